"""Batch-first tensor containers that cross module and rank boundaries: the text conditioning of
samples and the state that flows through a DiT between embed and head. A leaf module, so models/,
the sampler and the wire records of parallel/ share them without importing one another."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class Conditioning:
    """Per-sample text conditioning. Every tensor is batch-first, so a batch can be sliced by sample
    and samples from different batches concatenated (sequence dims are right-padded with zeros,
    which is also 'masked' for mask tensors)."""

    tensors: dict[str, Tensor]

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def select(self, index: Tensor | list[int] | slice) -> "Conditioning":
        return Conditioning({k: v[index] for k, v in self.tensors.items()})

    def to(self, device=None, dtype=None) -> "Conditioning":
        out = {}
        for k, v in self.tensors.items():
            # Only floating tensors change dtype: ids, masks and complex tables keep theirs.
            cast = dtype if (dtype is not None and v.is_floating_point()) else None
            out[k] = v.to(device=device, dtype=cast)
        return Conditioning(out)

    @staticmethod
    def cat(items: list["Conditioning"]) -> "Conditioning":
        keys = items[0].tensors.keys()
        out = {}
        for k in keys:
            parts = [c.tensors[k] for c in items]
            if parts[0].dim() >= 2 and len({p.shape[1] for p in parts}) > 1:
                length = max(p.shape[1] for p in parts)
                parts = [_pad_dim1(p, length) for p in parts]
            out[k] = torch.cat(parts, dim=0)
        return Conditioning(out)

    def state_dict(self) -> dict[str, Tensor]:
        return {f"cond.{k}": v.contiguous() for k, v in self.tensors.items()}

    @staticmethod
    def from_state_dict(flat: dict[str, Tensor]) -> "Conditioning":
        return Conditioning({k[len("cond."):]: v for k, v in flat.items() if k.startswith("cond.")})


def _pad_dim1(t: Tensor, length: int) -> Tensor:
    pad = torch.zeros((t.shape[0], length - t.shape[1], *t.shape[2:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)


@dataclass
class State:
    """What flows through the DiT between embed and head.

    `acts` are the activations that change block by block and cross a pipeline-stage boundary
    (image stream, text stream) plus temb, which every block reads and which is differentiable.
    `side` are read-only inputs that depend only on shapes and conditioning (rotary tables, masks,
    the latent shape): each stage recomputes them with `DiTAdapter.side_inputs` instead of receiving them.
    """

    acts: dict[str, Tensor]
    side: dict[str, Any] = field(default_factory=dict)
