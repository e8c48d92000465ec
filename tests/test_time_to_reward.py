"""lab/time_to_reward.py: the table and clock logic on made-up curves, and the whole script on the
tiny preset (two algorithms, 2 steps each), whose table, curves and plot it must write."""
import json
import shlex

import pytest

from lab.launch import TINY
from lab import time_to_reward as ttr


def _run(algorithm, placement, seed, rewards, step_s=2.0):
    r = ttr.Run(algorithm, placement, seed, "unused")
    r.curve = [(5 * i, 5 * i * step_s, x) for i, x in enumerate(rewards)]
    return r


def test_time_to_a_threshold_and_the_table():
    fast = _run("nft", "colocated", 0, [0.18, 0.31, 0.41, 0.44])
    slow = _run("nft", "colocated", 1, [0.18, 0.25, 0.35, 0.39], step_s=3.0)
    assert ttr.time_to(fast.curve, 0.30) == 10.0 and ttr.time_to(fast.curve, 0.432) == 30.0
    assert ttr.time_to(slow.curve, 0.30) == 30.0 and ttr.time_to(slow.curve, 0.40) is None
    text = ttr.table([fast, slow], [0.30, 0.40, 0.432])
    rows = text.splitlines()
    assert rows[2] == "| nft | colocated | 0 | 10 | 20 | 30 | 0.180 | 0.440 | 30 | 2.00 |"
    assert rows[3] == "| nft | colocated | 1 | 30 | - | - | 0.180 | 0.390 | 45 | 3.00 |"
    # the seeds' mean where both reached it, else the mean of those that did and how many
    assert rows[-1] == "| nft | colocated | 2 | 20 | 20 (1/2) | 30 (1/2) | 0.415 | 2.50 |"


def test_scorer_columns():
    run = _run("flow_grpo", "colocated", 0, [0.18, 0.30, 0.43])
    run.scores = {"shapes_detector": [0.05, 0.10, 0.25]}
    other = _run("flow_grpo", "colocated", 1, [0.15, 0.30, 0.35])
    other.scores = {"shapes_detector": [0.03, 0.09, 0.11]}
    rows = ttr.table([run, other], [0.40]).splitlines()
    assert rows[0].endswith("| s per step | shapes_detector: base, final |")
    assert rows[2].endswith("| 0.050, 0.250 |") and rows[3].endswith("| 0.030, 0.110 |")
    assert rows[-3].endswith("| mean shapes_detector gain |") and rows[-1].endswith("| 2.00 | +0.140 |")


def test_wall_clock_sums_the_step_periods(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, s in enumerate([1.5, 2.0, 2.5]):
            f.write(json.dumps({"step": step, "time": 0.0, "perf/step_s": s}) + "\n")
        f.write(json.dumps({"step": 3, "time": 0.0, "eval/reward": 0.3}) + "\n")  # no period: not a step
    assert ttr.wall_clock(str(tmp_path)) == {0: 0.0, 1: 1.5, 2: 3.5, 3: 6.0}


@pytest.mark.integration  # in process, but tens of seconds
def test_time_to_reward_runs_end_to_end_on_the_tiny_preset(tmp_path):
    out = tmp_path / "ttr"
    extra = [*TINY, "--eval-num-prompts", "4", "--lora-rank", "4"]
    assert ttr.main(["--out", str(out), "--algorithms", "nft,mixgrpo", "--placements", "colocated", "--seeds", "0",
                     "--steps", "2", "--save-every", "1", "--thresholds=-0.9,0",
                     "--extra=" + shlex.join(extra)]) == 0
    result = json.loads((out / "time_to_reward.json").read_text())
    assert [r["algorithm"] for r in result] == ["nft", "mixgrpo"]
    for r in result:
        curve = r["curve"]
        assert [p["step"] for p in curve] == [0, 1, 2]
        assert curve[0]["wall_s"] == 0.0 < curve[1]["wall_s"] < curve[2]["wall_s"]
        assert "--eval-every" in r["args"] and r["args"][r["args"].index("--eval-every") + 1] == "0"
    # the same version 0 and evaluation seeds for both; training moved each run's reward
    assert result[0]["curve"][0]["eval_reward"] == result[1]["curve"][0]["eval_reward"]
    assert all(len({p["eval_reward"] for p in r["curve"]}) > 1 for r in result)
    assert all(0.0 <= p["shapes_detector"] <= 1.0 for r in result for p in r["curve"])  # the scorer, beside it
    table = (out / "time_to_reward.md").read_text()
    assert "shapes_detector: base, final" in table and "mean shapes_detector gain" in table
    assert "| nft | colocated | 0 |" in table and "| mixgrpo | colocated | 1 |" in table
    assert (out / "time_to_reward.png").stat().st_size > 0
    with pytest.raises(ValueError, match="unknown"):
        ttr.main(["--out", str(out), "--algorithms", "grpo"])


def test_budget_columns_and_the_first_stage_settings():
    run = _run("nft-lr1e-3", "disagg+tag", 0, [0.43, 0.47, 0.55, 0.50], step_s=40.0)
    assert ttr.best_within(run.curve, 600) == 0.55 and ttr.best_within(run.curve, 399) == 0.47
    row = ttr.table([run], [0.532], budget_s=600).splitlines()[2]
    assert row.endswith("| 0.550 | +0.120 |")
    first = ttr.SETTINGS["first-stage"]
    assert first["nft"] == ttr.ALGORITHMS["nft"] and all(f[:2] == ["--algorithm", "nft"] for k, f in first.items()
                                                          if k.startswith("nft"))
