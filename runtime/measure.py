"""Each role's GPU memory at a released model's size, measured on the roles' own code under
FakeTensorMode with torch's trackers (runtime/fakemem.py): what `python -m scripts.check_recipe`
prints and docs/memory/*.json hold.

A rank is built as runtime/build.py builds it (`build._context`, its `load_model` giving the
released config's components as fake tensors in the dtypes build asks for), then its phases run in
the order of a run, each phase's peak taken by category:

- trainer: "micro-batch" (forward and backward of two packed micro-batches of the recipe's size,
  with its checkpointing) and "optimizer step" (`finish_step`), twice (the second with the
  optimizer's state: the steady state), "publication" (`make_version`, and on the first trainer
  the sends to every generator), "evaluation" (one batch of the held-out sampler, scored);
- generator: "publication" (receive the version the first trainer sent and install it), then
  "fragment" (`Generator.generate` of the step's first fragment: encode, K denoising steps per
  chunk, decode, score, cut into chunks);
- every rank: "start-up probe" (`probe.probe_speed`, before the trainer shards the model).

What stands in for what a measurement cannot run, and why:
- rewards: each reward model's network, built from its released config (rewards/configs/) in the
  reward's dtype, runs one batch of the reward's size on inputs of its processor's size (the
  processors and tokenizers work on the host, on images the fake run has no pixels of);
- the trainer's input: a `TransitionBatch` with the conditioning shapes a generator rank encodes;
- the wire: the trainer's sends go to a fake process group; the generator receives the header the
  trainer's send carried (replayed), into the buffers its own code allocates.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from dataclasses import dataclass, field

import torch
import transformers

from models import released
from parallel import compress, publish
from parallel.intake import TransitionBatch
from parallel.scoring import LocalScorer
from parallel.topology import ProcessGroups
from prompts.sets import eval_records
from rewards import parse_reward_spec, reward_class
from rl import sampler
from rl.conditioning import Conditioning
from runtime import build, evaluation, fakemem, probe
from runtime.memory import REWARD_MODELS, reward_network
from runtime.memtrack import FSDPTracker, Ref, Replay, Tracker, patched
from trainer import Trainer

TRAIN_MICRO_BATCHES = 1
"""Packed micro-batches per measured training call (it accumulates into the gradients held before it)."""


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


@dataclass(frozen=True)
class Sent:
    """What a generator sends its trainers, as shapes: the conditioning of one sample (and of its
    negative prompt with CFG) and the latent of one step."""

    cond: dict[str, tuple[tuple[int, ...], torch.dtype]]
    neg: dict[str, tuple[tuple[int, ...], torch.dtype]] | None
    latent: tuple[int, ...]

    @classmethod
    def of(cls, cond: Conditioning, neg: Conditioning | None, latent) -> "Sent":
        def shapes(c):
            return {k: (tuple(v.shape[1:]), v.dtype) for k, v in c.tensors.items()}
        return cls(shapes(cond), shapes(neg) if neg is not None else None, tuple(latent))


def _conditioning(shapes: dict, rows: int) -> Conditioning:
    return Conditioning({k: torch.ones((rows, *s), dtype=dt) if not dt.is_floating_point else
                         torch.empty((rows, *s), dtype=dt) for k, (s, dt) in shapes.items()})


def transition_batch(sent: Sent, sampling: sampler.SamplingConfig, sigmas: torch.Tensor, t: int,
                     rows: int) -> TransitionBatch:
    """TRAIN_MICRO_BATCHES packed micro-batches of `rows` transitions at timestep t, each of its own sample."""
    n = TRAIN_MICRO_BATCHES * rows
    return TransitionBatch(
        step=0, fragment=0, version=0, micro_batches=tuple(range(TRAIN_MICRO_BATCHES)),
        sizes=(rows,) * TRAIN_MICRO_BATCHES, sample_ids=torch.tensor(list(range(n))),
        timesteps=torch.tensor([t] * n), x_t=torch.empty((n, *sent.latent)), x_next=torch.empty((n, *sent.latent)),
        sigma=torch.tensor([float(sigmas[t])] * n), sigma_next=torch.tensor([float(sigmas[t + 1])] * n),
        log_probs=torch.tensor([0.0] * n), advantages=torch.tensor([1.0] * n), keep=torch.tensor([True] * n),
        cond_index=torch.tensor(list(range(n))), cond=_conditioning(sent.cond, n),
        neg_cond=_conditioning(sent.neg, n) if sent.neg is not None else None)


# ----- rewards ---------------------------------------------------------------------------------
class FakeRewards:
    """A RewardSet's GPU work: each model reward's network, resident in the reward's dtype, scoring
    a batch of the reward's size (every frame of a video is an image); the scores are zeros."""

    def __init__(self, specs: list[str], mode):
        self.names = [parse_reward_spec(s)[0] for s in specs]
        self.models = {}
        for name in self.names:
            if name in REWARD_MODELS:
                dtype = inspect.signature(reward_class(name)).parameters["dtype"].default
                self.models[name] = (fakemem.fake_module(reward_network(name), mode, dtype), dtype)

    @torch.no_grad()
    def _score(self, name: str, images: int) -> None:
        model, dtype = self.models[name]
        b = min(reward_class(name).batch_size or images, images)
        if isinstance(model, transformers.CLIPModel):
            size, text = model.config.vision_config.image_size, model.config.text_config.max_position_embeddings
            ids = torch.ones((b, text), dtype=torch.long)
            model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.empty((b, 3, size, size),
                                                                                                 dtype=dtype))
        else:  # an encoder-decoder OCR model: the image encoded, then its text decoded (32 tokens)
            size = model.config.encoder.image_size
            model(pixel_values=torch.empty((b, 3, size, size), dtype=dtype),
                  decoder_input_ids=torch.ones((b, 32), dtype=torch.long))

    def score_combined(self, images: torch.Tensor, prompts, metadata=None) -> dict[str, torch.Tensor]:
        count = images.shape[0] * (images.shape[2] if images.dim() == 5 else 1)
        for name in self.models:
            self._score(name, count)
        zeros = torch.tensor([0.0] * images.shape[0])
        return {**{n: zeros for n in self.names}, "combined": zeros}


