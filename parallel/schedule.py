"""GAP's block pipeline as data (docs/DESIGN.md 5.2): a stage partition of the DiT blocks and a
per-stage list of actions, checked by a validator and run by one executor (pipeline.py).

An action `F(stage, mb, t)` is one stage's part of denoising step t of micro-batch mb. Its input
comes from stage-1 (same t) or, on stage 0, from the last stage's F(S-1, mb, t-1) (the new latent
travels back); F(0, mb, 0) starts from the seeded initial noise. Sends never block (they are
drained at the end), receives do, so a schedule is valid when no stage ever waits for an action
that its producer has not yet reached: the validator replays the lists to prove it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


class ScheduleError(ValueError):
    pass


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    mb: int
    t: int

    def __str__(self) -> str:  # torchtitan-style: 1F3.0 = stage 1, forward, micro-batch 3, step 0
        return f"{self.stage}F{self.mb}.{self.t}"

    def producer(self, num_stages: int) -> "Action | None":
        """The action whose output this one consumes (None: it starts from the initial noise)."""
        if self.stage > 0:
            return Action(self.stage - 1, self.mb, self.t)
        if self.t > 0:
            return Action(num_stages - 1, self.mb, self.t - 1)
        return None


# ----- the stage partition ----------------------------------------------------------------------
def partition_blocks(block_costs: list[float], stage_speeds: list[float]) -> list[tuple[int, int]]:
    """Split blocks into len(stage_speeds) contiguous, non-empty ranges [start, end) minimizing the
    slowest stage's time sum(cost) / speed (exact dynamic programme; ties keep earlier cuts)."""
    n, s = len(block_costs), len(stage_speeds)
    if s < 1 or n < s:
        raise ValueError(f"cannot split {n} blocks into {s} non-empty stages")
    if min(stage_speeds) <= 0 or min(block_costs) < 0:
        raise ValueError(f"stage speeds must be positive and block costs non-negative: {stage_speeds}, {block_costs}")
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: the best bottleneck for the first j blocks on the first k stages.
    best = [[inf] * (n + 1) for _ in range(s + 1)]
    cut = [[0] * (n + 1) for _ in range(s + 1)]
    best[0][0] = 0.0
    for k in range(1, s + 1):
        for j in range(k, n - (s - k) + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], (prefix[j] - prefix[i]) / stage_speeds[k - 1])
                if cost < best[k][j] - 1e-12:
                    best[k][j], cut[k][j] = cost, i
    ranges, j = [], n
    for k in range(s, 0, -1):
        i = cut[k][j]
        ranges.append((i, j))
        j = i
    return ranges[::-1]


# ----- the schedule -----------------------------------------------------------------------------
def gap_schedule(num_stages: int, num_microbatches: int, num_steps: int,
                 in_flight: int | None = None) -> list[list[Action]]:
    """Every stage runs the same order: micro-batches sit in `in_flight` slots (default S, the
    fewest that keep every stage busy), slots take turns one denoising step at a time, and a slot
    takes its next micro-batch as soon as the previous one has finished its K steps. The only
    bubbles are the fill at the start and the drain at the end."""
    if num_stages < 1 or num_steps < 1 or num_microbatches < 0:
        raise ValueError(f"bad schedule size: stages {num_stages}, micro-batches {num_microbatches}, steps {num_steps}")
    slots = min(in_flight or num_stages, num_microbatches) if num_microbatches else 0
    queues = [[(mb, t) for mb in range(j, num_microbatches, slots) for t in range(num_steps)] for j in range(slots)]
    order = []
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    return [[Action(s, mb, t) for mb, t in order] for s in range(num_stages)]


@lru_cache(maxsize=4096)
def makespan_slots(num_stages: int, num_microbatches: int, num_steps: int) -> int:
    """Makespan, in stage slots, of `num_microbatches` through `gap_schedule` (work plus bubble,
    per stage)."""
    schedule = gap_schedule(num_stages, num_microbatches, num_steps)
    return (sum(len(a) for a in schedule) + idle_slots(schedule)) // num_stages


