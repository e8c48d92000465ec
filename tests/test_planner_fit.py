"""Out-of-sample prediction of measured runs (lab/planning/fit.py) on committed fixtures, and the
calibration probe on this CPU.

The fixtures (tests/fixtures/planner_runs, made by lab/make_plan_fixtures.py) are real runs of
this project on the tiny FLUX preset: for every target mode, one lab/bench.py invocation ran
gap-stream and the target back to back. Per-unit costs are fitted on the gap-stream run alone and
predict the target from its config.json; the target's traces are never read for the prediction.
Runs of 3 ranks on 2 cores measure contention, not parallel speed."""
import json
import os

import pytest

from lab.planning import fit
from lab.planning.profile import DeviceProfile

from lab import calibrate
from lab.planning import plan_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "planner_runs")
PROFILE = os.path.join(FIXTURES, "profile-cpu.json")
FIT_MODE = "gap-stream"

TOLERANCE = 0.15  # the bound on |relative error| of every target's predicted step time (the goal)
TARGETS = sorted(["colocated-replicate", "disagg", "gap+tsp", "gap+tsp8", "gap-frag2", "slow-gen", "gap+tsp+tag+tcss",
                  "gap-2rep", "gap-stages"])


def _targets() -> list[str]:
    return sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))


def _predict(target: str) -> dict:
    profile = DeviceProfile.load(PROFILE)
    units = fit.fit_unit_costs(os.path.join(FIXTURES, target, FIT_MODE), profile)
    return fit.predict_run(os.path.join(FIXTURES, target, target), units, profile)


def test_fixtures_are_small_and_complete():
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(FIXTURES) for f in files)
    assert total < 600_000, f"fixtures are {total} bytes"
    assert set(_targets()) == set(TARGETS)
    for t in _targets():
        for mode in (FIT_MODE, t):
            run = os.path.join(FIXTURES, t, mode)
            assert os.path.isfile(os.path.join(run, "config.json")) and os.path.isdir(os.path.join(run, "trace"))


@pytest.mark.parametrize("target", TARGETS)
def test_out_of_sample_step_time(target):
    r = _predict(target)
    assert not r["in_sample"]
    assert abs(r["rel_error"]) <= TOLERANCE, r


def test_the_fit_reproduces_its_own_run():
    profile = DeviceProfile.load(PROFILE)
    run = os.path.join(FIXTURES, "disagg", FIT_MODE)
    units = fit.fit_unit_costs(run, profile)
    r = fit.predict_run(run, units, profile)
    assert r["in_sample"] and abs(r["rel_error"]) < 0.05
    assert units.gen_scale > 0 and units.train_scale > 0 and 0.5 <= units.cores <= 4.0


def test_predicted_ratios_are_fitted_on_the_baseline_alone():
    """A bench scenario's planner ratios: the baseline predicts itself at 1.0 and every run from its
    config with the baseline's per-unit costs, the same numbers as predict_run gives."""
    profile = DeviceProfile.load(PROFILE)
    base = os.path.join(FIXTURES, "slow-gen", FIT_MODE)
    target = os.path.join(FIXTURES, "slow-gen", "slow-gen")
    out = fit.predict_ratios(base, [target], profile)
    assert out[base]["predicted_ratio"] == pytest.approx(1.0)
    units = fit.fit_unit_costs(base, profile)
    alone = fit.predict_run(target, units, profile)["predicted_step_s"]
    assert out[target]["predicted_step_s"] == pytest.approx(alone)
    assert out[target]["predicted_ratio"] == pytest.approx(out[base]["predicted_step_s"] / alone)
    assert out[target]["predicted_ratio"] < 0.8  # the generator slowed 3x: the planner sees a slower run


