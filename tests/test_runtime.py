"""The runtime through torchrun: placement invariance (docs/DESIGN.md section 4), on-policy ratio == 1,
verified publication, resume, outputs (topology errors: test_bad_inputs.py)."""
import json

import pytest
import torch

from lab.launch import TINY, torchrun, trained_weights
from traced import ALL_GATHER, REDUCE_SCATTER, assert_nccl_ok, created, merged, traced
from weights import assert_same_weights
from telemetry.metrics import read_metrics


def _changed(before, after):
    return sum(not torch.equal(before[n], after[n]) for n in before)


PLACEMENTS = {
    "colocated-2": (2, ["--mode", "colocated"]),
    "disagg-1g1t": (2, ["--generators", "1", "--trainers", "1", "--fragment-groups", "0"]),  # naive
    "disagg-2g2t": (4, ["--generators", "2", "--trainers", "2"]),
}
TRAFFIC = {"colocated-2": ["world"], "disagg-1g1t": ["data.to", "publish"],
           "disagg-2g2t": ["data.to", "publish", "trainers"],
           "disagg-1g2t-fsdp": ["data.to", "publish", "trainers"]}
"""the communicators each placement must have used (its recorded run is checked under NCCL's rules)"""


@pytest.mark.parametrize("training,dtype", [(["--lora-rank", "4"], "float32"), (["--lora-rank", "0"], "float32"),
                                            (["--lora-rank", "0"], "bfloat16")], ids=["lora", "full", "full-bf16"])
def test_placement_invariance(tmp_path, training, dtype):
    """Same seed and flags: every placement trains on the same transitions and ends with the same
    weights after 2 steps, up to floating-point reduction order; what each rank posted completes
    under NCCL's rules. In bf16 (compute dtype; float32 trained weights) too: generators hold the
    bf16 weights, and trainers, replicated or FSDP2, compute with exactly those (docs/DESIGN.md,
    precision), so on this CPU the placements agree to the same tolerance, and ratio == 1 exactly.
    Generators run no training probe."""
    results = {}
    placements = {**PLACEMENTS, **({"disagg-1g2t-fsdp": (3, ["--generators", "1", "--trainers", "2",
                                                            "--train-sharding", "fsdp"])} if dtype != "float32" else {})}
    for name, (nproc, placement) in placements.items():
        out = tmp_path / name
        torchrun(nproc, [*TINY, *training, "--dtype", dtype, "--steps", "2", "--output-dir", str(out), *placement],
                 env=traced(out))
        assert_nccl_ok(out, TRAFFIC[name])
        made = created(out)  # every rank creates every group, in one order: replicated bf16 trainers one each
        assert all(names == made[0] for names in made.values()), (name, made)
        own = {"colocated-2": ["own.t0", "own.t1"], "disagg-2g2t": ["own.t2", "own.t3"]}.get(name, [])
        assert [g for g in made[0] if g.startswith("own.")] == (own if dtype != "float32" else []), (name, made)
        results[name] = (trained_weights(str(out), 2), read_metrics(str(out / "metrics.jsonl")))
        speeds = json.loads((out / "speeds.json").read_text())
        assert all(("train_s" in row) == (row["role"] != "generator") for row in speeds), (name, speeds)
    ref_w, ref_m = results["colocated-2"]
    for name, (w, m) in results.items():
        assert_same_weights(ref_w, w, name)
        assert [r["reward/mean"] for r in m] == pytest.approx([r["reward/mean"] for r in ref_m], rel=1e-6), name
        # On-policy, one inner epoch: every update sees ratio == 1 exactly.
        for row in m:
            assert row["train/approx_kl"] == 0.0 and row["train/clipfrac"] == 0.0, (name, row)
            assert row["train/ratio"] == 1.0, (name, row)
    # Training moved the weights away from version 0, so the comparison above is not between untouched models.
    from models import load_model
    from models.lora import apply_lora

    initial = load_model("flux", seed=0)
    if training[1] != "0":
        apply_lora(initial.transformer, 4, None, "attn", seed=0)
    params = dict(initial.transformer.named_parameters())
    assert _changed({n: params[n].detach() for n in ref_w}, ref_w) > 0


