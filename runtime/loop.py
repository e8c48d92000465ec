"""The step loop of one rank. Every step k (docs/DESIGN.md, naive disaggregation and the mechanisms
on top of it):

  generators: install version k -> generate, decode, score the fragments of their replica ->
              send each fragment's training data to its trainers -> receive version k+1
  trainers:   receive (or, colocated, take) their work -> forward/backward each transition ->
              one optimizer update -> publish version k+1 to every generator
  scorers:    score the fragments sent to them
  all ranks:  put their step record on the store; the logging rank (the first trainer) logs them

Colocated mode runs both halves on every rank with no transfer and no publication.
"""
from __future__ import annotations

import base64
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from prompts import shapes as buckets
from runtime import probe as capacity
from checkpointing import checkpoint
from runtime import evaluation
from checkpointing import folder as runfolder
from runtime import guard as runguard
from checkpointing import resume as runstate
from rl import sampler
from rl.algorithm import RunningStd
from config.schema import RunConfig
from config.validate import RunFacts
from telemetry.metrics import LOGGED_IMAGES, MetricsLogger, thumbnails
from models import DiTAdapter, autocast, load_model, model_dtypes, resolve_device, set_attention
from models.lora import apply_lora
from parallel import compress, publish
from parallel.gap import PipelinedReplica, StageLayout, measure_block_costs, plan_stages, release_other_blocks
from parallel.gap import stage_param_names
from parallel.intake import TrainingSpec, make_intake
from parallel.stepplan import replica_speeds
from parallel.scoring import LocalScorer, RemoteScorer, scorer_step
from parallel.store import StepStore
from parallel.tag import Assistant, FragmentBoard, GroupAssistant
from parallel.topology import ProcessGroups, Topology
from prompts.sets import eval_records, load_prompts
from rewards import RewardSet, reward_model_paths
from rollout import Generator, VersionSync, generator_step
from runtime.guard import RunGuard
from telemetry.tracing import Slowdown, Tracer, summarize_step
from trainer import Trainer, trainer_step



@dataclass
class RankContext:
    """What every role's step needs to know about its rank, passed as one object."""

    cfg: RunConfig
    facts: RunFacts
    rank: int
    device: torch.device
    tracer: Tracer
    adapter: DiTAdapter
    sampling: sampler.SamplingConfig
    records: list  # list[prompts.PromptRecord]: the training prompt set
    intake: object  # parallel.intake.ChunkIntake or TransitionIntake: routing and the trainer's intake
    slowdown: Slowdown  # --debug-slow-rank: wraps every kind of this rank's work

    @property
    def topo(self) -> Topology:
        return self.facts.topology


