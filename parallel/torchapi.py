"""torch's private APIs, looked up in one place, so that a torch without one says so in one line.

The project runs on the torch its users have (torch 2.11 to 2.13 are tested). A few features reach
into torch's private modules and attributes, which any release may rename: the communication
trace's functional collectives, FSDP2's all-gather counter, the memory measurement's FakeTensor and
tracker internals, the run's store. Each looks its names up here, by dotted path ("a.b.c": the
longest importable module, then attributes), and either degrades with one warning naming the
missing API, the installed torch and what is off (`optional`), or, where the feature cannot work
without it, fails with that message (`require`: `MissingTorchAPI`).
"""
from __future__ import annotations

import importlib
import warnings

import torch

TESTED = "2.11-2.13"
"""the torch releases the project's tests run on"""


class MissingTorchAPI(RuntimeError):
    """A feature needs a private torch API that the installed torch lacks."""


CANNOT = f"it cannot run without it; use a torch the project tests ({TESTED})"
_MISSING = object()
_warned: set[str] = set()


def find(path: str):
    """The object at dotted `path` (a module, then its attributes), or None when any part is missing."""
    parts = path.split(".")
    obj, i = None, len(parts)
    while i > 0:  # the longest prefix that imports as a module
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            i -= 1
    if obj is None:
        return None
    for name in parts[i:]:
        obj = getattr(obj, name, _MISSING)
        if obj is _MISSING:
            return None
    return obj


def message(paths, feature: str, consequence: str) -> str:
    """One line: `feature` and what follows, the missing APIs and the installed torch."""
    names = ", ".join(paths) if not isinstance(paths, str) else paths
    return f"{feature}: torch {torch.__version__} has no {names} (a private torch API); {consequence}"


def warn_once(text: str) -> None:
    """Warn with `text` once per process (a feature checks its APIs where it starts, maybe often)."""
    if text not in _warned:
        _warned.add(text)
        warnings.warn(text, RuntimeWarning, stacklevel=3)


def optional(path: str, feature: str, consequence: str):
    """The object at `path`, or None after one warning that `feature` degrades to `consequence`."""
    obj = find(path)
    if obj is None:
        warn_once(message(path, feature, consequence))
    return obj


def require(feature: str, *paths: str):
    """The objects at `paths` (one, or a tuple in order); MissingTorchAPI naming every missing one
    when `feature` cannot work without them."""
    found = [find(p) for p in paths]
    missing = [p for p, obj in zip(paths, found) if obj is None]
    if missing:
        raise MissingTorchAPI(message(missing, feature, CANNOT))
    return found[0] if len(found) == 1 else tuple(found)


def attribute(obj, name: str, feature: str):
    """`obj.name`, a private attribute of a torch object (set per instance, so `require` cannot see
    it ahead), or MissingTorchAPI naming it."""
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        raise MissingTorchAPI(message(f"{type(obj).__module__}.{type(obj).__qualname__}.{name}", feature, CANNOT))
    return value


__all__ = ["CANNOT", "MissingTorchAPI", "TESTED", "attribute", "find", "message", "optional", "require", "warn_once"]
