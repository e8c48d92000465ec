"""Compressed publication (parallel/compress.py): receivers rebuild bit-exactly what the trainer
holds, error feedback loses nothing of an update, the wire is smaller, a run publishes through each
codec with verification on, and a codec trains the same weights in every placement."""
import shutil

import pytest
import torch

from checkpointing.checkpoint import RESIDUAL, read_state

from lab.launch import TINY, torchrun
from telemetry.metrics import read_metrics
from traced import assert_nccl_ok, traced
from parallel import compress
from parallel.publish import checksum


def _walk(spec, steps=30, seed=0):
    """A trainer updated like an optimizer that adopts what it publishes; returns (the uncompressed
    walk, the trainer's weights, the rebuilt ones of a receiver, the reconstruction, bytes per
    publication)."""
    g = torch.Generator().manual_seed(seed)
    exact = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(100, generator=g)}
    trainer = {n: t.clone() for n, t in exact.items()}
    receiver = {n: t.clone() for n, t in exact.items()}
    recon = compress.Reconstruction(spec, exact) if compress.lossy(spec) else None
    sizes = []
    for _ in range(steps):
        update = {n: 1e-3 * torch.randn(t.shape, generator=g) for n, t in exact.items()}
        exact = {n: t + update[n] for n, t in exact.items()}
        trainer = {n: t + update[n] for n, t in trainer.items()}
        wire, held = recon.publish(trainer) if recon else (trainer, trainer)
        trainer = {n: t.clone() for n, t in held.items()}  # the trainer adopts the reconstruction
        sizes.append(sum(t.numel() * t.element_size() for t in wire.values()))
        for name, parts in compress.split_wire(wire).items():
            compress.apply(spec, receiver[name], parts)
    return exact, trainer, receiver, recon, sizes[-1]


@pytest.mark.parametrize("spec", ["none", "bf16", "delta", "delta-topk:0.1"])
def test_receivers_rebuild_exactly_what_the_trainer_holds(spec):
    exact, trainer, receiver, _, size = _walk(spec)
    for n in exact:
        assert torch.equal(receiver[n], trainer[n]), (spec, n)  # bit for bit
        assert checksum(receiver[n]) == checksum(trainer[n])
    full = sum(t.numel() * 4 for t in exact.values())
    expected = {"none": full, "bf16": full // 2, "delta": full // 2,
                "delta-topk:0.1": (205 + 10) * (4 + 2)}  # ceil(0.1 * n) entries: int32 index + bf16 value
    assert size == expected[spec]


@pytest.mark.parametrize("spec,bound", [("delta-topk:0.1", 0.5 * 60 ** 0.5 * 1e-3 * 4), ("bf16", 2e-2)])
def test_error_feedback_leaves_no_permanent_drift(spec, bound):
    """The trainer's weights plus the residual are the uncompressed walk's (nothing an update
    changed is lost), and the residual stays at the size of one step's loss instead of
    accumulating: what a delta drops is sent again. (Walked 4 sigma ~ 60**0.5 * 1e-3 * 4; bf16
    rounds |w| <~ 4 to 2e-2.)"""
    exact, trainer, _, recon, _ = _walk(spec, steps=60)
    for n in exact:
        torch.testing.assert_close(trainer[n] + recon.residual[n], exact[n], rtol=0, atol=1e-6)
    assert max(r.abs().max().item() for r in recon.residual.values()) < bound


def test_a_reconstruction_refuses_a_residual_that_does_not_fit():
    w = {"a": torch.zeros(4, 3)}
    with pytest.raises(ValueError, match="residual 'a' \\[3\\] does not fit"):
        compress.Reconstruction("delta", w, {"a": torch.zeros(3)})
    with pytest.raises(ValueError, match="lossless codec"):
        compress.Reconstruction("none", w)


@pytest.mark.parametrize("spec,message", [("zip", "unknown --publish-compression 'zip'"),
                                          ("delta-topk", "delta-topk needs a fraction F in (0, 1]"),
                                          ("delta-topk:2", "delta-topk needs a fraction"),
                                          ("bf16:3", "bf16 takes no ':' argument")])
def test_bad_codecs_are_named(spec, message):
    with pytest.raises(ValueError) as e:
        compress.parse(spec)
    assert message in str(e.value)