# ----- one rank --------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_rank(cfg, facts, release: str, rank: int):
    """Rank `rank` of the run built as runtime/build.py builds its context, on fake tensors of the
    released model `release` (models/configs/): yields (the FakeRun, the RankContext)."""
    def load(name, model_path=None, *, preset="tiny", seed=0, dtype=torch.float32, device="cpu"):
        adapter = released.meta_adapter(release)
        if adapter.family != name:
            raise ValueError(f"released config {release!r} is a {adapter.family} model, not {name!r}")
        table = dtype if isinstance(dtype, dict) else {"default": dtype}
        for component, module in adapter.pipe.components.items():
            if isinstance(module, torch.nn.Module) and next(module.parameters(), None) is not None:
                fakemem.fake_module(module, run.mode, table.get(component, table.get("default", torch.float32)))
        return adapter

    with fakemem.fake_world(facts.topology.world_size, rank), fakemem.FakeRun() as run, \
            patched(build, "load_model", load), patched(probe, "_timed", _once):
        ctx, _ = build._context(cfg, facts, rank)
        yield run, ctx


def _once(fn, slowdown, device, repeats: int = 1) -> float:
    fn()
    return 0.0


def replaying(tracker, adapter, rewards: "FakeRewards | None" = None) -> Replay:
    """Repeated no-grad calls of the adapter (denoising steps, decodes, text encodings) and of the
    reward networks run once each (fakemem.Replay)."""
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


