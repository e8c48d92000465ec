"""Building one rank: the model, its role objects (generator, trainer, scorer, TAG helper), the
mechanisms they use (intake, GAP stages, publication, version sync), the run guard and the step
log, as one `Rank` whose methods are the phases of a step (runtime/loop.py runs them).

Every rank builds version 0 identically (same weights, same seeded LoRA init), checks every user
error it can before it waits on another rank, and measures its speed once (the start-up probe)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from checkpointing import checkpoint
from checkpointing import folder
from checkpointing import resume
from config.schema import RunConfig
from config.validate import RunFacts
from models import autocast, resolve_device, resolve_dtype
from parallel import commhooks, compress, publish, tail_assist
from parallel.gap import PipelinedReplica, StageLayout, measure_block_costs, plan_stages, release_other_blocks
from parallel.gap import stage_param_names
from parallel.scoring import LocalScorer, RemoteScorer, scorer_step
from parallel.stepplan import helper_weight, replica_speeds, trainer_speeds
from parallel.store import StepStore
from parallel.tag import Assistant, FragmentBoard, GroupAssistant
from parallel.topology import ProcessGroups, Topology
from parallel import store_keys as keys
from prompts import resolutions as prompt_shapes
from rewards import RewardSet, parse_reward_specs, reward_model_paths, reward_url
from rl import algorithms
from rollout import Generator, VersionSync
from runtime import guard
from runtime import probe
from runtime.context import RankContext, make_context
from runtime.evaluation import evaluate_on_trainers
from runtime.steplog import StepLog
from runtime.steps import drain_sends, generator_step, trainer_step
from trainer import Trainer


@dataclass
class Rank:
    """One rank, built: what its steps run with. Its methods are the phases of a step."""

    ctx: RankContext
    store: StepStore
    groups: ProcessGroups
    guard: guard.RunGuard
    log: StepLog
    start: int
    """the first step this run trains (a resumed run's checkpoint step)"""
    shares: list[float]
    """each generator replica's share of fragments (measured speeds, or even)"""
    shapes: object  # prompts.resolutions table of the prompts' shapes, or None for one shape
    publish_names: dict[int, list[str]]
    """the weights each generator rank holds (a GAP stage: its blocks'), by rank"""
    generator: Generator | None = None
    replica: PipelinedReplica | None = None
    versions: VersionSync | None = None
    trainer: Trainer | None = None
    publisher: publish.WeightPublisher | None = None
    assistant: Assistant | None = None
    helper: Trainer | None = None
    """tail assist: a generator rank's trainer of its share of the step's last fragment"""
    scorer_rewards: RewardSet | None = None
    deferred: list = field(default_factory=list)
    """TCSS: (step, sends) still in flight"""
    saved: int = 0
    """the last step a checkpoint holds"""
    run: dict = field(default_factory=dict)
    """the run record (checkpointing/runrecord.py) that config.json and every checkpoint carry"""
    speeds: list = field(default_factory=list)
    """every rank's start-up speed probe (runtime/probe.py gather_speeds; None for a scorer)"""

    @property
    def cfg(self) -> RunConfig:
        return self.ctx.cfg

    @property
    def topo(self) -> Topology:
        return self.ctx.topo

    # ----- the phases of a step -----------------------------------------------------------
    def plan(self, step: int):
        """Step k's fragment plan, the same on every rank."""
        return self.ctx.facts.step_plan(self.cfg, step, self.shares, self.shapes)

    def generate(self, plan) -> tuple[list, dict]:
        """A generator's step: its replica's fragments, generated, scored and sent to the trainers.
        Returns (the fragment results, what stays on this rank for its own training: colocated)."""
        if self.generator is None:
            return [], {}
        out = generator_step(self.ctx, self.generator, self.versions, plan, lambda: self._reward_std(plan.step),
                             self.replica, self.store, self.deferred if self.ctx.facts.tcss else None, self.helper)
        self._offload()
        return out

    def score(self, plan) -> None:
        """A scorer rank's step: score the fragments sent to it."""
        if self.scorer_rewards is not None:
            scorer_step(self.ctx, self.scorer_rewards, plan, _image_source(self.ctx, self.store, plan),
                        self.groups.images[self.ctx.rank], self.groups.scores)

    def train(self, plan, local: dict) -> tuple[dict | None, list]:
        """A trainer's step: train what lands, one update, publish. Returns (its statistics, the
        fragments its TAG helper generated: their rewards count too)."""
        if self.trainer is None:
            return None, []
        self.store.put(keys.trainer_began(plan.step, self.ctx.rank), 1)  # generators may wait for their sends now
        stats = trainer_step(self.ctx, self.trainer, plan, local, self.publish_names, self.publisher, self.assistant,
                             self.store, self._reward_std(plan.step))
        self._offload()  # a TAG helper encoded prompts
        return stats, (self.assistant.results if self.assistant is not None else [])

    def record(self, plan, started: float, gen_out: list, train_stats: dict | None) -> None:
        """Every rank's step record; the logging rank logs the step from all of them."""
        ended, step = time.time(), plan.step
        busy = self.ctx.tracer.busy_seconds(step) if self.cfg.output.trace else ended - started
        self.log.record(step, self.topo.role(self.ctx.rank), started, ended, busy, train_stats, gen_out)
        if self.log.logging:
            self.log.log(plan)
        self.guard.step_done(ended - started)

    def save(self, done: int) -> None:
        """Checkpoint the run after `done` steps (every trainer rank writes its shards)."""
        if self.trainer is not None:
            self.guard.set_phase("checkpoint")
            c, lora = self.cfg, self.ctx.adapter.transformer.peft_config["default"] if self.ctx.facts.lora else None
            checkpoint.save_run_state(c.output.output_dir, done, self.trainer, self.ctx.adapter, self.log.running,
                                      lora, write=self.ctx.rank == self.topo.trainer_ranks[0],
                                      extra=resume.extra_state(self.trainer, self.log.std_history, done),
                                      stale=self.publisher.kept(done - 1) if self.ctx.facts.tcss else None,
                                      config={**c.describe(), "run": self.run}, keep=c.output.keep_checkpoints,
                                      export_dtype=c.output.export_dtype)
        self.saved = done

    def evaluate(self, done: int) -> None:
        """Held-out evaluation of the version after `done` updates, on the trainer ranks."""
        self.guard.set_phase("evaluation")
        c = self.ctx
        ema = self.trainer is not None and c.cfg.output.eval_ema  # --eval-ema: the EMA in the parameters
        with self.trainer.ema_swapped() if ema else contextlib.nullcontext():
            evaluate_on_trainers(c.cfg, c.adapter, c.sampling, c.topo, c.rank, done, self.log.logger, c.tracer,
                                 self.groups.trainers, records=list(c.facts.eval_records))
        self._offload()

    def finish(self) -> None:
        """After the last step (or a signal): the publications still addressed to generators are
        received, TCSS sends complete, and a stopped run saves the steps it finished."""
        run_guard, start = self.guard, self.start
        last = run_guard.stop_at if run_guard.stopping else self.cfg.rl.steps
        run_guard.set_timeouts(relaxed=True)
        run_guard.set_phase("exit")
        self.settle(last)
        if run_guard.stopping and self.saved != last and last > start:
            self.save(last)  # a signal stopped the run: the steps it finished are kept
        if run_guard.stopping:
            out_dir = self.cfg.output.output_dir
            path = checkpoint.checkpoint_dir(out_dir, last)
            line = (f"stopped on a signal after step {last - 1}: checkpoint {path}; continue with --resume {out_dir} "
                    f"--output-dir {out_dir}" if last > start else
                    "stopped on a signal before this run's first step: nothing new to save")
            guard.write_error_file(line)  # torchrun's summary shows why the exit code is 4
            if self.log.logging:
                guard.say(line)
        self._meet_at_exit()

    def settle(self, last: int) -> None:
        """After step `last` - 1: the publications still addressed to this generator are received
        and its fragment sends (TCSS: deferred) complete, so no traffic of this placement is left."""
        if self.versions is not None:
            self.versions.drain(last, last)  # the trainers publish after every step
        drain_sends(self.store, self.deferred)  # after the drain: the trainers need the publications to get there
        self.deferred = []

    def release(self) -> None:
        """Before another placement is built in this process (runtime/autoplace.py): the step log
        closes (the trace goes on), the communicators go, the model and the roles are dropped."""
        self.log.close()
        self.groups.destroy()
        self.generator = self.replica = self.versions = self.trainer = self.publisher = self.assistant = None
        self.helper = None
        self.scorer_rewards = None
        self.ctx = dataclasses.replace(self.ctx, adapter=None, rewards=None, intake=None)

    def _meet_at_exit(self) -> None:
        """Wait, with no time limit (the heartbeats name a dead or silent rank), until every rank is
        here: the trainers' last checkpoint and evaluation may outlast any timeout, and the final
        barrier, posted at once on NCCL, would count its timeout from posting."""
        self.store.put(keys.rank_exited(self.ctx.rank), 1)
        for rank in range(self.topo.world_size):
            while not self.store.ready(keys.rank_exited(rank)):
                time.sleep(0.05)  # rank wait: the trainers' last checkpoint and evaluation

    def close(self, failing: bool = False) -> None:
        """Flush the step log, write the trace. While the run fails (`failing`), a write that fails
        too (the same full disk) is dropped: the run reports the error that ended it."""
        try:
            self.log.close()
            if self.cfg.output.trace:
                self.ctx.tracer.save(os.path.join(self.cfg.output.output_dir, "trace", f"rank{self.ctx.rank}.json"))
        except OSError:
            if not failing:
                raise

    def exit_code(self) -> int:
        return guard.EXIT_STOPPED if self.guard.stopping else guard.EXIT_OK

    def _offload(self) -> None:
        """--offload-text-encoders: the text encoders go back to host memory after a phase that
        encodes prompts, so the rest of the step has their device memory."""
        if self.cfg.model.offload_text_encoders:
            self.ctx.adapter.offload_text_encoders()

    def _reward_std(self, step: int) -> float | None:
        """The advantage std: None (each group's own) or the running std of the batches before this
        one, published by the logging rank (with TCSS, of the batches before the previous one; a
        resumed run's logging rank publishes the checkpoint's last two first)."""
        if self.cfg.rl.std_mode != "running":
            return None
        last = step - 1 - (1 if self.cfg.topology.tcss else 0)
        return None if last < 0 else self.store.get(keys.running_std(last))


# ----- building -------------------------------------------------------------------------------
def build(cfg: RunConfig, facts: RunFacts, rank: int, previous: Rank | None = None,
          placement: dict | None = None, speeds: list | None = None) -> Rank:
    """Everything rank `rank` runs its steps with. Collective: every rank calls it. `previous`: the
    rank as the placement before built it, released, when --placement auto switches inside the run
    (runtime/autoplace.py; `facts` then resume from its checkpoint): its store, run guard, tracer
    and run record go on, and the run folder is not prepared again. `placement`: what --placement
    auto chose, for the run record (config.json). `speeds`: this placement's speed probes when the
    run built it before (--placement auto switching back to it: its ranks hold the same roles), not
    measured again."""
    topo, t = facts.topology, cfg.topology
    commhooks.install()  # DIGENRL_COMM_TRACE: every collective from here on is recorded
    store = previous.store if previous is not None else StepStore(t.dist_timeout_s)
    groups = ProcessGroups.create(topo, t.dist_timeout_s, guard.pending_timeout_s(t.dist_timeout_s),
                                  exchange=facts.tsp and not facts.disagg, own=mixed_replicas(cfg, facts))
    if previous is not None:
        run_guard = previous.guard.rebind(topo, _member_groups(topo, rank, groups))
    else:
        served = any(map(reward_url, cfg.rl.reward))  # a reward service scores: the guard's timeouts outwait it
        run_guard = guard.RunGuard(topo, rank, store, heartbeat_timeout_s=t.heartbeat_timeout_s,
                                  stop_grace_s=t.stop_grace_s, dist_timeout_s=t.dist_timeout_s,
                                  groups=_member_groups(topo, rank, groups),
                                  start_step=facts.resume.step if facts.resume else 0,
                                  reward_timeout_s=cfg.rl.reward_timeout_s if served else None).start()
    tracer = previous.ctx.tracer if previous is not None else None  # one trace for the whole run
    ctx, shapes = make_context(cfg, facts, rank, groups, tracer)  # every check that needs the model: nothing written yet
    trainer = make_trainer(ctx) if topo.is_trainer(rank) else None
    # The probes' conditioning (sync point: rank 0 encodes it for every rank), for the speed probe and
    # the GAP stages' block costs: not needed where the speeds are reused and no replica has stages.
    probing = speeds is None or topo.gap_stages > 1  # the same on every rank
    cond = probe.probe_conditioning(ctx) if probing else None
    # After FSDP shards the model: trainers probe training as they train (sharded, checkpointed).
    if speeds is None:
        speeds = probe.gather_speeds(ctx, cfg.output.output_dir, cond, shapes,  # sync point
                                     training=trainer is not None)
    else:
        probe.write_speeds(ctx, cfg.output.output_dir, speeds)
    run = _prepare_folder(cfg, facts, rank, store, placement) if previous is None else \
        _record_switch(cfg, rank, previous.run, placement)
    if shapes is not None:  # the dispatch's costs, calibrated by the generators' chunk times
        shapes = prompt_shapes.measured_table(shapes, [speeds[g]["shape_s"] for g in topo.generator_ranks])
    in_place = facts.resume is not None and facts.resume.same_folder and previous is None
    log = StepLog(cfg, rank, rank == facts.log_rank, store, topo.world_size, facts.resume.step if facts.resume else 0,
                  in_place, algorithms.algorithm(cfg.rl.algorithm).loss(cfg.rl).SUMMARY, run)
    begin = resume.restore(facts, rank, ctx.adapter, trainer, log.running, store)  # --resume: the checkpoint's
    log.std_history = begin.std_history
    all_names = _publish_names(ctx.adapter, facts.lora)
    sampled = trainer.sampling_tensors(all_names) if trainer is not None else None  # may be an algorithm's copy
    resume.check_same_weights(ctx.adapter, all_names, begin.version,  # every rank starts from its version
                                resolve_dtype(cfg.model.dtype, ctx.device), sampled)
    layouts = _stage_layouts(ctx, cond) if topo.gap_stages > 1 else {}
    shares = replica_speeds({g: speeds[g]["generate_s"] for g in topo.generator_ranks},
                            [topo.replica_ranks(r) for r in range(topo.num_replicas)])
    if facts.tsp and facts.speed_split and facts.train_sharding != "fsdp":  # every rank packs alike
        ctx.intake.speeds = trainer_speeds({t: speeds[t]["train_s"] for t in topo.trainer_ranks})
        if facts.tail_assist:
            ctx.intake.helper_weight = helper_weight([speeds[g]["generate_s"] for g in topo.generator_ranks],
                                                     [speeds[t]["generate_s"] for t in topo.trainer_ranks],
                                                     ctx.intake.speeds)
    publish_names = {g: _stage_names(ctx.adapter, all_names, layouts.get(g)) for g in topo.generator_ranks}
    r = Rank(ctx, store, groups, run_guard, log, begin.step, shares, shapes, publish_names, trainer=trainer,
             saved=begin.step, run=run, speeds=speeds)
    _build_generator(r, layouts, begin.version)
    if trainer is not None:
        _build_trainer_side(r, speeds, all_names)
    if topo.is_scorer(rank):
        ctx.adapter.release_components(["transformer"])  # a scorer runs the rewards only
        r.scorer_rewards = ctx.rewards
    run_guard.expect_step(_expected_step_s(r, speeds))
    return r


def make_trainer(ctx: RankContext) -> Trainer:
    """The rank's Trainer, computing on the rank's device: an FSDP2 trainer's transformer is still in
    host memory (runtime/context.py `shards_from_host`), and FSDP2 moves it there a unit at a time; a
    replicated one in a compute dtype other than float32 runs FSDP2 over its own group (every rank
    created it: ProcessGroups.create(own=mixed_replicas(...)))."""
    return Trainer(ctx.cfg, ctx.adapter, ctx.sampling, ctx.comms.trainers, ctx.facts.train_sharding, ctx.slowdown,
                   ctx.comms.own.get(ctx.rank), ctx.device)


def _expected_step_s(r: Rank, speeds: list) -> float:
    """A generous prediction of the first step, which its timeouts scale with: every denoising and
    training forward of the step as if one rank ran them all at the slowest rank's probed speed."""
    plan, s = r.plan(r.start), r.ctx.sampling
    probed = [x for x in speeds if x]
    forwards = (len(plan.chunks) * s.num_steps, sum(len(f) for f in r.ctx.intake.forward_fragments(plan)))
    per_forward = (max(x["generate_s"] for x in probed), max(x.get("train_s", 0.0) for x in probed))
    return (2 if s.cfg_scale != 1.0 else 1) * sum(n * t for n, t in zip(forwards, per_forward))


def _prepare_folder(cfg: RunConfig, facts: RunFacts, rank: int, store: StepStore, placement: dict | None) -> dict:
    """Rank 0 clears or cuts back the run folder and writes config.json once every rank has loaded
    and passed its checks (a user error found on the way leaves nothing behind); every rank then
    reads the run record its checkpoints carry (with --placement auto, what it chose)."""
    if rank == 0:
        run = folder.prepare(cfg, facts.resume, facts.digests, say=guard.say)
        if placement is not None:
            run = _record_switch(cfg, rank, run, placement)
        store.put(keys.RUN_RECORD, run)
    dist.barrier()  # sync point: the folder is ready before any rank writes into it
    return store.get(keys.RUN_RECORD)


def _record_switch(cfg: RunConfig, rank: int, run: dict, placement: dict | None) -> dict:
    """The run record with --placement auto's record; rank 0 writes config.json again (its
    placement flags are the placement now running)."""
    run = {**run, "placement": placement} if placement is not None else run
    if rank == 0:
        cfg.save(os.path.join(cfg.output.output_dir, "config.json"), run)
    return run


def _build_generator(r: Rank, layouts: dict, version: int) -> None:
    """A generator rank's generator, its GAP stage and the version sync with the trainers."""
    ctx, topo, facts = r.ctx, r.topo, r.ctx.facts
    rank = ctx.rank
    if not topo.is_generator(rank):
        return
    scorer = RemoteScorer(topo.scorer_ranks, r.groups.images, r.groups.scores.get(rank)) if topo.scorer_ranks else \
        LocalScorer(ctx.rewards)
    r.generator = _generator(ctx, scorer, r.store, r.trainer)
    if layouts:
        layout = layouts[rank]
        release_other_blocks(ctx.adapter, layout.blocks)
        links = r.groups.stage_links(topo.replica_of(rank), layout.stage, layout.num_stages)
        r.replica = PipelinedReplica(r.generator, layout, links)
    if facts.tail_assist:  # trains a share of the fragments it ends a step with, with this rank's model
        r.helper = Trainer(ctx.cfg, ctx.adapter, ctx.sampling, slowdown=ctx.slowdown, device=ctx.device, helper=True)
        if r.helper.compute_dtype != torch.float32:  # its weights are the compute dtype's, its gradient float32
            tail_assist.float32_gradients(r.helper)
    if facts.disagg:
        receiver = publish.WeightReceiver(_params(ctx.adapter, r.publish_names[rank]))
        r.versions = VersionSync(receiver, r.store, topo.trainer_ranks[0], version, 1 if facts.tcss else 0,
                                 layouts.get(rank), topo.replica_of(rank), ctx.tracer, r.groups.publish)


def _build_trainer_side(r: Rank, speeds: list, all_names: list[str]) -> None:
    """A trainer rank's TAG helper, publisher and publication codec."""
    ctx, topo, facts, cfg = r.ctx, r.topo, r.ctx.facts, r.cfg
    rank, trainer = ctx.rank, r.trainer
    if facts.tag:
        helper = GroupAssistant if facts.train_sharding == "fsdp" else Assistant  # FSDP trainers generate together
        replica_s = sum(speeds[g]["generate_s"] for g in topo.generator_ranks) / len(topo.generator_ranks)
        r.assistant = helper(ctx, _generator(ctx, LocalScorer(ctx.rewards), r.store, trainer), r.store,
                             facts.num_trainers, topo.trainer_ranks.index(rank),
                             trainer_ratio=speeds[rank]["generate_s"] / replica_s)
    if facts.disagg:  # with TCSS the sending trainer keeps the last two versions for checkpoints
        r.publisher = publish.WeightPublisher(compression=cfg.topology.publish_compression,
                                              link_mbps=cfg.output.debug_link_bandwidth, keep=facts.tcss,
                                              holds=rank == topo.trainer_ranks[0])
    if compress.lossy(cfg.topology.publish_compression):  # every placement trains through the codec
        trainer.start_codec(cfg.topology.publish_compression, all_names, resume.residual(facts))
    if facts.tcss:  # the generators' version at the next checkpoint; resent at a resume
        resume.publish_start(facts, rank, trainer, r.publisher, r.publish_names, r.start,
                               facts.resume is not None and facts.resume.has_stale, r.store, r.groups.publish)


def mixed_replicas(cfg: RunConfig, facts: RunFacts) -> bool:
    """Whether trainers are replicated and compute in a dtype other than float32: each then runs
    FSDP2 over a group of its own as its mixed-precision engine (trainer.py), which every rank
    creates (ProcessGroups.create(own=True)). The same on every rank: it reads the config and the
    device type, which all ranks share."""
    compute = resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device))
    return facts.train_sharding == "replicate" and compute != torch.float32


