"""An RL algorithm as one object (docs/architecture.md, "Add an algorithm"): everything in which one
algorithm differs from another, as the methods of `Algorithm`. The roles and the mechanisms call
these methods and never ask which algorithm runs:

    options     flags, options, check_flags,       its own flags, those it reads, their ranges, what it
                check, check_steps                 asks of a run's flags
    rollout     sampling, carried                  what the generators sample and record, what a fragment carries
    training    timesteps, advantages, loss,        which transitions are trained, how rewards become
                forward                            advantages, each training forward's inputs and loss terms
    state       trainer_state, after_update,        what the trainers keep besides the weights, and what
                sampling_policy, sampled_tensors   they publish for the generators to sample with
    planner     cost                               what a step costs beyond the rollout, and in memory

The defaults are the common case, which Flow-GRPO defines: the SDE rollout's stored transitions
replayed through the clipped surrogate (rl/loss.py), the first int(K x fraction) steps trained, the
population std. Each algorithm's file overrides what it changes. A leaf of `rl/`: the trainer, its
model and the run's config are passed in (`Model` below names what a forward uses of the trainer).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from rl import sampler, timesteps
from rl.advantages import STD_EPS, AdvantageRule
from rl.loss import ClippedPolicyLoss


@dataclass(frozen=True)
class Cost:
    """What a step of an algorithm costs besides the rollout, as the planner prices it
    (planner/workload.py `for_algorithm`, planner/phases.py, planner/memory.py)."""

    trained_timesteps: int
    """(sample, t) transitions trained per sample"""
    frozen_forwards: int = 0
    """forwards without gradient per trained transition besides the trained one and the KL reference's"""
    state_copies: tuple[tuple[str, int], ...] = ()
    """(name, count) of float32 copies of the trained weights each trainer keeps, sharded like them"""
    carried: tuple[int, int] | None = None
    """(latents, log-probabilities) a fragment carries per sample; None: the path around every
    trained step, trained + 1 latents and trained log-probabilities"""


@dataclass
class LossTerms:
    """One training forward's loss, summed over its transitions."""

    policy: Tensor
    """the term linear in the advantages: with the step's global std its gradient is scaled at the
    step's end by 1 / (std + eps) (rl/gradients.py)"""
    unscaled: Tensor | None
    """the rest, never scaled (the KL term to the reference; None: nothing)"""
    stats: Tensor
    """float64 (len(loss.STATS),): the per-transition sums of the loss object's statistics"""


class Model(Protocol):
    """What an algorithm's forward uses of the trainer (trainer.py `Trainer`)."""

    cfg: object  # config.schema.RunConfig
    sampling: sampler.SamplingConfig

    def velocity(self, tr, x_t: Tensor) -> Tensor:
        """The trained policy's guided velocity at `x_t` and the transitions' sigmas and prompts (with gradient)."""

    def reference_velocity(self, tr, x_t: Tensor) -> Tensor:
        """The frozen reference policy's (no gradient)."""


