"""Tracer spans, busy time, Chrome trace output and the step metrics of DESIGN 8."""
from __future__ import annotations

import json
import time

import pytest

from telemetry.tracing import Tracer, bubble_fraction, merge_traces, summarize_step


def test_busy_seconds_unions_nested_and_overlapping_spans():
    tr = Tracer(rank=0, role="trainer")
    t0 = 1_700_000_000_000_000.0  # microseconds since the epoch
    tr.record("fragment", "train", step=1, start_us=t0, dur_us=4e6, fragment=0)
    tr.record("forward", "train", step=1, start_us=t0 + 1e6, dur_us=1e6, fragment=0)      # nested
    tr.record("opt", "optimizer", step=1, start_us=t0 + 3.5e6, dur_us=1e6)               # overlaps the end
    tr.record("recv", "comm", step=1, start_us=t0 + 6e6, dur_us=2e6)                     # not busy by default
    tr.record("gen", "generate", step=1, start_us=t0 + 9e6, dur_us=0.5e6)                # disjoint
    tr.record("other step", "train", step=2, start_us=t0, dur_us=10e6)
    assert tr.busy_seconds(1) == pytest.approx(5.0)
    assert tr.busy_seconds(1, cats=("comm",)) == pytest.approx(2.0)
    assert tr.busy_seconds(1, cats=("train", "comm")) == pytest.approx(6.0)
    assert tr.busy_seconds(3) == 0.0
    start, end = tr.step_window(1)
    assert start == pytest.approx(t0 / 1e6) and end == pytest.approx(t0 / 1e6 + 9.5)
    with pytest.raises(ValueError):
        tr.step_window(3)
    rec = tr.step_record(1)
    assert rec["role"] == "trainer" and rec["busy_s"] == pytest.approx(5.0)


class FakeEvent:
    """A device event whose work took `device_s` after its previous one; counts its synchronizes."""

    clock, synced = 0.0, []

    def __init__(self, device_s: float):
        self.device_s = device_s

    def record(self):
        FakeEvent.clock += self.device_s
        self.at = FakeEvent.clock

    def synchronize(self):
        FakeEvent.synced.append(self)

    def elapsed_time(self, end) -> float:
        return (end.at - self.at) * 1000.0  # ms, as torch.cuda.Event's


def test_span_times_wall_clock_and_reads_device_events_without_a_sync(tmp_path):
    tr = Tracer(rank=3, role="generator", event=lambda: FakeEvent(0.0))
    before = time.time()
    with tr.span("denoise", "generate", step=0, fragment=2, stage=1) as args:
        with tr.span("reward", "score", step=0, fragment=2):
            time.sleep(0.01)
        args["num_samples"] = 4
    after = time.time()
    assert FakeEvent.synced == []  # nothing waits while the spans run
    outer = tr.spans[-1]
    assert before * 1e6 - 2e3 <= outer.start_us <= outer.end_us <= after * 1e6 + 2e3
    assert outer.dur_us >= 1e4 and tr.busy_seconds(0) == pytest.approx(outer.dur_us / 1e6)
    with pytest.raises(ValueError, match="unknown trace category"):
        with tr.span("x", "sleeping", step=0):
            pass

    path = tmp_path / "trace" / "rank3.json"
    tr.save(path)
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert {e["name"] for e in complete} == {"denoise", "reward"}
    for e in complete:
        assert e["pid"] == 3 and e["tid"] == "generator" and e["cat"] in ("generate", "score")
        assert e["ts"] > 1.6e15 and e["dur"] > 0 and e["args"]["step"] == 0 and e["args"]["fragment"] == 2
    denoise = next(e for e in complete if e["name"] == "denoise")
    assert denoise["args"]["stage"] == 1 and denoise["args"]["num_samples"] == 4
    assert any(e["name"] == "process_name" and e["pid"] == 3 for e in meta)

    other = Tracer(rank=0, role="trainer")
    with other.span("fwd", "train", step=0):
        pass
    other.save(tmp_path / "rank0.json")
    merge_traces([path, tmp_path / "rank0.json"], tmp_path / "merged.json")
    merged = json.loads((tmp_path / "merged.json").read_text())["traceEvents"]
    assert {e["pid"] for e in merged if e["ph"] == "X"} == {0, 3}


def test_a_span_lasts_as_long_as_its_device_work():
    """Device work queued in a span and finishing later stretches the span (read at the step's end,
    waiting for each span's end event only)."""
    FakeEvent.synced = []
    events = iter([FakeEvent(0.0), FakeEvent(2.5), FakeEvent(0.0), FakeEvent(0.001)])
    tr = Tracer(rank=0, role="trainer", event=lambda: next(events))
    with tr.span("fwd", "train", step=0):
        pass
    with tr.span("opt", "optimizer", step=0):
        time.sleep(0.01)
    assert tr.busy_seconds(0) == pytest.approx(2.5, rel=1e-3)  # the optimizer span lies inside it: counted once
    assert tr.spans[0].dur_us == pytest.approx(2.5e6) and tr.spans[1].dur_us >= 1e4  # host time kept when longer
    assert len(FakeEvent.synced) == 2


def test_disabled_tracer_records_nothing():
    tr = Tracer(rank=0, role="trainer", enabled=False)
    with tr.span("fwd", "train", step=0):
        pass
    assert tr.spans == [] and tr.busy_seconds(0) == 0.0


def test_bubble_fraction():
    assert bubble_fraction([10.0, 10.0], 10.0) == 0.0          # everyone busy all step
    assert bubble_fraction([10.0, 0.0], 10.0) == 0.5           # one rank idle all step
    assert bubble_fraction([6.0, 4.0, 2.0], 8.0) == pytest.approx(0.5)
    assert bubble_fraction([12.0, 12.0], 10.0) == 0.0          # clamped, never negative
    assert bubble_fraction([0.0], 5.0) == 1.0
    with pytest.raises(ValueError):
        bubble_fraction([], 1.0)
    with pytest.raises(ValueError):
        bubble_fraction([1.0], 0.0)


def test_summarize_step():
    per_rank = [
        {"role": "generator", "busy_s": 8.0, "start_s": 100.0, "end_s": 108.0},
        {"role": "generator", "busy_s": 6.0, "start_s": 100.5, "end_s": 107.0},
        {"role": "trainer", "busy_s": 4.0, "start_s": 102.0, "end_s": 110.0},
        {"role": "trainer", "busy_s": 0.0, "start_s": None, "end_s": None},
    ]
    s = summarize_step(per_rank)
    assert s["step_s"] == pytest.approx(10.0)
    assert s["bubble_fraction"] == pytest.approx(1 - (18.0 / 4) / 10.0)
    assert s["busy_fraction/generator"] == pytest.approx(0.7)
    assert s["busy_fraction/trainer"] == pytest.approx(0.2)


def test_summarize_step_period_counts_overlapping_steps_once():
    """With TCSS a generator starts step k+1 before the trainer ends step k: the step's duration is
    the period between consecutive ends, not its own (overlapping) window."""
    per_rank = [{"role": "generator", "busy_s": 1.0, "start_s": 9.0, "end_s": 11.0},
                {"role": "trainer", "busy_s": 2.0, "start_s": 10.0, "end_s": 12.0}]
    assert summarize_step(per_rank)["step_s"] == 3.0
    s = summarize_step(per_rank, previous_end_s=10.0)
    assert s["step_s"] == 2.0 and s["bubble_fraction"] == 1 - 1.5 / 2.0
