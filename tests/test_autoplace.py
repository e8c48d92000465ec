"""--placement auto through torchrun: the start-up probe and the planner choose, config.json and the
log say what and why, and a run that switches placement inside the run, between steps, trains the
weights a fixed placement trains (runtime/autoplace.py)."""
import json

import pytest

from lab.launch import TINY, torchrun, trained_weights
from telemetry.metrics import read_metrics
from weights import assert_same_weights

ARGS = [a if a != "2" or TINY[i - 1] != "--prompts-per-step" else "4" for i, a in enumerate(TINY)]
ARGS += ["--lora-rank", "4", "--fragment-groups", "1", "--steps", "3"]  # 4 fragments of one group each
# The two best predicted placements are tried, one step each, before the faster runs the last step.
TRY_TWO = ["--placement", "auto", "--placement-trials", "2", "--placement-trial-steps", "1",
           "--placement-margin", "1e9"]


def _rows(run):
    return [r for r in read_metrics(str(run / "metrics.jsonl")) if "train/loss" in r]


@pytest.fixture(scope="module")
def switching(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto")
    proc = torchrun(2, [*ARGS, *TRY_TWO, "--output-dir", str(out)], timeout=600)
    return out, proc.stderr


def test_a_run_that_switches_placement_trains_the_fixed_weights(tmp_path, switching):
    """Two placements for a step each, then the faster: every step trains the colocated run's
    transitions and rewards, and the weights after 3 steps are the colocated run's."""
    run, _ = switching
    fixed = tmp_path / "fixed"
    torchrun(2, [*ARGS, "--placement", "fixed", "--mode", "colocated", "--output-dir", str(fixed)])
    assert_same_weights(trained_weights(str(fixed), 3), trained_weights(str(run), 3), "auto")
    rows, ref = _rows(run), _rows(fixed)
    assert [r["step"] for r in rows] == [0, 1, 2]  # each step logged once, across the switches
    for r, c in zip(rows, ref):
        assert r["train/num_transitions"] == c["train/num_transitions"]
        assert r["reward/mean"] == pytest.approx(c["reward/mean"], rel=1e-6)


def test_the_log_and_config_json_say_what_auto_chose_and_why(switching):
    """The first line names the placement, its predicted step time and the next ones; config.json's
    run record holds the ranking, the probe, the trials' measured steps and every switch; one trace
    per rank covers every step, whichever placement ran it."""
    run, stderr = switching
    said = [line for line in stderr.splitlines() if line.startswith("placement: ")]
    assert said[0].startswith("placement: ") and "fastest of" in said[0] and "predicted" in said[0]
    assert said[1].startswith("placement: switching after step 0") and "measured" in said[1]
    assert said[2].startswith("placement: switching after step 1") or said[2].startswith("placement: keeping")
    record = json.loads((run / "config.json").read_text())["run"]["placement"]
    ranked = record["ranked"]
    assert record["chosen"] == ranked[0] and record["runner_up"] == ranked[1]
    assert [x["predicted_step_s"] for x in ranked] == sorted(x["predicted_step_s"] for x in ranked)
    assert len(record["probe"]["chunk_s"]) == 2 and record["probe"]["link_bytes_s"] > 0
    tried = [x["label"] for x in ranked[:2]]
    assert set(record["measured_step_s"]) == set(tried) and all(s > 0 for s in record["measured_step_s"].values())
    switches = record["switches"]
    assert [s["after_step"] for s in switches] in ([0], [0, 1]) and all(s["switch_s"] > 0 for s in switches)
    assert switches[0]["from"] == tried[1] and switches[0]["to"] == tried[0]
    fastest = min(record["measured_step_s"], key=record["measured_step_s"].get)
    assert record["running"]["label"] == fastest
    config = json.loads((run / "config.json").read_text())
    assert config["topology"]["placement"] == "auto"
    running = next(x for x in ranked if x["label"] == fastest)
    assert "--mode" in running["flags"] and config["topology"]["mode"] == running["flags"][running["flags"].index("--mode") + 1]
    for rank in (0, 1):
        events = json.loads((run / "trace" / f"rank{rank}.json").read_text())["traceEvents"]
        steps = {e["args"]["step"] for e in events if e.get("ph") == "X" and e["cat"] in ("generate", "optimizer")}
        assert steps == {0, 1, 2}