def run(cfg: RunConfig, facts: RunFacts, rank: int) -> int:
    """One rank's run; returns its exit code (0 done, runguard.EXIT_STOPPED after a signal)."""
    topo = facts.topology
    device = _device(cfg)
    torch.manual_seed(cfg.seed)
    out_dir = cfg.output.output_dir
    store = StepStore(cfg.topology.dist_timeout_s)
    groups = ProcessGroups.create(topo, cfg.topology.dist_timeout_s)
    t = cfg.topology
    guard = RunGuard(topo, rank, store, heartbeat_timeout_s=t.heartbeat_timeout_s, stop_grace_s=t.stop_grace_s,
                     dist_timeout_s=t.dist_timeout_s, groups=_member_groups(topo, rank, groups),
                     start_step=facts.resume.step if facts.resume else 0).start()
    if rank == 0:
        runfolder.prepare(cfg, facts.resume, say=runguard.say)  # before any other rank writes there
    # Every rank builds version 0 identically: same weights, same seeded LoRA init.
    adapter = load_model(cfg.model.model, cfg.model.model_path, preset=cfg.model.preset, seed=cfg.seed,
                         dtype=model_dtypes(cfg.model.dtype, device), device=device)
    set_attention(adapter, cfg.model.attention)
    lora_config = None
    if facts.lora:
        apply_lora(adapter.transformer, cfg.optim.lora_rank, cfg.optim.lora_alpha, cfg.optim.lora_targets, cfg.seed)
        lora_config = adapter.transformer.peft_config["default"]
    sampling = _sampling(cfg, adapter)
    adapter.latent_shape(sampling.height, sampling.width, sampling.num_frames)  # a bad size fails alike on every rank
    records = load_prompts(cfg.rl.prompts)
    shapes = buckets.shape_table(adapter, records, sampling, cfg.rl.prompts)  # before any wait: names a bad line
    if cfg.output.eval_every:
        buckets.check_shapes(adapter, eval_records(cfg.output.eval_prompts, cfg.output.eval_num_prompts), sampling,
                             cfg.output.eval_prompts)
    capacity.check_memory_budget(cfg.topology.memory_budget_gb, adapter.transformer, facts)  # same on every rank
    tracer = Tracer(rank, topo.role(rank), enabled=cfg.output.trace,
                    sync=torch.cuda.synchronize if device.type == "cuda" else None)
    is_gen, is_train = topo.is_generator(rank), topo.is_trainer(rank)
    rl = cfg.rl
    intake = make_intake(facts.tsp, TrainingSpec.of(cfg, sampling), topo.trainer_ranks, lambda r: topo.replica_ranks(r)[-1],
                         facts.train_micro_batch, topo.trainer_ranks.index(rank) if is_train else None, tracer)
    slow = cfg.output.debug_slow_rank
    slowdown = Slowdown(slow[1] if slow and slow[0] == rank else 1.0)
    ctx = RankContext(cfg, facts, rank, device, tracer, adapter, sampling, records, intake, slowdown)
    speeds = _probe_speeds(ctx, out_dir, shapes)  # sync point: every rank's speed, before FSDP shards the model
    if shapes is not None:  # the dispatch's costs, calibrated by the generators' chunk times
        shapes = buckets.measured_table(shapes, [speeds[g]["shape_s"] for g in topo.generator_ranks])
    trainer = Trainer(cfg, adapter, sampling, groups.trainers, facts.train_sharding, slowdown) if is_train else None

    def reward_set():
        return RewardSet(rl.reward, device=device, model_paths=reward_model_paths(rl.reward_model))

    def make_generator(scorer):
        return Generator(adapter, sampling, scorer, records, seed=cfg.seed, negative_prompt=cfg.sampling.negative_prompt,
                         same_group_noise=cfg.sampling.same_group_noise, adv_clip=rl.adv_clip,
                         drop_zero_std=rl.drop_zero_std, autocast_ctx=lambda: autocast(device, cfg.model.dtype),
                         slowdown=slowdown)

    scorer_rewards = reward_set() if topo.is_scorer(rank) else None
    generator = None
    if is_gen:
        generator = make_generator(RemoteScorer(topo.scorer_ranks) if topo.scorer_ranks else LocalScorer(reward_set()))
    running = RunningStd()
    begin = runstate.restore(facts, rank, adapter, trainer, running, store)  # --resume: the checkpoint's state
    start, std_history = begin.step, begin.std_history
    all_names = _publish_names(adapter, facts.lora)
    runstate.check_same_weights(adapter, all_names, begin.version)  # every rank starts from its version
    layouts = _stage_layouts(ctx) if topo.gap_stages > 1 else {}
    shares = replica_speeds({g: speeds[g]["generate_s"] for g in topo.generator_ranks},
                            [topo.replica_ranks(r) for r in range(topo.num_replicas)])
    publish_names = {g: _stage_names(adapter, all_names, layouts.get(g)) for g in topo.generator_ranks}
    replica = None
    if is_gen and layouts:
        release_other_blocks(adapter, layouts[rank].blocks)
        replica = PipelinedReplica(generator, layouts[rank])
    assistant = None
    if is_train and facts.tag:
        helper = GroupAssistant if facts.train_sharding == "fsdp" else Assistant  # FSDP trainers generate together
        replica_s = sum(speeds[g]["generate_s"] for g in topo.generator_ranks) / len(topo.generator_ranks)
        assistant = helper(ctx, make_generator(LocalScorer(reward_set())), store, facts.num_trainers,
                           topo.trainer_ranks.index(rank), trainer_ratio=speeds[rank]["generate_s"] / replica_s)
    publisher = _publisher(cfg, rank == topo.trainer_ranks[0], keep=facts.tcss) if is_train and facts.disagg else None
    if is_train and compress.lossy(cfg.topology.publish_compression):  # every placement trains through the codec
        trainer.start_codec(cfg.topology.publish_compression, all_names, runstate.residual(facts))
    versions = None
    if facts.disagg and is_gen:
        receiver = publish.WeightReceiver(_params(adapter, publish_names[rank]))
        versions = VersionSync(receiver, store, topo.trainer_ranks[0], begin.version, 1 if facts.tcss else 0,
                               layouts.get(rank), topo.replica_of(rank), tracer)
    if facts.tcss and is_train:  # the generators' version at the next checkpoint; resent at a resume
        runstate.publish_start(facts, rank, trainer, publisher, publish_names, start,
                               facts.resume is not None and facts.resume.has_stale, store)
    deferred: list = []  # TCSS: (step, sends) still in flight
    logging = rank == facts.log_rank
    in_place = facts.resume is not None and facts.resume.same_folder
    logger = MetricsLogger(out_dir, enabled=logging, purge_step=start if in_place else None)
    for row in runfolder.rows_to_replay(out_dir, start) if logging and in_place else []:
        logger.log_tensorboard(row["step"], {k: v for k, v in row.items() if k not in ("step", "time")})
    progress = tqdm(total=rl.steps, initial=start, desc="steps", dynamic_ncols=True) if logging else None
    previous_end = None  # the logging rank's end of the previous step: perf/step_s is the loop's period
    saved = start

    def save(done: int) -> None:
        nonlocal saved
        if trainer is not None:
            guard.set_phase("checkpoint")
            checkpoint.save_run_state(out_dir, done, trainer, adapter, running, lora_config,
                                      write=rank == topo.trainer_ranks[0],
                                      extra=runstate.extra_state(trainer, std_history, done),
                                      stale=publisher.kept(done - 1) if facts.tcss else None, config=cfg.to_dict(),
                                      keep=cfg.output.keep_checkpoints, export_dtype=cfg.output.export_dtype)
        saved = done

    try:
        if cfg.output.eval_every and start == 0:
            _evaluate(cfg, adapter, sampling, topo, rank, 0, logger, tracer, groups.trainers)  # the base model
        for step in range(start, rl.steps):
            if guard.stop_before(step):  # a signal on some rank: every rank stops before the same step
                break
            guard.set_timeouts(relaxed=_saves_or_evaluates(cfg, step) or _saves_or_evaluates(cfg, step - 1))
            plan = facts.plan(cfg, step, shares, shapes)
            step_start = time.time()
            local: dict = {}
            gen_out = []
            if is_gen:
                gen_out, local = generator_step(ctx, generator, versions, plan,
                                                lambda: _reward_std(cfg, store, step), replica,
                                                store, deferred if facts.tcss else None)
            if scorer_rewards is not None:
                scorer_step(ctx, scorer_rewards, plan, _image_source(ctx, store, plan))
            train_stats = None
            if is_train:
                train_stats = trainer_step(ctx, trainer, plan, local, publish_names, publisher, assistant, store,
                                           _reward_std(cfg, store, step))
                if assistant is not None:
                    gen_out = gen_out + assistant.results  # TAG fragments: their rewards count too
            step_end = time.time()
            record = {"rank": rank, "role": topo.role(rank), "start_s": step_start, "end_s": step_end,
                      "busy_s": tracer.busy_seconds(step) if cfg.output.trace else step_end - step_start,
                      "train": train_stats, "samples": _samples(cfg, step, gen_out),
                      "rewards": _merge_rewards([r.rewards for r in gen_out]),
                      "zero_std": sum((r.zero_std for r in gen_out), [])}
            store.put(f"rec/{step}/{rank}", record)  # no rank waits here: the logging rank collects
            if logging:
                previous_end = _log_step(store, logger, progress, running, plan, topo.world_size, previous_end)
                std_history[step] = running.std
            guard.step_done(step_end - step_start)
            done = step + 1
            if (cfg.output.save_every and done % cfg.output.save_every == 0) or done == rl.steps:
                save(done)
            if cfg.output.eval_every and (done % cfg.output.eval_every == 0 or done == rl.steps):
                guard.set_phase("evaluation")
                _evaluate(cfg, adapter, sampling, topo, rank, done, logger, tracer, groups.trainers)
        last = guard.stop_at if guard.stopping else rl.steps
        guard.set_timeouts(relaxed=True)
        guard.set_phase("exit")
        if versions is not None:
            versions.drain(last, last)  # the trainers publish after every step
        for _, handles in deferred:  # after the drain: the trainers need the publications to get there
            for h in handles:
                h.wait()
        if guard.stopping and saved != last and last > start:
            save(last)  # a signal stopped the run: the steps it finished are kept
        if guard.stopping:
            path = checkpoint.checkpoint_dir(out_dir, last)
            line = (f"stopped on a signal after step {last - 1}: checkpoint {path}; continue with --resume {out_dir} "
                    f"--output-dir {out_dir}" if last > start else
                    "stopped on a signal before this run's first step: nothing new to save")
            runguard.write_error_file(line)  # torchrun's summary shows why the exit code is 4
            if logging:
                runguard.say(line)
    finally:
        if progress is not None:
            progress.close()
        logger.close()
        if cfg.output.trace:
            tracer.save(os.path.join(out_dir, "trace", f"rank{rank}.json"))
    return runguard.EXIT_STOPPED if guard.stopping else runguard.EXIT_OK


