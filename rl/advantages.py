"""Group-relative advantages (docs/ALGORITHMS.md, "Advantages"): pure functions of a fragment's
rewards, the same on whichever rank scores it."""
from __future__ import annotations

import torch
from torch import Tensor

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
