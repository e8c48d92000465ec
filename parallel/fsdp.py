"""FSDP2 over a DiT driven piece by piece: sharding units, whole tensors of sharded parameters
and back, and a count of the parameter all-gathers (the bench reports it per step)."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from parallel import torchapi


class Root(torch.nn.Module):
    """FSDP2's root over a DiT's sharding units (`shard_modules`).

    The adapters run embed / blocks / head piece by piece and never the transformer's own forward,
    so without a root every unit is a root of its own: before its all-gather, a root makes the
    all-gather stream wait for all compute queued so far, and no all-gather overlaps compute. One call
    of this module encloses a whole velocity (`DiTAdapter.enclosing`): the units inside are not roots,
    each all-gather is issued as soon as the host reaches its unit, while the device still computes
    the previous one, and backward prefetches the previous unit's all-gather (FSDP2's implicit
    backward prefetch, torch 2.13 `_fsdp_state.py`). The root also shards the transformer's own
    parameters, which no unit holds (Wan's `scale_shift_table`)."""

    def __init__(self, transformer: torch.nn.Module):
        super().__init__()
        self.transformer = transformer

    def forward(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


def shard_modules(transformer: torch.nn.Module, group, param_dtype: torch.dtype | None = None) -> Root:
    """Shard every block and every top-level module that holds parameters as its own unit, under
    one `Root`, which the caller runs each velocity through. Adapters drive embed / blocks / head
    directly (never model.forward), so each piece gathers its own parameters when it runs.

    `param_dtype` (the compute dtype, when it is not float32): FSDP2 mixed precision, as torchtitan
    and DanceGRPO train: float32 sharded weights, gradients and AdamW state; all-gathers and the
    forward in `param_dtype`; gradients reduce-scattered in float32. Forward inputs are not cast
    (cast_forward_inputs=False): the adapters cast them, as they do on generators, which hold the
    weights in the compute dtype, so a trainer's forward computes what the generator computed."""
    device_type = "cuda" if torch.cuda.is_available() and dist.get_backend(group) == "nccl" else "cpu"
    mesh = mesh_of(group, device_type)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None,
                                  cast_forward_inputs=False)
    for child in transformer.children():
        units = list(child) if isinstance(child, torch.nn.ModuleList) else [child]
        for unit in units:
            if any(True for _ in unit.parameters()):
                fully_shard(unit, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    return fully_shard(Root(transformer), mesh=mesh, mp_policy=policy)


def mesh_of(group, device_type: str) -> DeviceMesh:
    """The 1-D DeviceMesh over `group`, its dimension named after the group. DTensor caches its
    sharding propagation by mesh equality, which compares ranks and dimension names, not groups: a
    placement switched inside a run (runtime/autoplace.py) shards over a new group of the same ranks
    as a destroyed one, and an unnamed mesh would take the destroyed group's mesh from that cache
    (its parameters' `detach()` then carry it). The group's name keeps every group's mesh its own."""
    return DeviceMesh.from_group(group, device_type=device_type, mesh_dim_names=(f"pg{group.group_name}",))


def spans_ranks(t: Tensor) -> bool:
    """Whether `t` is sharded over more than one rank (its whole takes a collective)."""
    return isinstance(t, DTensor) and t.device_mesh.size() > 1


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor of a possibly FSDP-sharded parameter (a collective over the trainer group)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_part(t: Tensor) -> tuple[Tensor, int]:
    """(this rank's part of `t`, the flat index in the whole tensor of the part's first element): an
    FSDP2 shard (rows of dim 0, a contiguous range of the flattened tensor) or a plain tensor whole.
    The first row is `Shard.local_shard_size_and_offset`'s, public in torch 2.11-2.13 (torch.chunk's
    split, which FSDP2 shards by)."""
    if not isinstance(t, DTensor):
        return t, 0
    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        raise ValueError(f"local_part takes FSDP2's Shard(0) over a 1-D mesh, got {t.placements} over a "
                         f"{t.device_mesh.ndim}-D mesh")
    mesh = t.device_mesh
    _, first_row = Shard.local_shard_size_and_offset(t.shape[0], mesh.size(), mesh.get_local_rank()) \
        if t.dim() else (0, 0)
    row = 1
    for size in t.shape[1:]:
        row *= size
    return t.to_local(), int(first_row) * row


def whole_like(local: Tensor, like: Tensor) -> Tensor:
    """The whole tensor of which this rank holds `local`, sharded as `like` is (`local_part`): an
    all-gather over like's mesh when it is sharded (every member calls it), else `local` itself."""
    return full_tensor(shard_like(local, like))


def sharded(t: Tensor) -> bool:
    """Whether `t` is an FSDP-sharded (distributed) tensor."""
    return isinstance(t, DTensor)


def shard_like(local: Tensor, like: Tensor) -> Tensor:
    """`local`, this rank's part of a whole tensor sharded as `like` is, as a tensor of that whole
    (an FSDP2 DTensor; `like` plain: `local` is the whole)."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def mesh_group(tensors) -> object | None:
    """The process group of the first FSDP-sharded tensor among `tensors` (None: none is sharded)."""
    return next((t.device_mesh.get_group() for t in tensors if isinstance(t, DTensor)), None)


def copy_full(param: Tensor, whole: Tensor) -> None:
    """Copy a whole tensor into a possibly FSDP-sharded parameter in place: a sharded one keeps its
    own shard of `whole` (no communication: every rank passes the same tensor)."""
    if hasattr(param, "device_mesh"):
        param.copy_(distribute_tensor(whole.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None))
    else:
        param.copy_(whole.to(device=param.device, dtype=param.dtype))


PARAM_GROUP = ("FSDPModule._get_fsdp_state()", "FSDPState._fsdp_param_group")
"""FSDP2's private state that `param_groups` reads (torch 2.11-2.13)"""
_MISSING = object()


def _param_group(module: FSDPModule, needs: tuple[str, ...]):
    """FSDP2's parameter group of unit `module` (None: the unit holds no parameters), or _MISSING
    when this torch keeps it elsewhere or the group lacks an attribute in `needs`."""
    get_state = getattr(module, "_get_fsdp_state", None)
    group = getattr(get_state(), "_fsdp_param_group", _MISSING) if get_state is not None else _MISSING
    if group is not None and group is not _MISSING and not all(hasattr(group, n) for n in needs):
        return _MISSING
    return group


def param_groups(transformer: torch.nn.Module, feature: str, consequence: str | None = None,
                 needs: tuple[str, ...] = ()) -> list | None:
    """FSDP2's parameter group of every FSDP unit in `transformer` (torch-private state), each with
    the attributes `needs`. When this torch has no such state: None after one warning that `feature`
    degrades to `consequence`, or without a consequence torchapi.MissingTorchAPI (the feature
    cannot work without it)."""
    groups = [_param_group(m, needs) for m in transformer.modules() if isinstance(m, FSDPModule)]
    if any(g is _MISSING for g in groups):
        text = torchapi.message(PARAM_GROUP + tuple(f"FSDPParamGroup.{n}" for n in needs), feature,
                                consequence or torchapi.CANNOT)
        if consequence is None:
            raise torchapi.MissingTorchAPI(text)
        torchapi.warn_once(text)
        return None
    return [g for g in groups if g is not None]


def count_allgathers(transformer: torch.nn.Module, group, on_allgather: Callable[[], None]) -> None:
    """Call `on_allgather` for every parameter all-gather FSDP2 starts: wraps every param group's
    `unshard`, which starts one all-gather when the group is sharded and none is pending (FSDP2
    internals, torch 2.11-2.13; without them the count is off, with a warning)."""
    if dist.get_world_size(group) == 1:
        return  # FSDP over one rank gathers nothing
    groups = param_groups(transformer, "FSDP2's all-gather count (train/num_allgathers)",
                          "the count is off and train/num_allgathers reads 0", needs=("_all_gather_result", "unshard"))
    for param_group in groups or ():

        def unshard(*args, _group=param_group, _unshard=param_group.unshard, **kwargs):
            idle = _group._all_gather_result is None
            _unshard(*args, **kwargs)
            if idle and _group._all_gather_result is not None:
                on_allgather()

        param_group.unshard = unshard
