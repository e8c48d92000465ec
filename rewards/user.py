"""A user's own reward, loaded by `--reward module.path:function` or `--reward path/to/file.py:function`.

The function (or a class, built once with no arguments, whose instances are called) has the
signature of every reward (rewards/README.md, "Your own reward"):

    scores = fn(images, prompts, metadata)

- images: float32 in [0, 1], (B, 3, H, W), or (B, 3, F, H, W) from a video model, on the CPU;
- prompts: a list of B strings; metadata: a list of B dicts (a jsonl prompt file's free fields);
- scores: B finite numbers, as a tensor, a numpy array or a list (made float32 here).

`check_user_reward` loads it and calls it on a dummy batch (`dummy_batch`), so that a spec that
cannot be imported, is not callable, returns the wrong count or non-finite scores stops the run at
start-up with a ValueError naming the spec, before any rank waits on another. A module is imported
by its name (its folder must be on PYTHONPATH: torchrun puts the script's folder there, not the
working directory); a file is loaded from its path. Each process loads a spec once: the check and the
run's reward share the object.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import threading
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

DUMMY_BATCH = 2
DUMMY_SIDE = 64  # pixels on a side of the dummy images: small, and a multiple of the usual patch sizes
DUMMY_FRAMES = 3

_lock = threading.Lock()
_loaded: dict[tuple[int, str], object] = {}  # (pid, target) -> the callable


def is_target(text: str) -> bool:
    """Whether a spec (without its weight) names a user's function: 'module:function' or 'file.py:function'."""
    return ":" in text


def check_target(spec: str, target: str) -> None:
    """A ValueError for a target that cannot name a function, before anything is imported."""
    where, _, attr = target.rpartition(":")
    module_ok = where.endswith(".py") or (where and all(p.isidentifier() for p in where.split(".")))
    if not module_ok or not attr.isidentifier():
        raise ValueError(f"bad reward spec {spec!r}: a reward of your own is module.path:function or "
                         f"path/to/file.py:function, with :WEIGHT after it (rewards/README.md)")


def load(target: str):
    """The callable a target names: the function, or an instance of the class (built with no arguments).
    A ValueError names the target and what went wrong."""
    key = (os.getpid(), target)
    with _lock:
        if key not in _loaded:
            _loaded[key] = _load(target)
        return _loaded[key]


def _load(target: str):
    where, _, attr = target.rpartition(":")
    if where.endswith(".py") and not os.path.isfile(where):
        raise ValueError(f"--reward {target}: no such file {where!r}")
    try:
        module = _import_file(where) if where.endswith(".py") else importlib.import_module(where)
    except Exception as e:  # noqa: BLE001 - a user's module may raise anything while it loads
        hint = "" if where.endswith(".py") else (" (is its folder on PYTHONPATH? or give the file: "
                                                 "path/to/module.py:function)")
        raise ValueError(f"--reward {target}: cannot import {where!r}{hint}: {type(e).__name__}: {e}") from e
    if not hasattr(module, attr):
        raise ValueError(f"--reward {target}: {where!r} has no attribute {attr!r}")
    obj = getattr(module, attr)
    if inspect.isclass(obj):
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"--reward {target}: building {attr}() failed: {type(e).__name__}: {e}") from e
    if not callable(obj):
        raise ValueError(f"--reward {target}: {attr!r} is a {type(obj).__name__}, not a function or a class with "
                         f"__call__")
    return obj


def _import_file(path: str):
    name = "digenrl_user_reward_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def as_scores(target: str, out, batch: int) -> Tensor:
    """A user function's output as (B,) float32 on the CPU; a ValueError for the wrong count or type."""
    if isinstance(out, Tensor):
        scores = out.detach().float().cpu()
    else:
        try:
            scores = torch.from_numpy(np.asarray(out, dtype=np.float64)).float()
        except (TypeError, ValueError):
            raise ValueError(f"--reward {target}: returned a {type(out).__name__}, not B numbers "
                             f"(a tensor, numpy array or list)") from None
    if scores.numel() != batch or scores.dim() > 1 and scores.shape != (batch,):
        raise ValueError(f"--reward {target}: returned {tuple(scores.shape)} scores for {batch} images; a reward "
                         f"returns one score per image, shape ({batch},)")
    return scores.reshape(batch).contiguous()


class UserReward:
    """A user's function as a reward: called like every reward, its output checked and made float32."""

    remote = False

    def __init__(self, target: str):
        self.name = target
        self.fn = load(target)

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        prompts = list(prompts)
        metadata = [{} for _ in prompts] if metadata is None else [dict(m) for m in metadata]
        if images.shape[0] == 0:
            return torch.zeros(0)
        with torch.no_grad():
            out = self.fn(images.detach().float().cpu(), prompts, metadata)
        return as_scores(self.name, out, images.shape[0])

    def __repr__(self) -> str:
        return f"UserReward({self.name})"


def dummy_batch(video: bool) -> tuple[Tensor, list[str], list[dict]]:
    """Seeded random images (or videos) with plain prompts and empty metadata."""
    g = torch.Generator().manual_seed(0)
    shape = (DUMMY_BATCH, 3, DUMMY_FRAMES, DUMMY_SIDE, DUMMY_SIDE) if video else (DUMMY_BATCH, 3, DUMMY_SIDE, DUMMY_SIDE)
    return torch.rand(shape, generator=g), ["a photo of a cat", "a red cube"], [{} for _ in range(DUMMY_BATCH)]


def check_user_reward(target: str, video: bool = False) -> None:
    """Load `target` and score a dummy batch: a ValueError naming the spec if it cannot be imported,
    is not callable, fails, returns the wrong count or non-finite scores."""
    reward = UserReward(target)
    images, prompts, metadata = dummy_batch(video)
    try:
        scores = reward(images, prompts, metadata)
    except ValueError as e:
        if str(e).startswith(f"--reward {target}"):
            raise
        raise ValueError(f"--reward {target}: failed on a dummy batch {tuple(images.shape)}: ValueError: {e}") from e
    except Exception as e:  # noqa: BLE001 - the user's code: say what it raised, and where
        raise ValueError(f"--reward {target}: failed on a dummy batch {tuple(images.shape)}: "
                         f"{type(e).__name__}: {e}") from e
    bad = [i for i, s in enumerate(scores.tolist()) if not math.isfinite(s)]
    if bad:
        raise ValueError(f"--reward {target}: returned non-finite scores on a dummy batch "
                         f"({', '.join(f'{scores[i].item()} at sample {i}' for i in bad)})")


__all__ = ["UserReward", "check_user_reward", "check_target", "dummy_batch", "is_target", "load"]
