"""Each role's GPU memory at a released model's size, measured on the roles' own code under
FakeTensorMode with torch's trackers (lab/memory/fake_run.py): what `python -m scripts.check_recipe`
prints and docs/memory/*.json hold.

A rank is built as runtime/build.py builds it (`runtime.context.make_context`, its `load_model` giving the
released config's components as fake tensors in the dtypes build asks for), then its phases run in
the order of a run, each phase's peak taken by category:

- trainer: "micro-batch" (forward and backward of two packed micro-batches of the recipe's size,
  with its checkpointing) and "optimizer step" (`finish_step`), twice (the second with the
  optimizer's state: the steady state), "publication" (`make_version`, and on the first trainer
  the sends to every generator), "evaluation" (one batch of the held-out sampler, scored);
- generator: "publication" (receive the version the first trainer sent and install it), then
  "fragment" (`Generator.generate` of the step's first fragment: encode, K denoising steps per
  chunk, decode, score, cut into chunks);
- trainers and generators: "load" (its weights as runtime/context.py loads them, its rewards, and a trainer's
  Trainer: FSDP2 sharding the transformer a unit at a time, from host memory for a sharded
  trainer, and the KL reference, EMA and old policy copies) and "start-up probe"
  (`probe.probe_speed`, a trainer's after its model is sharded).

What stands in for what a measurement cannot run, and why:
- rewards: each reward model's network, built from its released config (rewards/configs/) in the
  reward's dtype, runs one batch of the reward's size on inputs of its processor's size (the
  processors and tokenizers work on the host, on images the fake run has no pixels of);
- the trainer's input: a `TransitionBatch` with the conditioning shapes a generator rank encodes;
- host memory: a sharded trainer's transformer waits on the meta device (never counted) until
  FSDP2 moves a unit of it to the device (`fake_run.moved_to_device`);
- the wire: the trainer's sends go to a fake process group; the generator receives the header the
  trainer's send carried (replayed), into the buffers its own code allocates.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.fsdp import FSDPModule

from models import autocast, released
from parallel import compress, fsdp, publish
from parallel.trainer_intake import TransitionBatch
from parallel.scoring import LocalScorer
from parallel.topology import ProcessGroups
from rl import sampler
from rollout import VersionSync
from runtime import build, context, evaluation, probe
from lab.memory import fake_run
from lab.memory.trackers import FSDPTracker, Ref, Replay, Tracker, patched
from lab.memory.fake_parts import FakeRewards, Sent, Store, conditioning, transition_batch
from trainer import Trainer

@dataclass
class RankMemory:
    """What one rank's phases peak at: {phase: {category: bytes, "total": bytes}}."""

    rank: int
    role: str
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0
    unknown_reads: int = 0
    """values read from tensors without data during the run (each read 1)"""
    phase_seconds: dict[str, float] = field(default_factory=dict)
    rises: dict[str, float] = field(default_factory=dict)
    """each repeated call's working set: its measured rise above where it ended (bytes), by name"""

    @classmethod
    def from_report(cls, row: dict) -> "RankMemory":
        """A role's measurement back from a report (runtime/memory.recipe_report), bytes from GiB."""
        gib = 1024 ** 3
        phases = {p: {**{k: v * gib for k, v in got["categories"].items()}, "total": got["measured_gib"] * gib}
                  for p, got in row["phases"].items() if got["measured_gib"] is not None}
        return cls(row["rank"], row["role"], phases, row["seconds"], row["unknown_reads"],
                   rises={k: v * gib for k, v in row.get("working_sets_gib", {}).items()})

    def add_rises(self, replay: Replay) -> None:
        for name, b in replay.rises.items():
            self.rises[name] = max(self.rises.get(name, 0.0), b)

    def add(self, phase: str, categories: dict[str, float]) -> None:
        if categories["total"] >= self.phases.get(phase, {}).get("total", -1.0):
            self.phases[phase] = dict(categories)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: self.phases[p]["total"])

    @property
    def peak(self) -> dict[str, float]:
        return self.phases[self.peak_phase]