def _member_groups(topo: Topology, rank: int, groups: ProcessGroups) -> list:
    """The process groups this rank belongs to (their timeouts adapt to the step time)."""
    out = [dist.group.WORLD]
    if topo.is_trainer(rank) and groups.trainers is not dist.group.WORLD:
        out.append(groups.trainers)
    return out


def _saves_or_evaluates(cfg: RunConfig, step: int) -> bool:
    """Step `step` ends with a checkpoint or an evaluation (every rank knows the schedule)."""
    done, o = step + 1, cfg.output
    return done == cfg.rl.steps or bool(o.save_every and done % o.save_every == 0) or \
        bool(o.eval_every and done % o.eval_every == 0)


def _device(cfg: RunConfig) -> torch.device:
    if cfg.model.device == "cpu":
        return torch.device("cpu")
    dev = resolve_device(cfg.model.device)
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" else dev


def _sampling(cfg: RunConfig, adapter) -> sampler.SamplingConfig:
    s = cfg.sampling
    return sampler.SamplingConfig.for_adapter(
        adapter, height=s.height, width=s.width, num_steps=s.sample_steps, sde_type=s.sde_type,
        noise_level=s.noise_level, guidance=s.guidance, cfg_scale=s.cfg_scale, seed=cfg.seed,
        num_frames=s.num_frames, sde_window=s.sde_window)


