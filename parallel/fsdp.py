"""FSDP2 over a DiT driven piece by piece: sharding units, whole tensors of sharded parameters
and back, and a count of the parameter all-gathers (the bench reports it per step)."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import distribute_tensor


def shard_modules(transformer: torch.nn.Module, group) -> None:
    """Shard every block and every top-level module that holds parameters as its own unit.
    Adapters drive embed / blocks / head directly (never model.forward), so each piece must gather
    its own parameters when it runs."""
    device_type = "cuda" if torch.cuda.is_available() and dist.get_backend(group) == "nccl" else "cpu"
    mesh = DeviceMesh.from_group(group, device_type=device_type)
    for child in transformer.children():
        units = list(child) if isinstance(child, torch.nn.ModuleList) else [child]
        for unit in units:
            if any(True for _ in unit.parameters()):
                fully_shard(unit, mesh=mesh, reshard_after_forward=True)


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor of a possibly FSDP-sharded parameter (a collective over the trainer group)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def copy_full(param: Tensor, whole: Tensor) -> None:
    """Copy a whole tensor into a possibly FSDP-sharded parameter in place: a sharded one keeps its
    own shard of `whole` (no communication: every rank passes the same tensor)."""
    if hasattr(param, "device_mesh"):
        param.copy_(distribute_tensor(whole.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None))
    else:
        param.copy_(whole.to(device=param.device, dtype=param.dtype))


def count_allgathers(transformer: torch.nn.Module, group, on_allgather: Callable[[], None]) -> None:
    """Call `on_allgather` for every parameter all-gather FSDP2 starts: wraps every param group's
    `unshard`, which starts one all-gather when the group is sharded and none is pending (FSDP2
    internals, torch 2.13)."""
    if dist.get_world_size(group) == 1:
        return  # FSDP over one rank gathers nothing
    for module in transformer.modules():
        param_group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        if param_group is None:
            continue

        def unshard(*args, _group=param_group, _unshard=param_group.unshard, **kwargs):
            idle = _group._all_gather_result is None
            _unshard(*args, **kwargs)
            if idle and _group._all_gather_result is not None:
                on_allgather()

        param_group.unshard = unshard
