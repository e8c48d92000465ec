"""The (sample, timestep) transitions of one training forward: what the trainer (trainer.py) builds
from a chunk's rows or a TSP micro-batch and an algorithm's `forward` (rl/algorithms/) trains."""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from rl.conditioning import Conditioning


@dataclass
class Transitions:
    """The (sample, timestep) transitions one training forward trains, at their own timesteps (a
    chunk's rows at one timestep, or a TSP micro-batch that mixes samples and timesteps)."""

    x_t: Tensor  # (n, *latent) float32
    x_next: Tensor  # (n, *latent) float32: the stored next latent whose log-probability is scored
    sigma: Tensor  # (n,)
    sigma_next: Tensor  # (n,)
    timesteps: list[int]  # n step indices t (the noise level of each)
    cond: Conditioning
    neg: Conditioning | None
    logp_old: Tensor  # (n,)
    adv: Tensor  # (n,), or (n, R) with one advantage per reward (--reward-combine losses)
    sample_ids: list[int] | None = None  # n sample ids of the step (the keys of forward-process noise)
    step: int | None = None  # the step the transitions belong to (its window, its noise)
    weight: Tensor | None = None  # (n,) each policy term's weight: 1 (None), or a correction's (rl.advantages)
    counted: Tensor | None = None  # (n,) bool: carries its KL term and statistics (None: all; False: a correction)
    steps: dict[str, Tensor] = field(default_factory=dict)  # the rollout's per-step fields at each t: (n, ...)
