"""Cost models for the step simulator (docs/DESIGN.md 9): the per-action costs measured in a run's traces,
the simulator setup that a run's config maps to, and the runtime's step metrics recomputed from a
simulated trace so that predictions and measurements are compared on the same definitions.

Measured costs (`measure_costs`), each the mean over the steps used (the first step, which warms
up kernels and allocators, is left out by default; the mean, not the median, because a step's
time is a sum of action times):

- replica_fragment_s[r]: the replica's generation window in a step (first start to last end of
  its `generate` spans, over all its stages) divided by the number of fragments it generated: the
  gaps between fragments (advantages, cutting into chunks, posting sends) and a pipeline's fill and
  drain are generator time too.
- trainer_fragment_s: the mean `tag_generate` span of trainers (TAG); without TAG spans a trainer
  is taken to be as fast as the mean replica.
- train_fragment_s: per fragment, the seconds of all trainer ranks' `train` spans of it divided by
  the number of trainer ranks (the simulator's definition: train_fragment_s * num_trainers
  rank-seconds of work per fragment).
- receiving: a trainer's `recv` of data that had already landed (posted after the generation
  ended) is trainer work; its mean duration is added to the fragment's training work once per
  receive (at most the receive's own duration).
- transfer_s: per fragment, the latest over trainers of recv end - max(generation end, recv start)
  - the receive work, for the fragment's first `recv` on each trainer: from when both sides are
  ready until the data has landed.
- update_s: last optimizer end - last `train` span end of the step (all trainers): FSDP padding,
  the gradient all-reduce and the optimizer step.
- publish_s: on-policy disagg, next step's first replica `generate` start - last optimizer end:
  publication, installation and the generators' step start. TCSS: the trainers' publish span
  (generators do not wait for it). Colocated: 0.

Not modelled: the inter-step work of the runtime (planning, the logging rank's metrics and image
writes), scorer ranks, colocated TSP's all-to-all before training, and differences in training
speed between trainer ranks (`Costs` has one training cost for all).
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from parallel.stepplan import plan_step
from parallel.schedule import fragments_in_flight
from telemetry.metrics import read_metrics
from parallel.event_engine import Costs, SimResult
from parallel.topology import Topology
from telemetry.tracing import BUSY_CATEGORIES, bubble_fraction


@dataclass(frozen=True)
class TraceSpan:
    rank: int
    name: str
    cat: str
    step: int
    fragment: int | None
    start_s: float
    end_s: float


@dataclass
class RunTrace:
    """A run folder: its resolved config, its per-rank traces and its metrics."""

    config: dict[str, Any]
    spans: list[TraceSpan]
    world_size: int
    metrics: list[dict[str, Any]] = field(default_factory=list)

    def of(self, ranks, cat: str | None = None, name: str | None = None, step: int | None = None) -> list[TraceSpan]:
        ranks = set(ranks)
        return [s for s in self.spans if s.rank in ranks and (cat is None or s.cat == cat)
                and (name is None or s.name == name) and (step is None or s.step == step)]

    @property
    def steps(self) -> list[int]:
        """The steps trained (an optimizer span; generators also record the last publication's
        installation under step = the number of steps)."""
        return sorted({s.step for s in self.spans if s.cat == "optimizer"})


def read_trace_events(events: list[dict[str, Any]], rank: int) -> list[TraceSpan]:
    """The complete ("X") events of one rank's Chrome trace, in seconds."""
    out = []
    for e in events:
        if e.get("ph") != "X":
            continue
        args = e.get("args", {})
        start = e["ts"] / 1e6
        out.append(TraceSpan(rank, e["name"], e["cat"], int(args["step"]), args.get("fragment"), start,
                             start + e["dur"] / 1e6))
    return out