def start_up(cfg, facts, release: str, rank: int, memory: RankMemory) -> None:
    """The start-up speed probe (runtime/probe.py) on a rank of its own: it runs before anything
    shards the model, and its hooks would outlive it in the rank the phases run on."""
    if not hasattr(probe, "probe_speed") or facts.topology.is_scorer(rank):
        return
    with fake_rank(cfg, facts, release, rank) as (run, ctx):
        tracker = Tracker()
        tracker.hold(run.mode)
        with tracker:
            run_phase(tracker, memory, "start-up probe", lambda: probe.probe_speed(
                ctx.adapter, ctx.sampling, cfg.rl.micro_batch, ctx.slowdown,
                lambda: fakemem.gpu_autocast(ctx.device, cfg.model.dtype)))


def sent_by_generators(cfg, facts, release: str) -> Sent:
    """The shapes a generator rank encodes and samples (its text encoders on one chunk's prompts)."""
    g = facts.topology.generator_ranks[0]
    with fake_rank(cfg, facts, release, g) as (run, ctx):
        plan = facts.step_plan(cfg, 0)
        generator = build._generator(ctx, LocalScorer(None))
        cond, neg = generator.chunk_inputs(plan, plan.fragments[0].chunks[0])
        return Sent.of(cond, neg, ctx.adapter.latent_shape(ctx.sampling.height, ctx.sampling.width,
                                                           ctx.sampling.num_frames))


# ----- trainer ---------------------------------------------------------------------------------
def measure_trainer(cfg, facts, release: str, rank: int, sent: Sent) -> tuple[RankMemory, dict]:
    """A trainer rank's phases; returns it and the publication header each generator rank receives."""
    started, memory, headers = time.perf_counter(), RankMemory(rank, "trainer"), {}
    start_up(cfg, facts, release, rank, memory)
    with fake_rank(cfg, facts, release, rank) as (run, ctx):
        trainer, batch = _trainer(cfg, facts, ctx, sent)
        fsdp = facts.train_sharding == "fsdp"
        tracker = FSDPTracker(ctx.adapter.transformer, trainer.optimizer) if fsdp else Tracker()
        tracker.hold(run.mode, [trainer.optimizer], host=tensors_of(batch))
        replay = replaying(tracker, ctx.adapter)
        with tracker:
            run_phase(tracker, memory, "micro-batch", lambda: trainer.train(batch))
            run_phase(tracker, memory, "optimizer step", lambda: _finish(trainer, run))
            if facts.disagg:
                run_phase(tracker, memory, "publication",
                          lambda: headers.update(_publish(cfg, facts, ctx, trainer, tracker)))
            if cfg.output.eval_every:
                run_phase(tracker, memory, "evaluation", lambda: _evaluate(cfg, ctx, run, tracker))
        memory.unknown_reads = run.unknown_reads
        memory.add_rises(replay)
    memory.seconds = time.perf_counter() - started
    return memory, headers


def _trainer(cfg, facts, ctx, sent: Sent) -> tuple[Trainer, TransitionBatch]:
    """The rank's Trainer as runtime/build.py makes it (its codec too), after one update (the
    optimizer's state exists) and with the gradients of earlier micro-batches; and its input."""
    trainer = Trainer(cfg, ctx.adapter, ctx.sampling, ProcessGroups.create(ctx.topo, 60).trainers,
                      facts.train_sharding, ctx.slowdown)
    fakemem.foreach_as_on_gpu(trainer.optimizer)
    if compress.lossy(cfg.topology.publish_compression):
        trainer.start_codec(cfg.topology.publish_compression, build._publish_names(ctx.adapter, facts.lora), None)
    sigmas = sampler.sigmas_for(ctx.adapter, ctx.sampling)
    rows = facts.train_micro_batch if facts.tsp else cfg.rl.micro_batch
    batch = transition_batch(sent, ctx.sampling, sigmas, min(trainer.spec.timesteps(0, 0)), rows)
    _first_update(trainer)
    for p in trainer.params:  # what the step's earlier micro-batches accumulated
        p.grad = torch.zeros_like(p)
    return trainer, batch


def _first_update(trainer: Trainer) -> None:
    """An update from zero gradients before the measured phases: the optimizer's state then exists,
    as in every step after the first (a backward of its own would take as long as the measured one)."""
    for p in trainer.params:
        p.grad = torch.zeros_like(p)
    trainer.num_transitions = 1
    _finish(trainer, None)