def _samples(cfg: RunConfig, step: int, gen_out: list) -> dict | None:
    """Thumbnails of this step's first samples, for the logging rank's grid: from the rank that
    generated fragment 0, every --log-images-every steps."""
    every = cfg.output.log_images_every
    if not (gen_out and every and step % every == 0 and gen_out[0].chunks[0].fragment == 0):
        return None
    images = thumbnails(gen_out[0].images, 16)
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).contiguous()  # what the grid keeps anyway
    return {"shape": list(pixels.shape), "pixels": base64.b64encode(pixels.numpy().tobytes()).decode(),
            "prompts": gen_out[0].prompts[:len(images)]}  # the store carries JSON


def _log_step(store: StepStore, logger: MetricsLogger, progress, running: RunningStd, plan, world_size: int,
              previous_end: float | None) -> float:
    """The logging rank: collect every rank's step record, update the running reward std (published
    for the generators of the next steps), log scalars and the sample grid, warn about steps that
    train nothing. Returns the step's end."""
    step = plan.step
    everyone = [store.get(f"rec/{step}/{r}") for r in range(world_size)]  # rank wait: each rank's record
    for r in range(world_size):
        store.delete(f"rec/{step}/{r}")
    all_rewards = _merge_rewards([rec["rewards"] for rec in everyone])
    running.update(all_rewards.get("combined", []))
    store.put(f"std/{step}", running.std)
    if step >= 3 and store.ready(f"std/{step - 3}"):
        store.delete(f"std/{step - 3}")
    scalars = _step_scalars(everyone, all_rewards, plan.num_samples, previous_end)
    logger.log(step, scalars)
    samples = next((rec["samples"] for rec in everyone if rec["samples"] is not None), None)
    if samples is not None:
        pixels = torch.frombuffer(bytearray(base64.b64decode(samples["pixels"])), dtype=torch.uint8)
        logger.log_images(step, "samples", pixels.reshape(samples["shape"]).float() / 255, samples["prompts"])
    progress.update(1)
    progress.write(_summary_line(step, scalars))
    if scalars["train/all_groups_zero_std"]:
        progress.write(f"warning: step {step}: every group's rewards are equal, so every advantage is 0 and the "
                       f"update has no policy gradient (a reward that cannot tell the samples apart?)")
    return max(rec["end_s"] for rec in everyone)



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