def load_run(run_dir: str) -> RunTrace:
    """DIR/config.json, DIR/trace/rank{R}.json (one per rank: the world size) and DIR/metrics.jsonl."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir!r} is not a run folder: no config.json")
    with open(path) as f:
        config = json.load(f)
    files = glob.glob(os.path.join(run_dir, "trace", "rank*.json"))
    ranks = sorted(int(m.group(1)) for p in files if (m := re.fullmatch(r"rank(\d+)\.json", os.path.basename(p))))
    if not ranks or ranks != list(range(len(ranks))):
        raise ValueError(f"{run_dir!r}: need trace/rank0.json .. rank{{N-1}}.json, found ranks {ranks} "
                         f"(was the run made with --no-trace?)")
    spans = []
    for r in ranks:
        with open(os.path.join(run_dir, "trace", f"rank{r}.json")) as f:
            spans += read_trace_events(json.load(f)["traceEvents"], r)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    metrics = [m for m in read_metrics(metrics_path) if "perf/step_s" in m] if os.path.isfile(metrics_path) else []
    return RunTrace(config, spans, len(ranks), metrics)


# ---------------------------------------------------------------------------------------------
# A run's config -> the simulator's setup
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SimSetup:
    """The arguments of `simulator.simulate_run` that describe a run's topology and mode."""

    mode: str
    """simulator mode: colocated, disagg (naive), gap (fragment streaming), tag, tcss"""
    tag_policy: str | None
    num_fragments: int
    num_trainers: int
    stages_per_replica: int
    chunks_per_fragment: int | None
    """None with TSP; else the chunks (micro-batches) of one fragment"""
    topology: Topology
    gen_wave: int = 1
    """fragments a replica of S stages pipelines together: enough for S micro-batches in flight"""

    @property
    def num_replicas(self) -> int:
        return self.topology.num_replicas

    @property
    def label(self) -> str:
        names = {"colocated": "colocated", "disagg": "naive disagg", "gap": "gap streaming",
                 "tag": "gap + tag (bts)", "tcss": "tcss" + (" + tag (bts)" if self.tag_policy else "")}
        stages = f", {self.stages_per_replica} stages" if self.stages_per_replica > 1 else ""
        tsp = ", tsp" if self.chunks_per_fragment is None else ""
        return names[self.mode] + stages + tsp


def sim_setup(config: dict[str, Any], world_size: int) -> SimSetup:
    """The simulator mode of a run: colocated; disagg with --tcss -> tcss (tag policy bts with --tag);
    --tag -> tag; more fragments than replicas -> gap (streaming); else naive disagg."""
    t, rl = config["topology"], config["rl"]
    topo = Topology.build(world_size, t["mode"], t.get("generators"), t.get("trainers"), t.get("scorers", 0),
                          t.get("gap_stages", 1))
    colocated = topo.mode == "colocated"
    num_trainers = topo.num_trainers
    plan = plan_step(0, seed=0, num_prompts=rl["prompts_per_step"], prompts_per_step=rl["prompts_per_step"],
                     group_size=rl["group_size"], micro_batch=rl["micro_batch"], num_replicas=topo.num_replicas,
                     num_trainers=num_trainers, fragment_groups=t.get("fragment_groups") or None, colocated=colocated)
    num_fragments = len(plan.fragments)
    chunks = None if t.get("tsp") else len(plan.fragments[0].chunks)
    if colocated:
        mode, policy = "colocated", None
    elif t.get("tcss"):
        mode, policy = "tcss", ("bts" if t.get("tag") else None)
    elif t.get("tag"):
        mode, policy = "tag", "bts"
    elif num_fragments > topo.num_replicas:
        mode, policy = "gap", None
    else:
        mode, policy = "disagg", None
    wave = fragments_in_flight(topo.gap_stages, len(plan.fragments[0].chunks))
    return SimSetup(mode, policy, num_fragments, num_trainers, topo.gap_stages, chunks, topo, wave)


# ---------------------------------------------------------------------------------------------
# Measured costs
# ---------------------------------------------------------------------------------------------

