"""The event engine of the step simulator (planner/simulator.py describes the model it runs):
costs, the state of a step in progress, the engine, and `predict_makespan`, which BTS asks from
the state a trainer sees at an idle window."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from telemetry.tracing import Tracer, bubble_fraction

Policy = Callable[["StepState", "Costs", int], Any]  # -> bool, or an object with .claim (bts.Decision)


@dataclass
class Costs:
    """Seconds per action, measured (`bts.CostTracker`) or modelled."""

    replica_fragment_s: list[float]
    """per replica: seconds to generate, decode and score one fragment (replicas may differ in speed)"""
    trainer_fragment_s: float
    """seconds for one trainer rank to generate and score one fragment (TAG)"""
    train_fragment_s: float
    """wall seconds for the trainer group (num_trainers ranks) to train one fragment, every trainer
    taking an equal share (TSP): the fragment's training work is train_fragment_s * num_trainers
    rank-seconds"""
    transfer_s: float = 0.0
    """seconds from the end of a fragment's generation until it has landed at the trainers"""
    update_s: float = 0.0
    """seconds of the optimizer update (all trainers, after the last share)"""
    publish_s: float = 0.0
    """seconds to publish the new version to the generators"""
    chunks_per_fragment: int | None = None
    """without TSP: the number of chunks of a fragment (each train_fragment_s * num_trainers / k
    seconds on one trainer, round-robin over the trainers). None: TSP"""
    gen_scale: list[float] | None = None
    """per fragment of a step (fragments of different shapes): its generation time on any worker
    relative to that worker's `replica_fragment_s` / `trainer_fragment_s`. None: all 1"""
    train_scale: list[float] | None = None
    """per fragment: its training time relative to `train_fragment_s`. None: all 1"""
    transfer_scale: list[float] | None = None
    """per fragment: its transfer time relative to `transfer_s`. None: all 1"""
    trainer_tail_s: float = 0.0
    """seconds the trainers spend after a publication before the next step's work (the runtime's
    checkpoint save and logging); the generators do not wait for it"""
    held_fraction: float = 0.0
    """the fraction of every fragment's training that waits for the step's last fragment: with N
    optimizer updates per rollout over parts that span the step (rl/updates.py), (N - 1) / N, the
    later updates' share, trained after the first update (`update_s` counts all N updates)"""

    def __post_init__(self):
        self.replica_fragment_s = [float(x) for x in self.replica_fragment_s]
        if not self.replica_fragment_s or min(self.replica_fragment_s) <= 0:
            raise ValueError(f"replica_fragment_s must list one positive time per replica, "
                             f"got {self.replica_fragment_s}")
        if self.trainer_fragment_s <= 0:
            raise ValueError(f"trainer_fragment_s must be positive, got {self.trainer_fragment_s}")
        for name in ("train_fragment_s", "transfer_s", "update_s", "publish_s", "trainer_tail_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.held_fraction < 1:
            raise ValueError(f"held_fraction must be in [0, 1), got {self.held_fraction}")
        if self.chunks_per_fragment is not None and self.chunks_per_fragment < 1:
            raise ValueError(f"chunks_per_fragment must be >= 1 or None (TSP), got {self.chunks_per_fragment}")
        for name in ("gen_scale", "train_scale", "transfer_scale"):
            scale = getattr(self, name)
            if scale is not None:
                setattr(self, name, [float(x) for x in scale])
                if not scale or min(scale) <= 0:
                    raise ValueError(f"{name} must list one positive factor per fragment, got {scale}")

    def scale(self, name: str, fragment: int) -> float:
        """Fragment `fragment`'s factor of `name` (gen_scale, train_scale, transfer_scale)."""
        scale = getattr(self, name)
        return 1.0 if scale is None else scale[fragment]

    @property
    def num_replicas(self) -> int:
        return len(self.replica_fragment_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Costs":
        return cls(**d)


@dataclass
class StepState:
    """A partially executed step, as BTS sees it at a trainer's idle window. Times share one clock
    (seconds since the step started, or any clock: the prediction comes back in the same one)."""

    now_s: float
    unclaimed: list[int]
    """fragments nobody has claimed yet, claimed lowest first"""
    replica_free_s: list[float]
    """per replica: when it finishes its current fragment (<= now_s: idle)"""
    arrivals_s: dict[int, float]
    """claimed fragments that have not landed yet (generating on a replica or a trainer, or in
    transfer): fragment -> when it lands at the trainers"""
    trainer_free_s: list[float]
    """per trainer: when its current action (a training share or a TAG fragment) ends (<= now_s: idle)"""
    trainer_backlog_s: list[float]
    """per trainer: seconds of training of landed fragments it has not started"""
    trainer: int = 0
    """the trainer deciding: it makes the first claim of `predict_makespan`"""
    num_fragments: int | None = None
    """the step's fragments, all of them (None: one more than the highest in `unclaimed` and
    `arrivals_s`); what a prediction of the next step generates"""


@dataclass
class SimResult:
    makespan_s: float
    """end of the last step (the first starts at 0)"""
    step_end_s: list[float]
    """per step: when its publication (colocated: its update) ends"""
    events: list[dict[str, Any]]
    """Chrome trace events of every rank"""
    bubble_fraction: float
    """tracing.bubble_fraction over all ranks and the whole run"""
    fragments_by_trainers: int
    """fragments generated by trainers (TAG), all steps"""
    generated_by: list[list[int]]
    """[step][fragment] -> the rank that generated it (a replica's first stage, or a trainer)"""
    decisions: list[dict[str, Any]] = field(default_factory=list)
    """every tag-policy call: time_s, step, trainer, claim, predicted_with_s, predicted_without_s"""

    @property
    def step_s(self) -> list[float]:
        return [b - a for a, b in zip([0.0] + self.step_end_s[:-1], self.step_end_s)]

    @property
    def steady_step_s(self) -> float:
        """Mean step time without the first step (its pipeline fill): the steady state of a run."""
        if len(self.step_end_s) < 2:
            return self.makespan_s
        return (self.step_end_s[-1] - self.step_end_s[0]) / (len(self.step_end_s) - 1)


def predict_makespan(state: StepState, costs: Costs, num_trainers: int, trainer_claims_now: int,
                     later_claims: int = 0, lockstep: bool = False, next_claims: int | None = None) -> float:
    """When the step of `state` ends (its publication), if `trainer_claims_now` trainers claim a
    fragment right now (the deciding trainer first, then the other idle trainers in order), then
    `later_claims` more claims happen in all, each by the first trainer to open an idle window
    (first come, first served, while fragments are left), and no other. Replicas go on claiming
    dynamically. Runs the simulator itself from the state, so with exact costs and no later claims
    it is the simulated end of the step.

    `lockstep`: the trainers are one FSDP group that generates together (tag.GroupAssistant). The
    claims now go to the trainers in order whatever each is doing (each generates after its current
    work, which in the runtime comes after: the same total), and every trainer without a claim is
    held `trainer_fragment_s` as well, the time of the throw-away forwards that keep its collectives
    in step. Later claims are still modelled one trainer at a time.

    `next_claims` (TCSS): predict the end of the next step instead, a whole step of the same
    fragments whose generation the replicas start as soon as they have nothing left of this one
    (their version is the one they hold: staleness 1), and in which the trainers claim
    `next_claims` fragments at their idle windows. Under TCSS a fragment a trainer takes over
    frees a generator for the next step, which the end of this step alone does not show."""
    if len(state.replica_free_s) != costs.num_replicas or not (
            len(state.trainer_free_s) == len(state.trainer_backlog_s) == num_trainers):
        raise ValueError(f"state has {len(state.replica_free_s)} replica(s) and {len(state.trainer_free_s)}/"
                         f"{len(state.trainer_backlog_s)} trainer time(s); costs have {costs.num_replicas} "
                         f"replica(s) and there are {num_trainers} trainer(s)")
    if not 0 <= state.trainer < num_trainers:
        raise ValueError(f"deciding trainer {state.trainer} is not one of {num_trainers} trainer(s)")
    frags = [*state.unclaimed, *state.arrivals_s]
    steps = 1 if next_claims is None else 2
    num_fragments = state.num_fragments or max(frags, default=0) + 1
    quota = [later_claims, next_claims or 0]  # claims left, by step (this one, the next)

    def later(s: StepState, c: Costs, m: int) -> bool:
        k = engine.train_step
        if quota[k] <= 0:
            return False
        quota[k] -= 1
        return True

    engine = _Engine(costs, num_trainers, steps, [1] * num_fragments, None,
                     policy=later if sum(quota) > 0 else None, tcss=steps > 1, stages=1, record=False)
    now = state.now_s
    engine.unclaimed[0] = list(state.unclaimed)
    engine.unstarted[0] = len(state.unclaimed)
    engine.rep_free = list(state.replica_free_s)
    engine.trn_free = [max(f, now) + b if b > 0 else f for f, b in zip(state.trainer_free_s, state.trainer_backlog_s)]
    for f, ready in state.arrivals_s.items():
        engine.push_shares(0, f, ready)
    others = [j for j in range(num_trainers) if j != state.trainer and (lockstep or (
        engine.trn_free[j] <= now and not engine.ready_entries(j, now)))]
    claimers = [state.trainer] + others
    claimed = 0
    for j in claimers[:trainer_claims_now]:
        if not engine.unclaimed[0]:
            break
        engine.start_generation(0, max(now, engine.trn_free[j]), ("trainer", j))
        claimed += 1
    if lockstep and claimed:
        for j in claimers[claimed:]:
            engine.trn_free[j] = max(now, engine.trn_free[j]) + costs.trainer_fragment_s
    engine.run(now)
    return engine.step_end[-1]


@dataclass
class _Share:
    """A trainer's part of one fragment."""

    ready: float
    step: int
    fragment: int
    dur: float


class _Engine:
    """The event loop of disaggregated runs. At each instant: the trainers' update and publication
    once a step is fully trained, then replica claims (replica order), then trainers (trainer order)
    start a ready share or, in an idle window, ask the tag policy; repeated until nothing changes,
    then time jumps to the next instant something ends or lands."""

    def __init__(self, costs: Costs, num_trainers: int, num_steps: int, units: list[int],
                 owners: list[int] | None, *, policy: Policy | None, tcss: bool, stages: int, record: bool,
                 weights: list[tuple[float, float, float]] | None = None, wave: int = 1):
        """`weights`: per fragment, its (generation, training, transfer) time in units of the costs'
        one-fragment times; default: `units` fragments of the costs' per-fragment scales. `wave`:
        the fragments a replica generates as one pipelined schedule (a GAP replica keeps as many
        micro-batches in flight as it has stages); they land together when the wave ends."""
        self.costs, self.M, self.K, self.R, self.S = costs, num_trainers, num_steps, costs.num_replicas, stages
        self.wave = wave
        self.units, self.first_unit = units, [sum(units[:f]) for f in range(len(units))]
        if weights is None:
            weights = [(n * costs.scale("gen_scale", f), n * costs.scale("train_scale", f),
                        costs.scale("transfer_scale", f)) for f, n in enumerate(units)]
        self.gen_w, self.train_w, self.xfer_w = (list(w) for w in zip(*weights))
        self.policy, self.tcss, self.dynamic = policy, tcss, owners is None
        num_fragments = len(units)
        self.unclaimed = [list(range(num_fragments)) for _ in range(num_steps)]  # dynamic claims
        self.assigned = [[[f for f in range(num_fragments) if owners[f] == r] for r in range(self.R)]
                         for _ in range(num_steps)] if owners is not None else None
        self.unstarted = [num_fragments] * num_steps
        self.rep_free, self.rep_step = [0.0] * self.R, [0] * self.R
        self.trn_free, self.asked = [0.0] * self.M, [False] * self.M
        self.queues: list[list[_Share]] = [[] for _ in range(self.M)]
        self.pending = [0] * num_steps  # shares pushed to a queue and not started, per step
        self.held = [[0.0] * num_trainers for _ in range(num_steps)]  # per step, per trainer: the later updates' training
        self.train_step = 0
        self.step_end: list[float | None] = [None] * num_steps
        # gate[k]: when the version that step k's fragments need is installed (None: not yet known)
        self.gate: list[float | None] = [0.0] + [None] * (num_steps - 1)
        if tcss and num_steps > 1:
            self.gate[1] = 0.0  # step 1 may run on version 0
        self.generated_by = [[-1] * num_fragments for _ in range(num_steps)]
        self.num_by_trainers, self.decisions = 0, []
        roles = ["generator"] * (self.R * stages) + ["trainer"] * self.M
        self.tracers = [Tracer(rank, role) for rank, role in enumerate(roles)] if record else None

    # -- actions ----------------------------------------------------------------------------------

    def _span(self, rank: int, name: str, cat: str, step: int, start: float, end: float, fragment=None, **args):
        if self.tracers is not None:
            self.tracers[rank].record(name, cat, step, start * 1e6, (end - start) * 1e6, fragment, **args)

    def push_shares(self, step: int, fragment: int, ready: float) -> None:
        c, m, n = self.costs, self.M, self.units[fragment]
        if c.chunks_per_fragment is None:  # TSP: every trainer an equal share
            shares = [(j, self.train_w[fragment] * c.train_fragment_s) for j in range(m)]
        else:
            k = c.chunks_per_fragment
            per_trainer = [0] * m
            for chunk in range(self.first_unit[fragment] * k, (self.first_unit[fragment] + n) * k):
                per_trainer[chunk % m] += 1
            shares = [(j, num_chunks * c.train_fragment_s * m / k * self.train_w[fragment] / n)
                      for j, num_chunks in enumerate(per_trainer) if num_chunks]
        for j, dur in shares:
            self.queues[j].append(_Share(ready, step, fragment, dur * (1 - c.held_fraction)))
            self.held[step][j] += dur * c.held_fraction
            self.pending[step] += 1

    def start_generation(self, step: int, t: float, worker: tuple[str, int]) -> None:
        kind, i = worker
        queue = self.unclaimed[step] if self.dynamic else self.assigned[step][i]
        frags = [queue.pop(0) for _ in range(min(len(queue), self.wave if kind == "replica" else 1))]
        self.unstarted[step] -= len(frags)
        if kind == "replica":
            per = self.costs.replica_fragment_s[i]
            ranks = list(range(i * self.S, (i + 1) * self.S))
        else:
            per = self.costs.trainer_fragment_s
            ranks = [self.R * self.S + i]
            self.num_by_trainers += 1
        end = t
        for f in frags:  # one span per fragment, back to back: the wave's busy time, fragment by fragment
            start, end = end, end + self.gen_w[f] * per
            for rank in ranks:
                self._span(rank, "generate", "generate", step, start, end, f, tag=kind == "trainer")
        if kind == "replica":
            self.rep_free[i] = end
        else:
            self.trn_free[i], self.asked[i] = end, False
        for f in frags:  # the wave's fragments land together
            self.generated_by[step][f] = ranks[0]
            transfer = self.costs.transfer_s * self.xfer_w[f]
            if transfer > 0:
                self._span(ranks[-1], "transfer", "comm", step, end, end + transfer, f)
            self.push_shares(step, f, end + transfer)

    def ready_entries(self, j: int, t: float) -> list[_Share]:
        return [e for e in self.queues[j] if e.step == self.train_step and e.ready <= t]

    def _replica_work_left(self, r: int, step: int) -> bool:
        return bool(self.unclaimed[step]) if self.dynamic else bool(self.assigned[step][r])

    def _snapshot(self, j: int, t: float) -> StepState:
        arrivals, backlog = {}, [0.0] * self.M
        for i, queue in enumerate(self.queues):
            for e in queue:
                if e.step != self.train_step:
                    continue
                if e.ready > t:
                    arrivals[e.fragment] = e.ready
                else:
                    backlog[i] += e.dur
        return StepState(t, list(self.unclaimed[self.train_step]), list(self.rep_free), arrivals,
                         list(self.trn_free), backlog, j, len(self.units))

    # -- the loop ---------------------------------------------------------------------------------

    def _settle(self, t: float) -> bool:
        """Start everything that can start at instant t; True when something did."""
        changed = False
        k, c = self.train_step, self.costs
        if (k < self.K and self.unstarted[k] == 0 and self.pending[k] == 0
                and all(f <= t for f in self.trn_free)):
            later = max(self.held[k])  # several updates: the later ones' training, after the first's sync point
            update_end = t + later + c.update_s
            end = update_end + c.publish_s  # sync point: every trainer, then every generator
            trainers = range(self.R * self.S, self.R * self.S + self.M)
            for j, rank in enumerate(trainers):
                if self.held[k][j] > 0:
                    self._span(rank, "train", "train", k, t, t + self.held[k][j], later_updates=True)
                self._span(rank, "optimizer", "optimizer", k, t + later, update_end)
                self._span(rank, "publish", "publish", k, update_end, end)
            if not self.tcss:
                for rank in range(self.R * self.S):
                    self._span(rank, "publish", "publish", k, update_end, end)
            self.step_end[k], self.train_step = end, k + 1
            self.trn_free, self.asked = [end + c.trainer_tail_s] * self.M, [False] * self.M
            nxt = k + 2 if self.tcss else k + 1
            if nxt < self.K:
                self.gate[nxt] = end
            changed = True
        for r in range(self.R):
            while self.rep_free[r] <= t and self.rep_step[r] < self.K:
                s = self.rep_step[r]
                if not self._replica_work_left(r, s):
                    self.rep_step[r] += 1
                    continue
                if self.gate[s] is None or self.gate[s] > t:
                    break
                self.start_generation(s, t, ("replica", r))
                changed = True
        k = self.train_step
        for j in range(self.M):
            if k >= self.K or self.trn_free[j] > t:
                continue
            ready = self.ready_entries(j, t)
            if ready:
                e = min(ready, key=lambda e: (e.ready, e.fragment))
                self.queues[j].remove(e)
                self.pending[k] -= 1
                self.trn_free[j], self.asked[j] = t + e.dur, False
                self._span(self.R * self.S + j, "train", "train", k, t, t + e.dur, e.fragment)
                changed = True
            elif self.policy is not None and not self.asked[j] and self.unclaimed[k]:
                self.asked[j] = True  # one question per idle window
                answer = self.policy(self._snapshot(j, t), c, self.M)
                claim = bool(getattr(answer, "claim", answer))
                self.decisions.append({"time_s": t, "step": k, "trainer": j, "claim": claim,
                                       "predicted_with_s": getattr(answer, "predicted_with_s", None),
                                       "predicted_without_s": getattr(answer, "predicted_without_s", None)})
                if claim:
                    self.start_generation(k, t, ("trainer", j))
                    changed = True
        return changed

    def run(self, t: float = 0.0) -> None:
        while True:
            while self._settle(t):
                pass
            if self.train_step >= self.K:
                return
            later = [x for x in (*self.rep_free, *self.trn_free, *(g for g in self.gate if g is not None),
                                 *(e.ready for q in self.queues for e in q)) if x > t]
            if not later:
                raise RuntimeError(f"simulator stalled at t={t}: step {self.train_step} cannot finish")
            t = min(later)

    def result(self) -> SimResult:
        makespan = self.step_end[-1]
        busy = [sum(tr.busy_seconds(k) for k in range(self.K)) for tr in self.tracers]
        return SimResult(makespan, list(self.step_end), _events(self.tracers), bubble_fraction(busy, makespan),
                         self.num_by_trainers, self.generated_by, self.decisions)


def _events(tracers: list[Tracer]) -> list[dict[str, Any]]:
    """Every rank's Chrome events; transfers go on a `comm` lane of their rank, since they overlap
    the rank's next generation."""
    out = []
    for tr in tracers:
        for e in tr.chrome_events():
            if e.get("cat") == "comm":
                e = {**e, "tid": "comm"}
            out.append(e)
    return out


def _colocated(num_steps: int, owners: list[int], costs: Costs, num_trainers: int) -> SimResult:
    """Every rank generates its planned fragments, then trains; one update (the sync point of all
    ranks) ends the step. The training work of a fragment, train_fragment_s * num_trainers
    rank-seconds, is split over all ranks once generation ends everywhere (TSP: all data moves
    first), or without TSP done by the fragment's owner (the colocated plan keeps chunks local)."""
    n, c = costs.num_replicas, costs
    work = [c.train_fragment_s * num_trainers * c.scale("train_scale", f) for f in range(len(owners))]
    tracers = [Tracer(r, "colocated") for r in range(n)]
    step_end, start = [], 0.0
    for k in range(num_steps):
        gen_end = [start] * n
        for f, r in enumerate(owners):
            dur = c.replica_fragment_s[r] * c.scale("gen_scale", f)
            tracers[r].record("generate", "generate", k, gen_end[r] * 1e6, dur * 1e6, f)
            gen_end[r] += dur
        train_end = list(gen_end)
        if c.chunks_per_fragment is None:
            t0 = max(gen_end)
            train_end = [t0] * n
            for f in range(len(owners)):
                for r in range(n):
                    tracers[r].record("train", "train", k, train_end[r] * 1e6, work[f] / n * 1e6, f)
                    train_end[r] += work[f] / n
        else:
            for f, r in enumerate(owners):
                tracers[r].record("train", "train", k, train_end[r] * 1e6, work[f] * 1e6, f)
                train_end[r] += work[f]
        t = max(train_end)
        for tr in tracers:
            tr.record("optimizer", "optimizer", k, t * 1e6, c.update_s * 1e6)
        start = t + c.update_s
        step_end.append(start)
    busy = [sum(tr.busy_seconds(k) for k in range(num_steps)) for tr in tracers]
    generated_by = [list(owners) for _ in range(num_steps)]
    return SimResult(start, step_end, _events(tracers), bubble_fraction(busy, start), 0, generated_by)


__all__ = ["Costs", "MODES", "SimResult", "StepState", "TAG_POLICIES", "predict_makespan", "simulate_run",
           "simulate_step"]