# ----- host data -------------------------------------------------------------------------------
def tensors_of(obj) -> list[torch.Tensor]:
    """Every tensor inside dataclasses, dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_of(getattr(obj, f.name))]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


# ----- one rank --------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_rank(cfg, facts, release: str, rank: int, memory: RankMemory | None = None, trains: bool = False):
    """Rank `rank` of the run built as runtime/build.py builds it, on fake tensors of the released
    model `release` (models/configs/), its rewards FakeRewards: yields (the FakeRun, the RankContext,
    the Trainer where it `trains`, else None). With `memory`, its "load" phase: the context (weights,
    rewards) and the Trainer (the model sharded, the KL reference, EMA and old policy copies)."""
    def load(name, model_path=None, *, preset="tiny", seed=0, dtype=torch.float32, device="cpu", release=(),
             host=()):
        adapter = released.meta_adapter(release_name)
        if adapter.family != name:
            raise ValueError(f"released config {release_name!r} is a {adapter.family} model, not {name!r}")
        adapter.release_components(list(release))  # they stay on the meta device: never fake, never counted
        table = dtype if isinstance(dtype, dict) else {"default": dtype}
        for component, module in adapter.pipe.components.items():
            if isinstance(module, torch.nn.Module) and next(module.parameters(), None) is not None \
                    and component not in release:
                wanted = table.get(component, table.get("default", torch.float32))
                if component in host:  # in host memory: on the meta device until FSDP2 moves a unit
                    with unset_fake_temporarily():
                        module.to(dtype=wanted)
                else:
                    fake_run.fake_module(module, run.mode, wanted)
        return adapter

    def rewards(cfg, device):
        return FakeRewards(cfg.rl.reward, run.mode, context.reward_dtype(cfg, device))

    def built():
        ctx, _ = context.make_context(cfg, facts, rank, groups)
        return ctx, (build.make_trainer(ctx) if trains else None)

    release_name, topo = release, facts.topology
    with fake_run.fake_world(topo.world_size, rank), fake_run.FakeRun() as run, \
            patched(context, "load_model", load), patched(context, "_reward_set", rewards), \
            patched(probe, "_timed", _once), patched(fsdp, "fully_shard", fake_run.moved_to_device(fsdp.fully_shard,
                                                                                                  run.mode)):
        groups = ProcessGroups.create(topo, 60, 60, exchange=facts.tsp and not facts.disagg,
                                      own=build.mixed_replicas(cfg, facts))
        if memory is None:
            yield (run, *built())
            return
        tracker = Tracker()
        tracker.hold(run.mode)
        with tracker, tracker.booking(Ref.PARAM):  # what loading makes is weights (and copies of them)
            ctx, trainer = run_phase(tracker, memory, "load", built)
        yield run, ctx, trainer


def _once(fn, slowdown, device, repeats: int = 1) -> float:
    fn()
    return 0.0


def replaying(tracker, adapter, rewards: "FakeRewards | None" = None) -> Replay:
    """Repeated no-grad calls of the adapter (denoising steps, decodes, text encodings) and of the
    reward networks run once each (fake_run.Replay)."""
    replay = Replay(tracker)
    adapter.velocity = replay.wrap(adapter.velocity, name="velocity")
    for name in ("decode", "encode_prompts"):  # no graph: the adapters run them under no_grad
        setattr(adapter, name, replay.wrap(getattr(adapter, name), graph_free=True, name=name))
    if rewards is not None:
        rewards._score = replay.wrap(rewards._score, graph_free=True, name="reward")
    return replay


def run_phase(tracker, memory: RankMemory, phase: str, fn):
    started = time.perf_counter()
    with tracker.window() as peak:
        out = fn()
    memory.add(phase, peak)
    memory.phase_seconds[phase] = memory.phase_seconds.get(phase, 0.0) + time.perf_counter() - started
    return out


def start_up(ctx, tracker, memory: RankMemory, sent: Sent, training: bool) -> None:
    """The start-up speed probe (runtime/probe.py) as runtime/build.py runs it: on the probes'
    conditioning (`probe_conditioning` encodes it on rank 0 for every rank), a trainer after its
    model is sharded."""
    cond = conditioning(sent.cond, ctx.cfg.rl.micro_batch)
    run_phase(tracker, memory, "start-up probe", lambda: probe.probe_speed(
        ctx.adapter, ctx.sampling, ctx.cfg.rl.micro_batch, ctx.slowdown,
        lambda: autocast(ctx.device, ctx.cfg.model.dtype), training, cond))


def sent_by_generators(cfg, facts, release: str) -> Sent:
    """The shapes a generator rank encodes and samples (its text encoders on one chunk's prompts)."""
    g = facts.topology.generator_ranks[0]
    with fake_rank(cfg, facts, release, g) as (run, ctx, _):
        plan = facts.step_plan(cfg, 0)
        generator = build._generator(ctx, LocalScorer(None), Store(), None)
        cond, neg = generator.chunk_inputs(plan, plan.fragments[0].chunks[0])
        return Sent.of(cond, neg, ctx.adapter.latent_shape(ctx.sampling.height, ctx.sampling.width,
                                                           ctx.sampling.num_frames))


# ----- trainer ---------------------------------------------------------------------------------
def _tracker(ctx, trainer: Trainer | None):
    """FSDPMemTracker where the trainer's transformer runs as FSDP2 units (sharded, or mixed
    precision over the rank itself), MemTracker elsewhere."""
    if trainer is not None and any(isinstance(m, FSDPModule) for m in ctx.adapter.transformer.modules()):
        return FSDPTracker(ctx.adapter.transformer, trainer.optimizer)
    return Tracker()


def measure_trainer(cfg, facts, release: str, rank: int, sent: Sent) -> tuple[RankMemory, dict]:
    """A trainer rank's phases; returns it and the publication header each generator rank receives."""
    started, memory, headers = time.perf_counter(), RankMemory(rank, "trainer"), {}
    with fake_rank(cfg, facts, release, rank, memory, trains=True) as (run, ctx, trainer):
        _start_codec(cfg, facts, ctx, trainer)
        tracker = _tracker(ctx, trainer)
        tracker.hold(run.mode, [trainer.optimizer])
        with tracker:  # runtime/build.py probes a trainer after its model is sharded, before any update
            start_up(ctx, tracker, memory, sent, training=True)
        batch = _steady(trainer, ctx, sent)
        tracker = _tracker(ctx, trainer)
        tracker.hold(run.mode, [trainer.optimizer], host=tensors_of(batch))
        replay = replaying(tracker, ctx.adapter)
        with tracker:
            run_phase(tracker, memory, "micro-batch", lambda: trainer.train(batch))
            run_phase(tracker, memory, "optimizer step", lambda: _finish(trainer))
            if facts.disagg:
                run_phase(tracker, memory, "publication",
                          lambda: headers.update(_publish(cfg, facts, ctx, trainer, tracker)))
            if cfg.output.eval_every:
                run_phase(tracker, memory, "evaluation", lambda: _evaluate(cfg, ctx, run, tracker))
        memory.unknown_reads = run.unknown_reads
        memory.add_rises(replay)
    memory.seconds = time.perf_counter() - started
    return memory, headers


def _start_codec(cfg, facts, ctx, trainer: Trainer) -> None:
    """The trainer's lossy publication codec, as runtime/build.py starts it (before any update)."""
    if compress.lossy(cfg.topology.publish_compression):
        trainer.start_codec(cfg.topology.publish_compression, build._publish_names(ctx.adapter, facts.lora), None)


def _steady(trainer: Trainer, ctx, sent: Sent) -> TransitionBatch:
    """The trainer after one update from zero gradients (its optimizer state exists, as in every
    step after the first: a backward of its own would take as long as the measured one) and holding
    the gradients of the step's earlier micro-batches; and a packed micro-batch to train."""
    for p in trainer.params:
        p.grad = torch.zeros_like(p)
    trainer.num_transitions = 1
    _finish(trainer)
    for p in trainer.params:
        p.grad = torch.zeros_like(p)
    sigmas = sampler.sigmas_for(ctx.adapter, ctx.sampling)
    rows = ctx.facts.train_micro_batch if ctx.facts.tsp else ctx.cfg.rl.micro_batch
    return transition_batch(sent, ctx.sampling, sigmas, min(trainer.spec.timesteps(0, 0)), rows)


def _finish(trainer: Trainer) -> None:
    """finish_step, with the step's loss sums and non-finite count as host zeros: the fake run's
    losses hold no values, and the update is applied only when they are finite."""
    trainer.current_step = 0
    trainer.loss_sums = torch.tensor([0.0] * trainer.loss_sums.numel(), dtype=trainer.loss_sums.dtype)
    trainer.nonfinite_advantages = torch.tensor(0.0)
    trainer.finish_step()


def _publish(cfg, facts, ctx, trainer: Trainer, tracker) -> dict:
    """trainer_step's publication: make_version on every trainer; the first one sends to each
    generator rank (whose headers are kept: {generator rank: header}), the others follow its
    gathers."""
    topo = ctx.topo
    names = build._publish_names(ctx.adapter, facts.lora)
    by_dst = {g: names for g in topo.generator_ranks}
    headers, send = {}, publish.send_payload

    def keep_header(tensors, meta, dst, group=None):
        headers[dst] = meta
        send(tensors, meta, dst, group)

    publisher = publish.WeightPublisher(compression=cfg.topology.publish_compression, keep=facts.tcss,
                                        holds=ctx.rank == topo.trainer_ranks[0])
    with patched(publish, "send_payload", keep_header), \
            patched(publish, "checksum", Replay(tracker).wrap(publish.checksum, graph_free=True)):
        out = trainer.make_version(names)
        if ctx.rank == topo.trainer_ranks[0]:
            publisher.publish_all(out, by_dst, 1, group=ctx.comms.publish)
        else:
            publisher.follow_all(out, by_dst)
        publisher.keep_version(out, names, 1)
    return headers


def _evaluate(cfg, ctx, run, tracker) -> None:
    """One batch of the held-out evaluation as evaluate_on_trainers runs it: the reward models
    loaded for it, the ODE sampler under the run's autocast, decode, score."""
    records = ctx.facts.eval_records
    dtype = torch.float32 if cfg.rl.reward_dtype == "float32" else ctx.adapter.dtype
    with tracker.booking(Ref.PARAM):
        rewards = FakeRewards(cfg.rl.reward, run.mode, dtype)
    rewards._score = Replay(tracker).wrap(rewards._score, graph_free=True)
    with autocast(ctx.adapter.device, cfg.model.dtype):
        evaluation.evaluate(ctx.adapter, ctx.sampling, records[:cfg.rl.micro_batch], rewards,
                            batch_size=cfg.rl.micro_batch, negative_prompt=cfg.sampling.negative_prompt)


# ----- generator -------------------------------------------------------------------------------
def measure_generator(cfg, facts, release: str, rank: int, sent: Sent, header: dict | None,
                      probe_too: bool = True) -> RankMemory:
    """A generator rank's phases: the start-up probe (unless not `probe_too`), a publication
    received and installed (with `header`: what the first trainer sent it), then a fragment."""
    started, memory = time.perf_counter(), RankMemory(rank, "generator")
    with fake_rank(cfg, facts, release, rank, memory) as (run, ctx, _):
        generator = build._generator(ctx, LocalScorer(ctx.rewards), Store(), None)
        names = build._publish_names(ctx.adapter, facts.lora)
        plan = facts.step_plan(cfg, 0)
        fragment = max((f for f in plan.fragments if f.replica == ctx.topo.replica_of(rank)),
                       key=lambda f: len(f.sample_ids))
        tracker = Tracker()
        tracker.hold(run.mode)
        replay = replaying(tracker, ctx.adapter, ctx.rewards)
        with tracker:
            if probe_too:
                start_up(ctx, tracker, memory, sent, training=False)
            if header is not None:
                receiver = publish.WeightReceiver(build._params(ctx.adapter, names))
                run_phase(tracker, memory, "publication", lambda: _install(ctx, receiver, header, tracker))
            run_phase(tracker, memory, "fragment",
                      lambda: generator.generate(plan, [fragment], 0, None, lambda result: None))
        memory.unknown_reads = run.unknown_reads
        memory.add_rises(replay)
    memory.seconds = time.perf_counter() - started
    return memory


def _install(ctx, receiver: publish.WeightReceiver, header: dict, tracker) -> None:
    """Version 1 received as the rank's VersionSync receives it (the trainer's header replayed; the
    buckets into this rank's own buffers): installed bucket by bucket at a step's start, or with
    TCSS into the idle copy that waits while a step is sampled."""
    topo, facts = ctx.topo, ctx.facts
    versions = VersionSync(receiver, Store({"pub/1": 1}), topo.trainer_ranks[0], 0, 1 if facts.tcss else 0, None,
                           topo.replica_of(ctx.rank), ctx.tracer, ctx.comms.publish)
    verify = publish.WeightReceiver._verify

    def checked(receiver_, header_, before):
        """The verification's checksums are computed (their memory is the install's); fake
        tensors hold no values, so its verdict is not taken."""
        try:
            return verify(receiver_, header_, before)
        except publish.PublicationError:
            return header_["version"]

    with patched(publish, "recv_payload", lambda src, group=None, device=None: ({}, header)), \
            patched(publish, "checksum", Replay(tracker).wrap(publish.checksum, graph_free=True)), \
            patched(publish.WeightReceiver, "_verify", checked), tracker.booking(Ref.COMM):
        if facts.tcss:
            versions.at_fragment_boundary(1)
        else:
            versions.at_step_start(1)


# ----- a run ------------------------------------------------------------------------------------
def measure_run(cfg, facts, release: str) -> dict[str, RankMemory]:
    """{role: its measured phases} for one rank of each role: the first trainer (it sends the
    publication), the first generator, the first scorer; a colocated run's first rank."""
    topo = facts.topology
    if topo.gap_stages > 1:
        raise ValueError(f"--gap-stages {topo.gap_stages}: the measurement runs whole-model generators; "
                         f"python -m scripts.check_recipe --predict-only gives the memory model's stages")
    sent = sent_by_generators(cfg, facts, release)
    if not facts.disagg:
        return {"colocated": measure_colocated(cfg, facts, release, 0, sent)}
    out = {}
    out["trainer"], headers = measure_trainer(cfg, facts, release, topo.trainer_ranks[0], sent)
    g = topo.generator_ranks[0]
    out["generator"] = measure_generator(cfg, facts, release, g, sent, headers.get(g))
    if topo.scorer_ranks:
        out["scorer"] = measure_scorer(cfg, facts, release, topo.scorer_ranks[0])
    return out


def measure_scorer(cfg, facts, release: str, rank: int) -> RankMemory:
    """A scorer rank: its reward models and one batch scored."""
    started, memory = time.perf_counter(), RankMemory(rank, "scorer")
    with fake_rank(cfg, facts, release, rank) as (run, ctx, _):
        tracker = Tracker()
        tracker.hold(run.mode)
        s = ctx.sampling
        with tracker:
            run_phase(tracker, memory, "scoring", lambda: ctx.rewards.score_combined(
                torch.empty((cfg.rl.micro_batch, 3, s.height, s.width)), []))
    memory.seconds = time.perf_counter() - started
    return memory


def measure_colocated(cfg, facts, release: str, rank: int, sent: Sent) -> RankMemory:
    """A colocated rank: it generates a fragment beside its training state, trains (a micro-batch,
    the optimizer step) and evaluates."""
    started, memory = time.perf_counter(), RankMemory(rank, "colocated")
    with fake_rank(cfg, facts, release, rank, memory, trains=True) as (run, ctx, trainer):
        _start_codec(cfg, facts, ctx, trainer)
        generator = build._generator(ctx, LocalScorer(ctx.rewards), Store(), trainer)
        plan = facts.step_plan(cfg, 0)
        fragment = next(f for f in plan.fragments if f.replica == ctx.topo.replica_of(rank))
        tracker = _tracker(ctx, trainer)
        tracker.hold(run.mode, [trainer.optimizer])
        with tracker:
            start_up(ctx, tracker, memory, sent, training=True)
        batch = _steady(trainer, ctx, sent)
        tracker = _tracker(ctx, trainer)
        tracker.hold(run.mode, [trainer.optimizer], host=tensors_of(batch))
        replay = replaying(tracker, ctx.adapter, ctx.rewards)
        with tracker:
            run_phase(tracker, memory, "fragment",
                      lambda: generator.generate(plan, [fragment], 0, None, lambda result: None))
            run_phase(tracker, memory, "micro-batch", lambda: trainer.train(batch))
            run_phase(tracker, memory, "optimizer step", lambda: _finish(trainer))
            if cfg.output.eval_every:
                run_phase(tracker, memory, "evaluation", lambda: _evaluate(cfg, ctx, run, tracker))
        memory.unknown_reads = run.unknown_reads
        memory.add_rises(replay)
    memory.seconds = time.perf_counter() - started
    return memory


__all__ = ["FakeRewards", "RankMemory", "Sent", "fake_rank", "measure_colocated", "measure_generator", "measure_run",
           "measure_scorer", "measure_trainer", "sent_by_generators", "tensors_of", "transition_batch"]
