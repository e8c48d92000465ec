"""The exponential moving average of the trained weights (--ema-decay): its decay schedule, its
step after each optimizer update, and the exchange that evaluates it in place (--eval-ema)."""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor


def ema_decay(decay: float, updates: int) -> float:
    """The EMA's decay after update number `updates` (counted from 1): min(decay, (1 + u) / (10 + u)),
    DiffusionNFT's and Flow-GRPO's ema.py `get_current_decay` at their post-increment step."""
    return min(decay, (1 + updates) / (10 + updates))


@torch.no_grad()
def step(ema: list[Tensor], params: list[Tensor], decay: float, updates: int) -> None:
    """After optimizer update number `updates`: ema <- d ema + (1 - d) params, d = `ema_decay`."""
    d = ema_decay(decay, updates)
    for e, p in zip(ema, params):
        e.lerp_(p.detach(), 1 - d)


@torch.no_grad()
def _exchange(ema: list[Tensor], params: list[Tensor]) -> None:
    for e, p in zip(ema, params):
        live = p.detach().clone()
        p.detach().copy_(e)
        e.copy_(live)


@contextlib.contextmanager
def swapped(ema: list[Tensor], params: list[Tensor]):
    """The EMA in the parameters inside the block, the trained weights again after it: an exchange
    in place, as the old policy's (sharded alike under FSDP2)."""
    _exchange(ema, params)
    try:
        yield
    finally:
        _exchange(ema, params)