def _reward_std(cfg: RunConfig, store: StepStore, step: int) -> float | None:
    """The advantage std: None (each group's own) or the running std of the batches before this
    one, published by the logging rank (with TCSS, of the batches before the previous one; a
    resumed run's logging rank publishes the checkpoint's last two first)."""
    if cfg.rl.std_mode != "running":
        return None
    last = step - 1 - (1 if cfg.topology.tcss else 0)
    return None if last < 0 else store.get(f"std/{last}")


def _publisher(cfg: RunConfig, sends: bool, keep: bool) -> publish.WeightPublisher:
    """The trainers' publisher. With `keep` (TCSS) the sending trainer keeps the last two versions
    for checkpoints."""
    return publish.WeightPublisher(compression=cfg.topology.publish_compression,
                                   link_mbps=cfg.output.debug_link_bandwidth, keep=keep and sends)


def _probe_speeds(ctx: RankContext, out_dir: str, shapes=None) -> list[dict | None]:
    """Every rank's start-up speed probe (capacity.probe_speed; scorer ranks: None), gathered on
    every rank; the first rank writes them to DIR/speeds.json. With prompts of several shapes,
    generator ranks also time a chunk at each shape ("shape_s", for the dispatch's costs)."""
    mine = None
    if not ctx.topo.is_scorer(ctx.rank):
        amp = lambda: autocast(ctx.device, ctx.cfg.model.dtype)  # noqa: E731
        mine = capacity.probe_speed(ctx.adapter, ctx.sampling, ctx.cfg.rl.micro_batch, ctx.slowdown, amp)
        if shapes is not None and ctx.topo.is_generator(ctx.rank):
            seconds = capacity.probe_shapes(ctx.adapter, ctx.sampling, ctx.cfg.rl.micro_batch, sorted(shapes.costs,
                                            key=buckets.shape_name), ctx.slowdown, amp)
            mine["shape_s"] = {buckets.shape_name(k): s for k, s in seconds.items()}
    everyone = [None] * ctx.topo.world_size
    dist.all_gather_object(everyone, mine)  # sync point
    if ctx.rank == 0:
        with open(os.path.join(out_dir, "speeds.json"), "w") as f:
            json.dump([{"rank": r, "role": ctx.topo.role(r), **(s or {})} for r, s in enumerate(everyone)], f, indent=1)
    return everyone


def _stage_layouts(ctx: RankContext) -> dict:
    """GAP stages: every generator rank measures its per-block cost (scaled by its slow-down);
    every rank then computes the same partition of every replica from the gathered measurements."""
    cfg, topo, rank, adapter = ctx.cfg, ctx.topo, ctx.rank, ctx.adapter
    costs = None
    if topo.is_generator(rank):
        with autocast(adapter.device, cfg.model.dtype):
            costs = [c * ctx.slowdown.factor for c in measure_block_costs(adapter, ctx.sampling, cfg.rl.micro_batch)]
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