def fragments_in_flight(num_stages: int, micro_batches_per_fragment: int) -> int:
    """Fragments a replica of `num_stages` pipelines at once when each has
    `micro_batches_per_fragment` micro-batches: `gap_schedule` keeps S micro-batches in flight, so
    fragments of fewer than S share one schedule and finish together (the planner's wave)."""
    return -(-num_stages // max(1, micro_batches_per_fragment))


def validate_schedule(schedule: list[list[Action]], num_stages: int, num_microbatches: int,
                      num_steps: int) -> None:
    """Raise ScheduleError (with the step-by-stage grid, the stuck actions marked) unless every
    stage runs each (mb, t) exactly once, on its own stage, and a replay with blocking receives
    and non-blocking sends finishes."""
    if len(schedule) != num_stages:
        raise ScheduleError(f"schedule has {len(schedule)} stage lists, expected {num_stages}")
    want = {(mb, t) for mb in range(num_microbatches) for t in range(num_steps)}
    for s, actions in enumerate(schedule):
        wrong = [a for a in actions if a.stage != s]
        if wrong:
            raise ScheduleError(f"stage {s} holds actions of other stages: {[str(a) for a in wrong[:5]]}\n"
                                + render_grid(schedule, set(wrong)))
        seen = [(a.mb, a.t) for a in actions]
        if len(seen) != len(set(seen)) or set(seen) != want:
            dup = sorted({x for x in seen if seen.count(x) > 1})
            missing = sorted(want - set(seen))
            extra = sorted(set(seen) - want)
            raise ScheduleError(f"stage {s}: duplicated {dup[:5]}, missing {missing[:5]}, unexpected {extra[:5]}\n"
                                + render_grid(schedule, set()))
    # Receives are posted in order, so each channel must deliver in the order it is consumed.
    for dst in range(num_stages if num_stages > 1 else 0):  # one stage keeps its latent: no messages
        consumed = [a.producer(num_stages) for a in schedule[dst] if a.producer(num_stages) is not None]
        src = dst - 1 if dst > 0 else num_stages - 1
        produced = [a for a in schedule[src] if _consumer(a, num_stages, num_steps) is not None
                    and _consumer(a, num_stages, num_steps).stage == dst]
        if consumed != produced:
            bad = next(i for i, (c, p) in enumerate(zip(consumed + [None] * len(produced), produced + [None] * len(consumed)))
                       if c != p)
            marks = {x for x in (consumed[bad] if bad < len(consumed) else None,
                                 produced[bad] if bad < len(produced) else None) if x is not None}
            raise ScheduleError(f"stage {dst} consumes its messages from stage {src} out of order: message {bad} is "
                                f"{produced[bad] if bad < len(produced) else None} but stage {dst} expects "
                                f"{consumed[bad] if bad < len(consumed) else None}\n" + render_grid(schedule, marks))
    done: set[Action] = set()
    pos = [0] * num_stages
    while any(pos[s] < len(schedule[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            while pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                p = a.producer(num_stages)
                if p is not None and p not in done:
                    break
                done.add(a)
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {schedule[s][pos[s]] for s in range(num_stages) if pos[s] < len(schedule[s])}
            raise ScheduleError("deadlock: every unfinished stage waits on an action its producer has not "
                                f"reached: {sorted(str(a) for a in stuck)}\n" + render_grid(schedule, stuck))


def _consumer(a: Action, num_stages: int, num_steps: int) -> Action | None:
    """The action that consumes a's output (None: a finishes its micro-batch)."""
    if a.stage < num_stages - 1:
        return Action(a.stage + 1, a.mb, a.t)
    if num_stages > 1 and a.t + 1 < num_steps:
        return Action(0, a.mb, a.t + 1)
    return None


def render_grid(schedule: list[list[Action]], marked: set[Action]) -> str:
    """Step-by-stage grid: row i shows each stage's i-th action; marked actions get a '!'."""
    width = max([len(str(a)) for actions in schedule for a in actions] + [6]) + 1
    lines = ["slot | " + " ".join(f"stage {s}".ljust(width) for s in range(len(schedule)))]
    for i in range(max((len(a) for a in schedule), default=0)):
        cells = []
        for actions in schedule:
            a = actions[i] if i < len(actions) else None
            text = "" if a is None else str(a) + ("!" if a in marked else "")
            cells.append(text.ljust(width))
        lines.append(f"{i:4d} | " + " ".join(cells))
    return "\n".join(lines)


def idle_slots(schedule: list[list[Action]]) -> int:
    """Bubble of a schedule in unit-time slots, replayed in lockstep (each action takes one slot)."""
    num_stages = len(schedule)
    finish: dict[Action, int] = {}
    clock = [0] * num_stages
    pending = [list(a) for a in schedule]
    while any(pending):
        for s in range(num_stages):
            while pending[s]:
                a = pending[s][0]
                p = a.producer(num_stages)
                if p is not None and p not in finish:
                    break
                start = max(clock[s], finish[p] if p is not None else 0)
                finish[a] = start + 1
                clock[s] = start + 1
                pending[s].pop(0)
    makespan = max(clock) if clock else 0
    return sum(makespan - len(a) for a in schedule)
