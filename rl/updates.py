"""Several optimizer updates per rollout (docs/ALGORITHMS.md, "Optimizer and update"): the step's
samples split into N parts, each trained (every trained transition of its samples) and followed by
one optimizer update. The part of a sample is a pure function of (seed, step, sample id) and the
run's batch shape, never of the placement, so every rank computes the same split without a message.

How each peer cuts its batch, and the split that reproduces it:

  samples  a permutation of the step's samples drawn from (seed, step), cut into N consecutive
           pieces: Flow-GRPO (train_sd3.py:827-836, a `randperm` of each GPU's samples cut into
           `num_batches_per_epoch` batches, accumulated over half of them: 2 updates per epoch) and
           DiffusionNFT (train_nft_sd3.py:806-827, 991-1004: the same cut, 1 or 2 updates per epoch).
           Their GPUs' samples are a random share of the batch, so a part is a uniformly random
           subset of the batch there and here.
  members  by position in the group, member m of G in part floor(N m / G): MixGRPO
           (train_grpo_flux.py:538-610; one prompt's G = 12 samples per GPU, gradient accumulation
           over 3 consecutive samples: members 0-2, 3-5, 6-8, 9-11, 4 updates).
  groups   whole groups in step order, group g of B in part floor(N g / B): no peer's; the split
           whose parts come in the order the fragments of a step are generated, so a disaggregated
           trainer updates on part j while part j + 1 is still being generated.

The sizes of the parts differ by at most one sample (floor(N i / n) over n items). A sample's every
trained transition is in its sample's part, as in every peer (they batch samples, not transitions).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from rl.seeding import derive_seed

SPLITS = ("samples", "members", "groups")


@dataclass(frozen=True)
class UpdateSplit:
    """How a run's steps split into optimizer updates: the flags --updates-per-rollout and --update-split."""

    num_updates: int = 1
    """N: optimizer updates per step (rollout); 1 = one update over the whole step"""
    split: str = "samples"
    """which samples each update trains (SPLITS, the module docstring)"""
    seed: int = 0
    """the run's --seed (the permutation of `samples`)"""
    num_samples: int = 1
    """B x G: samples per step"""
    group_size: int = 1
    """G: samples per group"""

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ValueError(f"unknown --update-split {self.split!r}; choose one of {SPLITS}")
        if self.num_updates < 1:
            raise ValueError(f"--updates-per-rollout must be >= 1, got {self.num_updates}")
        units = {"samples": self.num_samples, "members": self.group_size,
                 "groups": self.num_samples // max(self.group_size, 1)}[self.split]
        if self.num_updates > units:
            what = {"samples": "samples per step (--prompts-per-step x --group-size)",
                    "members": "samples per group (--group-size)", "groups": "groups per step (--prompts-per-step)"}
            raise ValueError(f"--updates-per-rollout {self.num_updates} with --update-split {self.split} needs at "
                             f"least that many {what[self.split]}, got {units}")

    @classmethod
    def of(cls, cfg) -> "UpdateSplit":
        """From a config.RunConfig."""
        rl = cfg.rl
        return cls(rl.updates_per_rollout, rl.update_split, cfg.seed, rl.prompts_per_step * rl.group_size,
                   rl.group_size)

    def parts(self, step: int) -> tuple[int, ...]:
        """The part (0 .. N-1) of every sample id of step `step`."""
        return _parts(self, step)

    def part_of(self, step: int, sample_id: int) -> int:
        return self.parts(step)[sample_id]


@functools.lru_cache(maxsize=16)
def _parts(split: UpdateSplit, step: int) -> tuple[int, ...]:
    n, big_n, g = split.num_samples, split.num_updates, split.group_size
    if big_n == 1:
        return (0,) * n
    if split.split == "members":
        return tuple(big_n * (i % g) // g for i in range(n))
    if split.split == "groups":
        groups = n // g
        return tuple(big_n * (i // g) // groups for i in range(n))
    order = np.random.default_rng(derive_seed(split.seed, step, "updates")).permutation(n)
    out = [0] * n
    for position, i in enumerate(order.tolist()):
        out[i] = big_n * position // n
    return tuple(out)


def held_fraction(num_updates: int, split: str, waits_for_step: bool = False) -> float:
    """The share of each fragment's training that cannot start before the step's last fragment has
    landed (the step simulator's `Costs.held_fraction`): the later updates' (N - 1) / N when the
    parts span the step's fragments (samples, members) or the first update waits for every reward
    (`waits_for_step`: the global std, a re-admission); 0 with one update, or whole groups in step
    order, whose updates follow the fragments as they land."""
    if num_updates == 1 or (split == "groups" and not waits_for_step):
        return 0.0
    return (num_updates - 1) / num_updates


@dataclass
class UpdateSums:
    """What one optimizer update reduced over the trainers: its statistics' sums (the loss's STATS
    and the trainer's counts, in `names` order), its transition count and gradient norm."""

    sums: list[float]
    num_transitions: float
    grad_norm: float
    applied: bool
    """the optimizer stepped (False: skipped for a non-finite value, or a part with nothing trained)"""


def step_stats(names: tuple[str, ...], updates: list[UpdateSums]) -> dict[str, float]:
    """A step's statistics from its updates: each statistic's mean over every transition the step
    trained (the sums over its updates over their transition counts, as one update over the whole
    step reports them), the mean gradient norm of the updates that trained something, and how many
    updates stepped the optimizer."""
    total = sum(u.num_transitions for u in updates)
    trained = [u for u in updates if u.num_transitions > 0]
    out = {f"train/{k}": sum(u.sums[i] for u in updates) / total for i, k in enumerate(names)}
    out["train/grad_norm"] = sum(u.grad_norm for u in trained) / len(trained)
    out["train/num_transitions"] = total
    out["train/num_updates"] = float(sum(u.applied for u in updates))
    return out