def _merge_rewards(parts: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Concatenate per-reward score lists (of fragments, or of ranks)."""
    out: dict[str, list[float]] = {}
    for rewards in parts:
        for k, v in rewards.items():
            out.setdefault(k, []).extend(v)
    return out


def _step_scalars(records, rewards, num_samples, previous_end: float | None) -> dict[str, float]:
    scalars: dict[str, float] = {}
    comb = torch.tensor(rewards.get("combined", [float("nan")]), dtype=torch.float64)
    scalars["reward/mean"] = comb.mean().item()
    scalars["reward/std"] = comb.std(unbiased=False).item()
    for k, v in rewards.items():
        if k != "combined":
            t = torch.tensor(v, dtype=torch.float64)
            scalars[f"reward/{k}/mean"] = t.mean().item()
            scalars[f"reward/{k}/std"] = t.std(unbiased=False).item()
    zero = [z for rec in records for z in rec["zero_std"]]
    scalars["train/zero_std_fraction"] = sum(zero) / max(1, len(zero))
    scalars["train/all_groups_zero_std"] = float(bool(zero) and all(zero))  # summed over steps: their count
    trains = [rec["train"] for rec in records if rec["train"] is not None]
    train = dict(trains[0])
    if "tag_fragments" in train:  # TAG: fragments generated by trainers, and BTS's predicted step time
        train.pop("tag_fragments")
        predicted = train.pop("tag_predicted_s")
        scalars["tag/fragments"] = float(sum(t["tag_fragments"] for t in trains))
        if predicted is not None:
            scalars["tag/predicted_step_s"] = predicted
    scalars.update(train)
    summary = summarize_step([{k: rec[k] for k in ("role", "busy_s", "start_s", "end_s")} for rec in records],
                             previous_end)
    scalars["perf/step_s"] = summary["step_s"]
    scalars["perf/samples_per_s"] = num_samples / summary["step_s"]
    scalars["perf/bubble_fraction"] = summary["bubble_fraction"]
    for k, v in summary.items():
        if k.startswith("busy_fraction/"):
            scalars[f"perf/{k}"] = v
    return scalars


def _summary_line(step: int, s: dict) -> str:
    return (f"step {step}: reward {s['reward/mean']:.4f} +- {s['reward/std']:.4f}  loss {s['train/loss']:.3e}  "
            f"approx_kl {s['train/approx_kl']:.2e}  clipfrac {s['train/clipfrac']:.3f}  "
            f"{s['perf/step_s']:.2f} s/step  {s['perf/samples_per_s']:.1f} samples/s  "
            f"bubble {s['perf/bubble_fraction']:.2f}")


def _evaluate(cfg: RunConfig, adapter, sampling, topo: Topology, rank: int, done: int, logger, tracer,
              group) -> None:
    """Trainer ranks hold the newest version (k+1 right after update k) and the whole model, so they
    evaluate: the held-out prompts of each shape are split evenly over them (equal counts, so FSDP
    ranks run equally many forwards); results are gathered on the first trainer, which logs."""
    out = cfg.output
    records = eval_records(out.eval_prompts, out.eval_num_prompts, out.eval_samples_per_prompt)
    evaluators = list(topo.trainer_ranks)
    if rank not in evaluators:
        return
    default = buckets.default_shape(sampling)
    names = [buckets.shape_name(buckets.record_shape(r, default)) for r in records]
    share = buckets.evaluation_share(names, len(evaluators), evaluators.index(rank))
    rows = [j for j, _ in share]  # record j is sample j: its fixed seed
    rewards = RewardSet(cfg.rl.reward, device=adapter.device, model_paths=reward_model_paths(cfg.rl.reward_model))
    with tracer.span("evaluate", "eval", done):
        scores, images = evaluation.evaluate(adapter, sampling, [records[j] for j in rows], rewards,
                                             batch_size=cfg.rl.micro_batch, sample_ids=rows,
                                             negative_prompt=cfg.sampling.negative_prompt, thumbnail=thumbnails,
                                             progress=rank == evaluators[0])
    real = [n for n, (_, keep) in enumerate(share) if keep]
    # Only what the grid shows travels, as uint8 thumbnails.
    result = [(rows[n], {k: v[n] for k, v in scores.items()},
               (images[n].clamp(0, 1) * 255).round().to(torch.uint8) if rows[n] < LOGGED_IMAGES else None)
              for n in real]
    everyone = [None] * len(evaluators)
    dist.all_gather_object(everyone, result, group=group)  # sync point: the trainer ranks
    if rank == evaluators[0]:
        got = sorted((item for part in everyone for item in part), key=lambda item: item[0])  # record order
        scores = {k: [item[1][k] for item in got] for k in got[0][1]}
        logger.log(done, evaluation.summarize(scores, names))
        shown = [(j, image.float() / 255) for j, _, image in got if image is not None][:LOGGED_IMAGES]
        same = len({tuple(image.shape) for _, image in shown}) == 1
        grid = torch.stack([image for _, image in shown]) if same else [image for _, image in shown]
        logger.log_images(done, "eval", grid, [records[j].prompt for j, _ in shown])