def test_fsdp_placements_match_replicate(tmp_path):
    """FSDP2 trainers and colocated FSDP generation reach the replicated weights; the FSDP2 groups'
    all-gathers and reduce-scatters are posted alike on every member (the NCCL check)."""
    runs = {"replicate": (2, ["--mode", "colocated"]),
            "colocated-fsdp": (2, ["--mode", "colocated", "--colocated-sharding", "fsdp"]),
            "disagg-fsdp": (3, ["--generators", "1", "--trainers", "2", "--train-sharding", "fsdp"])}
    fsdp = {"replicate": [], "colocated-fsdp": [f"world:{ALL_GATHER}", f"world:{REDUCE_SCATTER}"],
            "disagg-fsdp": [f"trainers:{ALL_GATHER}", f"trainers:{REDUCE_SCATTER}"]}
    weights = {}
    for name, (nproc, placement) in runs.items():
        out = tmp_path / name
        torchrun(nproc, [*TINY, "--lora-rank", "4", "--steps", "2", "--output-dir", str(out), *placement],
                 env=traced(out))
        assert_nccl_ok(out, collectives=fsdp[name])
        weights[name] = trained_weights(str(out), 2)
    for name in runs:
        assert_same_weights(weights["replicate"], weights[name], name)


def test_outputs_and_checkpoint_loading(tmp_path):
    out = tmp_path / "run"
    torchrun(2, [*TINY, "--lora-rank", "4", "--steps", "2", "--save-every", "1", "--output-dir", str(out)])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rl"]["steps"] == 2 and cfg["topology"]["mode"] == "disagg"
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1]
    for key in ("reward/mean", "reward/std", "reward/jpeg_compressibility/mean", "train/loss", "train/approx_kl",
                "train/clipfrac", "train/grad_norm", "perf/step_s", "perf/samples_per_s", "perf/bubble_fraction"):
        assert key in rows[0], key
    assert 0.0 <= rows[0]["perf/bubble_fraction"] <= 1.0 and rows[0]["perf/samples_per_s"] > 0
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tb").iterdir())
    assert (out / "samples" / "step-000000.png").is_file()
    for rank in (0, 1):
        trace = json.loads((out / "trace" / f"rank{rank}.json").read_text())
        spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        cats = {e["cat"] for e in spans}
        assert ({"generate", "comm", "publish"} if rank == 0 else {"train", "optimizer", "comm", "publish"}) <= cats
        assert all("step" in e["args"] for e in spans)
    # The LoRA file loads with diffusers' own loader and changes the pipeline's output.
    from models import load_model

    adapter = load_model("flux")
    x = torch.randn(1, *adapter.latent_shape(16, 16))
    cond = adapter.encode_prompts(["a red circle"])
    with torch.no_grad():
        before = adapter.velocity(x, torch.tensor([0.5]), cond)
        adapter.pipe.load_lora_weights(str(out / "checkpoints" / "step-2"))
        after = adapter.velocity(x, torch.tensor([0.5]), cond)
    assert not torch.allclose(before, after)
    assert (out / "checkpoints" / "step-1" / "state.json").is_file()


def test_full_finetune_checkpoint_loads_with_diffusers(tmp_path):
    from diffusers import FluxTransformer2DModel

    out = tmp_path / "run"
    torchrun(2, [*TINY, "--lora-rank", "0", "--steps", "1", "--mode", "colocated", "--output-dir", str(out)])
    model = FluxTransformer2DModel.from_pretrained(str(out / "checkpoints" / "step-1"), subfolder="transformer")
    saved = trained_weights(str(out), 1)
    for name, p in model.named_parameters():  # exported in --export-dtype (bfloat16 by default)
        assert torch.equal(p.detach(), saved[name].to(torch.bfloat16).float())


@pytest.mark.parametrize("training", [["--lora-rank", "4"], ["--lora-rank", "0", "--dtype", "bfloat16"]],
                         ids=["lora", "full-bf16"])
def test_resume_matches_uninterrupted_run(tmp_path, training):
    """Disaggregated, with an EMA: a copy of the run cut back to its step-1 checkpoint resumes in
    place and ends bitwise equal; metrics.jsonl holds every step once (test_faults.py: the other
    modes, signals and torn checkpoints). In bf16 too: the trainer's float32 weights and AdamW
    state, sharded by its own mixed-precision FSDP2, resume exactly."""
    import shutil

    args = [*TINY, *training, "--ema-decay", "0.9", "--steps", "2", "--save-every", "1"]
    torchrun(2, [*args, "--output-dir", str(tmp_path / "straight")])
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step-2")
    torchrun(2, [*args, "--resume", str(tmp_path / "resumed"), "--output-dir", str(tmp_path / "resumed")],
             env=traced(tmp_path / "resumed"))
    assert_nccl_ok(tmp_path / "resumed", ["data.to", "publish"])
    straight = trained_weights(str(tmp_path / "straight"), 2)
    resumed = trained_weights(str(tmp_path / "resumed"), 2)
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    assert _changed(trained_weights(str(tmp_path / "resumed"), 1), resumed) > 0
    assert [r["step"] for r in read_metrics(str(tmp_path / "resumed"))] == [0, 1]


