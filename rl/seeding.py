"""Seeds and noise keyed by data, never by rank (docs/DESIGN.md, placement invariance).

All noise of sample i of step k is drawn from generators seeded by (seed, k, i) alone, so a
trajectory does not depend on which rank produced it, on its batch neighbours or on the order of
generation. A leaf module: the plan, the algorithms, the sampler and the GAP stages all use it.
"""
from __future__ import annotations

import hashlib

import torch
from torch import Tensor


def derive_seed(*key: int | str) -> int:
    """A 63-bit seed from a key tuple, stable across processes, machines and Python versions."""
    digest = hashlib.sha256(repr(tuple(key)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def noise(shape: tuple[int, ...], *key: int | str) -> Tensor:
    """Standard normal float32 noise on CPU seeded by `key` alone (callers move it to their device,
    so CPU and GPU runs draw the same numbers)."""
    gen = torch.Generator(device="cpu").manual_seed(derive_seed(*key))
    return torch.randn(shape, generator=gen, dtype=torch.float32)


def initial_noise(seed: int, step: int, sample_id: int, shape: tuple[int, ...]) -> Tensor:
    return noise(shape, seed, step, sample_id, "init")


def step_noise(seed: int, step: int, sample_id: int, t: int, shape: tuple[int, ...]) -> Tensor:
    return noise(shape, seed, step, sample_id, "sde", t)


def forward_noise(seed: int, step: int, sample_id: int, t: int, shape: tuple[int, ...]) -> Tensor:
    """The noise a forward-process algorithm (DiffusionNFT) adds to sample i's clean latent at the
    schedule's sigma t on the trainer: keyed like every other noise, so any trainer draws the same."""
    return noise(shape, seed, step, sample_id, "forward", t)
