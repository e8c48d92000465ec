"""Compressed publication (parallel/compress.py): receivers rebuild bit-exactly what the trainer
says they hold, lossy deltas keep tracking the trainer's weights (error feedback), the wire is
smaller, and a run publishes through each codec with verification on."""
import pytest
import torch

from launch import TINY, torchrun
from metrics import read_metrics
from parallel import compress
from parallel.publish import checksum


def _walk(spec, steps=30, seed=0):
    """A trainer's weights drifting like an optimizer's; returns (trainer's, held by the trainer,
    rebuilt by a receiver, bytes per publication)."""
    g = torch.Generator().manual_seed(seed)
    w = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(100, generator=g)}
    receiver = {n: t.clone() for n, t in w.items()}
    recon = compress.Reconstruction(spec, w)
    sizes = []
    for _ in range(steps):
        w = {n: t + 1e-3 * torch.randn(t.shape, generator=g) for n, t in w.items()}
        wire, held = recon.publish(w)
        sizes.append(sum(t.numel() * t.element_size() for t in wire.values()))
        for name, parts in compress.split_wire(wire).items():
            compress.apply(spec, receiver[name], parts)
    return w, held, receiver, sizes[-1]


@pytest.mark.parametrize("spec", ["none", "bf16", "delta", "delta-topk:0.1"])
def test_receivers_rebuild_exactly_what_the_trainer_holds(spec):
    w, held, receiver, size = _walk(spec)
    for n in w:
        assert torch.equal(receiver[n], held[n]), (spec, n)  # bit for bit
        assert checksum(receiver[n]) == checksum(held[n])
    full = sum(t.numel() * 4 for t in w.values())
    expected = {"none": full, "bf16": full // 2, "delta": full // 2,
                "delta-topk:0.1": (205 + 10) * (4 + 2)}  # ceil(0.1 * n) entries: int32 index + bf16 value
    assert size == expected[spec]


def test_lossy_deltas_track_the_trainer_with_error_feedback():
    """The distance to the trainer's weights stays at the size of one step's loss instead of
    accumulating: what a delta drops is sent again."""
    w, held, _, _ = _walk("delta-topk:0.1", steps=60)
    err = max((w[n] - held[n]).abs().max().item() for n in w)
    drift = 60 ** 0.5 * 1e-3 * 4  # how far the weights walked (a few sigma)
    assert err < 0.5 * drift
    w, held, _, _ = _walk("bf16", steps=60)
    assert max((w[n] - held[n]).abs().max().item() for n in w) < 2e-2  # bf16 rounding of |w| <~ 4


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
        torchrun(2, [*args, "--publish-compression", spec, "--output-dir", str(out)])
        rows = read_metrics(str(out / "metrics.jsonl"))
        assert all(r["publish/seconds"] > 0 for r in rows)
        sent[spec] = rows[-1]["publish/bytes"]
    assert sent["bf16"] == pytest.approx(sent["none"] / 2, rel=0.01)
    assert sent["delta-topk:0.01"] < 0.05 * sent["none"]


def test_lossless_codecs_keep_placement_invariance(tmp_path):
    """bf16 deltas against what the generators hold: one generator or two replicas, streamed or not,
    every receiver rebuilds the same weights, so the runs train the same weights bit for bit; and the
    codec is active (uncompressed publication trains other weights)."""
    from launch import trained_weights

    args = [*TINY, "--steps", "3", "--log-images-every", "0"]
    runs = {"one": (2, ["--generators", "1", "--trainers", "1", "--fragment-groups", "0",
                        "--publish-compression", "delta"]),
            "two": (3, ["--generators", "2", "--trainers", "1", "--fragment-groups", "1",
                        "--publish-compression", "delta"]),
            "none": (2, ["--generators", "1", "--trainers", "1", "--fragment-groups", "0"])}
    weights = {}
    for name, (nproc, extra) in runs.items():
        torchrun(nproc, [*args, *extra, "--output-dir", str(tmp_path / name)])
        weights[name] = trained_weights(str(tmp_path / name), 3)
    for n in weights["one"]:
        assert torch.equal(weights["one"][n], weights["two"][n]), n
    assert any(not torch.equal(weights["one"][n], weights["none"][n]) for n in weights["one"])


def test_a_corrupted_lossy_delta_is_rejected(tmp_path):
    proc = torchrun(2, [*TINY, "--steps", "2", "--publish-compression", "delta-topk:0.01",
                        "--output-dir", str(tmp_path / "run")], env={"DIGENRL_DEBUG_CORRUPT_PUBLISH": "1"},
                    check=False)
    assert proc.returncode != 0
    assert "PublicationError" in proc.stderr and "failed verification" in proc.stderr


def test_a_lossy_codec_is_named_when_its_steps_are_mostly_clipped():
    lossy_clip_warning = compress.clip_warning
    assert compress.lossy("delta-topk:0.01") and compress.lossy("bf16") and not compress.lossy("none")
    line = lossy_clip_warning("delta-topk:0.01", 7, 0.24)
    assert line.startswith("warning: step 7: 24% of the transitions were clipped") and "delta-topk:0.01" in line
    assert lossy_clip_warning("delta-topk:0.01", 7, 0.01) is None  # under the threshold
    assert lossy_clip_warning("none", 7, 0.5) is None  # the generators hold the trainer's weights
    assert lossy_clip_warning(None, 7, 0.5) is None  # colocated: nothing is published
