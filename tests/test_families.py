"""Every model family end to end under torchrun with the default logging: 2 steps of its tiny preset
at the preset's own size, frames and steps (1 generator + 1 trainer), with the sample grid at step 0
and evaluations at steps 0 and 2. The five runs go at once, so the test takes about as long as the
slowest of them on two cores."""
import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from lab.launch import ROOT
from telemetry.metrics import read_metrics

FAMILIES = ("flux", "sd3", "qwen_image", "wan", "hunyuan_video")
VIDEO = {"wan", "hunyuan_video"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("families")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = {}
    for family in FAMILIES:
        out = base / family
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.join(ROOT, "train_disagg.py"), "--model", family, "--preset", "tiny", "--steps", "2",
               "--prompts-per-step", "2", "--group-size", "2", "--micro-batch", "2", "--eval-num-prompts", "2",
               "--output-dir", str(out)]
        log = open(base / f"{family}.log", "w")
        procs[family] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log, out)
    results = {}
    for family, (proc, log, out) in procs.items():
        code = proc.wait(timeout=600)
        log.close()
        results[family] = (code, (base / f"{family}.log").read_text(), out)
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_evaluates_and_logs_with_the_defaults(runs, family):
    code, log, out = runs[family]
    assert code == 0, log[-6000:]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"]["preset"] == "tiny" and cfg["sampling"]["height"] is None  # the preset's own size
    rows = read_metrics(out)
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in train] == [0, 1] and [r["step"] for r in evals] == [0, 2]
    assert all(0.0 <= r["train/all_groups_zero_std"] <= 1.0 for r in train)
    for tag, step in (("samples", 0), ("eval", 2)):
        png = out / tag / f"step-{step:06d}.png"
        assert png.is_file(), (tag, sorted(p.name for p in out.iterdir()))
        gif = png.with_suffix(".gif")
        if family in VIDEO:
            with Image.open(gif) as g:
                assert g.n_frames == 5  # the tiny video presets make 5 frames
        else:
            assert not gif.exists()
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tb").iterdir())


@pytest.mark.parametrize("family", FAMILIES)
def test_a_step_with_no_reward_spread_is_flagged_and_warned(runs, family):
    """train/all_groups_zero_std is 1 exactly on the steps the log warns about (the tiny random models
    often score every sample alike)."""
    _, log, out = runs[family]
    flagged = [r["step"] for r in read_metrics(out) if r.get("train/all_groups_zero_std") == 1.0]
    warned = [int(line.split("warning: step ")[1].split(":")[0]) for line in log.split("\n")
              if "warning: step " in line]
    assert flagged == warned


def test_step_scalars_flag_steps_whose_groups_all_have_zero_std():
    from runtime.steplog import step_scalars as _step_scalars

    def records(zero_std):
        train = {"loss": 0.0}
        return [{"role": "trainer", "busy_s": 1.0, "start_s": 0.0, "end_s": 1.0, "train": train, "zero_std": zero_std}]

    rewards = {"combined": [0.5, 0.5, 0.2, 0.7]}
    flat = _step_scalars(records([True, True, True, True]), rewards, 4, None)
    mixed = _step_scalars(records([True, True, False, False]), rewards, 4, None)
    assert flat["train/all_groups_zero_std"] == 1.0 and flat["train/zero_std_fraction"] == 1.0
    assert mixed["train/all_groups_zero_std"] == 0.0 and mixed["train/zero_std_fraction"] == 0.5
