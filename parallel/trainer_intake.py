"""The trainer's intake (docs/DESIGN.md, GAP streaming and TSP): what a scored fragment becomes
on the wire, where it goes, and how a trainer rank takes in the fragments of a step.

Whether TSP is on is decided once, by the choice of intake (`make_intake`):
- `ChunkIntake` (no TSP): a fragment travels as whole chunks (`TrainChunk`), each to the trainer the
  plan assigns; a trainer runs one forward per trained timestep of a chunk.
- `TransitionIntake` (TSP): every trainer gets its packed share of every fragment
  (`TransitionBatch`, packed by parallel/tsp.py), micro-batches that mix samples and timesteps.
Both give the generator side its routing (`route`), the trainer side its work in plan order
(`needs`, then `take` each as it lands), and the facts that depend on the packing: each trainer's
forwards, for FSDP padding and TAG windows.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rl import algorithms
from parallel import p2p, tsp
from parallel.stepplan import StepPlan
from rl.conditioning import Conditioning
from rl.updates import UpdateSplit

STEPS = "step."
"""payload key prefix of the per-step fields a record carries (an algorithm's `SamplingConfig.record`)"""

CPU = torch.device("cpu")

@dataclass
class TrainChunk:
    """What a trainer needs for one chunk of samples (docs/DESIGN.md, "trajectory")."""

    step: int
    fragment: int
    chunk: int
    version: int
    sample_ids: Tensor   # (n,) int64
    latents: Tensor      # (n, K+1, *latent_shape) float32; a clean record: (n, 1, *latent_shape)
    log_probs: Tensor    # (n, K) float32, under the generating policy (pi_old); a clean record: (n, 0)
    advantages: Tensor   # (n,) float32
    keep: Tensor         # (n,) bool: False for dropped zero-std groups
    sigmas: Tensor       # (K+1,) float32
    cond: Conditioning
    neg_cond: Conditioning | None
    steps: dict[str, Tensor] = field(default_factory=dict)  # per-step fields the rollout recorded: (n, K, ...)

    @property
    def clean(self) -> bool:
        """A record of clean samples only (an algorithm that trains the forward process), no path,
        no log-probs."""
        return self.log_probs.shape[1] == 0

    def at(self, rows, t: int) -> tuple[Tensor, Tensor, Tensor]:
        """(x_t, x_next, logp_old) of `rows` (an index or an index tensor) at step t. A clean record
        gives its clean sample as x_t, an empty x_next and logp 0: its trainer noises x_t itself."""
        if not self.clean:
            return self.latents[rows, t], self.latents[rows, t + 1], self.log_probs[rows, t]
        x0 = self.latents[rows, 0]
        lead = x0.shape[:x0.dim() - (self.latents.dim() - 2)]
        return x0, x0.new_empty((*lead, 0)), x0.new_zeros(lead)

    def steps_at(self, rows, t: int) -> dict[str, Tensor]:
        """The per-step fields of `rows` at step t."""
        return {name: v[rows, t] for name, v in self.steps.items()}

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        tensors = {"sample_ids": self.sample_ids, "latents": self.latents, "log_probs": self.log_probs,
                   "advantages": self.advantages, "keep": self.keep, "sigmas": self.sigmas, **self.cond.state_dict(),
                   **{STEPS + k: v for k, v in self.steps.items()}}
        if self.neg_cond is not None:
            tensors.update({"neg." + k: v for k, v in self.neg_cond.state_dict().items()})
        meta = {"kind": "chunk", "step": self.step, "fragment": self.fragment, "chunk": self.chunk,
                "version": self.version}
        return {k: v.contiguous() for k, v in tensors.items()}, meta

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "TrainChunk":
        neg = {k[len("neg."):]: v for k, v in tensors.items() if k.startswith("neg.")}
        return cls(meta["step"], meta["fragment"], meta["chunk"], meta["version"], tensors["sample_ids"],
                   tensors["latents"], tensors["log_probs"], tensors["advantages"], tensors["keep"],
                   tensors["sigmas"], Conditioning.from_state_dict(tensors),
                   Conditioning.from_state_dict(neg) if neg else None, _steps(tensors))


@dataclass
class TransitionBatch:
    """TSP: one trainer's share of one fragment, its packed micro-batches transition by transition
    (docs/DESIGN.md, TSP). Conditioning is carried once per sample involved; `cond_index` maps each
    transition to its sample's row."""

    step: int
    fragment: int
    version: int
    micro_batches: tuple[int, ...]  # step-wide micro-batch indices (parallel.tsp.MicroBatch.index)
    sizes: tuple[int, ...]          # transitions per micro-batch; rows are consecutive
    sample_ids: Tensor   # (n,) int64
    timesteps: Tensor    # (n,) int64: t of each transition
    x_t: Tensor          # (n, *latent_shape) float32 (clean records: the clean sample)
    x_next: Tensor       # (n, *latent_shape) float32 (clean records: (n, 0))
    sigma: Tensor        # (n,) float32
    sigma_next: Tensor   # (n,) float32
    log_probs: Tensor    # (n,) float32 under the generating policy (pi_old)
    advantages: Tensor   # (n,) float32
    keep: Tensor         # (n,) bool
    cond_index: Tensor   # (n,) int64 rows of cond / neg_cond
    cond: Conditioning   # (u rows): the samples involved
    neg_cond: Conditioning | None
    steps: dict[str, Tensor] = field(default_factory=dict)  # per-step fields at each transition's t: (n, ...)

    _ROWS = ("sample_ids", "timesteps", "x_t", "x_next", "sigma", "sigma_next", "log_probs", "advantages", "keep",
             "cond_index")

    @classmethod
    def gather(cls, chunks: list[TrainChunk], micro_batches: tuple[tsp.MicroBatch, ...]) -> "TransitionBatch":
        """Pick the transitions of `micro_batches` (all of one fragment and one trainer) from the
        fragment's chunks."""
        where = {int(i): (c, j) for c in chunks for j, i in enumerate(c.sample_ids.tolist())}
        rows, samples = [], {}  # samples: sample id -> (chunk, row in chunk, row in cond)
        for mb in micro_batches:
            for i, t in mb.transitions:
                c, j, u = samples.setdefault(i, (*where[i], len(samples)))
                rows.append((c, j, t, u))
        conds = [c.cond.select([j]) for c, j, _ in samples.values()]
        negs = [c.neg_cond.select([j]) for c, j, _ in samples.values() if c.neg_cond is not None]
        first = chunks[0]
        x_t, x_next, logp = zip(*(c.at(j, t) for c, j, t, _ in rows))
        return cls(first.step, first.fragment, first.version, tuple(m.index for m in micro_batches),
                   tuple(len(m.transitions) for m in micro_batches),
                   sample_ids=torch.tensor([int(c.sample_ids[j]) for c, j, _, _ in rows], dtype=torch.int64),
                   timesteps=torch.tensor([t for _, _, t, _ in rows], dtype=torch.int64),
                   x_t=torch.stack(x_t), x_next=torch.stack(x_next),
                   sigma=torch.stack([c.sigmas[t] for c, _, t, _ in rows]),
                   sigma_next=torch.stack([c.sigmas[t + 1] for c, _, t, _ in rows]),
                   log_probs=torch.stack(logp),
                   advantages=torch.stack([c.advantages[j] for c, j, _, _ in rows]),
                   keep=torch.stack([c.keep[j] for c, j, _, _ in rows]),
                   cond_index=torch.tensor([u for _, _, _, u in rows], dtype=torch.int64),
                   cond=Conditioning.cat(conds), neg_cond=Conditioning.cat(negs) if negs else None,
                   steps={k: torch.stack([c.steps[k][j, t] for c, j, t, _ in rows]) for k in first.steps})

    def bounds(self) -> list[tuple[int, int]]:
        """[lo, hi) rows of each micro-batch."""
        out, lo = [], 0
        for n in self.sizes:
            out.append((lo, lo + n))
            lo += n
        return out

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        tensors = {k: getattr(self, k) for k in self._ROWS}
        tensors.update(self.cond.state_dict())
        tensors.update({STEPS + k: v for k, v in self.steps.items()})
        if self.neg_cond is not None:
            tensors.update({"neg." + k: v for k, v in self.neg_cond.state_dict().items()})
        meta = {"kind": "transitions", "step": self.step, "fragment": self.fragment, "version": self.version,
                "micro_batches": list(self.micro_batches), "sizes": list(self.sizes)}
        return {k: v.contiguous() for k, v in tensors.items()}, meta

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "TransitionBatch":
        if meta.get("kind") != "transitions":
            raise p2p.ProtocolError(f"expected a transitions payload, got {meta}")
        neg = {k[len("neg."):]: v for k, v in tensors.items() if k.startswith("neg.")}
        return cls(meta["step"], meta["fragment"], meta["version"], tuple(meta["micro_batches"]),
                   tuple(meta["sizes"]), **{k: tensors[k] for k in cls._ROWS},
                   cond=Conditioning.from_state_dict(tensors),
                   neg_cond=Conditioning.from_state_dict(neg) if neg else None, steps=_steps(tensors))


def _steps(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k[len(STEPS):]: v for k, v in tensors.items() if k.startswith(STEPS)}


@dataclass(frozen=True)
class TrainingSpec:
    """What decides which transitions a step trains and when: the algorithm (its `timesteps`, an
    rl.algorithms.Algorithm), the step's SDE window (fixed, or one that moves with the step) and
    which of the step's optimizer updates trains each sample (rl.updates)."""

    algorithm: object
    num_steps: int
    timestep_fraction: float
    seed: int
    sde_window: tuple[int, int] | None
    window_schedule: object | None = None  # sampler.SamplingConfig.window_schedule
    updates: UpdateSplit = UpdateSplit()

    @classmethod
    def of(cls, cfg, sampling) -> "TrainingSpec":
        """From a config.RunConfig and the run's sampler.SamplingConfig."""
        return cls(algorithms.algorithm(cfg.rl.algorithm), sampling.num_steps, cfg.rl.timestep_fraction, cfg.seed,
                   sampling.sde_window, sampling.window_schedule, UpdateSplit.of(cfg))

    @property
    def num_updates(self) -> int:
        return self.updates.num_updates

    def part_of(self, step: int, sample_id: int) -> int:
        """The optimizer update (0 .. N-1) of the step that trains sample `sample_id`."""
        return self.updates.part_of(step, sample_id) if self.updates.num_updates > 1 else 0

    def window_at(self, step: int, sample_id: int | None = None) -> tuple[int, int] | None:
        """The SDE window of a step (and sample: Flow-GRPO-Fast's is drawn per group)."""
        if self.window_schedule is None:
            return self.sde_window
        return self.window_schedule.window(step, sample_id)

    def timesteps(self, step: int, sample_id: int) -> tuple[int, ...]:
        return self.algorithm.timesteps(self.num_steps, self.timestep_fraction, seed=self.seed, step=step,
                                        sample_id=sample_id, window=self.window_at(step, sample_id))

    def forward_timesteps(self, step: int, sample_ids: tuple[int, ...]) -> list[int]:
        """The timesteps at which a chunk needs a forward pass without TSP (all its samples that
        train a timestep train it together): a pure function of the plan, so FSDP ranks can match
        forward counts."""
        ts = set()
        for i in sample_ids:
            ts.update(self.timesteps(step, i))
        return sorted(ts)


@dataclass(frozen=True)
class Need:
    """A piece of a trainer's work: `key` in the inbox, part of `fragment`; `forwards[p]` the
    forwards it takes in the step's update p (rl.updates: the updates that train its samples)."""

    fragment: int
    key: object
    forwards: tuple[int, ...] = (1,)


class _Intake:
    """What both intakes share: the inbox, the source of a fragment, the receive."""

    def __init__(self, spec: TrainingSpec, trainer_ranks: tuple[int, ...], replica_last_rank: Callable[[int], int],
                 me: int | None = None, tracer=None, comms=None):
        """`me`: this rank's index among the trainers (None on a rank that only routes). `comms`: the
        run's parallel.topology.ProcessGroups, whose `data` say the communicator data to each
        trainer travels on (None: the default group)."""
        self.spec, self.trainer_ranks, self.me, self.tracer, self.comms = spec, trainer_ranks, me, tracer, comms
        self.replica_last_rank = replica_last_rank  # replica -> its last stage's rank, which emits
        self.num_trainers = len(trainer_ranks)
        self.inbox: dict = {}
        self.speeds: tuple[float, ...] | None = None  # TSP: the trainers' relative speeds (None: equal shares)
        self.helper_weight: float | None = None  # tail assist: the helper's, in their unit (None: their mean)

    def group_to(self, dst: int):
        """The communicator training data to trainer rank `dst` travels on, from any sender."""
        return self.comms.data.get(dst) if self.comms is not None else None

    def route_keeping(self, plan: StepPlan, chunks: list[TrainChunk]):
        """(`route`'s payloads, the share its generating rank keeps: only TransitionIntake's tail assist)."""
        return self.route(plan, chunks), None

    def static_source(self, plan: StepPlan, fragment: int) -> int:
        """Without TAG a fragment comes from the last stage of the replica the plan assigns."""
        return self.replica_last_rank(plan.fragments[fragment].replica)

    def take(self, plan: StepPlan, need: Need, src: int | None):
        """The piece `need`: from the inbox (colocated, or generated here by TAG) or received from
        rank `src`, the rank that generated its fragment."""
        if need.key in self.inbox:
            return self.inbox.pop(need.key)
        with _span(self.tracer, "recv", "comm", plan.step, need.fragment):
            mine = self.group_to(self.trainer_ranks[self.me])
            item = self.record.from_payload(*p2p.recv_payload(src, mine, device=CPU))  # rank wait: the generator
        self.check(plan, need, item)
        return item

    def fragment_transitions(self, plan: StepPlan, fragment: int) -> int:
        """The transitions a fragment trains this step, over all trainers (BTS's cost per fragment
        is per transition times this: a sliding window changes it from step to step)."""
        return sum(len(self.spec.timesteps(plan.step, i)) for i in plan.fragments[fragment].sample_ids)

    def accept(self, tensors: dict[str, Tensor], meta: dict) -> None:
        """This trainer's own share of a fragment generated on this rank (TAG)."""
        item = self.record.from_payload(tensors, meta)
        self.inbox[self.key_of(item)] = item

    def needs(self, plan: StepPlan, trainer: int | None = None) -> list[Need]:
        """A trainer's work in plan order (default: this rank's), each piece with its forwards per update."""
        return self.needs_of(plan, self.me if trainer is None else trainer)

    def passes(self, plan: StepPlan, trainer: int | None = None, padded: bool = False) -> list[tuple[int, list[int]]]:
        """The order of a trainer's work over the step's updates: per update p, (how many of its
        needs it has taken once p's pieces are all in, the needs p trains). A piece is received
        in plan order, so a sender's sends are taken in the order it posted them, and by the
        update that first trains it; update p takes every piece up to the last that p trains.
        `padded` (FSDP, whose trainers pad every update): the first piece comes in with the first
        update, the template of its padding forwards."""
        needs, out, taken = self.needs(plan, trainer), [], 0
        for p in range(self.spec.num_updates):
            mine = [i for i, n in enumerate(needs) if n.forwards[p]]
            taken = max(taken, mine[-1] + 1 if mine else 0, 1 if padded and needs else 0)
            out.append((taken, mine))
        return out

    def forwards_by_update(self, plan: StepPlan) -> list[list[list[int]]]:
        """Per trainer, per update of the step, the fragment of each of its forward passes in the
        order it runs them (every timestep counts, even one with no kept transition)."""
        out = []
        for r in range(self.num_trainers):
            needs = self.needs(plan, r)
            out.append([[n.fragment for n in needs for _ in range(n.forwards[p])]
                        for p in range(self.spec.num_updates)])
        return out

    def forward_fragments(self, plan: StepPlan) -> list[list[int]]:
        """Per trainer, the fragment of each of its forward passes this step, update by update."""
        return [[f for update in per for f in update] for per in self.forwards_by_update(plan)]

    def receive_slots(self, plan: StepPlan) -> list[list[tuple[int, int]]]:
        """Per trainer of an FSDP group, (slot, fragment) where it first takes a piece of each
        fragment: slot i is the group's i-th planned forward (every trainer pads each update to
        the group's most forwards, parallel.forward_rows), the piece taken just before it."""
        per_update = [max(len(u[p]) for u in self.forwards_by_update(plan)) for p in range(self.spec.num_updates)]
        out = []
        for r in range(self.num_trainers):
            needs, slots, slot, taken = self.needs(plan, r), [], 0, 0
            for p, (upto, mine) in enumerate(self.passes(plan, r, padded=True)):
                start = slot
                for i in range(upto):
                    if i >= taken:
                        slots.append((slot, needs[i].fragment))
                    if i in mine:
                        slot += needs[i].forwards[p]
                taken, slot = upto, start + per_update[p]
            out.append(slots)
        return out


class ChunkIntake(_Intake):
    """No TSP: whole chunks, one forward per trained timestep of a chunk."""

    record = TrainChunk

    def key_of(self, item: TrainChunk):
        return item.chunk

    def route(self, plan: StepPlan, chunks: list[TrainChunk]) -> list[tuple[int, dict[str, Tensor], dict]]:
        """(trainer rank, tensors, meta) payloads of a scored fragment: each chunk to its planned trainer."""
        return [(self.trainer_ranks[plan.chunks[c.chunk].trainer], *c.to_payload()) for c in chunks]

    def needs_of(self, plan: StepPlan, trainer: int) -> list[Need]:
        """Trainer `trainer`'s chunks in plan order: per update, one forward per timestep its
        samples of that update train."""
        out = []
        for c in plan.chunks:
            if c.trainer == trainer:
                parts = [self.spec.part_of(plan.step, i) for i in c.sample_ids]
                out.append(Need(c.fragment, c.index, tuple(
                    len(self.spec.forward_timesteps(plan.step, tuple(i for i, q in zip(c.sample_ids, parts) if q == p)))
                    for p in range(self.spec.num_updates))))
        return out

    def check(self, plan: StepPlan, need: Need, item: TrainChunk) -> None:
        if (item.step, item.chunk) != (plan.step, need.key):
            raise p2p.ProtocolError(f"received chunk {item.chunk} of step {item.step}, expected chunk {need.key} of "
                                    f"step {plan.step}")

    def span_args(self, item: TrainChunk) -> dict:
        return {"chunk": item.chunk}

    def chunks_per_fragment(self, plan: StepPlan) -> int | None:
        return len(plan.fragments[0].chunks)

    def fragment_seconds(self, plan: StepPlan, fragment: int, seconds: float) -> float:
        """This trainer's seconds on its chunks of a fragment -> the trainer group's wall time per
        fragment (the unit of parallel.event_engine.Costs.train_fragment_s): chunks go round-robin."""
        chunks = plan.fragments[fragment].chunks
        return seconds / sum(c.trainer == self.me for c in chunks) * len(chunks) / self.num_trainers

    def exchange(self, plan: StepPlan, rank: int) -> None:
        """Colocated: every rank trains the chunks it generated; nothing moves."""


class TransitionIntake(_Intake):
    """TSP: every trainer's packed share of every fragment (docs/DESIGN.md, TSP)."""

    record = TransitionBatch

    def __init__(self, spec: TrainingSpec, trainer_ranks, replica_last_rank, micro_batch: int, me=None, tracer=None,
                 comms=None, tail_assist: bool = False):
        """`tail_assist`: the rank that generates the step's last fragment trains a share of it too
        (docs/DESIGN.md 5.9)."""
        super().__init__(spec, trainer_ranks, replica_last_rank, me, tracer, comms)
        self.micro_batch, self.tail_assist = micro_batch, tail_assist

    def helped(self, plan: StepPlan) -> int | None:
        """The fragment whose generating rank trains a share of it (tail assist: the last), or None."""
        return len(plan.fragments) - 1 if self.tail_assist else None

    def packing(self, plan: StepPlan) -> tsp.Packing:
        """The step's packing: a pure function of (seed, step, config), computed alike by the
        generator that routes a fragment and by every trainer that receives a share of it."""
        return _packing(tuple(f.sample_ids for f in plan.fragments), plan.step, self.spec, self.micro_batch,
                        self.num_trainers, self.speeds, self.helped(plan), self.helper_weight)

    def key_of(self, item: TransitionBatch):
        return ("tsp", item.fragment)

    def fragment_transitions(self, plan: StepPlan, fragment: int) -> int:
        """The transitions the trainers train of a fragment this step (tail assist: without the
        helper's share of the last)."""
        total = super().fragment_transitions(plan, fragment)
        if fragment != self.helped(plan):
            return total
        return total - self.packing(plan).num_transitions()[-1]

    def batches(self, plan: StepPlan, chunks: list[TrainChunk]) -> list[tuple[int, TransitionBatch]]:
        """A scored fragment's chunks -> (trainer index, its TransitionBatch) for every trainer
        that trains part of the fragment."""
        packing, fragment = self.packing(plan), chunks[0].fragment
        return [(r, TransitionBatch.gather(chunks, packing.of(fragment, r))) for r in packing.trainers_of(fragment)]

    def route(self, plan: StepPlan, chunks: list[TrainChunk]) -> list[tuple[int, dict[str, Tensor], dict]]:
        """Every trainer that trains part of the fragment gets exactly its transitions."""
        return self.route_keeping(plan, chunks)[0]

    def route_keeping(self, plan: StepPlan, chunks: list[TrainChunk]):
        """`route`'s payloads and the share the fragment's generating rank trains (tail assist), one packing."""
        batches = self.batches(plan, chunks)
        return ([(self.trainer_ranks[r], *b.to_payload()) for r, b in batches if r < self.num_trainers],
                next((b for r, b in batches if r == self.num_trainers), None))

    def needs_of(self, plan: StepPlan, trainer: int) -> list[Need]:
        """Trainer `trainer`'s share of every fragment it has a share of, in plan order: per update,
        one forward per packed micro-batch of that update."""
        packing, out = self.packing(plan), []
        for f in plan.fragments:
            if trainer in packing.trainers_of(f.index):
                parts = [m.part for m in packing.of(f.index, trainer)]
                out.append(Need(f.index, ("tsp", f.index), tuple(parts.count(p) for p in range(self.spec.num_updates))))
        return out

    def check(self, plan: StepPlan, need: Need, item: TransitionBatch) -> None:
        if (item.step, item.fragment) != (plan.step, need.fragment):
            raise p2p.ProtocolError(f"received fragment {item.fragment} of step {item.step}, expected fragment "
                                    f"{need.fragment} of step {plan.step}")
        want = tuple(m.index for m in self.packing(plan).of(need.fragment, self.me))
        if item.micro_batches != want:
            raise p2p.ProtocolError(f"received micro-batches {item.micro_batches}, the packing gives {want}")

    def span_args(self, item: TransitionBatch) -> dict:
        return {"micro_batches": len(item.sizes), "transitions": len(item.keep)}

    def chunks_per_fragment(self, plan: StepPlan) -> int | None:
        return None  # every trainer trains every fragment

    def fragment_seconds(self, plan: StepPlan, fragment: int, seconds: float) -> float:
        return seconds  # every trainer trains its share of the fragment at once

    def exchange(self, plan: StepPlan, rank: int) -> None:
        """Colocated: the rank that generated each fragment routes it like a generator would, into
        the inboxes. Every rank walks the fragments in the same order, so each blocking send meets
        its receive (no cycle of waiting ranks); generation has finished on every rank."""
        me = self.me
        for f in plan.fragments:
            owner = self.static_source(plan, f.index)
            if owner == rank:
                chunks = [self.inbox.pop(c.index) for c in f.chunks]
                for r, batch in self.batches(plan, chunks):
                    if r == me:
                        self.inbox[self.key_of(batch)] = batch
                        continue
                    with _span(self.tracer, "send", "comm", plan.step, f.index):
                        dst = self.trainer_ranks[r]
                        p2p.send_payload(*batch.to_payload(), dst=dst, group=self.group_to(dst))  # rank wait: dst
            elif me in self.packing(plan).trainers_of(f.index):
                with _span(self.tracer, "recv", "comm", plan.step, f.index):
                    batch = TransitionBatch.from_payload(*p2p.recv_payload(owner, self.group_to(rank),
                                                                           device=CPU))  # rank wait
                self.inbox[self.key_of(batch)] = batch


@functools.lru_cache(maxsize=8)
def _packing(fragment_ids, step, spec: TrainingSpec, micro_batch, num_trainers, speeds=None, helped=None,
             helper_weight=None):
    timesteps = {i: spec.timesteps(step, i) for ids in fragment_ids for i in ids}
    parts = {i: spec.part_of(step, i) for ids in fragment_ids for i in ids}
    return tsp.pack_step(fragment_ids, timesteps, micro_batch=micro_batch, num_trainers=num_trainers, parts=parts,
                         weights=speeds, helped=helped, helper_weight=helper_weight)


def _span(tracer, name: str, category: str, step: int, fragment: int):
    return tracer.span(name, category, step, fragment) if tracer is not None else contextlib.nullcontext()


def make_intake(tsp_on: bool, spec: TrainingSpec, trainer_ranks: tuple[int, ...],
                replica_last_rank: Callable[[int], int], micro_batch: int, me: int | None = None,
                tracer=None, comms=None, tail_assist: bool = False) -> _Intake:
    """The one place that decides between the two intakes (tail assist needs TSP's)."""
    if tsp_on:
        return TransitionIntake(spec, trainer_ranks, replica_last_rank, micro_batch, me, tracer, comms, tail_assist)
    return ChunkIntake(spec, trainer_ranks, replica_last_rank, me, tracer, comms)
