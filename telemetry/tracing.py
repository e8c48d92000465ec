"""Timed events of every rank, written as a Chrome trace (open in https://ui.perfetto.dev), and
the step metrics derived from them (docs/DESIGN.md, observability): step time, busy fraction per
role and the bubble fraction. Also `Slowdown`, which emulates a slower device for benchmarks.

Timestamps are microseconds since the Unix epoch, so the traces of all ranks (one file each, or
merged with `merge_traces`) line up in one view. Each tracer reads the wall clock once and then
adds `perf_counter` deltas, which are monotonic and precise.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

CATEGORIES = ("generate", "score", "comm", "train", "optimizer", "publish", "eval")
"""Kinds of work. comm, publish and eval are not counted as busy by default."""

BUSY_CATEGORIES = ("generate", "score", "train", "optimizer")
"""The work that the ideal schedule of the bubble fraction spreads over all ranks."""


class Slowdown:
    """--debug-slow-rank: the wrapped work runs `factor` times slower, by sleeping (factor - 1)
    times its duration after it. Wrapped around every kind of work of a rank (denoising, GAP
    stage actions, training forwards, scoring, the start-up speed probe), it emulates a slower
    device on identical hardware; waits on other ranks are never wrapped."""

    def __init__(self, factor: float = 1.0):
        if not factor >= 1:
            raise ValueError(f"a slow-down factor must be >= 1, got {factor}")
        self.factor = factor

    @contextmanager
    def __call__(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if self.factor > 1:
            time.sleep((time.perf_counter() - start) * (self.factor - 1))


@dataclass
class Span:
    """One timed event."""

    name: str
    cat: str
    step: int
    fragment: int | None
    start_us: float
    """microseconds since the Unix epoch"""
    dur_us: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


def _check_cat(cat: str) -> None:
    if cat not in CATEGORIES:
        raise ValueError(f"unknown trace category {cat!r}; known: {list(CATEGORIES)}")


class Tracer:
    """Records the spans of one rank.

    A span's clock is the host's. On an accelerator, where work is queued and runs later, `event`
    (e.g. `lambda: torch.cuda.Event(enable_timing=True)`) makes each span last at least as long
    as the device took for the work it queued: two events recorded on the current stream at its
    start and end, read when the spans are read (`settle`, at the end of a step). Nothing here
    synchronizes the device: a device-wide synchronize would also wait for every send and receive
    the rank has posted, which on NCCL can wait for the rank's own later work (docs/communication.md).
    A disabled tracer records nothing but still validates categories."""

    def __init__(self, rank: int, role: str, enabled: bool = True, event: Callable[[], Any] | None = None):
        self.rank = rank
        self.role = role
        self.enabled = enabled
        self.event = event
        self.spans: list[Span] = []
        self._pending: list[tuple[Span, Any, Any]] = []  # spans whose device events are not read yet
        self._origin_ns = time.time_ns()
        self._perf_origin_ns = time.perf_counter_ns()

    def now_us(self) -> float:
        """Microseconds since the Unix epoch, from the wall-clock origin plus a perf_counter delta."""
        return (self._origin_ns + time.perf_counter_ns() - self._perf_origin_ns) / 1000.0

    @contextmanager
    def span(self, name: str, cat: str, step: int, fragment: int | None = None, **args) -> Iterator[dict]:
        """Time the body as one event. Yields the event's args dict, so the body can add values
        known only at its end (`with tracer.span(...) as a: a["num_samples"] = n`)."""
        _check_cat(cat)
        if not self.enabled:
            yield args
            return
        begin = self._mark()
        start = self.now_us()
        try:
            yield args
        finally:
            span = Span(name, cat, step, fragment, start, self.now_us() - start, args)
            self.spans.append(span)
            if begin is not None:
                self._pending.append((span, begin, self._mark()))

    def _mark(self):
        """A device event recorded on the current stream now (None without `event`)."""
        if self.event is None:
            return None
        e = self.event()
        e.record()
        return e

    def settle(self) -> None:
        """Stretch every span whose device work took longer than its host time. Waits only for the
        end event of each span (the current stream up to it), never for the whole device."""
        for span, begin, end in self._pending:
            end.synchronize()
            span.dur_us = max(span.dur_us, begin.elapsed_time(end) * 1000.0)  # elapsed_time: ms
        self._pending = []

    def record(self, name: str, cat: str, step: int, start_us: float, dur_us: float,
               fragment: int | None = None, **args) -> None:
        """Add an event timed elsewhere (device events, the simulator)."""
        _check_cat(cat)
        if dur_us < 0:
            raise ValueError(f"negative duration {dur_us} us for event {name!r}")
        if self.enabled:
            self.spans.append(Span(name, cat, step, fragment, float(start_us), float(dur_us), args))

    # -- derived quantities ---------------------------------------------------------------------

    def busy_seconds(self, step: int, cats: tuple[str, ...] = BUSY_CATEGORIES) -> float:
        """Seconds of step `step` covered by at least one span of `cats` (the union of their
        intervals, so nested or overlapping spans count once)."""
        for cat in cats:
            _check_cat(cat)
        self.settle()
        intervals = sorted((s.start_us, s.end_us) for s in self.spans if s.step == step and s.cat in cats)
        return _union_length(intervals) / 1e6

    def step_window(self, step: int) -> tuple[float, float]:
        """(first start, last end) of the spans of step `step`, in seconds since the epoch.
        Raises ValueError when this rank recorded nothing for the step."""
        self.settle()
        spans = [s for s in self.spans if s.step == step]
        if not spans:
            raise ValueError(f"rank {self.rank} ({self.role}) recorded no span for step {step}")
        return min(s.start_us for s in spans) / 1e6, max(s.end_us for s in spans) / 1e6

    def step_record(self, step: int) -> dict[str, Any]:
        """This rank's input to `summarize_step`: role, busy_s, start_s, end_s (None when the
        rank recorded nothing for the step)."""
        has_spans = any(s.step == step for s in self.spans)
        start, end = self.step_window(step) if has_spans else (None, None)
        return {"role": self.role, "busy_s": self.busy_seconds(step), "start_s": start, "end_s": end}

    # -- output ---------------------------------------------------------------------------------

    def chrome_events(self) -> list[dict[str, Any]]:
        """Complete events ("ph": "X") plus process and thread name metadata."""
        self.settle()
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": self.rank, "args": {"name": f"rank {self.rank} ({self.role})"}},
            {"ph": "M", "name": "process_sort_index", "pid": self.rank, "args": {"sort_index": self.rank}},
            {"ph": "M", "name": "thread_name", "pid": self.rank, "tid": self.role, "args": {"name": self.role}},
        ]
        for s in self.spans:
            events.append({
                "ph": "X", "name": s.name, "cat": s.cat, "pid": self.rank, "tid": self.role,
                "ts": s.start_us, "dur": s.dur_us,
                "args": {"step": s.step, "fragment": s.fragment, **s.args},
            })
        return events

    def save(self, path: str | os.PathLike) -> None:
        """Write `{"traceEvents": [...], "displayTimeUnit": "ms"}` to `path`."""
        _write_trace(path, self.chrome_events())


def merge_traces(paths: list[str | os.PathLike], out_path: str | os.PathLike) -> None:
    """Concatenate the events of several rank traces into one file."""
    events = []
    for p in paths:
        with open(p) as f:
            events.extend(json.load(f)["traceEvents"])
    _write_trace(out_path, events)


def _write_trace(path: str | os.PathLike, events: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f, default=str)


def _union_length(sorted_intervals: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted_intervals:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


# ---------------------------------------------------------------------------------------------
# Step metrics (pure)
# ---------------------------------------------------------------------------------------------

def bubble_fraction(busy_seconds_per_rank: list[float], step_seconds: float) -> float:
    """Fraction of the step's rank-time lost to idling (DESIGN 8).

    bubble = 1 - ideal / actual, where ideal = sum(busy) / num_ranks is the step time of a
    perfect schedule that spreads all generation and training work evenly over every rank, and
    actual = `step_seconds`, the measured wall time of the step. 0 means no rank ever waited;
    0.5 means half of all rank-seconds were idle. Clamped to [0, 1] (busy time measured
    slightly beyond the step window, e.g. by clock granularity, must not give a negative
    bubble)."""
    if not busy_seconds_per_rank:
        raise ValueError("bubble_fraction needs at least one rank")
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be positive, got {step_seconds}")
    ideal = sum(busy_seconds_per_rank) / len(busy_seconds_per_rank)
    return min(1.0, max(0.0, 1.0 - ideal / step_seconds))


def summarize_step(per_rank: list[dict[str, Any]], previous_end_s: float | None = None) -> dict[str, float]:
    """Step metrics from every rank's {"role", "busy_s", "start_s", "end_s"} (`step_record`).

    Returns {"step_s", "bubble_fraction": ..., "busy_fraction/<role>": that role's busy seconds /
    (its number of ranks * step_s)}. step_s is the last end minus the previous step's last end
    when `previous_end_s` is given (the period of the step loop: with TCSS, steps overlap and a
    step's own window would count the overlap twice), else last end - first start. Ranks with no
    spans in the step (start_s None) count as idle."""
    windows = [(r["start_s"], r["end_s"]) for r in per_rank if r.get("start_s") is not None]
    if not windows:
        raise ValueError("summarize_step: no rank recorded a span for this step")
    end = max(e for _, e in windows)
    step_s = end - (previous_end_s if previous_end_s is not None else min(start for start, _ in windows))
    if step_s <= 0:
        raise ValueError(f"summarize_step: empty step window ({step_s} s)")
    out = {"step_s": step_s, "bubble_fraction": bubble_fraction([r["busy_s"] for r in per_rank], step_s)}
    roles: dict[str, list[float]] = {}
    for r in per_rank:
        roles.setdefault(r["role"], []).append(r["busy_s"])
    for role, busy in sorted(roles.items()):
        out[f"busy_fraction/{role}"] = sum(busy) / (len(busy) * step_s)
    return out


__all__ = [
    "BUSY_CATEGORIES", "CATEGORIES", "Span", "Tracer", "bubble_fraction", "merge_traces", "summarize_step",
]
