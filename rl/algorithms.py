"""The RL algorithms a run can train with (--algorithm), each as the pieces it is made of: which
timesteps of a sample are trained, how rewards become advantages, and the loss. A registry, so every
role and the planner read one algorithm's facts from one place, and a convention that differs
between algorithms is a field of the record, not a test of its name."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from rl.advantages import STD_EPS, AdvantageRule
from rl.loss import ClippedPolicyLoss
from rl.nft import NFTLoss


@dataclass(frozen=True)
class Algorithm:
    name: str
    description: str
    timesteps: str
    """rl.timesteps rule: first, random or window (each trains int(candidates x fraction) steps)"""
    needs_window: bool = False
    """the SDE runs only inside --sde-window (ODE elsewhere), and only the window is trained"""
    sliding_window: bool = False
    """the window moves with the training step (MixGRPO: --window-size, --window-stride, ...)"""
    forward_process: bool = False
    """trains clean samples noised on the trainers (DiffusionNFT): generators sample with the ODE by
    default and the old policy, fragments carry clean latents (no trajectory, no log-probability)"""
    std_ddof: int = 0
    """the advantage std: 0 the population std (Flow-GRPO, np.std), 1 Bessel-corrected (DanceGRPO, torch.std)"""
    std_eps: float = STD_EPS
    """added to the advantage std: 1e-4 (Flow-GRPO stat_tracking.py:37), 1e-8 (DanceGRPO train_grpo_flux.py:542)"""
    std_mode: str = "group"
    """the std its authors normalise by, which its recipes set with --std-mode (the flag's default
    stays group, the shipped demo's): global (Flow-GRPO's default, config/base.py:52) or group"""
    quantize_timestep: bool = False
    """its authors feed the model int(sigma * 1000) / 1000, which its recipes set with --quantize-timestep"""

    def loss(self, rl) -> ClippedPolicyLoss | NFTLoss:
        """The loss object of a run's [rl] config section."""
        if self.forward_process:
            return NFTLoss(rl.nft_beta, rl.beta, rl.adv_clip)
        return ClippedPolicyLoss(rl.clip_range, rl.beta, rl.kl_form)

    def advantages(self, rl, weights: tuple[tuple[str, float], ...] = ()) -> AdvantageRule:
        """How a run's rewards become advantages: this algorithm's std convention and the [rl]
        section's options; `weights` the run's (reward name, weight) pairs."""
        return AdvantageRule(std_mode=rl.std_mode, ddof=self.std_ddof, eps=self.std_eps, clip=rl.adv_clip,
                             combine=rl.reward_combine, weights=tuple(weights), drop_zero=rl.drop_zero_std,
                             readmit_multiple=rl.readmit_multiple, best_of_n=rl.best_of_n)


ALGORITHMS = {a.name: a for a in (
    Algorithm("flow_grpo", "Flow-GRPO: the first fraction x K steps in order", "first", std_mode="global"),
    Algorithm("dance_grpo", "DanceGRPO: a random subset of fraction x (K - 1) steps per sample", "random",
              std_ddof=1, std_eps=1e-8, quantize_timestep=True),
    Algorithm("flow_grpo_fast", "Flow-GRPO-Fast: SDE and training only inside --sde-window", "window",
              needs_window=True, std_mode="global"),
    Algorithm("mixgrpo", "MixGRPO: SDE and training only inside a window that slides along the steps", "window",
              sliding_window=True),
    Algorithm("nft", "DiffusionNFT: a reward-weighted flow-matching loss on clean samples against the old policy",
              "subset", forward_process=True),
)}
ALIASES = {"window": "flow_grpo_fast"}
"""old spellings, accepted with a warning"""


def algorithm(name: str) -> Algorithm:
    """The named algorithm; an old spelling warns and gives the new one."""
    if name in ALIASES:
        warnings.warn(f"--algorithm {name} is now spelled --algorithm {ALIASES[name]}", stacklevel=2)
        name = ALIASES[name]
    if name not in ALGORITHMS:
        raise ValueError(f"unknown --algorithm {name!r}; choose one of {tuple(ALGORITHMS)}")
    return ALGORITHMS[name]
