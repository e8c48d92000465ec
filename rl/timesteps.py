"""Which of the K denoising steps of a sample are trained (docs/ALGORITHMS.md, "Which timesteps are
trained"): a pure function of (seed, step, sample), so every rank and the planner agree."""
from __future__ import annotations

import numpy as np

from rl.seeding import derive_seed

RULES = ("first", "random", "window", "subset")


def trained_timesteps(rule: str, num_steps: int, fraction: float, *, seed: int, step: int, sample_id: int,
                      window: tuple[int, int] | None = None) -> tuple[int, ...]:
    """Every rule trains n = int(C * fraction) (at least 1) of its C candidate steps.

    first (Flow-GRPO): the first int(K * fraction) of the K steps, in order (train_sd3.py:345, 864);
    random (DanceGRPO): int((K - 1) * fraction) of the K - 1 steps before the last, which it never
    trains (train_grpo_flux.py:512, 570), a subset seeded by (seed, step, sample) where DanceGRPO
    draws a torch.randperm from its global RNG (:551-556); window (Flow-GRPO-Fast, MixGRPO): the SDE
    window only; subset (DiffusionNFT): int(K * fraction) of all K sigmas of the schedule, seeded
    by (seed, step, sample) (NVlabs/DiffusionNFT train_nft_sd3.py:810-816: a permutation of the K
    timesteps per sample, the first int(K * fraction) kept), the indices into the sigmas at which
    the clean sample is noised."""
    if rule == "first":
        n = max(1, min(num_steps, int(num_steps * fraction)))
        return tuple(range(n))
    if rule == "random":
        candidates = max(1, num_steps - 1)
        n = max(1, min(candidates, int(candidates * fraction)))
        rng = np.random.default_rng(derive_seed(seed, step, sample_id, "timesteps"))
        return tuple(sorted(int(t) for t in rng.choice(candidates, size=n, replace=False)))
    if rule == "subset":
        n = max(1, min(num_steps, int(num_steps * fraction)))
        rng = np.random.default_rng(derive_seed(seed, step, sample_id, "timesteps"))
        return tuple(sorted(int(t) for t in rng.choice(num_steps, size=n, replace=False)))
    if rule == "window":
        if window is None:
            raise ValueError("the window rule needs an SDE window START:END")
        return tuple(range(*window))
    raise ValueError(f"unknown timestep rule {rule!r}; choose one of {RULES}")
