"""Compressed weight publication (--publish-compression): what travels for each published tensor,
and how a receiver rebuilds the tensor from it.

Codecs:
- `none`: the tensor itself;
- `bf16`: the tensor cast to bfloat16;
- `delta`: the difference to the version the receivers already hold, in bfloat16;
- `delta-topk:F`: the largest fraction F of that difference by magnitude (at least one entry per
  tensor), as int32/int64 indices and bfloat16 values.

Both sides apply the same operation to the same values (`apply`): the trainer to its copy of what
the generators hold (`Reconstruction`), each generator to its live parameters. The two results are
bitwise equal, so the publication's checksum is of the reconstructed weights and verification keeps
its meaning.

A lossy codec is part of the update, not only of the wire: every trainer rank adopts the
reconstruction as its weights, so it trains exactly the policy the generators sample with (the
importance ratio starts each step at 1, as uncompressed), and keeps what was not sent as a residual
that the next version's delta carries (error feedback, as in EF-SGD and FusionLLM's AdaTopK: the
trainer's weights plus the residual are the initial weights plus every optimizer update). Colocated
runs apply the same codec to themselves, so a run trains the same weights whatever its placement.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from parallel.fsdp import local_part, shard_like, whole_like

CODECS = ("none", "bf16", "delta", "delta-topk")
WIRE_DTYPE = torch.bfloat16
WIRE_BYTES = torch.finfo(WIRE_DTYPE).bits // 8


def parse(spec: str) -> tuple[str, float | None]:
    """'delta-topk:0.01' -> ('delta-topk', 0.01); the other codecs take no argument."""
    name, _, arg = spec.partition(":")
    if name not in CODECS:
        raise ValueError(f"unknown --publish-compression {spec!r}; choose none, bf16, delta or delta-topk:F")
    if name != "delta-topk":
        if arg:
            raise ValueError(f"--publish-compression {spec!r}: {name} takes no ':' argument")
        return name, None
    try:
        fraction = float(arg)
    except ValueError:
        fraction = float("nan")
    if not 0 < fraction <= 1:
        raise ValueError(f"--publish-compression {spec!r}: delta-topk needs a fraction F in (0, 1], as delta-topk:0.01")
    return name, fraction


def lossy(spec: str) -> bool:
    """Whether receivers rebuild something other than the weights sent: every codec but none (bf16
    rounds values or deltas; delta-topk also leaves part of each delta out). A lossy codec keeps a
    `Reconstruction` on every trainer rank."""
    return parse(spec)[0] != "none"


def topk_count(numel: int, fraction: float) -> int:
    """Entries delta-topk:F sends of a tensor of `numel` elements: ceil(F x numel), at least one."""
    return max(1, math.ceil(fraction * numel))


def index_bytes(numel: int) -> int:
    """Bytes of one top-k index into a tensor of `numel` elements (int32, or int64 from 2**31)."""
    return 4 if numel < 2**31 else 8


def wire_bytes(spec: str, numel: int, element_size: int) -> int:
    """Bytes that travel for one tensor of `numel` elements of `element_size` bytes each (what a
    publication counts: the sum of its wire tensors' sizes). The planner prices publication with it."""
    name, fraction = parse(spec)
    if name == "none":
        return numel * element_size
    if name in ("bf16", "delta"):
        return numel * WIRE_BYTES
    k = topk_count(numel, fraction)
    return k * (index_bytes(numel) + WIRE_BYTES)


def encode(spec: str, new: Tensor, held: Tensor | None) -> dict[str, Tensor]:
    """The wire parts of one tensor: {"" : values} or, for top-k, {"idx", "val"}. `held` is what
    the receivers hold now (needed by the delta codecs)."""
    name, fraction = parse(spec)
    new = new.detach()
    if name == "none":
        return {"": new.contiguous()}
    if name == "bf16":
        return {"": new.to(WIRE_DTYPE).contiguous()}
    delta = (new.float() - held.float()).reshape(-1)
    if name == "delta":
        return {"": delta.to(WIRE_DTYPE).view(new.shape).contiguous()}
    return topk_parts(delta, fraction)


def topk_parts(delta: Tensor, fraction: float) -> dict[str, Tensor]:
    """delta-topk's wire parts of a whole flattened delta: the largest fraction of it by magnitude,
    as sorted indices and bf16 values."""
    k = topk_count(delta.numel(), fraction)
    idx = delta.abs().topk(k, sorted=False).indices.sort().values
    index_dtype = torch.int32 if index_bytes(delta.numel()) == 4 else torch.int64
    return {"idx": idx.to(index_dtype).contiguous(), "val": delta[idx].to(WIRE_DTYPE).contiguous()}


def apply(spec: str, target: Tensor, parts: dict[str, Tensor]) -> None:
    """Rebuild `target` in place from its wire parts: the one operation both sides run."""
    name, _ = parse(spec)
    with torch.no_grad():
        if name in ("none", "bf16"):
            target.copy_(parts[""].to(device=target.device, dtype=target.dtype))
        elif name == "delta":
            target.add_(parts[""].to(device=target.device, dtype=target.dtype))
        else:
            flat = target.view(-1)
            idx = parts["idx"].to(device=target.device, dtype=torch.int64)
            flat.index_add_(0, idx, parts["val"].to(device=target.device, dtype=target.dtype))


def wire_name(name: str, part: str) -> str:
    return name if not part else f"{name}|{part}"


def split_wire(wire: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """{wire name: tensor} -> {tensor name: {part: tensor}}."""
    out: dict[str, dict[str, Tensor]] = {}
    for key, t in wire.items():
        name, _, part = key.partition("|")
        out.setdefault(name, {})[part] = t
    return out


class Reconstruction:
    """What the generators hold (`held`, in their dtype) and what a lossy codec has not sent of the
    trainer's updates yet (`residual`, float32), kept alike by every trainer rank and sharded as the
    trained weights are: under FSDP each trainer holds its shard of both (module docstring)."""

    def __init__(self, spec: str, initial: dict[str, Tensor], residual: dict[str, Tensor] | None = None,
                 dtype: torch.dtype | None = None):
        """`initial`: the trained weights every rank holds now (FSDP shards or whole); `residual`:
        whole tensors to go on from (a resumed run's), zero by default; `dtype`: the dtype receivers
        hold (the compute dtype; default: the weights' own)."""
        if not lossy(spec):
            raise ValueError(f"--publish-compression {spec}: a lossless codec needs no reconstruction")
        self.spec = spec
        self.held = {n: t.detach().to(dtype or t.dtype).clone() for n, t in initial.items()}
        self.residual = {n: torch.zeros_like(t.detach(), dtype=torch.float32) for n, t in initial.items()}
        for n, r in (residual or {}).items():
            if n not in self.held or tuple(r.shape) != tuple(self.held[n].shape):
                raise ValueError(f"publication residual {n!r} {list(r.shape)} does not fit the trained weights")
            local, start = local_part(self.residual[n])
            local.copy_(r.detach().float().reshape(-1)[start:start + local.numel()].view_as(local))

    def publish(self, weights: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(wire tensors by wire name, the tensors the receivers will hold) for a new version made
        from the trainer's `weights`; what the wire leaves out of `weights` + residual becomes the
        new residual. Runs on this rank's shards, sharded like `weights`: an elementwise codec
        encodes each shard; delta-topk's top fraction is of the whole tensor, so it gathers one
        tensor's delta at a time (every trainer rank computes the same parts)."""
        codec, fraction = parse(self.spec)
        wire = {}
        for name, new in weights.items():
            mine, start = local_part(new.detach())
            held, _ = local_part(self.held[name])
            residual, _ = local_part(self.residual[name])
            wanted = mine.float() + residual
            if codec == "delta-topk":
                parts = topk_parts(whole_like(wanted - held.float(), new).reshape(-1), fraction)
                idx = parts["idx"].to(torch.int64)
                own = (idx >= start) & (idx < start + held.numel())  # the entries in this rank's shard
                apply(self.spec, held, {"idx": idx[own] - start, "val": parts["val"][own]})
            else:
                parts = encode(self.spec, wanted, held)
                apply(self.spec, held, parts)
                parts = {p: shard_like(t, new) for p, t in parts.items()}
            residual.copy_(wanted - held.float())
            wire.update({wire_name(name, p): t for p, t in parts.items()})
        return wire, dict(self.held)
