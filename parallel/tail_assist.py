"""Tail assist (docs/DESIGN.md 5.9): the rank that generates a step's last fragment trains a share of
it too, so that the trainers' part of the on-policy tail (the last fragment's training, which no
generation overlaps) is shared with a rank that would otherwise wait for the next version.

TSP packs the last fragment over the M trainers and one helper (`tsp.pack(helped=...)`); the rank
that generated the fragment keeps the helper's share (`TransitionIntake.route_keeping`) and trains it
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
from parallel.fsdp import local_part


def _digest(names: list[str]) -> str:
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def float32_gradients(helper) -> None:
    """A helper whose trained weights are in a half-precision compute dtype, as a generator holds
    them, accumulates each backward's gradient in float32, as a mixed-precision trainer does (FSDP2
    over its own rank: the gradient of the weights cast to the compute dtype, reduced in float32 and
    accumulated into float32 gradients): into `helper.float_grads`, which `payload` sends."""
    helper.float_grads = [None] * len(helper.params)

    def hook(i: int):
        def accumulate(p: Tensor) -> None:
            g = p.grad.float()
            helper.float_grads[i] = g if helper.float_grads[i] is None else helper.float_grads[i].add_(g)
            p.grad = None
        return accumulate

    for i, p in enumerate(helper.params):
        p.register_post_accumulate_grad_hook(hook(i))


def payload(helper) -> tuple[dict[str, Tensor], dict]:
    """What `helper` trained since its last update, as a payload for the first trainer: its gradient
    sum (float32, its trained weights flattened in order; none trained: zeros), its loss statistic
    sums and counts. The helper's gradients and sums are cleared."""
    held = getattr(helper, "float_grads", None) or [p.grad for p in helper.params]
    grads = [g if g is not None else torch.zeros_like(p, dtype=torch.float32) for g, p in zip(held, helper.params)]
    tensors = {"grads": torch.cat([g.detach().float().reshape(-1) for g in grads]),
               "sums": helper.loss_sums.detach().clone(),
               "nonfinite": helper.nonfinite_advantages.reshape(1).clone()}
    meta = {"names": _digest(helper.names), "numel": int(tensors["grads"].numel()),
            "num_transitions": helper.num_transitions, "counts": dict(helper.counts),
            "step": helper.current_step}
    for p in helper.params:
        p.grad = None
    if getattr(helper, "float_grads", None) is not None:
        helper.float_grads = [None] * len(helper.params)
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
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            # whole on a replicated trainer (in a half-precision dtype an FSDP2 DTensor over its own rank)
            held = local_part(p.grad)[0]
            held.add_(flat[offset:offset + p.numel()].view_as(held))
            offset += p.numel()
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