def _mean(xs: list[float], default: float | None = None) -> float | None:
    return sum(xs) / len(xs) if xs else default


def used_steps(run: RunTrace, skip: int = 1) -> list[int]:
    """The steps whose costs and times count: all but the first `skip` (all, if that leaves none)."""
    steps = run.steps
    return steps[skip:] if len(steps) > skip else steps


def measure_costs(run: RunTrace, setup: SimSetup, skip: int = 1) -> Costs:
    """The simulator's costs measured in a run's traces (see the module docstring)."""
    topo = setup.topology
    trainers = topo.trainer_ranks
    steps = used_steps(run, skip)
    replica_s = []
    for r in range(topo.num_replicas):
        per_step = []
        for k in steps:
            spans = run.of(topo.replica_ranks(r), cat="generate", step=k)
            frags = {s.fragment for s in spans if s.fragment is not None}
            if frags:
                per_step.append((max(s.end_s for s in spans) - min(s.start_s for s in spans)) / len(frags))
        replica_s.append(_mean(per_step))
    measured = [x for x in replica_s if x is not None]
    if not measured:
        raise ValueError("the traces hold no generate span in the steps used: no replica generated anything")
    replica_s = [_mean(measured) if x is None else x for x in replica_s]
    tag_spans = [] if setup.mode == "colocated" else [
        s for k in steps for s in run.of(trainers, cat="generate", step=k)]
    trainer_s = _mean([s.end_s - s.start_s for s in tag_spans], _mean(replica_s))
    train_work: dict[tuple[int, int], float] = {}
    for k in steps:
        for s in run.of(trainers, cat="train", step=k):
            if s.fragment is not None:  # fragment None: FSDP padding, counted in the update
                train_work[(k, s.fragment)] = train_work.get((k, s.fragment), 0.0) + s.end_s - s.start_s
    if not train_work:
        raise ValueError("the traces hold no train span in the steps used")
    receives = [] if setup.mode == "colocated" else _receives(run, steps, topo)
    receive_s = _mean([s.end_s - s.start_s for _, _, s, ready in receives if s.start_s >= ready], 0.0)
    for k, f, s, _ in receives:
        if (k, f) in train_work:
            train_work[(k, f)] += min(receive_s, s.end_s - s.start_s)
    train_s = _mean([w / len(trainers) for w in train_work.values()])
    first: dict[tuple[int, int, int], tuple[TraceSpan, float]] = {}
    for k, f, s, ready in receives:  # only a fragment's first receive on each trainer waits for it to land
        if (k, f, s.rank) not in first or s.start_s < first[(k, f, s.rank)][0].start_s:
            first[(k, f, s.rank)] = (s, ready)
    latency: dict[tuple[int, int], float] = {}
    for (k, f, _), (s, ready) in first.items():
        wait = max(0.0, s.end_s - max(ready, s.start_s) - min(receive_s, s.end_s - s.start_s))
        latency[(k, f)] = max(latency.get((k, f), 0.0), wait)
    update, publish = [], []
    for k in steps:
        last_train = [s.end_s for s in run.of(trainers, cat="train", step=k) if s.fragment is not None]
        opt = run.of(trainers, cat="optimizer", step=k)
        if not opt or not last_train:
            continue
        opt_end = max(s.end_s for s in opt)
        update.append(max(0.0, opt_end - max(last_train)))
        if setup.mode == "colocated":
            continue
        if setup.mode == "tcss":
            publish += [s.end_s - s.start_s for s in run.of(trainers, cat="publish", name="publish", step=k)]
        else:
            nxt = run.of(topo.generator_ranks, cat="generate", step=k + 1)
            if nxt:
                publish.append(max(0.0, min(s.start_s for s in nxt) - opt_end))
    if not publish and setup.mode != "colocated":  # no next step in the steps used: the trainers' own span
        publish = [s.end_s - s.start_s for k in steps for s in run.of(trainers, cat="publish", name="publish", step=k)]
    return Costs(replica_fragment_s=replica_s, trainer_fragment_s=trainer_s, train_fragment_s=train_s,
                 transfer_s=_mean(list(latency.values()), 0.0), update_s=_mean(update, 0.0),
                 publish_s=_mean(publish, 0.0), chunks_per_fragment=setup.chunks_per_fragment)


