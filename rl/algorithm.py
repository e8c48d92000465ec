"""Flow-GRPO / DanceGRPO as pure functions (formulas: docs/ALGORITHMS.md)."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from rl.seeding import derive_seed

ALGORITHMS = ("flow_grpo", "dance_grpo", "window")
STD_EPS = 1e-4


def group_advantages(rewards: Tensor, group_ids: Tensor, *, adv_clip: float, std: float | None = None) -> Tensor:
    """A = (r - mean_group) / (std + 1e-4), clamped to [-adv_clip, adv_clip].

    std None: each group's own std (streams: a group never spans fragments). Otherwise the given
    std, e.g. the running std of previous batches (the streaming stand-in for Flow-GRPO's
    batch-global std)."""
    rewards = rewards.double()
    adv = torch.empty_like(rewards)
    for gid in group_ids.unique():
        m = group_ids == gid
        r = rewards[m]
        s = r.std(unbiased=False) if std is None else torch.tensor(std, dtype=torch.float64)
        adv[m] = (r - r.mean()) / (s + STD_EPS)
    return adv.clamp(-adv_clip, adv_clip).float()


def zero_std_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """(n,) bool: the sample's group has all-equal rewards (its advantages are all 0)."""
    out = torch.zeros_like(group_ids, dtype=torch.bool)
    for gid in group_ids.unique():
        m = group_ids == gid
        out[m] = bool((rewards[m] == rewards[m][0]).all())
    return out


def trained_timesteps(algorithm: str, num_steps: int, fraction: float, *, seed: int, step: int, sample_id: int,
                      window: tuple[int, int] | None = None) -> tuple[int, ...]:
    """Which of the K steps of a sample are trained (docs/ALGORITHMS.md, "Which timesteps are trained").

    flow_grpo: the first floor(K * fraction) steps in order; dance_grpo: a random subset of
    round(K * fraction) steps seeded by (seed, step, sample), the last step excluded; window: the
    SDE window only (Flow-GRPO-Fast / MixGRPO)."""
    if algorithm == "flow_grpo":
        n = max(1, min(num_steps, int(num_steps * fraction)))
        return tuple(range(n))
    if algorithm == "dance_grpo":
        candidates = max(1, num_steps - 1)
        n = max(1, min(candidates, round(num_steps * fraction)))
        rng = np.random.default_rng(derive_seed(seed, step, sample_id, "timesteps"))
        return tuple(sorted(int(t) for t in rng.choice(candidates, size=n, replace=False)))
    if algorithm == "window":
        if window is None:
            raise ValueError("--algorithm window needs --sde-window START:END")
        return tuple(range(*window))
    raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {ALGORITHMS}")


def clipped_policy_loss(logp_new: Tensor, logp_old: Tensor, adv: Tensor, clip_range: float) -> tuple[Tensor, Tensor]:
    """Per transition: max(-A r, -A clip(r, 1-eps, 1+eps)), r = exp(logp_new - logp_old). Returns (loss, ratio)."""
    ratio = torch.exp(logp_new - logp_old)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped), ratio


def kl_to_reference(mean: Tensor, mean_ref: Tensor, std: Tensor) -> Tensor:
    """Per transition: mean over dims of (mean_theta - mean_ref)^2 / (2 std^2) (Flow-GRPO)."""
    sq = (mean - mean_ref).pow(2).reshape(mean.shape[0], -1).mean(dim=1)
    return sq / (2 * std.pow(2))


class RunningStd:
    """Std of all rewards of previous batches (Welford); None before the first batch."""

    def __init__(self):
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, rewards: list[float]) -> None:
        for r in rewards:
            self.n += 1
            d = r - self.mean
            self.mean += d / self.n
            self.m2 += d * (r - self.mean)

    @property
    def std(self) -> float | None:
        return (self.m2 / self.n) ** 0.5 if self.n > 1 else None

    def state_dict(self) -> dict:
        return {"n": self.n, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, d: dict) -> None:
        self.n, self.mean, self.m2 = d["n"], d["mean"], d["m2"]
