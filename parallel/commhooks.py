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
again. It also wraps torch's group creations (new_group, split_group, and so new_subgroups and
DeviceMesh), so every group this process creates is recorded, by whichever code: NCCL's rule that a
group is created by every rank, in one order, is then checked too. When the variable is unset
nothing is wrapped.

The functional collectives live in a private torch module, and a group name resolves to its group
only through a private function: where a torch lacks them, those collectives go unrecorded with one
warning (parallel/torchapi.py); DTensor's own calls name their group by a mesh, resolved publicly.

`synchronize` is the device-wide synchronize of start-up timings; it is recorded as "sync" (it
waits for every operation the rank posted). tests/test_device_sync.py keeps it out of the step path.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from parallel import torchapi
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
"""the functional collectives (DTensor's redistributions), in torch's private module FUNCOL_MODULE"""
FUNCOL_MODULE = "torch.distributed._functional_collectives"
CREATE = ("new_group", "split_group")
"""torch.distributed's group creations (new_subgroups and DeviceMesh create through these)"""
FEATURE = "the communication trace (DIGENRL_COMM_TRACE)"

_local = threading.local()
_installed = False
_by_name: dict[str, object] = {}  # group_name -> ProcessGroup, of every group created while recording


def _functional_group(group):
    """The ProcessGroup a functional collective's `group` names, through APIs public in torch 2.11
    to 2.13 (2.11 has no `_functional_collectives._resolve_group`): a ProcessGroup, a 1-D DeviceMesh
    or (mesh, dim), as DTensor passes them; a list of ranks as it is; a group name from the groups
    created since `install`, else torch's private resolver. None: it cannot be resolved here."""
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, DeviceMesh):
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1])
    if isinstance(group, list) and all(isinstance(r, int) for r in group):
        return sorted(group)
    if isinstance(group, str):
        if group in _by_name:
            return _by_name[group]
        world = dist.group.WORLD
        if world is not None and world.group_name == group:
            return world
        resolve = torchapi.optional("torch._C._distributed_c10d._resolve_process_group", FEATURE,
                                    "collectives named by a group name go unrecorded")
        return resolve(group) if resolve is not None else None
    return None


def _call_facts(fn, args, kwargs, functional: bool):
    """(the ProcessGroup a collective call runs on, None for the default one, or its list of ranks;
    whether it is async). A functional collective whose group cannot be resolved: (False, False)."""
    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = kwargs
    group = bound.get("group")
    if functional:
        group = _functional_group(group)
        if group is None:
            torchapi.warn_once(f"{FEATURE}: a functional collective's group given as a "
                               f"{type(bound.get('group')).__name__} cannot be resolved with torch "
                               f"{torch.__version__}; such collectives go unrecorded")
            return False, False
        return group, False
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
    """Record one collective named `name` on `group` (a ProcessGroup, None for the default one, or a
    list of ranks) and a wait on it when `blocking`; collectives posted inside the block belong to
    it and are not recorded again."""
    depth = getattr(_local, "depth", 0)
    if depth == 0 and commtrace.enabled():
        if isinstance(group, list):
            members, label = group, "ranks:" + ",".join(map(str, group))
        else:
            members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            label = commtrace.group_name(group)
        index = commtrace.record("collective", label, nbytes=nbytes, name=name, members=members)
        if blocking:
            commtrace.record("wait", label, target=index)
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
        if group is False:  # cannot be named: unrecorded (warned once)
            return fn(*args, **kwargs)
        with collective(name, group, _nbytes(args), blocking=not async_op):
            return fn(*args, **kwargs)

    return recorded


def _creation_facts(fn, via: str, args, kwargs) -> dict:
    """What a creation call asks for: the group's global ranks, whether only they take part, the
    ranks that must all take part (the world for new_group, the parent's for split_group)."""
    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = kwargs
    world = list(range(dist.get_world_size()))
    if via == "new_group":
        ranks = bound.get("ranks")
        return dict(ranks=world if ranks is None else list(ranks), members=world, group="world",
                    local_sync=bool(bound.get("use_local_synchronization", False)))
    parent = bound.get("parent_pg")
    members = dist.get_process_group_ranks(parent) if parent is not None else world  # in group-rank order
    splits = [[members[r] for r in split] for split in bound.get("split_ranks") or ()]  # parent ranks -> global
    me = dist.get_rank()
    return dict(ranks=next((s for s in splits if me in s), []), members=members, local_sync=False,
                group=commtrace.group_name(parent), splits=splits)


def _wrap_creation(fn, via: str):
    """`fn` (torch's new_group or split_group), recording each creation before it runs (a creation
    that hangs is on record). A creation inside a recorded one (new_group over split_group) is not
    recorded again."""
    @functools.wraps(fn)
    def creating(*args, **kwargs):
        if getattr(_local, "creating", False) or not commtrace.enabled() or not dist.is_initialized():
            return fn(*args, **kwargs)
        facts = _creation_facts(fn, via, args, kwargs)
        name = getattr(_local, "name", None) or "ranks:" + ",".join(map(str, sorted(facts["ranks"])))
        commtrace.record_creation(name=name, via=via, **facts)
        _local.creating = True
        try:
            group = fn(*args, **kwargs)
        finally:
            _local.creating = False
        if isinstance(group, dist.ProcessGroup):
            _by_name[group.group_name] = group  # functional collectives may name it
        return group

    return creating


def _replace(name: str, fn, wrapped) -> None:
    """Put `wrapped` where torch.distributed's modules hold `fn` (device_mesh imports new_group and
    split_group by name). Only torch.distributed's modules are read: reading an attribute of an
    arbitrary module may import things (transformers' lazy modules)."""
    for key, module in list(sys.modules.items()):
        if module is not None and (key == "torch.distributed" or key.startswith("torch.distributed.")) \
                and getattr(module, name, None) is fn:
            setattr(module, name, wrapped)


def install() -> None:
    """Record every collective and every group creation of this process from now on (once; only
    with DIGENRL_COMM_TRACE)."""
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
    funcol = torchapi.optional(FUNCOL_MODULE, FEATURE, "DTensor's collectives (a sharded parameter's full_tensor, "
                               "the gradient norm of FSDP2 parameters) go unrecorded")
    for name in FUNCOL if funcol is not None else ():
        fn = getattr(funcol, name, None)
        if fn is not None:
            setattr(funcol, name, _wrap(fn, "functional." + name, functional=True))
    for name in CREATE:
        fn = getattr(c10d, name, None)
        if fn is not None:
            _replace(name, fn, _wrap_creation(fn, name))


_new_group = _wrap_creation(c10d.new_group, "new_group")  # torch's, recorded whether or not install() ran


def new_group(name: str, ranks: list[int], timeout):
    """dist.new_group, called on every rank in the same order (with a device bound, NCCL creates a
    group by ncclCommSplit of the world's communicator, which every rank joins); recorded as a
    "new_group" line named `name`, so the check finds a creation some rank skips or makes in
    another order. The group is named `name` in traces."""
    _local.name = name
    try:
        group = _new_group(sorted(ranks), timeout=timeout)
    finally:
        _local.name = None
    if dist.get_rank() in ranks:  # the others get a placeholder they never use
        commtrace.name_group(group, name)
    return group


def synchronize(device: torch.device) -> None:
    """Wait for all work on the device, communication included: for start-up timings only."""
    if device.type == "cuda":
        commtrace.record("sync", "")
        torch.cuda.synchronize(device)


__all__ = ["C10D", "CREATE", "FUNCOL", "collective", "install", "new_group", "synchronize"]
