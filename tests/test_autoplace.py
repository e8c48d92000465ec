"""--placement auto through torchrun: the start-up probe and the planner choose, config.json and the
log say what and why, and a run that switches placement inside the run, between steps, trains the
weights a fixed placement trains (runtime/autoplace.py)."""
import json

import pytest

from lab.launch import TINY, torchrun, trained_weights
from telemetry.metrics import read_metrics
from weights import assert_same_weights

ARGS = [a if a != "2" or TINY[i - 1] != "--prompts-per-step" else "4" for i, a in enumerate(TINY)]
STEPS = 5
ARGS += ["--lora-rank", "4", "--fragment-groups", "1", "--steps", str(STEPS)]  # 4 fragments of one group each
# Every placement of 2 ranks (colocated, colocated FSDP2, 1 + 1, 1 + 1 with TAG; of five, with a
# colocated split by speed, the four predicted best) is tried, one step each, whatever the probe
# ranks first (a disaggregated trial among them, before the decision: its generator must take the
# trainers' publication first), before the fastest (or, if a switch costs more than it saves in the
# one step left, the last tried) runs the last step.
TRY_ALL = ["--placement", "auto", "--placement-trials", "4", "--placement-trial-steps", "1",
           "--placement-margin", "1e9"]


def _rows(run):
    return [r for r in read_metrics(str(run / "metrics.jsonl")) if "train/loss" in r]


@pytest.fixture(scope="module")
def switching(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto")
    proc = torchrun(2, [*ARGS, *TRY_ALL, "--output-dir", str(out)], timeout=600)
    return out, proc.stderr


def test_a_run_that_switches_placement_trains_the_fixed_weights(tmp_path, switching):
    """Four placements for a step each, then the one kept: every step trains the colocated run's
    transitions and rewards, and the weights after 5 steps are the colocated run's."""
    run, _ = switching
    fixed = tmp_path / "fixed"
    torchrun(2, [*ARGS, "--placement", "fixed", "--mode", "colocated", "--output-dir", str(fixed)])
    assert_same_weights(trained_weights(str(fixed), STEPS), trained_weights(str(run), STEPS), "auto")
    rows, ref = _rows(run), _rows(fixed)
    assert [r["step"] for r in rows] == list(range(STEPS))  # each step logged once, across the switches
    for r, c in zip(rows, ref):
        assert r["train/num_transitions"] == c["train/num_transitions"]
        assert r["reward/mean"] == pytest.approx(c["reward/mean"], rel=1e-6)


def test_the_log_and_config_json_say_what_auto_chose_and_why(switching):
    """The first line names the placement, its predicted step time and the next ones; config.json's
    run record holds the ranking, the probe, the trials' measured steps and every switch; one trace
    per rank covers every step, whichever placement ran it."""
    run, stderr = switching
    # (a line another rank's output ran into still counts: the ranks share one stderr)
    said = [line[line.index("placement: "):] for line in stderr.splitlines() if "placement: " in line]
    assert said[0].startswith("placement: ") and "fastest of" in said[0] and "predicted" in said[0]
    for k in range(3):
        assert said[1 + k].startswith(f"placement: switching after step {k}") and "measured" in said[1 + k]
    assert said[4].startswith("placement: switching after step 3") or said[4].startswith("placement: keeping")
    record = json.loads((run / "config.json").read_text())["run"]["placement"]
    ranked = record["ranked"]
    assert record["chosen"] == ranked[0] and record["runner_up"] == ranked[1]
    assert [x["predicted_step_s"] for x in ranked] == sorted(x["predicted_step_s"] for x in ranked)
    assert len(record["probe"]["chunk_s"]) == 2 and record["probe"]["link_bytes_s"] > 0
    assert record["probe"]["gather_s"] >= 0 and record["probe"]["train_gather_s"] >= 0  # FSDP2's, measured
    assert len(record["probe"]["forward_s"]) == 2 and all(a >= 0 for a in record["probe"]["forward_s"])
    # Four placements of 2 ranks, and a fifth (colocated split by speed) where the probe measured the
    # ranks apart: the four predicted best are tried, the best last (the steps leave room for four).
    assert len(ranked) in (4, 5) and any("TAG" in x["label"] for x in ranked)
    order = [x["label"] for x in record["trials"]]
    assert order == [x["label"] for x in ranked[3::-1]]
    assert set(record["measured_step_s"]) == set(order) and all(s > 0 for s in record["measured_step_s"].values())
    switches = record["switches"]
    assert [s["after_step"] for s in switches] in ([0, 1, 2], [0, 1, 2, 3]) and all(s["switch_s"] > 0 for s in switches)
    assert [s["from"] for s in switches[:3]] == order[:3] and [s["to"] for s in switches[:3]] == order[1:]
    # a placement's ranks probe their speeds when it is first built; a switch back to it reuses them
    assert [s["probed"] for s in switches] == [s["to"] not in order[:i + 1] for i, s in enumerate(switches)]
    # The fastest trial runs the last step unless what it saves there is less than a switch costs.
    fastest = min(record["measured_step_s"], key=record["measured_step_s"].get)
    decision = record["decision"]
    assert decision["fastest"] == fastest and decision["remaining_steps"] == STEPS - len(order)
    measured = record["measured_step_s"]
    assert decision["gain_s"] == pytest.approx(measured[order[-1]] - measured[fastest])
    # A switch costs the period of the step after it (the switch included) over its placement's
    # median step; the rule weighs their mean.
    periods = {r["step"]: r["perf/step_s"] for r in _rows(run)}
    for s in switches[:3]:
        assert s["first_step_s"] == pytest.approx(periods[s["after_step"] + 1]) and s["first_step_s"] >= s["switch_s"]
        assert s["cost_s"] == pytest.approx(max(0.0, s["first_step_s"] - measured[s["to"]]))
    assert decision["switch_s"] == pytest.approx(sum(s["cost_s"] for s in switches[:3]) / 3)
    assert record["running"]["label"] == (fastest if decision["gain_s"] > decision["switch_s"] else order[-1])
    assert record["trial_steps_s"] == {k: [v] for k, v in record["measured_step_s"].items()}  # one step each
    config = json.loads((run / "config.json").read_text())
    assert config["topology"]["placement"] == "auto"
    running = next(x for x in ranked if x["label"] == record["running"]["label"])
    flags = running["flags"]
    assert "--mode" in flags and config["topology"]["mode"] == flags[flags.index("--mode") + 1]
    for rank in (0, 1):
        events = json.loads((run / "trace" / f"rank{rank}.json").read_text())["traceEvents"]
        steps = {e["args"]["step"] for e in events if e.get("ph") == "X" and e["cat"] in ("generate", "optimizer")}
        assert steps == set(range(STEPS))