def test_fit_cli(tmp_path, capsys):
    out = tmp_path / "fit.json"
    assert plan_cli.main(["--fit-run", os.path.join(FIXTURES, "gap+tsp", FIT_MODE), "--profile", PROFILE, "--predict",
                          os.path.join(FIXTURES, "gap+tsp", "gap+tsp"), "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["run"] == "gap+tsp" and row["predicted_step_s"] > 0 and "measured" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--profile"):
        plan_cli.main(["--fit-run", os.path.join(FIXTURES, "gap+tsp", FIT_MODE)])


def test_the_profile_must_time_the_runs_kind_of_training(tmp_path):
    """A full-fine-tuning profile does not give a LoRA run's training shape: the fit refuses it,
    naming the flag."""
    raw = json.load(open(PROFILE))
    assert DeviceProfile.load(PROFILE).finetune.startswith("lora:")
    full = DeviceProfile.from_dict({k: v for k, v in raw.items() if k != "finetune"})
    assert full.finetune == "full"
    with pytest.raises(ValueError, match="--lora-rank"):
        fit.fit_unit_costs(os.path.join(FIXTURES, "disagg", FIT_MODE), full)


def test_lora_profiles_count_two_forwards_of_training_work():
    """MFU of training: 3 forwards of work for full fine-tuning, 2 for LoRA (no weight gradients)."""
    raw = json.load(open(PROFILE))
    lora = DeviceProfile.from_dict({**raw, "finetune": "lora:32:attn"}).mfu_points(1e12, "train")
    full = DeviceProfile.from_dict({**raw, "finetune": "full"}).mfu_points(1e12, "train")
    assert [m for _, m in lora] == pytest.approx([2 / 3 * m for _, m in full])
    assert DeviceProfile.from_dict({**raw, "finetune": "full"}).mfu_points(1e12, "forward") == \
        DeviceProfile.from_dict(raw).mfu_points(1e12, "forward")


def test_fitted_publication_and_tail_are_the_traced_spans():
    """Publication splits into the trainers' send per generator rank and the generators' install;
    the trainers' tail (checkpoint, logging) is traced time, not a residual."""
    profile = DeviceProfile.load(PROFILE)
    units = fit.fit_unit_costs(os.path.join(FIXTURES, "gap-2rep", FIT_MODE), profile)
    assert units.send_per_rank_s > 0 and units.install_s > 0 and units.trainer_tail_s > 0
    config = json.load(open(os.path.join(FIXTURES, "gap-2rep", "gap-2rep", "config.json")))
    _, costs = fit.target_costs(config, 3, units, profile)  # two generator ranks: two sends, one install
    assert costs.publish_s == pytest.approx(2 * units.send_per_rank_s + units.install_s + units.step_overhead_s)
    assert costs.trainer_tail_s == units.trainer_tail_s
    # a colocated fit run sends nothing: its tail (after the update) goes on every colocated rank
    units = fit.fit_unit_costs(os.path.join(FIXTURES, "colocated-replicate", "colocated-replicate"), profile)
    assert units.send_per_rank_s == 0 and units.install_s == 0 and units.trainer_tail_s > 0
    with pytest.raises(ValueError, match="one-stage replicas"):
        fit.fit_unit_costs(os.path.join(FIXTURES, "gap-stages", "gap-stages"), profile)


def test_calibrate_probe_runs_on_cpu(tmp_path, monkeypatch):
    out = tmp_path / "profile.json"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert calibrate.main(["--model", "flux", "--preset", "tiny", "--max-batch", "2", "--repeats", "1",
                           "--device", "cpu", "--out", str(out)]) == 0
    profile = DeviceProfile.load(str(out))
    raw = profile.raw
    assert raw["device_type"] == "cpu" and raw["batches"] == [1, 2] and raw["gpu_key"] is None
    assert len(raw["forward_s"][0]) == len(raw["blocks"]) == 4  # the tiny preset: 2 double + 2 single blocks
    assert all(f > 0 for row in raw["flops"] for f in row)
    assert sum(raw["flops"][1]) == pytest.approx(2 * sum(raw["flops"][0]), rel=0.05)  # FLOPs scale with the batch
    assert profile.forward_s(2) > 0 and profile.train_s(2) > 0
    assert raw["allgather"] is None  # one process: no collective to time
    assert (raw["image_tokens"], raw["text_tokens"]) == (64, 64)  # the tiny model at 32 px: its own token counts
    assert raw["finetune"] == "full" and profile.finetune == "full"
    lora = tmp_path / "lora.json"
    assert calibrate.main(["--model", "flux", "--preset", "tiny", "--max-batch", "1", "--repeats", "1",
                           "--device", "cpu", "--lora-rank", "4", "--out", str(lora)]) == 0
    assert DeviceProfile.load(str(lora)).finetune == "lora:4:attn"


def test_calibrate_builds_the_released_model_on_meta_at_its_token_counts():
    """--preset released (CUDA's default): FLUX.1-dev's transformer from the meta device, made where
    it is asked in bf16 (here: meta again, so nothing is allocated), timed at the real model's token
    counts: 1024 image + 512 text tokens at 512 px, 4096 image tokens at 1024 px."""
    import torch

    adapter = calibrate.released_adapter("flux", torch.device("meta"), torch.bfloat16)
    params = list(adapter.transformer.parameters())
    assert len(adapter.blocks) == 57 and sum(p.numel() for p in params) > 11.9e9
    assert all(p.dtype == torch.bfloat16 and p.is_meta for p in params)
    assert not any(adapter.holds(name) for name in ("vae", *adapter.text_encoders()))  # never made
    for size, image in ((512, 1024), (1024, 4096)):
        shape = adapter.latent_shape(size, size)
        cond = calibrate.conditioning(adapter, 2, None)
        state = adapter.embed(torch.zeros(2, *shape, dtype=torch.bfloat16, device="meta"),
                              torch.full((2,), 0.5, device="meta"), cond)
        assert adapter.image_seq_len(shape) == image and state.acts["hidden"].shape[:2] == (2, image)
        assert state.acts["text"].shape[:2] == (2, 512) and calibrate._tokens(state, None) == image + 512