def _generator(ctx: RankContext, scorer, store: StepStore, trainer: Trainer | None) -> Generator:
    """A rank's generator; on a rank that also trains (colocated, a TAG helper) it samples with the
    trainer's sampling policy (the algorithm's: DiffusionNFT's old policy)."""
    cfg = ctx.cfg
    weights = tuple(parse_reward_specs(cfg.rl.reward, reward_model_paths(cfg.rl.reward_model)))
    algorithm = algorithms.algorithm(cfg.rl.algorithm)
    return Generator(ctx.adapter, ctx.sampling, scorer, ctx.records, seed=cfg.seed,
                     negative_prompt=cfg.sampling.negative_prompt, same_group_noise=cfg.sampling.same_group_noise,
                     rule=algorithm.advantages(cfg.rl, weights), store=store,
                     autocast_ctx=lambda: autocast(ctx.device, cfg.model.dtype), slowdown=ctx.slowdown,
                     carried=algorithm.carried, policy=trainer.sampling_policy if trainer is not None else None)


def _member_groups(topo: Topology, rank: int, groups: ProcessGroups) -> list:
    """The process groups this rank belongs to (their timeouts adapt to the step time)."""
    out = [dist.group.WORLD]
    if topo.is_trainer(rank) and groups.trainers is not dist.group.WORLD:
        out.append(groups.trainers)
    return out


