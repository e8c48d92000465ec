"""lab/forward_check.py: the auto runs' probe costs predict each training span of the fixed runs of
the same round, by the rank that ran it (a bench folder written by hand)."""
import json

import pytest

from lab import forward_check


def _write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _span(step, micro_batches, transitions, seconds):
    return {"ph": "X", "name": "train", "cat": "train", "dur": seconds * 1e6,
            "args": {"step": step, "micro_batches": micro_batches, "transitions": transitions}}


def test_each_span_is_predicted_from_its_ranks_probe(tmp_path):
    rnd = tmp_path / "window" / "round1"
    for name, forward_s in (("auto", [0.01, 0.03]), ("auto+stale", [0.03, 0.01])):
        _write(rnd / name / "config.json",
               {"topology": {"tsp": True, "train_micro_batch": 16}, "rl": {"micro_batch": 4},
                "run": {"placement": {"probe": {"forward_s": forward_s, "row_s": [0.01, 0.02]}}}})
    spans = [_span(0, 1, 4, 9.0)] + [_span(s, 1, 4, 0.07) for s in range(1, 9)]  # step 0 left out
    _write(rnd / "colocated-replicate" / "trace" / "rank1.json", {"traceEvents": spans})
    _write(rnd / "gap" / "trace" / "rank1.json", {"traceEvents": spans[:5]})  # too few spans
    rows = forward_check.rows(str(tmp_path), ["window"])
    assert len(rows) == 1
    r = rows[0]
    assert (r["mode"], r["rank"], r["micro_batches"], r["transitions"], r["spans"]) == \
        ("colocated-replicate", 1, 1, 4, 8)
    assert r["measured_s"] == pytest.approx(0.07)
    assert r["predicted_s"] == pytest.approx(0.02 + 4 * 0.02)  # rank 1: forward_s averaged over the runs
    assert r["one_size_s"] == pytest.approx(4 * (0.02 / 16 + 0.02))
