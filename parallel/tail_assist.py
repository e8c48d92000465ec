"""Tail assist (docs/DESIGN.md 5.9): the rank that generates a step's last fragment trains a share of
it too, so that the trainers' part of the on-policy tail (the last fragment's training, which no
generation overlaps) is shared with a rank that would otherwise wait for the next version.

TSP packs the last fragment over the M trainers and one helper (`tsp.pack(helped=...)`); the rank
that generated the fragment keeps the helper's share (`TransitionIntake.helper_share`) and trains it
with a trainer of its own over its own model, which holds exactly the step's weights (on-policy,
exact publication, float32). What it trained, the gradient's sum and the loss's statistic sums, goes
to the first trainer (`send`), which adds it before the update's all-reduce (`add`): the update sums
the same transitions' gradients as any placement, in another order. Where a trainer generated the
last fragment (TAG), it trains the helper's share itself and nothing is sent.

Both sides are duck-typed over trainer.Trainer: `params`, `loss_sums`, `counts`,
`num_transitions`, `nonfinite_advantages`, `names`.
"""
from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from parallel import p2p


def _digest(names: list[str]) -> str:
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def payload(helper) -> tuple[dict[str, Tensor], dict]:
    """What `helper` trained since its last update, as a payload for the first trainer: its gradient
    sum (float32, its trained weights flattened in order; none trained: zeros), its loss statistic
    sums and counts. The helper's gradients and sums are cleared."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in helper.params]
    tensors = {"grads": torch.cat([g.detach().reshape(-1) for g in grads]).float(),
               "sums": helper.loss_sums.detach().clone(),
               "nonfinite": helper.nonfinite_advantages.reshape(1).clone()}
    meta = {"names": _digest(helper.names), "numel": int(tensors["grads"].numel()),
            "num_transitions": helper.num_transitions, "counts": dict(helper.counts),
            "step": helper.current_step}
    for p in helper.params:
        p.grad = None
    helper.reset_stats()
    return tensors, meta


def add(trainer, tensors: dict[str, Tensor], meta: dict) -> None:
    """Add a helper's payload into `trainer`'s accumulated gradient and sums, before its update."""
    numel = sum(p.numel() for p in trainer.params)
    if meta["names"] != _digest(trainer.names) or meta["numel"] != numel:
        raise p2p.ProtocolError(f"tail assist: the helper trained {meta['numel']} values of weights "
                                f"{meta['names']}, this trainer trains {numel} of {_digest(trainer.names)}")
    if meta["step"] != trainer.current_step:
        raise p2p.ProtocolError(f"tail assist: received step {meta['step']}'s gradient in step {trainer.current_step}")
    flat, offset = tensors["grads"].to(trainer.device), 0
    with torch.no_grad():
        for p in trainer.params:
            g = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.add_(g)
    trainer.loss_sums += tensors["sums"].to(trainer.device)
    trainer.nonfinite_advantages += tensors["nonfinite"][0].to(trainer.device)
    trainer.num_transitions += meta["num_transitions"]
    for k, v in meta["counts"].items():
        trainer.counts[k] += v


def send(helper, dst: int, group) -> p2p.SendHandle:
    """The helper's payload to the first trainer rank `dst`, on the communicator its fragments take."""
    return p2p.isend_payload(*payload(helper), dst=dst, group=group)


def receive(trainer, src: int, group) -> None:
    """The payload of the helper rank `src`, added into `trainer` (the first trainer)."""
    add(trainer, *p2p.recv_payload(src, group, device=trainer.device))  # rank wait: the helper's training