def _finish(trainer: Trainer, run) -> None:
    """finish_step, with the step's loss sums as host zeros: the fake run's losses hold no values,
    and the update is applied only when they are finite."""
    trainer.current_step = 0
    trainer.loss_sums = torch.tensor([0.0] * trainer.loss_sums.numel(), dtype=trainer.loss_sums.dtype)
    trainer.finish_step()


def _publish(cfg, facts, ctx, trainer: Trainer, tracker) -> dict:
    """make_version on every trainer; the first one's sends to each generator rank, whose headers
    are kept: {generator rank: header}."""
    names_by_rank = {g: build._publish_names(ctx.adapter, facts.lora) for g in ctx.topo.generator_ranks}
    wire, held = trainer.make_version(sorted({n for names in names_by_rank.values() for n in names}))
    if ctx.rank != ctx.topo.trainer_ranks[0]:
        return {}
    headers, send = {}, publish.send_payload

    def keep_header(tensors, meta, dst, group=None):
        headers[dst] = meta
        send(tensors, meta, dst, group)

    publisher = publish.WeightPublisher(compression=cfg.topology.publish_compression)
    with patched(publish, "send_payload", keep_header), \
            patched(publish, "checksum", Replay(tracker).wrap(publish.checksum, graph_free=True)):
        publisher.publish_all(wire, held, names_by_rank, 1)
    return headers


def _evaluate(cfg, ctx, run, tracker) -> None:
    """One batch of the held-out evaluation (runtime/evaluation.py): the ODE sampler, decode, score
    (the reward models load for it, as evaluate_on_trainers loads them)."""
    records = eval_records(cfg.output.eval_prompts, cfg.output.eval_num_prompts, cfg.output.eval_samples_per_prompt)
    with tracker.booking(Ref.PARAM):
        rewards = FakeRewards(cfg.rl.reward, run.mode)
    rewards._score = Replay(tracker).wrap(rewards._score, graph_free=True)
    evaluation.evaluate(ctx.adapter, ctx.sampling, records[:cfg.rl.micro_batch], rewards,
                        batch_size=cfg.rl.micro_batch, negative_prompt=cfg.sampling.negative_prompt)


# ----- generator -------------------------------------------------------------------------------
def measure_generator(cfg, facts, release: str, rank: int, header: dict | None,
                      probe_too: bool = True) -> RankMemory:
    """A generator rank's phases: receive and install a publication (with `header`), then a fragment
    (and, unless not `probe_too`, the start-up probe)."""
    started, memory = time.perf_counter(), RankMemory(rank, "generator")
    if probe_too:
        start_up(cfg, facts, release, rank, memory)
    with fake_rank(cfg, facts, release, rank) as (run, ctx):
        rewards = FakeRewards(cfg.rl.reward, run.mode)
        generator = build._generator(ctx, LocalScorer(rewards))
        names = build._publish_names(ctx.adapter, facts.lora)
        receiver = publish.WeightReceiver(build._params(ctx.adapter, names))
        plan = facts.step_plan(cfg, 0)
        fragment = max((f for f in plan.fragments if f.replica == ctx.topo.replica_of(rank)),
                       key=lambda f: len(f.sample_ids))
        tracker = Tracker()
        tracker.hold(run.mode)
        replay = replaying(tracker, ctx.adapter, rewards)
        with tracker:
            if header is not None:
                run_phase(tracker, memory, "publication", lambda: _install(receiver, header, tracker))
            results = []
            run_phase(tracker, memory, "fragment", lambda: generator.generate(plan, [fragment], 0, None,
                                                                              results.append))
        memory.unknown_reads = run.unknown_reads
        memory.add_rises(replay)
    memory.seconds = time.perf_counter() - started
    return memory


def _install(receiver: publish.WeightReceiver, header: dict, tracker) -> None:
    """WeightReceiver.receive (the trainer's header replayed; its buffers are this rank's) and install."""
    with patched(publish, "recv_payload", lambda src, group=None, device=None: ({}, header)), \
            tracker.booking(Ref.COMM):
        receiver.receive(0)
    with patched(publish, "checksum", Replay(tracker).wrap(publish.checksum, graph_free=True)):
        receiver.install()


