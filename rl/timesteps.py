"""Which of the K denoising steps of a sample are trained (docs/ALGORITHMS.md, "Which timesteps are
trained"): the rules the algorithms (rl/algorithms/) choose from, pure functions of (seed, step,
sample), so every rank and the planner agree. Each trains n = int(C x fraction) (at least 1) of its
C candidate steps."""
from __future__ import annotations

import numpy as np

from rl.seeding import derive_seed


def count(candidates: int, fraction: float) -> int:
    """n = int(C x fraction), at least 1 and at most C."""
    return max(1, min(candidates, int(candidates * fraction)))


def first(num_steps: int, fraction: float) -> tuple[int, ...]:
    """The first int(K x fraction) of the K steps, in order (Flow-GRPO train_sd3.py:345, 864)."""
    return tuple(range(count(num_steps, fraction)))


def seeded_subset(candidates: int, fraction: float, *, seed: int, step: int, sample_id: int) -> tuple[int, ...]:
    """int(C x fraction) of the steps 0..C-1, sorted, drawn from (seed, step, sample) alone, where the
    peers draw from a global RNG (DanceGRPO train_grpo_flux.py:551-556, NVlabs/DiffusionNFT
    train_nft_sd3.py:810-816), so every placement trains the same transitions."""
    rng = np.random.default_rng(derive_seed(seed, step, sample_id, "timesteps"))
    return tuple(sorted(int(t) for t in rng.choice(candidates, size=count(candidates, fraction), replace=False)))


def in_window(window: tuple[int, int] | None) -> tuple[int, ...]:
    """The steps of an SDE window START:END, START <= t < END (a fixed or a sliding window)."""
    if window is None:
        raise ValueError("training only the SDE window needs a window START:END")
    return tuple(range(*window))
