"""A step's gradient accumulation when the policy term's scale is known only at its end (Flow-GRPO's
batch-global std while streaming, docs/ALGORITHMS.md "Global std"): the policy term's gradient
accumulates in `.grad` and, with beta > 0, the KL term's apart, since the KL term is not scaled;
`combine` makes grad = scale x policy + KL once the scale is known, before any reduction, clipping
or optimizer step. Works alike on plain and FSDP2-sharded (DTensor) gradients."""
from __future__ import annotations

import torch
from torch import Tensor


class SplitGradients:
    def __init__(self, params: list[Tensor]):
        self.params = params
        self.kl: list[Tensor | None] | None = None  # the KL term's gradients while kept apart

    def begin(self, apart: bool) -> None:
        """A new step: keep the KL term's gradients apart, or sum them with the policy term's."""
        self.kl = [None] * len(self.params) if apart else None

    def backward(self, policy: Tensor, kl: Tensor | None) -> None:
        """Backward of the policy term and (None: no) KL term of one forward. Kept apart, the KL
        term's gradient comes from a second backward through the same graph, with `.grad` and
        the KL accumulators swapped around it (one more backward per forward: its cost)."""
        if kl is None or self.kl is None:
            (policy if kl is None else policy + kl).backward()
            return
        policy.backward(retain_graph=True)
        self._swap()
        kl.backward()
        self._swap()

    def _swap(self) -> None:
        for i, p in enumerate(self.params):
            p.grad, self.kl[i] = self.kl[i], p.grad

    @torch.no_grad()
    def combine(self, scale: float) -> None:
        """grad = scale x the policy term's gradient + the KL term's (kept apart, or already in)."""
        if scale == 1.0 and self.kl is None:
            return
        kl = self.kl or [None] * len(self.params)
        for p, k in zip(self.params, kl):
            if p.grad is not None:
                p.grad.mul_(scale)
                if k is not None:
                    p.grad.add_(k)
            elif k is not None:
                p.grad = k
        self.kl = None