# ----- a run ------------------------------------------------------------------------------------
def measure_run(cfg, facts, release: str) -> dict[str, RankMemory]:
    """{role: its measured phases} for one rank of each role: the first trainer (it sends the
    publication), the first generator (its last GAP stage, which decodes and scores, when there are
    stages), the first scorer; a colocated run's first rank."""
    topo = facts.topology
    if topo.gap_stages > 1:
        raise ValueError(f"--gap-stages {topo.gap_stages}: the measurement runs whole-model generators; "
                         f"python -m scripts.check_recipe --predict-only gives the memory model's stages")
    if not facts.disagg:
        return {"colocated": measure_colocated(cfg, facts, release, 0)}
    sent = sent_by_generators(cfg, facts, release)
    out = {}
    out["trainer"], headers = measure_trainer(cfg, facts, release, topo.trainer_ranks[0], sent)
    g = topo.replica_ranks(0)[-1]
    out["generator"] = measure_generator(cfg, facts, release, g, headers.get(g))
    if topo.scorer_ranks:
        out["scorer"] = measure_scorer(cfg, facts, release, topo.scorer_ranks[0])
    return out


def measure_scorer(cfg, facts, release: str, rank: int) -> RankMemory:
    """A scorer rank: its reward models and one batch scored."""
    started, memory = time.perf_counter(), RankMemory(rank, "scorer")
    with fakemem.fake_world(facts.topology.world_size, rank), fakemem.FakeRun() as run:
        rewards = FakeRewards(cfg.rl.reward, run.mode)
        tracker = Tracker()
        tracker.hold(run.mode)
        d = cfg.sampling
        with tracker:
            run_phase(tracker, memory, "scoring", lambda: rewards.score_combined(
                torch.empty((cfg.rl.micro_batch, 3, d.height or 512, d.width or 512)), []))
    memory.seconds = time.perf_counter() - started
    return memory


def measure_colocated(cfg, facts, release: str, rank: int) -> RankMemory:
    """A colocated rank: it trains (a micro-batch, the optimizer step, evaluation) and generates a
    fragment beside its training state."""
    started, memory = time.perf_counter(), RankMemory(rank, "colocated")
    sent = sent_by_generators(cfg, facts, release)
    start_up(cfg, facts, release, rank, memory)
    with fake_rank(cfg, facts, release, rank) as (run, ctx):
        trainer, batch = _trainer(cfg, facts, ctx, sent)
        rewards = FakeRewards(cfg.rl.reward, run.mode)
        generator = build._generator(ctx, LocalScorer(rewards))
        plan = facts.step_plan(cfg, 0)
        fragment = next(f for f in plan.fragments if f.replica == ctx.topo.replica_of(rank))
        tracker = FSDPTracker(ctx.adapter.transformer, trainer.optimizer) if facts.train_sharding == "fsdp" \
            else Tracker()
        tracker.hold(run.mode, [trainer.optimizer], host=tensors_of(batch))
        replaying(tracker, ctx.adapter, rewards)
        with tracker:
            run_phase(tracker, memory, "fragment",
                      lambda: generator.generate(plan, [fragment], 0, None, lambda r: None))
            run_phase(tracker, memory, "micro-batch", lambda: trainer.train(batch))
            run_phase(tracker, memory, "optimizer step", lambda: _finish(trainer, run))
            if cfg.output.eval_every:
                run_phase(tracker, memory, "evaluation", lambda: _evaluate(cfg, ctx, run, tracker))
        memory.unknown_reads = run.unknown_reads
    memory.seconds = time.perf_counter() - started
    return memory


__all__ = ["FakeRewards", "RankMemory", "Sent", "fake_rank", "measure_colocated", "measure_generator", "measure_run",
           "measure_scorer", "measure_trainer", "sent_by_generators", "tensors_of", "transition_batch"]