def test_running_std_matches_colocated(tmp_path):
    """--std-mode running: a disaggregated generator takes the std of the previous batches from the
    logging trainer, which publishes it only after the new weights, so it must install those first
    (it used to wait for the std first and deadlock); colocated and disaggregated runs agree."""
    args = [*TINY, "--lora-rank", "4", "--steps", "3", "--dist-timeout-s", "60"]
    runs = {"colocated": ["--mode", "colocated", "--std-mode", "running"], "disagg": ["--std-mode", "running"],
            "group": []}
    for name, extra in runs.items():
        torchrun(2, [*args, *extra, "--output-dir", str(tmp_path / name)])
    weights = {name: trained_weights(str(tmp_path / name), 3) for name in runs}
    assert_same_weights(weights["colocated"], weights["disagg"], "running std")
    assert _changed(weights["group"], weights["disagg"]) > 0  # the running std changed the advantages


def test_two_updates_per_rollout_are_placement_invariant_and_resume_exactly(tmp_path):
    """--updates-per-rollout 2 over whole groups in step order (a disaggregated trainer updates on the
    first two groups while the last two are generated): colocated and disaggregated (2 + 2, fragments
    of one group streamed) runs train the same weights, the second update off-policy (ratio != 1)
    alike in both; a colocated copy cut back to its step-1 checkpoint (the EMA, AdamW's
    state and the update count after two updates) resumes bitwise."""
    import shutil

    args = [*TINY, "--prompts-per-step", "4", "--fragment-groups", "1", "--lora-rank", "4", "--steps", "2",
            "--updates-per-rollout", "2", "--update-split", "groups", "--ema-decay", "0.9"]
    colocated = [*args, "--mode", "colocated", "--save-every", "1"]
    torchrun(2, [*colocated, "--output-dir", str(tmp_path / "colocated")])
    torchrun(4, [*args, "--generators", "2", "--trainers", "2", "--output-dir", str(tmp_path / "disagg")],
             env=traced(tmp_path / "disagg"))
    assert_nccl_ok(tmp_path / "disagg", TRAFFIC["disagg-2g2t"])
    ref = trained_weights(str(tmp_path / "colocated"), 2)
    assert_same_weights(ref, trained_weights(str(tmp_path / "disagg"), 2), "disagg")
    rows = {name: read_metrics(str(tmp_path / name / "metrics.jsonl")) for name in ("colocated", "disagg")}
    for a, b in zip(*rows.values()):
        assert a["train/num_updates"] == b["train/num_updates"] == 2.0
        assert a["train/ratio"] == pytest.approx(b["train/ratio"], rel=1e-6)
        assert a["train/num_transitions"] == b["train/num_transitions"]
    assert rows["colocated"][1]["train/approx_kl"] > 0 and rows["colocated"][1]["train/ratio"] != 1.0  # update 1
    shutil.copytree(tmp_path / "colocated", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step-2")
    torchrun(2, [*colocated, "--resume", str(tmp_path / "resumed"), "--output-dir", str(tmp_path / "resumed")])
    resumed = trained_weights(str(tmp_path / "resumed"), 2)
    assert all(torch.equal(ref[n], resumed[n]) for n in ref)


def test_corrupted_publication_is_detected(tmp_path):
    proc = torchrun(2, [*TINY, "--lora-rank", "4", "--steps", "2", "--output-dir", str(tmp_path / "run")],
                    env={"DIGENRL_DEBUG_CORRUPT_PUBLISH": "1"}, check=False)
    assert proc.returncode != 0
    assert "PublicationError" in proc.stderr


def test_scorer_ranks_match_colocated(tmp_path):
    """Rewards computed on a scorer rank (while the generator denoises its next fragment) give the
    colocated run's weights."""
    args = [*TINY, "--lora-rank", "4", "--steps", "2", "--fragment-groups", "1"]
    torchrun(3, [*args, "--generators", "1", "--trainers", "1", "--scorers", "1", "--output-dir", str(tmp_path / "s")],
             env=traced(tmp_path / "s"))
    assert_nccl_ok(tmp_path / "s", ["images.to", "scores.to", "data.to", "publish"])
    # Images and scores on one communicator, as before: the generator sends fragment 1's images
    # before it receives fragment 0's scores, which the scorer sends before it receives them.
    old = merged(tmp_path / "s", ["images.to", "scores.to"])
    assert old.deadlock and old.cycles == [[0, 2]], old.message
    torchrun(2, [*args, "--mode", "colocated", "--output-dir", str(tmp_path / "c")])
    assert_same_weights(trained_weights(str(tmp_path / "c"), 2), trained_weights(str(tmp_path / "s"), 2), "scorers")
    trace = json.loads((tmp_path / "s" / "trace" / "rank2.json").read_text())
    assert any(e.get("cat") == "score" for e in trace["traceEvents"])