class Algorithm:
    """The interface, with Flow-GRPO's choices as its defaults. Registry: rl/algorithms/__init__.py."""

    name = ""
    """--algorithm NAME"""
    description = ""
    """one line for --help"""
    flags: dict[str, type] = {}
    """its own flags: config section ("rl", "sampling") -> a dataclass of fields declared with
    `rl.algorithms.fields.flag` (default, --help text, parse), in its own file; config/schema.py's
    section inherits them, so each is a flag and a config.json key of that section"""
    options: tuple[str, ...] = ()
    """flags ("section.field") declared elsewhere (config/schema.py) that only some algorithms read,
    this one among them"""
    std_ddof = 0
    """the advantage std: 0 the population std (Flow-GRPO, np.std), 1 Bessel-corrected (torch.std)"""
    std_eps = STD_EPS
    """added to the advantage std: 1e-4 (Flow-GRPO stat_tracking.py:37)"""
    std_mode = "group"
    """the std its authors normalise by, which its recipes set with --std-mode (the flag's default
    stays group, the shipped demo's): global (Flow-GRPO's default, config/base.py:52) or group"""
    quantize_timestep = False
    """its authors feed the model int(sigma * 1000) / 1000, which its recipes set with --quantize-timestep"""
    reward_combine = "rewards"
    """how its authors combine several rewards, which its recipes set with --reward-combine: rewards (a
    weighted sum, then one advantage) or advantages (one advantage per reward, then their weighted sum)"""

    # ----- options ------------------------------------------------------------------------------
    def own_options(self) -> tuple[str, ...]:
        """Every flag ("section.field") it declares in `flags`."""
        return tuple(f"{section}.{f.name}" for section, cls in self.flags.items() for f in dataclasses.fields(cls))

    def read_options(self) -> tuple[str, ...]:
        """The flags only some algorithms read that this one reads: its own and `options`. Set by a
        run of another algorithm, they are an error naming this one (rl.algorithms.check)."""
        return self.own_options() + self.options

    def check_flags(self, cfg) -> None:
        """The ranges and choices of the flags this algorithm owns, checked in every run (a flag
        exists whatever the algorithm: a bad value is an error before anything else)."""

    def check(self, cfg) -> None:
        """What this algorithm asks of a run's flags, before any file is read; a ValueError names them."""

    def check_steps(self, cfg, num_steps: int) -> None:
        """What it asks once the K sampling steps are known (the model's default or --sample-steps):
        a KL term (beta > 0) with CPS divides by the last step's std, which is 0."""
        s, rl = cfg.sampling, cfg.rl
        if rl.beta > 0 and s.sde_type == "cps" and num_steps - 1 in self.timesteps(
                num_steps, rl.timestep_fraction, seed=0, step=0, sample_id=0, window=s.sde_window):
            raise ValueError(f"--beta {rl.beta} with --sde-type cps trains the last step, whose std is 0, and the "
                             f"KL divides by it: use --timestep-fraction below 1 or an --sde-window that ends "
                             f"before step {num_steps - 1}")

    # ----- the rollout ------------------------------------------------------------------------------
    def sampling(self, cfg, sampling: sampler.SamplingConfig) -> sampler.SamplingConfig:
        """The run's sampler (the flags over the family's defaults) as this algorithm samples and
        records: its noise level, its window, the step fields its loss reads (`record`)."""
        return sampling

    def carried(self, traj: sampler.Trajectory) -> sampler.Trajectory:
        """What a fragment carries of a sampled trajectory (default: all of it)."""
        return traj

    # ----- training -----------------------------------------------------------------------------
    def timesteps(self, num_steps: int, fraction: float, *, seed: int, step: int, sample_id: int,
                  window: tuple[int, int] | None = None) -> tuple[int, ...]:
        """The steps of sample `sample_id` trained at training step `step` (`window`: the SDE window
        of that step, if the rollout has one): the first int(K x fraction), in order."""
        return timesteps.first(num_steps, fraction)

    def advantages(self, rl, weights: tuple[tuple[str, float], ...] = ()) -> AdvantageRule:
        """How a run's rewards become advantages: this algorithm's std convention and the [rl]
        section's options; `weights` the run's (reward name, weight) pairs."""
        return AdvantageRule(std_mode=rl.std_mode, ddof=self.std_ddof, eps=self.std_eps, clip=rl.adv_clip,
                             combine=rl.reward_combine, weights=tuple(weights), drop_zero=rl.drop_zero_std,
                             readmit_multiple=rl.readmit_multiple, best_of_n=rl.best_of_n)

    def loss(self, rl):
        """The loss object of a run's [rl] section: its STATS and SUMMARY (what the step log shows),
        `needs_reference` (a KL term) and `rescale` (its sums under the global std's scale)."""
        return ClippedPolicyLoss(rl.clip_range, rl.beta, rl.kl_form)

    def forward(self, loss, model: Model, tr, state, pad: bool = False) -> LossTerms:
        """One training forward of the transitions `tr` (trainer.Transitions). `pad`: a padding
        forward (FSDP ranks run equally many), which runs the same computation and trains nothing.
        Default: replay the stored transitions x_t -> x_next and score them under the trained policy."""
        out, mean_ref = self.replay(loss, model, tr)
        return self.policy_terms(loss, out, mean_ref, tr, pad)

    @staticmethod
    def replay(loss, model: Model, tr) -> tuple[sampler.StepOutput, Tensor | None]:
        """The stored transitions scored under the trained policy, and with a KL term the reference
        policy's step mean (its x_next is not read: the mean does not depend on it)."""
        s = model.sampling
        out = sampler.score_rows(s, tr.x_t, model.velocity(tr, tr.x_t), tr.sigma, tr.sigma_next, tr.timesteps,
                                 tr.x_next, tr.step, tr.sample_ids)
        mean_ref = None
        if loss.needs_reference:
            mean_ref = sampler.score_rows(s, tr.x_t, model.reference_velocity(tr, tr.x_t), tr.sigma, tr.sigma_next,
                                          tr.timesteps, tr.x_t, tr.step, tr.sample_ids).mean
        return out, mean_ref

    def policy_terms(self, loss, out: sampler.StepOutput, mean_ref: Tensor | None, tr, pad: bool) -> LossTerms:
        """The loss terms of scored transitions: every policy term weighted by its row's weight (a
        padding forward's weigh 0 and count nothing)."""
        none = torch.zeros_like(out.log_prob)
        policy, kl, stats = loss(out.log_prob, tr.logp_old, tr.adv, weight=none if pad else tr.weight,
                                 counted=none.bool() if pad else tr.counted, mean=out.mean, mean_ref=mean_ref,
                                 std=out.std, std_dev_t=out.std_dev_t)
        return LossTerms(policy, kl, stats)

    # ----- the trainers' state ------------------------------------------------------------------
    def trainer_state(self, cfg, params: list[Tensor]) -> object | None:
        """What a trainer keeps besides the weights, the optimizer and the EMA (None: nothing)."""
        return None

    def after_update(self, state, updates: int) -> None:
        """After a step's updates, once (with --updates-per-rollout N, after the last of them, as NFT
        moves its old policy after its epoch's updates), `updates` the count of optimizer updates
        so far; a step whose updates were all skipped makes no call."""

    def sampling_policy(self, state):
        """A context that puts the policy the generators sample with into the parameters (colocated
        ranks and TAG helpers generate with the trainer's model): the trained weights as they are."""
        return contextlib.nullcontext()

    def sampled_tensors(self, state) -> list[Tensor] | None:
        """The tensors the generators sample with, one per trained parameter in their order, when
        they are not the trained weights (what the trainers publish and checkpoints keep apart)."""
        return None

    # ----- the planner --------------------------------------------------------------------------
    def cost(self, num_steps: int, fraction: float | None = None, window: int = 2) -> Cost:
        """What a step costs besides the rollout, for a run of K = `num_steps` sampling steps
        (`fraction`: --timestep-fraction, None: the authors' 0.99; `window`: an SDE window's steps)."""
        return Cost(len(timesteps.first(num_steps, 0.99 if fraction is None else fraction)))


def replace(sampling: sampler.SamplingConfig, **changes) -> sampler.SamplingConfig:
    """A sampling config with `changes`, checked again."""
    out = dataclasses.replace(sampling, **changes)
    out.validate()
    return out
