"""Exact checksums of tensors, for verified publication (parallel/publish.py) and the start-up
check that every rank holds the same weights.

A checksum is an exact integer sum of a tensor's bytes weighted by position (`checksum`), so it
agrees across devices, reduction orders and processes, and it adds up over pieces: each FSDP
trainer checksums its own shard (`checksum_sums`) and the sums are combined (`checksums_of`), so no
rank gathers the whole tensor to checksum it.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import Tensor

from parallel.fsdp import local_part, mesh_group
from parallel.fsdp import sharded as sharded_tensor
from parallel.p2p import as_bytes, comm_device

_MOD_POSITION = 65521  # largest prime below 2**16: position weights are 1..65521
_MERSENNE_61 = (1 << 61) - 1  # checksums are folded into [0, 2**61 - 1)
_HI_FACTOR = 0x9E3779B97F4A7C15 % _MERSENNE_61  # mixes the high halves into the fold
_LEN_FACTOR = 0xC2B2AE3D27D4EB4F % _MERSENNE_61  # mixes the byte length into the fold
_CHUNK_WORDS = 1 << 24  # bounds the int64 temporaries to 128 MiB per chunk


def _int32_words(t: Tensor):
    """Yield (first word index, int32 chunk) covering the tensor's bytes, zero-padded to 4."""
    b = as_bytes(t.detach().contiguous())  # [nbytes] uint8
    n_full = b.numel() // 4 * 4
    body = b[:n_full]
    if body.storage_offset() % 4:
        body = body.clone()  # a dtype view needs an aligned storage offset
    words = body.view(torch.int32)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        yield start, words[start:start + _CHUNK_WORDS]
    if n_full < b.numel():
        tail = torch.zeros(4, dtype=torch.uint8, device=b.device)
        tail[:b.numel() - n_full] = b[n_full:]
        yield words.numel(), tail.view(torch.int32)


def checksum(t: Tensor) -> int:
    """Exact, order-independent checksum of a tensor's bytes, as a Python int in [0, 2**61-1).

    The bytes are read as int32 words x_i (the last one zero-padded), each split into 16-bit
    halves, and weighted by their position w_i = (i mod 65521) + 1:
        lo = sum_i (x_i & 0xFFFF) * w_i,   hi = sum_i ((x_i >> 16) & 0xFFFF) * w_i
    Every product is below 2**32 and every chunk sum below 2**56, so the int64 sums are exact on
    any device and in any reduction order. lo, hi and the byte length are folded modulo the
    Mersenne prime 2**61-1. Changing any single element always changes the checksum (it changes
    lo or hi by d * w_i with 0 < |d|, w_i < 2**16); so does moving a value to another position,
    except between positions that are a multiple of 65521 words apart. Dtype and shape are not
    part of it: `state_checksum` adds them."""
    lo = hi = 0
    nbytes = t.numel() * t.element_size()
    for start, words in _int32_words(t):
        w = words.to(torch.int64)
        pos = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device) % _MOD_POSITION + 1
        lo += int(((w & 0xFFFF) * pos).sum())
        hi += int((((w >> 16) & 0xFFFF) * pos).sum())
    return (lo + hi * _HI_FACTOR + nbytes * _LEN_FACTOR) % _MERSENNE_61


def checksum_sums(t: Tensor, start: int = 0) -> tuple[int, int]:
    """(lo, hi) of `checksum` for a piece of a larger tensor: `t` holds the whole tensor's flat
    elements from index `start` on (an FSDP shard, `fsdp.local_part`). The pieces' sums add up to
    the whole tensor's, which `fold` turns into its `checksum`, so each trainer checksums its own
    shard and no rank gathers the whole. Halfword h_j (little-endian 16 bits, j counted over the
    whole tensor) is the low half of word j // 2 when j is even, the high half when odd: the same
    sums as `checksum`'s. Needs an even element size (every weight dtype)."""
    size = t.element_size()
    if size % 2:
        raise ValueError(f"checksum_sums needs an even element size, got {t.dtype}")
    b = as_bytes(t.detach().contiguous())
    if b.storage_offset() % 2:
        b = b.clone()  # a dtype view needs an aligned storage offset
    halves = b.view(torch.int16)
    first = start * size // 2
    lo = hi = 0
    for s in range(0, halves.numel(), _CHUNK_WORDS):
        h = halves[s:s + _CHUNK_WORDS].to(torch.int64) & 0xFFFF
        j = torch.arange(first + s, first + s + h.numel(), dtype=torch.int64, device=h.device)
        weighted = h * ((j >> 1) % _MOD_POSITION + 1)
        odd = j & 1
        hi += int((weighted * odd).sum())
        lo += int((weighted * (1 - odd)).sum())
    return lo, hi


def fold(lo: int, hi: int, nbytes: int) -> int:
    """`checksum` from the (lo, hi) sums of a whole tensor of `nbytes` bytes."""
    return (lo + hi * _HI_FACTOR + nbytes * _LEN_FACTOR) % _MERSENNE_61


def checksums_of(tensors: dict[str, Tensor], dtype: torch.dtype | None = None) -> dict[str, int]:
    """`checksum` of each tensor as `dtype` (default: its own), one tensor cast at a time. An
    FSDP-sharded tensor is checksummed on this rank's shard and the sums are combined over its mesh:
    a collective, which every member calls with the same names in the same order. Computed once per
    version, whatever the number of receivers."""
    out, sharded = {}, []
    for name, t in tensors.items():
        local, start = local_part(t.detach())
        local = local if dtype is None else local.to(dtype)
        if not sharded_tensor(t):  # whole on this rank
            out[name] = checksum(local)
            continue
        lo, hi = checksum_sums(local, start)
        sharded.append((name, lo % _MERSENNE_61, hi % _MERSENNE_61, t.numel() * local.element_size()))
    group = mesh_group(tensors.values())
    if sharded:
        mine = torch.tensor([[lo, hi] for _, lo, hi, _ in sharded], dtype=torch.int64, device=comm_device(group))
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)  # sync point: the trainers sharing the weights
        total = torch.stack(everyone).cpu().tolist()  # [ranks][tensors][2], each < 2**61: summed as Python ints
        for i, (name, _, _, nbytes) in enumerate(sharded):
            out[name] = fold(sum(r[i][0] for r in total), sum(r[i][1] for r in total), nbytes)
    return {name: out[name] for name in tensors}


def state_checksum(tensors: dict[str, Tensor]) -> int:
    """Checksum of a named set of tensors: names, dtypes, shapes and `checksum` of each,
    independent of dict order. A Python int in [0, 2**63)."""
    return combine({name: (str(t.dtype), list(t.shape), checksum(t)) for name, t in tensors.items()})


def combine_checksums(tensors: dict[str, Tensor], sums: dict[str, int], dtype: torch.dtype | None = None) -> int:
    """`state_checksum` of `tensors` as `dtype`, from their `checksums_of` (no second pass)."""
    return combine({n: (str(dtype if dtype is not None and t.is_floating_point() else t.dtype), list(t.shape), sums[n])
                     for n, t in tensors.items()})


def combine(entries: dict[str, tuple[str, list[int], int]]) -> int:
    lines = sorted(f"{name}|{dtype}|{shape}|{value}" for name, (dtype, shape, value) in entries.items())
    digest = hashlib.sha256("\n".join(lines).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
