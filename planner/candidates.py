"""The placements a run may take on its ranks, each predicted from what the start-up probe measured
on this machine, ranked (`--placement auto`, runtime/autoplace.py; docs/placement.md).

Every placement trains the same weights (placement invariance), so placement is a speed knob: the
run ranks every one this world size allows and its memory admits, and runs the fastest. The
candidates: colocated with replicated or FSDP2-sharded ranks (fragments split evenly, or by
measured speed when the ranks differ), and every disaggregated split of G generators and T
trainers, with GAP stages where the generators divide into them, replicated or FSDP2 trainers,
with and without TAG, and with TCSS only when the user allows staleness.

The prediction is the step simulator's (planner/simulator.py, the event engine BTS runs) on costs
built from the probe: per rank, the seconds of one chunk's generation (encoding, K denoising
steps, decoding and scoring) and of one trained transition's forward and backward; the link's
bandwidth and latency between ranks. The step plan is the runtime's own (`plan_step`). What moves
over the link is counted from the run's sizes: each sample's training data, a published version per
generator rank, the replicated trainers' gradient all-reduce, FSDP2's gathers of the weights.
Pure: plain numbers in, seconds out; no torch models, no ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from parallel.event_engine import Costs
from parallel.schedule import fragments_in_flight, makespan_slots
from parallel.stepplan import helper_weight, plan_step, trainer_speeds
from planner.simulator import simulate_run

SPEED_SPREAD = 1.1
"""colocated: fragments are split by measured speed as a candidate of its own when the fastest
rank generates this much faster than the slowest"""
STEADY_STEPS = 3
"""steps simulated for a disaggregated candidate (its steady step leaves out the first's fill)"""


@dataclass(frozen=True)
class Placement:
    """One way to place the run on its ranks: the topology flags it sets."""

    mode: str
    """colocated or disagg"""
    generators: int | None = None
    trainers: int | None = None
    gap_stages: int = 1
    sharding: str = "replicate"
    """colocated: --colocated-sharding; disagg: --train-sharding"""
    tag: bool = False
    tcss: bool = False
    fragment_split: str = "auto"
    """auto (the runtime's: speed when disaggregated, even when colocated), or speed"""
    tail_assist: bool = False
    """the generator of the step's last fragment trains a share of it (--tail-assist)"""

    @property
    def stale(self) -> bool:
        return self.tcss

    def flags(self) -> list[str]:
        """train_disagg.py flags that run this placement with --placement fixed."""
        if self.mode == "colocated":
            out = ["--mode", "colocated", "--colocated-sharding", self.sharding]
        else:
            out = ["--mode", "disagg", "--generators", str(self.generators), "--trainers", str(self.trainers),
                   "--gap-stages", str(self.gap_stages), "--train-sharding", self.sharding]
            out += ["--tag"] if self.tag else []
            out += ["--tcss"] if self.tcss else []
            out += ["--tail-assist"] if self.tail_assist else []
        return out + (["--fragment-split", self.fragment_split] if self.fragment_split != "auto" else [])

    def label(self) -> str:
        """The placement in words: 'colocated', '1 generator + 1 trainer, TAG'."""
        if self.mode == "colocated":
            return "colocated" + (" FSDP2" if self.sharding == "fsdp" else "") + (
                ", split by speed" if self.fragment_split == "speed" else "")
        parts = [f"{self.generators} generator{'s' * (self.generators > 1)} + {self.trainers} "
                 f"{'FSDP2 ' if self.sharding == 'fsdp' else ''}trainer{'s' * (self.trainers > 1)}"]
        parts += [f"{self.gap_stages} GAP stages"] if self.gap_stages > 1 else []
        parts += ["TAG"] if self.tag else []
        parts += ["TCSS"] if self.tcss else []
        parts += ["tail assist"] if self.tail_assist else []
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return {"label": self.label(), "flags": self.flags()}


@dataclass(frozen=True)
class Machine:
    """What the start-up probe measured (runtime/autoplace.py)."""

    chunk_s: list[float]
    """per rank: seconds to generate one chunk of the run's micro-batch (encode its prompts, K
    denoising steps, decode, score)"""
    row_s: list[float]
    """per rank: seconds each trained transition adds to a training forward and backward (with
    `forward_s` empty: a forward at the run's transitions per forward, divided by them)"""
    link_bytes_s: float
    """bytes per second between two ranks"""
    latency_s: float = 0.0
    """seconds of a small message between two ranks"""
    gather_s: float | None = None
    """measured: seconds FSDP2 sharding over every rank adds to one denoising forward (its
    all-gathers, their copies and hooks, the ranks' lockstep); None: priced from the link (bytes
    and a latency per unit)"""
    train_gather_s: float | None = None
    """measured: the same for one training forward and backward (None: three forwards' gathers)"""
    forward_s: list[float] = field(default_factory=list)
    """per rank: seconds a training forward and backward costs whatever its transitions (the probe
    times two sizes: a forward of n transitions takes forward_s + n row_s); empty: none"""

    @property
    def world_size(self) -> int:
        return len(self.chunk_s)


@dataclass(frozen=True)
class Workload:
    """The run's step, in the sizes a placement's costs follow from (runtime/autoplace.py reads
    them from the run's config and model)."""

    prompts_per_step: int
    group_size: int
    micro_batch: int
    num_prompts: int
    seed: int
    fragment_groups: int | None
    """groups per fragment (None: naive, one fragment per replica)"""
    sample_steps: int
    trained_per_sample: float
    """transitions a sample trains (the algorithm's timesteps)"""
    sample_bytes: float
    """bytes of one sample's training data on the wire (trajectory, conditioning)"""
    version_bytes: float
    """bytes of a version published to one generator rank"""
    grad_bytes: float
    """bytes of the trained parameters' gradient (all-reduced by replicated trainers)"""
    weight_bytes: float
    """bytes of the transformer's weights (FSDP2 gathers them at every forward)"""
    tsp: bool
    train_micro_batch: int
    """transitions per training forward"""
    blocks: int
    """DiT blocks (a GAP replica has at most as many stages)"""
    units: int = 1
    """FSDP2 units of the transformer (every block and top-level module): each forward gathers each"""


@dataclass
class Prediction:
    placement: Placement
    step_s: float
    """the simulated steady step, seconds"""
    trainer_fragments: int = 0
    """fragments the trainers generated per step (TAG)"""
    shares: tuple[int, ...] = ()
    """colocated: the samples each rank generates (a split by speed may give the even split's)"""

    def to_dict(self) -> dict:
        return {**self.placement.to_dict(), "predicted_step_s": self.step_s}


# ----- the candidates -----------------------------------------------------------------------------
def candidates(world_size: int, machine: Machine | None = None, *, allow_stale: bool = False,
               blocks: int = 1, tail_assist: bool = False) -> list[Placement]:
    """Every placement of `world_size` ranks: colocated (replicated, FSDP2; by speed when the
    measured ranks differ), then every disaggregated split; with `tail_assist` (the run's config
    allows it: config.validate.tail_assist_refusal) on-policy splits of whole replicas and
    replicated trainers also with tail assist."""
    out = [Placement("colocated")]
    if world_size > 1:
        out.append(Placement("colocated", sharding="fsdp"))
    if machine is not None and max(machine.chunk_s) > SPEED_SPREAD * min(machine.chunk_s):
        out.append(Placement("colocated", fragment_split="speed"))
    for generators in range(1, world_size):
        trainers = world_size - generators
        stages = [s for s in (1, 2, 4) if generators % s == 0 and s <= blocks]
        for s in stages:
            for sharding in ("replicate", "fsdp") if trainers > 1 else ("replicate",):
                for tag in (False, True):
                    for tcss in (False, True) if allow_stale else (False,):
                        out.append(Placement("disagg", generators, trainers, s, sharding, tag, tcss))
                        if tail_assist and s == 1 and sharding == "replicate" and not tcss:
                            out.append(Placement("disagg", generators, trainers, s, sharding, tag, tcss,
                                                 tail_assist=True))
    return out


def rank(placements: list[Placement], workload: Workload, machine: Machine) -> list[Prediction]:
    """Each placement predicted, fastest first (ties: the earlier candidate, colocated first). A
    colocated split by speed that gives every rank the fragments the even split gives is the same
    run: it is left out."""
    preds = [predict(p, workload, machine) for p in placements]
    even = {(x.placement.sharding, x.shares) for x in preds
            if x.placement.mode == "colocated" and x.placement.fragment_split == "auto"}
    preds = [x for x in preds if x.placement.fragment_split != "speed" or (x.placement.sharding, x.shares) not in even]
    return sorted(preds, key=lambda x: x.step_s)


# ----- one placement's step -------------------------------------------------------------------------
def _gathers_s(workload: Workload, machine: Machine, group: int) -> float:
    """Seconds FSDP2 over `group` ranks adds to one forward: as the probe measured it over every
    rank (taken for any group), else its all-gathers of every weight, one per unit, over the link."""
    if group <= 1:
        return 0.0
    if machine.gather_s is not None:
        return machine.gather_s
    return workload.weight_bytes * (group - 1) / group / machine.link_bytes_s + workload.units * machine.latency_s


def _train_gathers_s(workload: Workload, machine: Machine, group: int) -> float:
    """The same for one training forward and backward (the backward gathers again and
    reduce-scatters: three forwards' gathers where the probe did not measure it)."""
    if group <= 1:
        return 0.0
    if machine.train_gather_s is not None:
        return machine.train_gather_s
    return 3 * _gathers_s(workload, machine, group)


def _allreduce_s(nbytes: float, machine: Machine, group: int) -> float:
    if group <= 1:
        return 0.0
    return 2 * nbytes * (group - 1) / group / machine.link_bytes_s + machine.latency_s


def _plan(p: Placement, w: Workload, replicas: int, trainers: int, speeds: list[float] | None):
    return plan_step(0, seed=w.seed, num_prompts=w.num_prompts, prompts_per_step=w.prompts_per_step,
                     group_size=w.group_size, micro_batch=w.micro_batch, num_replicas=replicas,
                     num_trainers=trainers, fragment_groups=w.fragment_groups, colocated=p.mode == "colocated",
                     replica_speeds=speeds)


def _train_s(w: Workload, m: Machine, samples: int, trainer_ranks: list[int], fsdp: bool,
             by_speed: bool = False) -> float:
    """Wall seconds of one fragment's training on its trainers (TSP): each an equal share, at the
    slowest trainer's speed, or with `by_speed` (replicated TSP trainers whose fragments are split
    by speed) shares in proportion to the trainers' rounded speeds, as the runtime packs them
    (`trainer_speeds`); FSDP2 trainers gather the weights three times per forward."""
    transitions = samples * w.trained_per_sample
    t = len(trainer_ranks)
    # every trainer runs the forwards of the largest share (parallel/tsp.py pack), each at a fixed cost
    forwards = math.ceil(math.ceil(transitions / t - 1e-9) / w.train_micro_batch)
    fixed = forwards * max(m.forward_s[r] for r in trainer_ranks) if m.forward_s else 0.0
    speeds = trainer_speeds({r: m.row_s[r] for r in trainer_ranks}) if by_speed and w.tsp and not fsdp else None
    if speeds is None:
        share = transitions / t * max(m.row_s[r] for r in trainer_ranks)
    else:
        share = max(transitions * v / sum(speeds) * m.row_s[r] for v, r in zip(speeds, sorted(trainer_ranks)))
    if fsdp:
        share += forwards * _train_gathers_s(w, m, t)
    return share + fixed


def _trainers_part(m: Machine, trainer_ranks: list[int], generator_ranks: list[int]) -> float:
    """Tail assist: the trainers' part of the last fragment's transitions, as the runtime packs it
    (parallel/tsp.py `pack`: the trainers' weights `trainer_speeds`, the helper's `helper_weight`)."""
    weights = trainer_speeds({r: m.row_s[r] for r in trainer_ranks}) or (1.0,) * len(trainer_ranks)
    helper = helper_weight([m.chunk_s[r] for r in generator_ranks], [m.chunk_s[r] for r in trainer_ranks], weights)
    helper = sum(weights) / len(weights) if helper is None else helper
    return sum(weights) / (sum(weights) + helper)


def predict(p: Placement, w: Workload, m: Machine) -> Prediction:
    """The steady step time of placement `p` (the simulator on the probe's costs)."""
    return _colocated(p, w, m) if p.mode == "colocated" else _disagg(p, w, m)


def _colocated(p: Placement, w: Workload, m: Machine) -> Prediction:
    n = m.world_size
    ranks = list(range(n))
    fsdp = p.sharding == "fsdp" and n > 1
    speeds = [1 / s for s in m.chunk_s] if p.fragment_split == "speed" and not fsdp else None
    plan = _plan(p, w, n, n, speeds)
    chunks = [len(f.chunks) for f in plan.fragments]
    samples = [len(f.sample_ids) for f in plan.fragments]
    per_chunk = list(m.chunk_s)
    if fsdp:  # every rank in lockstep at the slowest, gathering the weights at every forward
        per_chunk = [max(m.chunk_s) + w.sample_steps * _gathers_s(w, m, n)] * n
    costs = Costs([c * chunks[0] for c in per_chunk], max(per_chunk) * chunks[0],
                  _train_s(w, m, samples[0], ranks, fsdp, by_speed=speeds is not None),
                  update_s=0.0 if fsdp else _allreduce_s(w.grad_bytes, m, n),
                  chunks_per_fragment=None if w.tsp else chunks[0],
                  gen_scale=[c / chunks[0] for c in chunks], train_scale=[s / samples[0] for s in samples])
    result = simulate_run("colocated", 1, len(plan.fragments), costs, n, owners=[f.replica for f in plan.fragments])
    exchange = 0.0
    if w.tsp and n > 1:  # colocated TSP: every rank's trajectories move to their trainers' shares first
        exchange = sum(samples) * w.sample_bytes * (n - 1) / n / m.link_bytes_s + m.latency_s
    shares = tuple(sum(len(f.sample_ids) for f in plan.fragments if f.replica == r) for r in ranks)
    return Prediction(p, result.makespan_s + exchange, shares=shares)


def _replica_s(p: Placement, w: Workload, m: Machine, ranks: list[int], num_chunks: int) -> float:
    """Seconds for one replica (its `ranks`, the stages of a GAP pipeline) to generate a fragment of
    `num_chunks` chunks: one stage's share of a denoising step per slot, the GAP schedule's slots
    (parallel/schedule.py), a hop between stages per slot."""
    slowest = max(m.chunk_s[r] for r in ranks)
    s = len(ranks)
    if s == 1:
        return slowest * num_chunks
    wave = fragments_in_flight(s, num_chunks)
    slot = slowest / (s * w.sample_steps) + m.latency_s
    return makespan_slots(s, num_chunks * wave, w.sample_steps) * slot / wave


def _disagg(p: Placement, w: Workload, m: Machine) -> Prediction:
    g, t, s = p.generators, p.trainers, p.gap_stages
    replicas = [list(range(r * s, (r + 1) * s)) for r in range(g // s)]
    trainer_ranks = list(range(g, g + t))
    fsdp = p.sharding == "fsdp" and t > 1
    one_chunk = [_replica_s(p, w, m, ranks, 1) for ranks in replicas]
    plan = _plan(p, w, len(replicas), t, [1 / x for x in one_chunk])  # --fragment-split auto: by speed
    chunks = [len(f.chunks) for f in plan.fragments]
    samples = [len(f.sample_ids) for f in plan.fragments]
    trainer_gen = max(m.chunk_s[r] for r in trainer_ranks) * chunks[0]
    if fsdp:  # a trainer group generates together, gathering the weights at every forward
        trainer_gen += chunks[0] * w.sample_steps * _gathers_s(w, m, t)
    transfer = samples[0] * w.sample_bytes / m.link_bytes_s + m.latency_s
    train_scale = [x / samples[0] for x in samples]
    update_s = 0.0 if fsdp else _allreduce_s(w.grad_bytes, m, t)
    if p.tail_assist:  # the last fragment shared with its generator; its gradient sent to the first trainer
        train_scale[-1] *= _trainers_part(m, trainer_ranks, list(range(g)))
        update_s += w.grad_bytes / m.link_bytes_s + m.latency_s
    costs = Costs([_replica_s(p, w, m, ranks, chunks[0]) for ranks in replicas], trainer_gen,
                  _train_s(w, m, samples[0], trainer_ranks, fsdp, by_speed=True), transfer_s=transfer,
                  update_s=update_s,
                  publish_s=g * (w.version_bytes / m.link_bytes_s + m.latency_s),  # one generator rank at a time
                  chunks_per_fragment=None if w.tsp else chunks[0],
                  gen_scale=[c / chunks[0] for c in chunks], train_scale=train_scale,
                  transfer_scale=[x / samples[0] for x in samples])
    mode = "tcss" if p.tcss else "tag" if p.tag else "gap" if len(plan.fragments) > len(replicas) else "disagg"
    owners = None if p.tag else [f.replica for f in plan.fragments]
    if mode == "disagg":
        owners = None  # naive: the simulator merges each replica's fragments itself
    result = simulate_run(mode, STEADY_STEPS + (2 if p.tcss else 0), len(plan.fragments), costs, t,
                          "bts" if p.tag else None, stages_per_replica=s, owners=owners,
                          plan_speeds=None if owners is not None else [1 / x for x in one_chunk],
                          wave=fragments_in_flight(s, chunks[0]))
    per_step = result.fragments_by_trainers / len(result.step_end_s)
    return Prediction(p, result.steady_step_s, round(per_step))



__all__ = ["Machine", "Placement", "Prediction", "Workload", "candidates", "predict", "rank"]
