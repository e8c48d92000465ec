"""The RL algorithms a run can train with (--algorithm), each as the pieces it is made of: which
timesteps of a sample are trained, and the loss. A registry, so every role and the planner read
one algorithm's facts from one place."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from rl.loss import ClippedPolicyLoss


@dataclass(frozen=True)
class Algorithm:
    name: str
    description: str
    timesteps: str
    """rl.timesteps rule: first, random or window"""
    needs_window: bool = False
    """the SDE runs only inside --sde-window (ODE elsewhere), and only the window is trained"""

    def loss(self, rl) -> ClippedPolicyLoss:
        """The loss object of a run's [rl] config section."""
        return ClippedPolicyLoss(rl.clip_range, rl.beta)


ALGORITHMS = {a.name: a for a in (
    Algorithm("flow_grpo", "Flow-GRPO: the first fraction x K steps in order", "first"),
    Algorithm("dance_grpo", "DanceGRPO: a random subset of the steps per sample", "random"),
    Algorithm("flow_grpo_fast", "Flow-GRPO-Fast: SDE and training only inside --sde-window", "window",
              needs_window=True),
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
