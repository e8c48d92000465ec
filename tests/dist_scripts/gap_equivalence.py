"""Run a GAP replica of WORLD_SIZE stages and compare its trajectories with one-stage generation.

Usage (torchrun): gap_equivalence.py OUT_JSON. The last stage writes, per model family, the largest
absolute difference of latents and log-probs against Generator.generate on the full model."""
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from rl import sampler
from models import load_model
from parallel.stepplan import plan_step
from parallel.schedule import partition_blocks
from parallel import commhooks
from parallel.gap import PipelinedReplica, StageLayout, release_other_blocks
from prompts.sets import PromptRecord
from rewards import RewardSet
from rollout import Generator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


FAMILIES = {"flux": {}, "wan": {"num_frames": 5, "cfg_scale": 2.0}, "hunyuan_video": {"num_frames": 5}}
PROMPTS = ["a red circle", "two blue squares on the left", "three green triangles", "a cyan square"]


def main(out_path: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    commhooks.install()  # DIGENRL_COMM_TRACE: the collectives too
    rank, world = dist.get_rank(), dist.get_world_size()
    links = [commhooks.new_group(f"gap.s{s}->s{(s + 1) % world}", [s, (s + 1) % world], timedelta(seconds=120))
             for s in range(world)]  # one communicator per link, as ProcessGroups makes them
    records = [PromptRecord(p) for p in PROMPTS]
    report = {}
    for family, extra in FAMILIES.items():
        adapter = load_model(family, seed=0)
        cfg = sampler.SamplingConfig.for_adapter(adapter, height=16, width=16, num_steps=3, noise_level=0.7,
                                                 seed=5, **extra)
        rewards = RewardSet(["jpeg_compressibility"])
        plan = plan_step(1, seed=0, num_prompts=len(records), prompts_per_step=2, group_size=2, micro_batch=1,
                         num_replicas=1, num_trainers=1, fragment_groups=1)
        reference = None
        if rank == world - 1:
            ref_gen = Generator(load_model(family, seed=0), cfg, rewards, records, seed=0)
            reference = []
            ref_gen.generate(plan, plan.fragments, 0, None, reference.append)
        blocks = partition_blocks([1.0] * len(adapter.blocks), [1.0] * world)[rank]
        release_other_blocks(adapter, blocks)
        gen = Generator(adapter, cfg, rewards, records, seed=0)
        replica = PipelinedReplica(gen, StageLayout(tuple(range(world)), rank, blocks),
                                   (links[(rank - 1) % world], links[rank]))
        emitted = []
        replica.run_step(plan, plan.fragments, 0, gen.stream(plan, None, emitted.append))
        results = emitted
        if rank == world - 1:
            lat = lp = 0.0
            for ref, got in zip(reference, results):
                for a, b in zip(ref.chunks, got.chunks):
                    lat = max(lat, (a.latents - b.latents).abs().max().item())
                    lp = max(lp, (a.log_probs - b.log_probs).abs().max().item())
                    assert torch.equal(a.advantages, b.advantages) or lat > 0
            report[family] = {"latents": lat, "log_probs": lp, "fragments": len(results),
                              "emitted": len(emitted), "blocks": blocks}
    if rank == world - 1:
        with open(out_path, "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
