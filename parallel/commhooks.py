"""The collectives of a run in its communication trace (telemetry/commtrace.py), and the one place
that may synchronize the whole device.

With DIGENRL_COMM_TRACE set, `install` wraps torch.distributed's collectives (all_reduce,
all_gather_object, barrier, ...) and the functional collectives DTensor runs (a sharded parameter's
`full_tensor`, the gradient norm of FSDP2 parameters), so every collective any code posts is
recorded where the project called it: the trainer's all-reduce, the start-up gathers, evaluation,
checkpointing (torch.distributed.checkpoint's own gathers), and FSDP2's all-gather and
reduce-scatter of each unit, which it posts through torch.distributed too. Point-to-point traffic is
recorded by parallel/p2p.py, which knows the waits. A collective whose call returns its result
(not async_op) is recorded with a wait on it: the conservative reading, since the caller reads the
result next. A call nested in a recorded one (all_gather_object's own all_gather) is not recorded
again. When the variable is unset nothing is wrapped.

`synchronize` is the device-wide synchronize of start-up timings; it is recorded as "sync" (it
waits for every operation the rank posted). tests/test_device_sync.py keeps it out of the step path.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _resolve_process_group

from telemetry import commtrace

commtrace.plumbing(__file__)

C10D = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
        "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "gather", "scatter", "all_to_all",
        "all_to_all_single", "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list",
        "gather_object", "scatter_object_list", "all_reduce_coalesced")
"""torch.distributed's collectives (FSDP2 posts its all-gathers and reduce-scatters through these)"""
FUNCOL = ("all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
          "all_to_all_single", "broadcast", "all_reduce_coalesced", "all_gather_into_tensor_coalesced",
          "reduce_scatter_tensor_coalesced")
"""the functional collectives (DTensor's redistributions)"""

_local = threading.local()
_installed = False


def _call_facts(fn, args, kwargs, functional: bool):
    """(the ProcessGroup a collective call runs on, None for the default one; whether it is async)."""
    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = kwargs
    group = bound.get("group")
    if functional:  # a mesh, a (mesh, dim) or a group's name: the ProcessGroup behind it
        group = funcol._resolve_group(group)
        return (group if isinstance(group, dist.ProcessGroup) else _resolve_process_group(group)), False
    return group, bool(bound.get("async_op", False))


def _nbytes(args) -> int:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.numel() * a.element_size()
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return sum(t.numel() * t.element_size() for t in a)
    return 0


@contextlib.contextmanager
def collective(name: str, group=None, nbytes: int = 0, blocking: bool = True):
    """Record one collective named `name` on `group` (and a wait on it when `blocking`); collectives
    posted inside the block belong to it and are not recorded again."""
    depth = getattr(_local, "depth", 0)
    if depth == 0 and commtrace.enabled():
        members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        index = commtrace.record("collective", commtrace.group_name(group), nbytes=nbytes, name=name, members=members)
        if blocking:
            commtrace.record("wait", commtrace.group_name(group), target=index)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth


def _wrap(fn, name: str, functional: bool):
    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        if getattr(_local, "depth", 0):
            return fn(*args, **kwargs)
        group, async_op = _call_facts(fn, args, kwargs, functional)
        with collective(name, group, _nbytes(args), blocking=not async_op):
            return fn(*args, **kwargs)

    return recorded


def install() -> None:
    """Record every collective of this process from now on (once; only with DIGENRL_COMM_TRACE)."""
    global _installed
    if _installed or not commtrace.enabled():
        return
    _installed = True
    for name in C10D:
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        wrapped = _wrap(fn, name, functional=False)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)
    for name in FUNCOL:
        fn = getattr(funcol, name, None)
        if fn is not None:
            setattr(funcol, name, _wrap(fn, "functional." + name, functional=True))


def new_group(name: str, ranks: list[int], timeout):
    """dist.new_group, called on every rank in the same order, recorded as a collective of the
    world named after the communicator: the check then finds ranks that create communicators in
    different orders. The group is named `name` in traces."""
    with collective(f"new_group {name}"):
        group = dist.new_group(sorted(ranks), timeout=timeout)
    if dist.get_rank() in ranks:  # the others get a placeholder they never use
        commtrace.name_group(group, name)
    return group


def synchronize(device: torch.device) -> None:
    """Wait for all work on the device, communication included: for start-up timings only."""
    if device.type == "cuda":
        commtrace.record("sync", "")
        torch.cuda.synchronize(device)


__all__ = ["C10D", "FUNCOL", "collective", "install", "new_group", "synchronize"]
