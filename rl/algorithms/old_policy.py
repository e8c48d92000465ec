"""DiffusionNFT's old policy (docs/ALGORITHMS.md, "DiffusionNFT"): a frozen copy of the trained
weights that the generators sample with and that the loss contrasts against, pulled toward the
trained weights by a soft update after the optimizer steps:

    old <- d old + (1 - d) theta,    d = 0 while u < flat, else min((u - flat) x uprate, uphold)

u is the number of optimizer updates so far, this one included (NVlabs/DiffusionNFT
scripts/train_nft_sd3.py:169-189 return_decay, :1034-1039 the update after each epoch's updates;
d = 0 is a hard copy). The schedules are NFT's decay types under VeRL-Omni's names.

The copy holds the trained tensors only (LoRA adapters, or every weight of a full fine-tune) with
the parameters' own sharding (FSDP2 shards stay shards). `swapped` exchanges them with the live
parameters in place for a forward under the old policy, tensor by tensor, so no second model is
built. A leaf module: plain tensors."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DecaySchedule:
    flat: int
    uprate: float
    uphold: float

    def decay(self, updates: int) -> float:
        """d after `updates` optimizer updates."""
        if updates < self.flat:
            return 0.0
        return min((updates - self.flat) * self.uprate, self.uphold)


SCHEDULES = {
    "copy": DecaySchedule(0, 0.0, 0.0),  # NFT decay_type 0: a hard copy after every update
    "linear_to_0_5": DecaySchedule(0, 0.001, 0.5),  # decay_type 1: NFT's default (geneval, pickscore, hpsv2)
    "delayed_linear_to_0_999": DecaySchedule(75, 0.0075, 0.999),  # decay_type 2: NFT's sd3_ocr
}


def schedule(name: str) -> DecaySchedule:
    """A named schedule, or FLAT:UPRATE:UPHOLD (e.g. 0:0.001:0.5 is linear_to_0_5)."""
    if name in SCHEDULES:
        return SCHEDULES[name]
    try:
        flat, uprate, uphold = name.split(":")
        out = DecaySchedule(int(flat), float(uprate), float(uphold))
    except ValueError:
        raise ValueError(f"unknown --old-policy-decay {name!r}; choose one of {tuple(SCHEDULES)} or give "
                         f"FLAT:UPRATE:UPHOLD") from None
    if out.flat < 0 or not (0 <= out.uprate and 0 <= out.uphold < 1):
        raise ValueError(f"--old-policy-decay {name!r}: FLAT must be >= 0, UPRATE >= 0 and UPHOLD in [0, 1)")
    return out


class OldPolicy:
    """The old policy of a list of trained parameters, starting as an exact copy of them."""

    def __init__(self, params: list[Tensor], decay: DecaySchedule, interval: int = 1):
        """`interval`: updates between soft updates (VeRL-Omni's old_policy_update_interval; NFT
        updates once per epoch, after every optimizer update of the epoch)."""
        if interval < 1:
            raise ValueError(f"--old-policy-interval must be >= 1, got {interval}")
        self.params, self.schedule, self.interval = list(params), decay, interval
        self.tensors = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def after_update(self, updates: int) -> float | None:
        """After the optimizer's update number `updates`: the soft update when one is due. Returns
        the decay used (None: not due)."""
        if updates % self.interval:
            return None
        d = self.schedule.decay(updates)
        for old, p in zip(self.tensors, self.params):
            old.mul_(d).add_(p.detach(), alpha=1.0 - d)  # d old + (1 - d) theta, as NFT computes it
        return d

    @contextlib.contextmanager
    def swapped(self):
        """The parameters hold the old policy inside the block, the trained weights again after it
        (an exchange in place, one tensor's worth of temporary memory at a time)."""
        self._exchange()
        try:
            yield
        finally:
            self._exchange()

    @torch.no_grad()
    def _exchange(self) -> None:
        for old, p in zip(self.tensors, self.params):
            live = p.detach().clone()
            p.detach().copy_(old)
            old.copy_(live)

    @torch.no_grad()
    def load(self, tensors: list[Tensor]) -> None:
        """Copy whole or sharded tensors of the same layout in (a resume, a lossy codec's rebuild)."""
        for old, t in zip(self.tensors, tensors):
            old.copy_(t)
