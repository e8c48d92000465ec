"""Tail assist through torchrun (docs/DESIGN.md 5.9): the rank that generated a step's last
fragment trains a share of it, and the run trains the colocated run's weights; its communication
completes under NCCL's rules. The pure parts are in tests/test_tail_assist.py."""
import json

import pytest

from lab.launch import TINY, torchrun, trained_weights
from traced import assert_nccl_ok, traced
from weights import assert_same_weights
from telemetry.metrics import read_metrics

ARGS = [a if a != "2" or TINY[i - 1] != "--prompts-per-step" else "4" for i, a in enumerate(TINY)]
ARGS += ["--lora-rank", "4", "--fragment-groups", "1", "--tsp", "--train-micro-batch", "4", "--steps", "3"]
"""4 fragments of one group (2 samples x 2 trained timesteps = 4 transitions) a step"""


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    out = tmp_path_factory.mktemp("colocated")
    torchrun(2, [*ARGS, "--mode", "colocated", "--output-dir", str(out)])
    return out


def _rows(run):
    return [r for r in read_metrics(str(run / "metrics.jsonl")) if "train/loss" in r]


def _assist_spans(run, rank):
    events = json.loads((run / "trace" / f"rank{rank}.json").read_text())["traceEvents"]
    return [(e["args"]["step"], e["args"]["fragment"]) for e in events if e.get("name") == "assist_train"]


@pytest.mark.parametrize("name,nproc,placement,share", [
    # the generator trains 2 of the last fragment's 4 transitions, the trainer the other 2 (even shares:
    # by speed, probes that measure the ranks more than 15% apart give the generator 3 or 1)
    ("1g1t", 2, ["--generators", "1", "--trainers", "1", "--fragment-split", "even"], 2),
    # 2 trainers and the generator: 2, 1 and 1 (even shares: 3 ranks time-share 2 cores, probes differ)
    ("1g2t", 3, ["--generators", "1", "--trainers", "2", "--fragment-split", "even"], 1),
])
def test_the_generator_trains_a_share_of_the_last_fragment_and_the_weights_are_colocated(
        tmp_path, colocated, name, nproc, placement, share):
    run = tmp_path / name
    torchrun(nproc, [*ARGS, *placement, "--tail-assist", "--trace", "--output-dir", str(run)], env=traced(run))
    assert_nccl_ok(run, ["data.to", "publish"])
    assert_same_weights(trained_weights(str(colocated), 3), trained_weights(str(run), 3), name)
    rows, ref = _rows(run), _rows(colocated)
    assert len(rows) == 3
    for r, c in zip(rows, ref):
        assert r["train/num_transitions"] == c["train/num_transitions"] == 16  # the helper's share counted once
        assert r["train/assist_transitions"] == share and r["train/assist_by_trainer"] == 0
        assert r["reward/mean"] == pytest.approx(c["reward/mean"], rel=1e-6)
    assert _assist_spans(run, 0) == [(s, 3) for s in range(3)]  # the generator trained the last fragment's share


def test_with_tag_the_generator_keeps_the_last_fragment_and_the_weights_are_colocated(tmp_path, colocated):
    """TAG with a slowed generator: idle trainers claim fragments, but not the last, which the
    generator generates and shares; every step's share is trained once and the weights stay the
    colocated ones (a trainer that wins the last fragment in a race trains the share itself:
    tests/test_tail_assist.py)."""
    run = tmp_path / "tag"
    torchrun(3, [*ARGS, "--generators", "1", "--trainers", "2", "--fragment-split", "even", "--tag",
                 "--debug-slow-rank", "0:5", "--tail-assist", "--trace", "--output-dir", str(run)], env=traced(run))
    assert_nccl_ok(run, ["data.to", "publish"])
    assert_same_weights(trained_weights(str(colocated), 3), trained_weights(str(run), 3), "tag")
    rows = _rows(run)
    for r, c in zip(rows, _rows(colocated)):
        assert r["train/num_transitions"] == c["train/num_transitions"] == 16
    assert sum(r["tag/fragments"] for r in rows) > 0  # the trainers did generate
    assert [r["train/assist_by_trainer"] for r in rows] == [0, 0, 0]
    assert _assist_spans(run, 0) == [(s, 3) for s in range(3)]
    assert _assist_spans(run, 1) == _assist_spans(run, 2) == []


def test_in_bf16_the_generator_trains_its_share_and_the_step_counts_it(tmp_path):
    """--dtype bfloat16: the generator trains its share with the bf16 weights it holds, its gradient
    summed in float32 (tests/test_tail_assist.py), added into a trainer whose gradients are FSDP2
    DTensors over its own rank. The weights are not compared: in bf16 on this CPU the same split
    with forwards of 2 or of 4 transitions, or split and colocated, already end 100% apart on some
    LoRA B tensor after 3 steps (AdamW on gradients that are bf16 rounding), so the run checks what
    is exact: the transitions counted, the first step's data and its loss."""
    rows = {}
    for name, extra in (("split", []), ("assisted", ["--tail-assist"])):
        out = tmp_path / name
        torchrun(2, [*ARGS, "--generators", "1", "--trainers", "1", "--fragment-split", "even", "--dtype", "bfloat16",
                     *extra, "--output-dir", str(out)], env=traced(out))
        rows[name] = _rows(out)
        assert [r.get("train/assist_transitions", 0) for r in rows[name]] == [2 if extra else 0] * 3
    assert_nccl_ok(tmp_path / "assisted", ["data.to", "publish"])
    for a, b in zip(rows["split"], rows["assisted"]):
        assert a["train/num_transitions"] == b["train/num_transitions"] == 16
    first, assisted = rows["split"][0], rows["assisted"][0]
    assert assisted["reward/mean"] == first["reward/mean"]  # the same version generated the same data
    assert assisted["train/loss"] == pytest.approx(first["train/loss"], rel=1e-2, abs=1e-4)
