"""DanceGRPO (arXiv 2505.07818; XueZeyue/DanceGRPO, docs/ALGORITHMS.md "DanceGRPO"): Flow-GRPO's
clipped surrogate on a random subset of the steps before the last (train_grpo_flux.py:512, 551-556,
570), drawn per sample from (seed, step, sample) where DanceGRPO draws from torch's global RNG, and
group advantages with the Bessel-corrected std + 1e-8 (torch.std, :540-545). Its authors feed the
model int(sigma x 1000) / 1000 (:231, 238), which its recipes set with --quantize-timestep."""
from __future__ import annotations

from rl import timesteps
from rl.algorithms.algorithm import Algorithm, Cost


class DanceGRPO(Algorithm):
    name = "dance_grpo"
    description = ("DanceGRPO: a random int(fraction x (K - 1)) of the steps before the last per sample; "
                   "Bessel std + 1e-8")
    std_ddof = 1
    std_eps = 1e-8
    quantize_timestep = True

    def timesteps(self, num_steps, fraction, *, seed, step, sample_id, window=None):
        """int((K - 1) x fraction) of the K - 1 steps before the last, which DanceGRPO never trains."""
        return timesteps.seeded_subset(max(1, num_steps - 1), fraction, seed=seed, step=step, sample_id=sample_id)

    def cost(self, num_steps, fraction=None, window=2):
        """round(0.6 K) of the K - 1 steps (the published runs' fraction)."""
        return Cost(max(1, min(num_steps - 1, round(num_steps * (0.6 if fraction is None else fraction)))))
