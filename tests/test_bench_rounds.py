"""lab/bench.py --rounds (lab/bench_summary.py): each mode's runs of several rounds pooled into one result, and a
--placement auto mode's trials and switches counted over every round (no run is started: the runs'
folders are written here)."""
import json
import statistics

import pytest

from lab.bench_summary import compare_auto, pool_rounds, round_notes


def _run(folder, step_s, placement=None):
    """A finished run's folder: one metrics row per step, and an auto run's placement record."""
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step, s in enumerate(step_s):
            f.write(json.dumps({"step": step, "perf/step_s": s, "perf/samples_per_s": 16 / s,
                                "perf/bubble_fraction": 0.1, "perf/busy_fraction/colocated": 0.9}) + "\n")
    if placement is not None:
        (folder / "config.json").write_text(json.dumps({"run": {"placement": placement}}))
    return {"mode": folder.name, "status": "ok", "output_dir": str(folder), "wall_s": 10.0,
            "step_s": statistics.median(step_s[1:])}


def test_rounds_pool_every_rounds_measured_steps(tmp_path):
    """The median and the total over both rounds' steps after each round's warm-up step; each
    round's own median beside them."""
    rounds = [_run(tmp_path / "r1" / "m", [9.0, 1.0, 2.0, 3.0]), _run(tmp_path / "r2" / "m", [9.0, 4.0, 5.0, 6.0])]
    out = pool_rounds(rounds, warmup=1)
    assert out["step_s"] == pytest.approx(3.5) and out["steps_total_s"] == pytest.approx(21.0)
    assert out["measured_steps"] == [1, 2, 3, 1, 2, 3]
    assert out["samples_per_s"] == pytest.approx(16 / 3.5)
    assert out["round_step_s"] == [2.0, 5.0] and out["wall_s"] == 20.0
    assert out["output_dir"] == rounds[0]["output_dir"] and out["output_dirs"] == [r["output_dir"] for r in rounds]
    line, = round_notes([{**out, "scenario": "fits"}])
    assert line == "fits: median step s by round: m 2.000 / 5.000"


def test_a_failed_round_fails_the_mode(tmp_path):
    ok = _run(tmp_path / "r1" / "m", [9.0, 1.0])
    failed = {"mode": "m", "status": "failed (exit 1)", "error": "boom", "output_dir": str(tmp_path / "r2" / "m")}
    out = pool_rounds([ok, failed], warmup=1)
    assert out["status"] == "failed (exit 1)" and out["error"] == "boom" and out["output_dir"] == failed["output_dir"]


def test_auto_counts_the_switches_of_every_round(tmp_path):
    """Switches inside the measured stretch of each round add up (one after the warm-up step's
    predecessor does not count); the placements each round ran are named, once if they agree."""
    def record(running, switches):
        return {"running": {"label": running}, "chosen": {"label": "colocated"},
                "switches": [{"after_step": a, "switch_s": s} for a, s in switches]}
    rounds = [_run(tmp_path / "r1" / "auto", [9.0, 1.0, 1.0], record("colocated", [(0, 1.5), (1, 2.0)])),
              _run(tmp_path / "r2" / "auto", [9.0, 2.0, 2.0], record("1 + 1", [(-1, 7.0), (1, 0.5)]))]
    fixed = [_run(tmp_path / "r1" / "fixed", [9.0, 1.0, 1.0]), _run(tmp_path / "r2" / "fixed", [9.0, 1.0, 1.0])]
    rows = [{**pool_rounds(runs, warmup=1), "mode": mode} for mode, runs in (("colocated-replicate", fixed),
                                                                             ("auto", rounds))]
    compare_auto(rows)
    auto = rows[1]
    assert auto["best_fixed"] == "colocated-replicate"
    assert auto["vs_best_fixed"] == pytest.approx(1.0 / 1.5)
    assert auto["auto_switches"] == 4 and auto["switch_s"] == pytest.approx(4.0)  # the switch before step 0 left out
    assert auto["vs_best_fixed_run"] == pytest.approx(4.0 / (6.0 + 4.0))
    assert auto["auto_placement"] == "colocated / 1 + 1" and auto["auto_chosen"] == "colocated"


def test_every_second_round_runs_the_modes_in_reverse_and_each_mode_keeps_its_own_runs(monkeypatch, tmp_path):
    """Rounds alternate the order (a, b, c, then c, b, a): a drift linear in time then adds the same to
    every mode's pooled steps; each mode's pooled result is made of its own runs, whatever the order."""
    import argparse

    import lab.bench as bench

    calls = []

    def fake_measure(name, workload, out, args):
        calls.append(name)
        return {"mode": name, "round_dir": out, "at": len(calls)}

    monkeypatch.setattr(bench, "measure_mode", fake_measure)
    monkeypatch.setattr(bench, "pool_rounds", lambda runs, warmup: runs)
    modes = ("colocated-replicate", "gap", "gap+tag")
    args = argparse.Namespace(rounds=3, warmup=1)
    pooled = bench.measure_rounds(modes, [], str(tmp_path), args)
    assert calls == [*modes, *modes[::-1], *modes]
    assert [[r["mode"] for r in runs] for runs in pooled] == [[m] * 3 for m in modes]
    assert [[r["at"] for r in runs] for runs in pooled] == [[1, 6, 7], [2, 5, 8], [3, 4, 9]]
    assert [r["round_dir"] for r in pooled[0]] == [str(tmp_path / f"round{k}") for k in (1, 2, 3)]


def test_a_bench_run_writes_its_checkpoint_after_the_last_step_only():
    """The bench's shared flags turn the periodic checkpoint off (by default every steps/10: every
    second step of a 20-step bench, each a measured step's extra cost); the run still saves at its
    end."""
    from config.cli import parse_config
    from lab.bench import parse_args, workload_flags
    from runtime.loop import saves_after

    def saves(argv):
        cfg = parse_config(argv)
        cfg.resolve_defaults()
        return [step for step in range(20) if saves_after(cfg, step + 1)]

    assert saves(workload_flags(parse_args(["--steps", "20"]))) == [19]
    assert saves(["--steps", "20", "--eval-every", "0"]) == list(range(1, 20, 2))  # what the bench turns off


def test_modes_narrow_each_scenario_to_its_baseline_and_the_named_modes():
    """--modes with --scenarios: each scenario runs its baseline and those of its modes the list
    names, in the scenario's order; a named mode in none of the scenarios is an error naming it."""
    from lab.bench import scenario_modes
    from lab.bench_modes import SCENARIOS

    names = ["fits", "sharded", "window"]
    assert scenario_modes(names, None) == {n: SCENARIOS[n].modes for n in names}
    chosen = scenario_modes(names, "auto,gap+tag+assist,auto3,gap-fsdp")
    assert chosen == {"fits": ("colocated-replicate", "gap+tag+assist", "auto"),
                      "sharded": ("colocated-fsdp3", "gap-fsdp", "auto3"),
                      "window": ("colocated-replicate", "gap+tag+assist", "auto")}
    with pytest.raises(ValueError, match="colocated-speed, in none of the scenarios fits, sharded, window"):
        scenario_modes(names, "auto,colocated-speed")
    with pytest.raises(ValueError, match="unknown mode"):
        scenario_modes(names, "auto,no-such-mode")
