"""Payload transfer and verified weight publication across 3 gloo ranks.

Run: torchrun --standalone --nproc_per_node 3 tests/dist_scripts/p2p_publish.py OUT_DIR
Rank 0 plays the trainer; ranks 1 and 2 play generator stages, each holding a subset of the
model. Each rank writes OUT_DIR/rank{r}.json with its checks ({name: true/false or detail}) and
exits 0 only if all of them passed.
"""
from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


from parallel.p2p import comm_device, isend_payload, recv_payload, send_payload
from parallel.publish import (
    CORRUPT_ENV, PublicationError, WeightPublisher, WeightReceiver, checksum, state_checksum,
)
from tests.dist_scripts.rank_report import finish

BUCKET_BYTES = 1024  # forces several buckets per publication


def mixed_payload() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g)
    return {
        "fp32": x,
        "bf16": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(5, generator=g).to(torch.float16),
        "int64": torch.arange(-4, 7, dtype=torch.int64).reshape(1, 11),
        "bool": torch.tensor([[True, False, True], [False, False, True]]),
        "complex64": torch.randn(4, 3, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
        "strided": x.t(),  # non-contiguous: sent as its values
        "odd_uint8": torch.arange(3, dtype=torch.uint8),
    }


def model_weights(version: int) -> dict[str, torch.Tensor]:
    """The trainer's full model at `version` (identical on every rank)."""
    g = torch.Generator().manual_seed(100 + version)
    return {
        "embed.weight": torch.randn(16, 8, generator=g),                         # 512 B
        "blocks.0.attn.weight": torch.randn(24, 16, generator=g),                # 1536 B: alone
        "blocks.0.norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
        "blocks.1.attn.weight": torch.randn(8, 8, generator=g),
        "blocks.1.norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
        "blocks.1.mask": torch.rand(9, generator=g) > 0.5,
        "head.weight": torch.randn(10, 8, generator=g),
        "head.bias": torch.randn(10, generator=g),
    }


STAGE_NAMES = {
    1: ["embed.weight", "blocks.0.attn.weight", "blocks.0.norm.weight"],
    2: ["blocks.1.attn.weight", "blocks.1.norm.weight", "blocks.1.mask", "head.weight", "head.bias"],
}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def run(rank: int, checks: dict) -> None:
    g12 = dist.new_group([1, 2])  # every rank creates every group, in the same order
    checks["comm_device_cpu"] = comm_device() == torch.device("cpu")
    meta = {"step": 3, "fragment": [0, 1], "name": "x"}

    # -- payloads: 0 -> 1 blocking, 1 -> 0 echo non-blocking, 1 -> 2 empty dict over a subgroup
    if rank == 0:
        send_payload(mixed_payload(), meta, dst=1)
        echoed, echo_meta = recv_payload(src=1)
        expected = {k: v.contiguous() for k, v in mixed_payload().items()}
        checks["payload_roundtrip"] = same(echoed, expected) and echo_meta == {**meta, "echo": True}
    elif rank == 1:
        got, got_meta = recv_payload(src=0)
        expected = mixed_payload()
        checks["payload_received"] = same(got, {k: v.contiguous() for k, v in expected.items()}) and got_meta == meta
        handle = isend_payload(got, {**got_meta, "echo": True}, dst=0)
        handle.wait()
        send_payload({}, {"empty": True}, dst=2, group=g12)
    else:
        got, got_meta = recv_payload(src=1, group=g12)
        checks["empty_payload"] = got == {} and got_meta == {"empty": True}

    # -- publication: rank 0 publishes each stage's subset; receivers start from zeros
    if rank == 0:
        publish_weights = WeightPublisher(bucket_bytes=BUCKET_BYTES).publish
        stats = {}
        for version in (1, 2):
            weights = model_weights(version)
            for dst in (1, 2):
                stats[dst] = publish_weights({n: weights[n] for n in STAGE_NAMES[dst]}, version, dst)
        checks["several_buckets"] = stats[1].num_buckets >= 3 and stats[2].num_buckets >= 3
        checks["num_changed"] = stats[1].num_changed == 3 and stats[2].num_changed == 5
        # v3: to rank 1 only; rank 1 already holds v3 (an update that does nothing)
        publish_weights({n: model_weights(3)[n] for n in STAGE_NAMES[1]}, 3, 1)
        # v4: both receivers corrupt their install via the test hook
        for dst in (1, 2):
            publish_weights({n: model_weights(4)[n] for n in STAGE_NAMES[dst]}, 4, dst)
        # a name the receiver does not hold
        publish_weights({n: model_weights(5)[n] for n in STAGE_NAMES[2] + ["embed.weight"]}, 5, 2)
        # the wire is still in step after the failures
        send_payload({"x": torch.ones(2)}, {"after": True}, dst=2)
    else:
        names = STAGE_NAMES[rank]
        full_model = {k: torch.zeros_like(v) for k, v in model_weights(0).items()}
        targets = {n: full_model[n] for n in names}
        receiver = WeightReceiver(targets)
        for version in (1, 2):
            before = {n: t.clone() for n, t in targets.items()}
            got_version = receiver.receive(src=0)
            checks[f"receive_leaves_targets_v{version}"] = same(targets, before)
            receiver.install()
            want = {n: model_weights(version)[n] for n in names}
            checks[f"install_exact_v{version}"] = got_version == version and same(targets, want)
            checks[f"checksums_agree_v{version}"] = state_checksum(targets) == state_checksum(want) and all(
                checksum(targets[n]) == checksum(want[n]) for n in names)
        others = [n for n in full_model if n not in names]
        checks["other_params_untouched"] = all(not full_model[n].any() for n in others)

        if rank == 1:
            receiver.receive(src=0)
            with torch.no_grad():  # the targets already equal v3: install cannot change them
                for n in names:
                    targets[n].copy_(model_weights(3)[n])
            try:
                receiver.install()
                checks["noop_detected"] = "not raised"
            except PublicationError as e:
                print(f"rank {rank}: {e}", flush=True)
                checks["noop_detected"] = sorted(e.unchanged) == sorted(names) and not e.mismatched

        receiver.receive(src=0)
        mode = "flip" if rank == 1 else "skip"
        os.environ[CORRUPT_ENV] = mode
        try:
            receiver.install()
            checks[f"corrupt_{mode}_detected"] = "not raised"
        except PublicationError as e:
            print(f"rank {rank}: {e}", flush=True)
            if mode == "flip":
                checks["corrupt_flip_detected"] = len(e.mismatched) == 1 and "checksum" in str(e)
            else:
                checks["corrupt_skip_detected"] = sorted(e.unchanged) == sorted(names) and len(e.mismatched) == 5
        finally:
            del os.environ[CORRUPT_ENV]

        if rank == 2:
            try:
                receiver.receive(src=0)
                checks["extra_name_detected"] = "not raised"
            except PublicationError as e:
                print(f"rank {rank}: {e}", flush=True)
                checks["extra_name_detected"] = "embed.weight" in str(e)
            got, got_meta = recv_payload(src=0)
            checks["wire_in_step"] = torch.equal(got["x"], torch.ones(2)) and got_meta == {"after": True}


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    checks: dict = {}
    try:
        run(rank, checks)
    except Exception:  # noqa: BLE001 - reported in the rank's file
        checks["exception"] = traceback.format_exc()

    def clean_exit():  # docs/MODELS.md: barrier, destroy, flush, _exit
        dist.barrier()
        dist.destroy_process_group()
    finish(out_dir, rank, checks, clean_exit=clean_exit)


if __name__ == "__main__":
    main()
