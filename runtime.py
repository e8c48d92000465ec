"""The step loop of one rank. Every step k (DESIGN.md 5.1, naive disaggregation):

  generators: install version k -> generate, decode, score the fragments of their replica ->
              send each chunk to its trainer -> receive version k+1 (staged until the next step)
  trainers:   receive (or, colocated, take) their chunks -> forward/backward each transition ->
              one optimizer update -> publish version k+1 to every generator
  all ranks:  gather step statistics and trace records; rank 0 logs them

Colocated mode runs both halves on every rank with no transfer and no publication.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import sampler
from config import RunConfig
from context import RankContext
from models import load_model, resolve_device, set_attention
from models.lora import apply_lora
from parallel import publish
from parallel.plan import plan_step
from parallel.store import StepStore
from parallel.topology import ProcessGroups, Topology
from prompts import load_prompts
from tracing import Tracer, summarize_step


def _device(cfg: RunConfig) -> torch.device:
    if cfg.model.device == "cpu":
        return torch.device("cpu")
    dev = resolve_device(cfg.model.device)
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" else dev


def _sampling(cfg: RunConfig, adapter) -> sampler.SamplingConfig:
    s = cfg.sampling
    window = tuple(int(x) for x in s.sde_window.split(":")) if s.sde_window else None
    return sampler.SamplingConfig.for_adapter(
        adapter, height=s.height, width=s.width, num_steps=s.sample_steps, sde_type=s.sde_type,
        noise_level=s.noise_level, guidance=s.guidance, cfg_scale=s.cfg_scale, seed=cfg.seed,
        num_frames=s.num_frames, sde_window=window)


def _slow_factor(cfg: RunConfig, rank: int) -> float:
    """--debug-slow-rank R:FACTOR (tests and benchmarks only)."""
    if not cfg.output.debug_slow_rank:
        return 1.0
    r, factor = cfg.output.debug_slow_rank.split(":")
    return float(factor) if int(r) == rank else 1.0


def run(cfg: RunConfig, topo: Topology, rank: int) -> None:
    from rewards import RewardSet, reward_model_paths
    from rollout import Generator, VersionSync, generator_step
    from scoring import LocalScorer, RemoteScorer, scorer_step
    from trainer import Trainer, autocast, trainer_step

    device = _device(cfg)
    torch.manual_seed(cfg.seed)
    out_dir = cfg.output.output_dir
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        cfg.save(os.path.join(out_dir, "config.json"))
    # Every rank builds version 0 identically: same weights, same seeded LoRA init.
    adapter = load_model(cfg.model.model, cfg.model.model_path, preset=cfg.model.preset, seed=cfg.seed,
                         device=device)
    set_attention(adapter, cfg.model.attention)
    lora_config = None
    if cfg.optim.lora_rank > 0:
        apply_lora(adapter.transformer, cfg.optim.lora_rank, cfg.optim.lora_alpha, cfg.optim.lora_targets, cfg.seed)
        lora_config = adapter.transformer.peft_config["default"]
    sampling = _sampling(cfg, adapter)
    records = load_prompts(cfg.rl.prompts)
    groups = ProcessGroups.create(topo, cfg.topology.dist_timeout_s)
    tracer = Tracer(rank, topo.role(rank), enabled=cfg.output.trace,
                    sync=torch.cuda.synchronize if device.type == "cuda" else None)
    is_gen, is_train = topo.is_generator(rank), topo.is_trainer(rank)
    shard = cfg.topology.colocated_sharding if topo.mode == "colocated" else cfg.topology.train_sharding
    trainer = Trainer(cfg, adapter, sampling, groups.trainers if is_train else None, shard) if is_train else None
    def reward_set():
        return RewardSet(cfg.rl.reward, device=device, model_paths=reward_model_paths(cfg.rl.reward_model))

    def make_generator(rewards):
        return Generator(adapter, sampling, rewards, records, seed=cfg.seed, negative_prompt=cfg.sampling.negative_prompt,
                         same_group_noise=cfg.sampling.same_group_noise, adv_clip=cfg.rl.adv_clip,
                         drop_zero_std=cfg.rl.drop_zero_std, autocast_ctx=lambda: autocast(device, cfg.model.dtype))

    scorer_rewards = reward_set() if topo.is_scorer(rank) else None
    generator = None
    if is_gen:
        generator = make_generator(RemoteScorer(topo.scorer_ranks) if topo.scorer_ranks else LocalScorer(reward_set()))
    disagg = topo.mode == "disagg"

    from algorithm import RunningStd
    from metrics import MetricsLogger
    from pipeline import PipelinedReplica, release_other_blocks

    running = RunningStd()
    start = 0
    if cfg.output.resume:
        start = _resume(cfg, adapter, trainer, running)
    all_names = _publish_names(adapter, cfg)
    _check_same_weights(adapter, all_names, trainer)  # every rank starts from the same version
    layouts = _stage_layouts(cfg, topo, rank, adapter, sampling) if topo.gap_stages > 1 else {}
    publish_names = {g: _stage_names(adapter, all_names, layouts.get(g)) for g in topo.generator_ranks}
    replica = None
    if is_gen and layouts:
        release_other_blocks(adapter, layouts[rank].blocks)
        replica = PipelinedReplica(generator, layouts[rank])
    receiver = publish.WeightReceiver(_params(adapter, publish_names[rank])) if (disagg and is_gen) else None
    assistant = None
    ctx = RankContext(cfg, topo, rank, device, tracer, adapter, sampling, records)
    # The first trainer rank logs: trainers finish every step, while generators may run ahead (TCSS).
    log_rank = topo.trainer_ranks[0]
    store = StepStore(cfg.topology.dist_timeout_s)
    if is_train and cfg.topology.tag:
        from tag import Assistant, GroupAssistant

        helper = GroupAssistant if shard == "fsdp" else Assistant  # FSDP trainers generate together
        assistant = helper(ctx, make_generator(reward_set()), store, len(topo.trainer_ranks),
                           topo.trainer_ranks.index(rank))
    deferred: list = []  # TCSS: (step, sends) still in flight
    versions = None
    if receiver is not None:
        versions = VersionSync(receiver, store, topo.trainer_ranks[0], start, 1 if cfg.topology.tcss else 0,
                               layouts.get(rank), topo.replica_of(rank), tracer)
    logger = MetricsLogger(out_dir, enabled=(rank == log_rank))
    images = logger if rank == log_rank else _ImageLogger(out_dir, is_gen)
    slow = _slow_factor(cfg, rank)
    progress = _progress(cfg, start) if rank == log_rank else None
    previous_end = None  # the logging rank's end of the previous step: perf/step_s is the loop's period
    try:
        if cfg.output.eval_every and start == 0:
            _evaluate(cfg, adapter, sampling, topo, rank, 0, logger, tracer, groups.trainers)  # the base model
        for step in range(start, cfg.rl.steps):
            plan = plan_step(step, seed=cfg.seed, num_prompts=len(records), prompts_per_step=cfg.rl.prompts_per_step,
                             group_size=cfg.rl.group_size, micro_batch=cfg.rl.micro_batch,
                             num_replicas=topo.num_replicas, num_trainers=len(topo.trainer_ranks),
                             fragment_groups=cfg.topology.fragment_groups or None, colocated=not disagg)
            step_start = time.time()
            local: dict = {}
            gen_out = []
            if is_gen:
                gen_out, local = generator_step(ctx, generator, versions, plan,
                                                lambda: _reward_std(cfg, store, running, step, start), slow,
                                                replica, store, deferred if cfg.topology.tcss else None)
            if scorer_rewards is not None:
                scorer_step(ctx, scorer_rewards, plan, _image_source(ctx, store, plan))
            train_stats = None
            if is_train:
                train_stats = trainer_step(ctx, trainer, plan, local, publish_names, assistant, store,
                                           _reward_std(cfg, store, running, step, start))
                if assistant is not None:
                    gen_out = gen_out + assistant.results  # TAG fragments: their rewards count too
            step_end = time.time()
            record = {"rank": rank, "role": topo.role(rank), "start_s": step_start, "end_s": step_end,
                      "busy_s": tracer.busy_seconds(step) if cfg.output.trace else step_end - step_start,
                      "train": train_stats,
                      "rewards": _merge_rewards([r.rewards for r in gen_out]), "zero_std": sum((r.zero_std for r in gen_out), [])}
            if gen_out and cfg.output.log_images_every and step % cfg.output.log_images_every == 0 \
                    and gen_out[0].chunks[0].fragment == 0:
                images.log_images(step, "samples", gen_out[0].images[:16], gen_out[0].prompts[:16])
            store.put(f"rec/{step}/{rank}", record)  # no rank waits here: the logging rank collects
            if rank == log_rank:
                everyone = [store.get(f"rec/{step}/{r}") for r in range(topo.world_size)]
                for r in range(topo.world_size):
                    store.delete(f"rec/{step}/{r}")
                all_rewards = _merge_rewards([rec["rewards"] for rec in everyone])
                running.update(all_rewards.get("combined", []))
                store.put(f"std/{step}", running.std)
                if step >= 3 and store.ready(f"std/{step - 3}"):
                    store.delete(f"std/{step - 3}")
                scalars = _step_scalars(everyone, all_rewards, plan.num_samples, previous_end)
                previous_end = max(rec["end_s"] for rec in everyone)
                logger.log(step, scalars)
                if progress is not None:
                    progress.update(1)
                    progress.write(_summary_line(step, scalars))
            done = step + 1
            if (cfg.output.save_every and done % cfg.output.save_every == 0) or done == cfg.rl.steps:
                _save(cfg, adapter, trainer, topo, rank, done, running, lora_config)
            if cfg.output.eval_every and (done % cfg.output.eval_every == 0 or done == cfg.rl.steps):
                _evaluate(cfg, adapter, sampling, topo, rank, done, logger, tracer, groups.trainers)
        if versions is not None:
            versions.drain(cfg.rl.steps, cfg.rl.steps)  # the trainers publish after every step
        for _, handles in deferred:  # after the drain: the trainers need the publications to get there
            for h in handles:
                h.wait()
    finally:
        if progress is not None:
            progress.close()
        logger.close()
        images.close()
        if cfg.output.trace:
            tracer.save(os.path.join(out_dir, "trace", f"rank{rank}.json"))


def _image_source(ctx: RankContext, store: StepStore, plan):
    """Where a scorer rank receives fragment f's images from: the last stage of the replica that
    generates it, planned or, with TAG, the one that claimed it. None: a trainer claimed it (TAG),
    and scores it on its own rank."""
    topo = ctx.topo
    if not ctx.cfg.topology.tag:
        return lambda f: topo.replica_ranks(f.replica)[-1]
    from tag import FragmentBoard

    board = FragmentBoard(store, plan.step, len(plan.fragments))

    def source(f):
        owner = board.wait_owner(f.index)
        return None if owner["replica"] is None else topo.replica_ranks(owner["replica"])[-1]

    return source


def _params(adapter, names: list[str]) -> dict[str, torch.Tensor]:
    params = dict(adapter.transformer.named_parameters())
    return {n: params[n] for n in names}


def _publish_names(adapter, cfg: RunConfig) -> list[str]:
    """LoRA runs send only the adapter tensors; full fine-tuning sends every transformer weight."""
    named = adapter.transformer.named_parameters()
    if cfg.optim.lora_rank > 0:
        return [n for n, _ in named if ".lora_" in n]
    return [n for n, _ in named]


def _reward_std(cfg: RunConfig, store: StepStore, running, step: int, start: int) -> float | None:
    """The advantage std: None (each group's own) or the running std of the batches before this
    one, published by the logging rank (with TCSS, of the batches before the previous one)."""
    if cfg.rl.std_mode != "running":
        return None
    last = step - 1 - (1 if cfg.topology.tcss else 0)
    return running.std if last < start else store.get(f"std/{last}")


class _ImageLogger:
    """The sample grids of a generator rank (the logging rank is a trainer and has no images)."""

    def __init__(self, out_dir: str, enabled: bool):
        self.out_dir, self.enabled, self.logger = out_dir, enabled, None

    def log_images(self, step, tag, images, captions) -> None:
        if self.enabled and self.logger is None:
            from metrics import MetricsLogger

            self.logger = MetricsLogger(self.out_dir)
        if self.logger is not None:
            self.logger.log_images(step, tag, images, captions)

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()


def _stage_layouts(cfg: RunConfig, topo: Topology, rank: int, adapter, sampling) -> dict:
    """GAP stages: every generator rank measures its per-block cost; every rank then computes the
    same partition of every replica from the gathered measurements."""
    from pipeline import StageLayout, measure_block_costs, plan_stages
    from trainer import autocast

    costs = None
    if topo.is_generator(rank):
        with autocast(adapter.device, cfg.model.dtype):
            costs = measure_block_costs(adapter, sampling, cfg.rl.micro_batch)
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
    from pipeline import stage_param_names

    return names if layout is None else stage_param_names(adapter, names, layout.blocks, layout.first, layout.last)


def _check_same_weights(adapter, names: list[str], trainer) -> None:
    """Version 0 must be identical on every rank (same checkpoint, same seeded LoRA init)."""
    from trainer import full_tensor

    params = dict(adapter.transformer.named_parameters())
    local = publish.state_checksum({n: full_tensor(params[n].detach()) for n in names})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)  # sync point
    if len(set(everyone)) != 1:
        raise RuntimeError(f"ranks start from different weights: checksums by rank {everyone}")


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


def _progress(cfg: RunConfig, start: int):
    from tqdm import tqdm

    return tqdm(total=cfg.rl.steps, initial=start, desc="steps", dynamic_ncols=True)


def _save(cfg: RunConfig, adapter, trainer, topo: Topology, rank: int, done: int, running, lora_config) -> None:
    """Trainer ranks gather the full state (collectives under FSDP); the first trainer writes it."""
    from checkpoint import checkpoint_dir, save_checkpoint

    if trainer is None:
        return
    weights = trainer.full_weights()
    ema = trainer.ema_weights()
    optim = _optimizer_state(trainer)
    if rank != topo.trainer_ranks[0]:
        return
    state = {"optimizer": optim, "num_updates": trainer.num_updates, "running_std": running.state_dict(),
             "torch_rng": torch.get_rng_state(), "step": done}
    save_checkpoint(checkpoint_dir(cfg.output.output_dir, done), adapter, weights, lora=cfg.optim.lora_rank > 0,
                    step=done, trainer_state=state, ema=ema, lora_config=lora_config)


def _optimizer_state(trainer) -> dict:
    if trainer.sharding != "fsdp":
        return trainer.optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(trainer.adapter.transformer, trainer.optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _resume(cfg: RunConfig, adapter, trainer, running) -> int:
    """Every rank installs the checkpoint's weights; trainers also restore optimizer and EMA."""
    import json

    from safetensors.torch import load_file

    from checkpoint import install_weights, latest_checkpoint, read_trained_weights

    path = latest_checkpoint(cfg.output.resume)
    with open(os.path.join(path, "state.json")) as f:
        step = json.load(f)["step"]
    weights, _ = read_trained_weights(path)
    install_weights(adapter.transformer, weights)
    state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    running.load_state_dict(state["running_std"])
    if trainer is not None:
        trainer.num_updates = state["num_updates"]
        if trainer.sharding == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(trainer.adapter.transformer, trainer.optimizer, state["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
        else:
            trainer.optimizer.load_state_dict(state["optimizer"])
        ema_path = os.path.join(path, "ema.safetensors")
        if trainer.ema is not None and os.path.isfile(ema_path):
            ema = load_file(ema_path)
            with torch.no_grad():
                for e, n in zip(trainer.ema, trainer.names):
                    e.copy_(ema[n].to(e.device, e.dtype)) if not hasattr(e, "device_mesh") else None
    torch.set_rng_state(state["torch_rng"])
    return step


def _evaluate(cfg: RunConfig, adapter, sampling, topo: Topology, rank: int, done: int, logger, tracer,
              group) -> None:
    """Trainer ranks hold the newest version (k+1 right after update k) and the whole model, so they
    evaluate: the held-out prompts are split evenly over them (equal counts, so FSDP ranks run
    equally many forwards); results are gathered on rank 0."""
    from evaluation import eval_records, evaluate, summarize
    from rewards import RewardSet, reward_model_paths

    out = cfg.output
    records = eval_records(out.eval_prompts, out.eval_num_prompts, out.eval_samples_per_prompt)
    evaluators = list(topo.trainer_ranks)
    per = -(-len(records) // len(evaluators))
    result = None
    if rank in evaluators:
        lo = evaluators.index(rank) * per
        mine = records[lo:lo + per]
        padded = mine + [records[-1]] * (per - len(mine))  # equal forward counts on every generator
        rewards = RewardSet(cfg.rl.reward, device=adapter.device, model_paths=reward_model_paths(cfg.rl.reward_model))
        with tracer.span("evaluate", "eval", done):
            scores, images = evaluate(adapter, sampling, padded, rewards, batch_size=cfg.rl.micro_batch,
                                      first_sample_id=lo, negative_prompt=cfg.sampling.negative_prompt)
        result = ({k: v[:len(mine)] for k, v in scores.items()}, images[:len(mine)], [r.prompt for r in mine])
    if result is None:
        return
    everyone = [None] * len(evaluators)
    dist.all_gather_object(everyone, result, group=group)  # sync point: the trainer ranks
    if rank == evaluators[0]:
        parts = [r for r in everyone if r is not None]
        scores = {k: sum((p[0][k] for p in parts), []) for k in parts[0][0]}
        images = torch.cat([p[1] for p in parts])
        prompts = sum((p[2] for p in parts), [])
        logger.log(done, summarize(scores))
        logger.log_images(done, "eval", images[:64], prompts[:64])