def test_runs_publish_through_every_codec(tmp_path):
    """1 generator + 1 trainer, full fine-tuning: each codec's publications verify (a mismatch would
    stop the run), and the bytes logged per step shrink as the codec says."""
    args = [*TINY, "--steps", "2", "--lora-rank", "0", "--log-images-every", "0", "--generators", "1",
            "--trainers", "1"]
    sent = {}
    for spec in ("none", "bf16", "delta-topk:0.01"):
        out = tmp_path / spec.replace(":", "-")
        torchrun(2, [*args, "--publish-compression", spec, "--output-dir", str(out)], env=traced(out))
        assert_nccl_ok(out, ["data.to", "publish"])
        rows = read_metrics(str(out / "metrics.jsonl"))
        assert all(r["publish/seconds"] > 0 for r in rows)
        sent[spec] = rows[-1]["publish/bytes"]
    assert sent["bf16"] == pytest.approx(sent["none"] / 2, rel=0.01)
    assert sent["delta-topk:0.01"] < 0.05 * sent["none"]


def test_codecs_keep_placement_invariance_and_resume_with_their_residual(tmp_path):
    """Every trainer trains the weights the generators rebuild, and colocated runs apply the codec
    to themselves: bf16 deltas with one generator or two replicas, streamed or not, and top-k
    deltas disaggregated or colocated, train the same weights bit for bit, and FSDP trainers train
    the weights the generator samples with. A run resumed from step 2
    (another placement) goes on from the checkpoint's residual to the same step-3 weights. And the
    codec is active: the two codecs train different weights."""
    from lab.launch import trained_weights

    args = [*TINY, "--steps", "3", "--log-images-every", "0", "--save-every", "1"]
    disagg = ["--generators", "1", "--trainers", "1", "--fragment-groups", "0"]
    runs = {"delta-one": (2, [*disagg, "--publish-compression", "delta"]),
            "delta-two": (3, ["--generators", "2", "--trainers", "1", "--fragment-groups", "1",
                              "--publish-compression", "delta"]),
            "topk-disagg": (2, [*disagg, "--publish-compression", "delta-topk:0.01"]),
            "topk-colocated": (1, ["--mode", "colocated", "--publish-compression", "delta-topk:0.01"]),
            "topk-fsdp": (3, ["--generators", "1", "--trainers", "2", "--train-sharding", "fsdp",
                              "--publish-compression", "delta-topk:0.01"])}
    weights = {}
    for name, (nproc, extra) in runs.items():
        torchrun(nproc, [*args, *extra, "--output-dir", str(tmp_path / name)])
        weights[name] = trained_weights(str(tmp_path / name), 3)
    resumed = tmp_path / "topk-resumed"
    shutil.copytree(tmp_path / "topk-disagg", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-3")
    assert read_state(str(resumed / "checkpoints" / "step-2"), RESIDUAL)  # a residual to go on from
    torchrun(1, [*args, "--mode", "colocated", "--publish-compression", "delta-topk:0.01", "--resume", str(resumed),
                 "--output-dir", str(resumed)])
    weights["topk-resumed"] = trained_weights(str(resumed), 3)
    for n in weights["delta-one"]:
        assert torch.equal(weights["delta-one"][n], weights["delta-two"][n]), n
        assert torch.equal(weights["topk-disagg"][n], weights["topk-colocated"][n]), n
        assert torch.equal(weights["topk-disagg"][n], weights["topk-resumed"][n]), n
    assert any(not torch.equal(weights["delta-one"][n], weights["topk-disagg"][n]) for n in weights["delta-one"])
    # On-policy: the trainers' first forward of a step runs the weights the generator sampled with
    # (under FSDP each trainer adopts its shard), so every importance ratio is exactly 1. (FSDP's
    # gradients differ from one trainer's in the last bits, which can swap near-equal entries of a
    # top-k selection, so its weights are not compared bit for bit.)
    for name in ("topk-disagg", "topk-fsdp"):
        rows = read_metrics(str(tmp_path / name / "metrics.jsonl"))
        assert [(r["train/approx_kl"], r["train/clipfrac"], r["train/ratio"]) for r in rows] == [(0.0, 0.0, 1.0)] * 3


def test_a_corrupted_lossy_delta_is_rejected(tmp_path):
    proc = torchrun(2, [*TINY, "--steps", "2", "--publish-compression", "delta-topk:0.01",
                        "--output-dir", str(tmp_path / "run")], env={"DIGENRL_DEBUG_CORRUPT_PUBLISH": "1"},
                    check=False)
    assert proc.returncode != 0
    assert "PublicationError" in proc.stderr and "failed verification" in proc.stderr
