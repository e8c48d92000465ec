"""Group creation as recorded in the communication trace, on 2 gloo ranks.

Run: DIGENRL_COMM_TRACE=DIR torchrun --standalone --nproc_per_node 2 -m tests.dist_scripts.group_creation MODE
MODE "alone": the mixed-precision group of a replicated trainer as the code made it before, by the
trainer (rank 1) alone with use_local_synchronization; gloo lets it pass, NCCL with a bound device
would hang in ncclCommSplit. MODE "every": ProcessGroups.create(own=True) on a colocated pair, then
groups that bypass commhooks.new_group (new_subgroups), and one bf16 forward of FSDP2 over each
rank's own group (the trainer's engine).
"""
from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.device_mesh import DeviceMesh

from parallel import commhooks
from parallel.topology import ProcessGroups, Topology


def main(mode: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    commhooks.install()
    rank = dist.get_rank()
    if mode == "alone":
        commhooks.new_group("trainers", [1], timedelta(seconds=60))
        if rank == 1:
            dist.new_group([dist.get_rank()], use_local_synchronization=True)  # the old parallel/fsdp.own_group
    else:
        groups = ProcessGroups.create(Topology.build(2, "colocated"), 60, 60, own=True)
        dist.new_subgroups(group_size=1)
        mesh = DeviceMesh.from_group(groups.own[rank], device_type="cpu")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        layer = fully_shard(torch.nn.Linear(4, 4), mesh=mesh, mp_policy=policy)
        out = layer(torch.randn(2, 4).to(torch.bfloat16))
        assert out.dtype == torch.bfloat16  # computed with the weights cast for the forward
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