def _receives(run: RunTrace, steps: list[int], topo: Topology) -> list[tuple[int, int, TraceSpan, float]]:
    """Every trainer `recv` span of a generated fragment: (step, fragment, span, when the
    fragment's generation ended)."""
    out = []
    for k in steps:
        ready: dict[int, float] = {}
        for s in run.of(range(run.world_size), cat="generate", step=k):
            if s.fragment is not None:
                ready[s.fragment] = max(ready.get(s.fragment, s.end_s), s.end_s)
        recvs = run.of(topo.trainer_ranks, cat="comm", name="recv", step=k)
        out += [(k, s.fragment, s, ready[s.fragment]) for s in recvs if s.fragment in ready]
    return out


# ---------------------------------------------------------------------------------------------
# Step metrics on the runtime's definitions
# ---------------------------------------------------------------------------------------------

def measured_step_metrics(run: RunTrace, skip: int = 1) -> dict[str, float | None]:
    """Medians over the steps used: `step_s` and `bubble_fraction` as the runtime logged them
    (perf/step_s: the last end of step k over all ranks minus that of step k-1), and `period_s`
    from the traces: the end of a step's last trainer span minus the previous step's."""
    steps = set(used_steps(run, skip))
    logged = [m for m in run.metrics if m["step"] in steps]
    trainers = sim_setup(run.config, run.world_size).topology.trainer_ranks
    ends = {k: max(s.end_s for s in run.of(trainers, step=k) if s.cat != "eval") for k in run.steps}
    periods = [ends[k] - ends[k - 1] for k in sorted(steps) if k - 1 in ends]
    return {"step_s": statistics.median(m["perf/step_s"] for m in logged) if logged else None,
            "bubble_fraction": statistics.median(m["perf/bubble_fraction"] for m in logged) if logged else None,
            "period_s": statistics.median(periods) if periods else None}


def predicted_step_metrics(result: SimResult, setup: SimSetup, costs: Costs, skip: int = 1) -> dict[str, float]:
    """The same three medians from a simulated run, on the runtime's definitions: step k lasts from
    the end of step k-1 to its own end (perf/step_s is the period of the step loop), and its bubble
    is computed from each rank's busy time in step k (the union of its generate/train/optimizer
    spans) over that period."""
    spans: dict[int, list[dict]] = {}
    for e in result.events:
        if e.get("ph") == "X":
            spans.setdefault(e["pid"], []).append(e)
    periods, bubbles = [], []
    first = max(1, skip)
    for k in range(first, len(result.step_end_s)):
        busy = [_union_s([(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in spans.get(rank, [])
                          if e["args"]["step"] == k and e["cat"] in BUSY_CATEGORIES])
                for rank in range(setup.topology.world_size)]
        period = result.step_end_s[k] - result.step_end_s[k - 1]
        periods.append(period)
        bubbles.append(bubble_fraction(busy, period))
    return {"step_s": statistics.median(periods) if periods else result.makespan_s,
            "bubble_fraction": statistics.median(bubbles) if bubbles else result.bubble_fraction,
            "period_s": statistics.median(result.step_s[first:] or result.step_s)}


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals (overlapping spans count once, as `Tracer.busy_seconds`)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0 or math.isnan(measured):
        return None
    return (predicted - measured) / measured


__all__ = ["RunTrace", "SimSetup", "TraceSpan", "load_run", "measure_costs", "measured_step_metrics",
           "predicted_step_metrics", "read_trace_events", "relative_error", "sim_setup", "used_steps"]
