"""The RL algorithms a run can train with (--algorithm), each as the pieces it is made of: which
timesteps of a sample are trained, and the loss. A registry, so every role and the planner read
one algorithm's facts from one place."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from rl.loss import ClippedPolicyLoss
from rl.nft import NFTLoss


@dataclass(frozen=True)
class Algorithm:
    name: str
    description: str
    timesteps: str
    """rl.timesteps rule: first, random or window"""
    needs_window: bool = False
    """the SDE runs only inside --sde-window (ODE elsewhere), and only the window is trained"""
    sliding_window: bool = False
    """the window moves with the training step (MixGRPO: --window-size, --window-stride, ...)"""
    forward_process: bool = False
    """trains clean samples noised on the trainers (DiffusionNFT): generators sample with the ODE by
    default and the old policy, fragments carry clean latents (no trajectory, no log-probability)"""

    def loss(self, rl) -> ClippedPolicyLoss | NFTLoss:
        """The loss object of a run's [rl] config section."""
        if self.forward_process:
            return NFTLoss(rl.nft_beta, rl.beta, rl.adv_clip)
        return ClippedPolicyLoss(rl.clip_range, rl.beta)


ALGORITHMS = {a.name: a for a in (
    Algorithm("flow_grpo", "Flow-GRPO: the first fraction x K steps in order", "first"),
    Algorithm("dance_grpo", "DanceGRPO: a random subset of the steps per sample", "random"),
    Algorithm("flow_grpo_fast", "Flow-GRPO-Fast: SDE and training only inside --sde-window", "window",
              needs_window=True),
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