def _image_source(ctx: RankContext, store: StepStore, plan):
    """Where a scorer rank receives fragment f's images from: the last stage of the replica that
    generates it, planned or, with TAG, the one that claimed it. None: a trainer claimed it (TAG),
    and scores it on its own rank."""
    topo = ctx.topo
    if not ctx.facts.tag:
        return lambda f: topo.replica_ranks(f.replica)[-1]
    board = FragmentBoard(store, plan.step, len(plan.fragments))

    def source(f):
        owner = board.wait_owner(f.index)
        return None if owner["replica"] is None else topo.replica_ranks(owner["replica"])[-1]

    return source


def _params(adapter, names: list[str]) -> dict[str, torch.Tensor]:
    params = dict(adapter.transformer.named_parameters())
    return {n: params[n] for n in names}


def _publish_names(adapter, lora: bool) -> list[str]:
    """LoRA runs send only the adapter tensors; full fine-tuning sends every transformer weight."""
    named = adapter.transformer.named_parameters()
    return [n for n, _ in named if ".lora_" in n] if lora else [n for n, _ in named]


def _stage_layouts(ctx: RankContext, cond) -> dict:
    """GAP stages: every generator rank measures its per-block cost (scaled by its slow-down) with
    the probes' conditioning `cond`; every rank then computes the same partition of every replica
    from the gathered measurements."""
    cfg, topo, rank, adapter = ctx.cfg, ctx.topo, ctx.rank, ctx.adapter
    costs = None
    if topo.is_generator(rank):
        with autocast(adapter.device, cfg.model.dtype):
            costs = [c * ctx.slowdown.factor
                     for c in measure_block_costs(adapter, ctx.sampling, cfg.rl.micro_batch, cond=cond)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, costs)  # sync point
    layouts = {}
    for r in range(topo.num_replicas):
        ranks = topo.replica_ranks(r)
        ranges = plan_stages({g: everyone[g] for g in ranks}, ranks)
        for stage, g in enumerate(ranks):
            layouts[g] = StageLayout(ranks, stage, ranges[stage])
    return layouts


def _stage_names(adapter, names: list[str], layout) -> list[str]:
    return names if layout is None else stage_param_names(adapter, names, layout.blocks, layout.first, layout.last)
