"""lab/bench.py end to end: two quick modes on the tiny preset, and the unknown-mode error."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = ["-m", "lab.bench"]
QUICK = ["--preset", "tiny", "--steps", "2", "--warmup", "1", "--prompts-per-step", "2", "--group-size", "2",
         "--micro-batch", "2", "--sample-steps", "3", "--height", "16", "--width", "16", "--timeout", "120"]


def _bench(args, timeout=150):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *BENCH, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_two_modes_table(tmp_path):
    json_path = tmp_path / "table.json"
    proc = _bench(["--modes", "colocated-replicate,disagg", *QUICK, "--out", str(tmp_path / "bench"),
                   "--json", str(json_path), "--", "--reward", "jpeg_compressibility"])
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(json_path.read_text())
    modes = {r["mode"]: r for r in report["modes"]}
    assert list(modes) == ["colocated-replicate", "disagg"]
    base = modes["colocated-replicate"]["samples_per_s"]
    for name, r in modes.items():
        assert r["status"] == "ok", r
        assert r["nproc"] == 2 and r["exceeds_cores"] == (2 > os.cpu_count())
        assert r["measured_steps"] == [1]
        assert r["samples_per_s"] > 0 and r["step_s"] > 0
        assert r["samples_per_s"] == pytest.approx(r["samples_per_step"] / r["step_s"])
        assert r["samples_per_step"] == 4
        assert 0.0 <= r["bubble_fraction"] <= 1.0
        assert r["ratio_vs"]["colocated-replicate"] == pytest.approx(r["samples_per_s"] / base)
        assert r["ratio_vs"]["colocated-fsdp"] is None  # that baseline did not run
        assert os.path.isfile(os.path.join(r["output_dir"], "metrics.jsonl"))
    assert modes["colocated-replicate"]["ratio_vs"]["colocated-replicate"] == pytest.approx(1.0)
    assert set(modes["disagg"]["busy_fraction"]) == {"generator", "trainer"}
    assert set(modes["colocated-replicate"]["busy_fraction"]) == {"colocated"}
    # The bubble recomputed from the rank traces matches the logged one.
    check = modes["disagg"]["bubble_check"]
    assert check["bubble"] == pytest.approx(check["logged_bubble"], abs=1e-6)
    assert report["workload"]["model"] == "flux preset tiny" and report["workload"]["resolution"] == "16x16"
    markdown = (tmp_path / "bench" / "bench.md").read_text()
    assert markdown.startswith("| mode |") and "| disagg | 2 |" in markdown
    assert "bubble = 1 - ideal / actual" in proc.stdout


def test_unknown_mode_is_a_clear_error(tmp_path):
    proc = _bench(["--modes", "disagg,no-such-mode", "--out", str(tmp_path / "bench")], timeout=60)
    assert proc.returncode == 2
    assert "unknown mode(s) no-such-mode" in proc.stderr
    assert "colocated-replicate" in proc.stderr and "gap-stream" in proc.stderr
    assert not (tmp_path / "bench").exists()  # nothing ran


def test_a_scenario_reports_measured_and_predicted_ratios(tmp_path):
    """--scenarios: a JSON list of rows with the required fields, the ratio to the scenario's
    baseline, the planner's ratio fitted on the baseline run alone, markdown and both figures; the
    --placement auto modes beside the fixed ones, each against the best fixed mode it may choose
    (on-policy ones for auto, TCSS ones too for auto+stale)."""
    out = tmp_path / "bench"
    proc = _bench(["--scenarios", "window", *QUICK, "--out", str(out), "--json", str(tmp_path / "rows.json"),
                   "--", "--reward", "jpeg_compressibility"], timeout=800)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["mode"] for r in rows] == ["colocated-replicate", "gap+tag", "gap+tag+assist", "gap+tag+tcss", "auto",
                                         "auto+stale"]
    by_mode = {r["mode"]: r for r in rows}
    for name, allowed in (("auto", ("colocated-replicate", "gap+tag", "gap+tag+assist")),
                          ("auto+stale", ("colocated-replicate", "gap+tag", "gap+tag+assist", "gap+tag+tcss"))):
        best = max(allowed, key=lambda m: by_mode[m]["samples_per_s"])
        r = by_mode[name]
        assert r["best_fixed"] == best and r["vs_best_fixed"] == pytest.approx(
            r["samples_per_s"] / by_mode[best]["samples_per_s"])
        assert r["auto_placement"] and r["auto_switches"] == 0  # 2 steps: no room for trials
        assert r["switch_s"] == 0 and r["vs_best_fixed_run"] == pytest.approx(
            by_mode[best]["steps_total_s"] / r["steps_total_s"])
        assert r["steps_total_s"] == pytest.approx(r["step_s"])  # one measured step
        assert f"window: {name} chose" in proc.stdout
    assert not by_mode["auto"].get("best") and not by_mode["auto+stale"].get("best")  # the best fixed mode is marked
    base = rows[0]
    assert base["baseline"] and not any(r["baseline"] for r in rows[1:])
    for r in rows:
        assert r["scenario"] == "window" and r["status"] == "ok", r
        assert r["ratio"] == pytest.approx(r["samples_per_s"] / base["samples_per_s"])
        assert 0.0 <= r["bubble"] <= 1.0
        assert r["predicted_step_s"] > 0
        assert r["predicted_ratio"] == pytest.approx(base["predicted_step_s"] / r["predicted_step_s"])
    assert base["ratio"] == pytest.approx(1.0) and base["predicted_ratio"] == pytest.approx(1.0)
    assert sum(bool(r.get("best")) for r in rows) == 1
    markdown = (out / "scenarios.md").read_text()
    assert "planner x" in markdown and "fitted on each scenario's baseline run alone" in markdown
    assert (out / "ratios.png").stat().st_size > 0 and (out / "timeline.png").stat().st_size > 0
    assert (out / "profile.json").is_file()  # measured first, since no --profile was given
