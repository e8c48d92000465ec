"""Mixed-precision FSDP2 trainers and their publication, across 3 gloo ranks.

Run: torchrun --standalone --nproc_per_node 3 -m tests.dist_scripts.lean_fsdp OUT_DIR
Ranks 0 and 1 are FSDP2 trainers of the tiny Wan (full fine-tuning, bf16 compute): one root over
the units, the transformer's own parameter sharded, each unit's forward in bf16, float32 gradients,
checksums of a version from shards, publication bucket by bucket (no rank gathers the whole model)
and the lossy codec on shards equal to the codec on whole tensors. Rank 2 is a generator holding
the weights in bf16: it installs each publication as it arrives (or staged, then installed) and
verifies it. Each rank writes OUT_DIR/rank{r}.json with its checks and exits 0 only if all passed.
"""
from __future__ import annotations

import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from config.schema import RunConfig
from models import load_model
from parallel import compress
from parallel.fsdp import full_tensor
from parallel.trainer_intake import TrainChunk
from parallel.checksums import checksum
from parallel.publish import WeightPublisher, WeightReceiver
from rl import sampler
from trainer import Trainer
from tests.dist_scripts.rank_report import finish

BUCKET_BYTES = 4096  # several buckets per publication
BF16 = torch.bfloat16


def _adapter():
    return load_model("wan", preset="tiny", seed=0)


def trainer_checks(rank: int, group, checks: dict) -> None:
    cfg = RunConfig()
    cfg.model.dtype, cfg.optim.lora_rank, cfg.optim.lr = "bfloat16", 0, 1e-3
    adapter = _adapter()
    sampling = sampler.SamplingConfig.for_adapter(adapter, height=16, width=16, num_steps=2, cfg_scale=1.0)
    trainer = Trainer(cfg, adapter, sampling, group, "fsdp")
    model = adapter.transformer
    checks["root_shards_the_transformers_own_parameter"] = hasattr(model.scale_shift_table, "device_mesh")
    seen = []
    adapter.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(m.attn1.to_q.weight.dtype))
    cond = adapter.encode_prompts(["a red circle", "two blue squares"])
    traj = sampler.denoise(adapter, cond, None, [0, 1], 0, sampling)  # under the root too (no grad)
    chunk = TrainChunk(0, 0, 0, 0, torch.tensor([0, 1]), traj.latents, traj.log_probs, torch.tensor([1.0, -1.0]),
                       torch.ones(2, dtype=torch.bool), traj.sigmas, cond, None)
    trainer.current_step = 0
    trainer.train_chunk(chunk)
    states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
    checks["units_are_not_roots"] = bool(states) and all(s._is_root is False for s in states)
    checks["root_is_the_root"] = adapter.enclosing._get_fsdp_state()._is_root is True
    checks["forward_in_bf16"] = bool(seen) and set(seen) == {BF16}
    grads = [p.grad for p in trainer.params if p.grad is not None]
    checks["float32_gradients"] = bool(grads) and all(g.dtype == torch.float32 for g in grads)
    trainer.finish_step()

    names = trainer.names
    publisher = WeightPublisher(bucket_bytes=BUCKET_BYTES)
    by_dst = {2: names}
    # version 1: the compute-dtype cast of the float32 weights, checksummed on shards
    out = trainer.make_version(names)
    whole = {n: full_tensor(p.detach()).to(BF16) for n, p in trainer.weights(names).items()}
    checks["shard_checksums_equal_whole"] = all(out.checksums[n] == checksum(whole[n]) for n in names)
    checks["published_in_compute_dtype"] = all(dtype == str(BF16) for _, dtype in out.wire.values())
    if rank == 0:
        sent = publisher.publish_all(out, by_dst, 1)
        checks["several_buckets"] = sent[0].num_buckets > 3
    else:
        publisher.follow_all(out, by_dst)  # the same bucket all-gathers as trainer 0's sends
    publisher.publish_all(trainer.make_version(names), by_dst, 2) if rank == 0 else \
        publisher.follow_all(trainer.make_version(names), by_dst)  # version 2, received staged
    # version 3: a lossy codec on shards, against the same codec on whole tensors
    before = {n: full_tensor(p.detach()) for n, p in trainer.weights(names).items()}
    trainer.start_codec("delta-topk:0.3", names)
    with torch.no_grad():  # an update, so that the delta is not zero
        for p in trainer.params:
            p.add_(0.01 * torch.ones_like(p))
    moved = {n: full_tensor(p.detach()) for n, p in trainer.weights(names).items()}
    reference = compress.Reconstruction("delta-topk:0.3", before, dtype=BF16)
    ref_wire, ref_held = reference.publish(moved)
    out = trainer.make_version(names)
    wire = out.fetch(list(out.wire))
    held = out.fetch(names, True)
    checks["sharded_codec_equals_whole"] = (wire.keys() == ref_wire.keys()
                                            and all(torch.equal(wire[k], ref_wire[k]) for k in wire)
                                            and all(torch.equal(held[n], ref_held[n]) for n in names))
    checks["trainer_adopts_the_reconstruction"] = all(
        torch.equal(full_tensor(p.detach()), ref_held[n].float()) for n, p in trainer.weights(names).items())
    publisher.publish_all(out, by_dst, 3) if rank == 0 else publisher.follow_all(out, by_dst)
    dist.barrier()


def generator_checks(checks: dict) -> None:
    adapter = _adapter()
    adapter.transformer.requires_grad_(False).to(BF16)
    params = dict(adapter.transformer.named_parameters())
    receiver = WeightReceiver(params)
    # version 1 into the live weights, bucket by bucket; version 2 staged, then installed
    checks["installed_v1"] = receiver.receive(src=0, install=True) == 1
    before = {n: t.clone() for n, t in params.items()}
    checks["staged_v2"] = receiver.receive(src=0) == 2 and all(torch.equal(before[n], t) for n, t in params.items())
    checks["installed_v2"] = receiver.install() == 2
    checks["installed_codec_v3"] = receiver.receive(src=0, install=True) == 3  # verified against the shards' sums
    dist.barrier()


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    checks: dict = {}
    try:
        if rank < 2:
            trainer_checks(rank, group, checks)
        else:
            generator_checks(checks)
    except Exception:  # noqa: BLE001 - reported in the rank's file
        checks["exception"] = traceback.format_exc()
    finish(out_dir, rank, checks)


if __name__ == "__main__":
    main()
