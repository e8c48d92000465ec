"""The trainer role: replays trajectories as (sample, timestep) transitions with the clipped
Flow-GRPO / DanceGRPO loss, accumulates gradients over the fragments of a logical batch, steps
the optimizer once per batch, and hands out the new version's weights for publication.

The loss of a batch is the mean over all its trained transitions (docs/ALGORITHMS.md). Each forward
adds the *sum* of its transitions' losses; `finish_step` sums gradients over trainer ranks and
divides by the batch's transition count, so every placement computes the same gradient up to
reduction order (docs/DESIGN.md, placement invariance).

Without TSP a chunk of samples goes whole to one trainer, which runs one forward per trained
timestep. With --tsp every trainer receives a `TransitionBatch`: its share of each fragment's
transitions, packed by `parallel.tsp` into micro-batches that mix samples and timesteps. Which of
the two a run uses is its intake's choice (parallel/intake.py).
"""
from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rl import algorithm
from rl import sampler
from config.schema import RunConfig
from models import DiTAdapter, autocast
from models.lora import trainable_names
from rl.nonfinite import SkipTracker
from parallel import compress
from parallel.fsdp import copy_full, count_allgathers, full_tensor, shard_modules
from parallel.intake import TrainChunk, TrainingSpec, TransitionBatch
from parallel.publish import WeightPublisher
from telemetry.tracing import Slowdown

STAT_KEYS = ("loss", "policy_loss", "kl", "approx_kl", "clipfrac", "clipfrac_high", "clipfrac_low", "ratio",
             "staleness_mean", "staleness_frac_1")


class Trainer:
    def __init__(self, cfg: RunConfig, adapter: DiTAdapter, sampling: sampler.SamplingConfig, group=None,
                 sharding: str = "replicate", slowdown: Slowdown | None = None):
        """`slowdown` (--debug-slow-rank) wraps every training forward + backward."""
        self.cfg, self.adapter, self.sampling = cfg, adapter, sampling
        self.slowdown = slowdown or Slowdown()
        self.spec = TrainingSpec.of(cfg, sampling)  # which timesteps of a sample are trained
        self.group, self.sharding = group, sharding
        self.device = adapter.device
        model = adapter.transformer
        self.lora = cfg.optim.lora_rank > 0
        if not self.lora:
            model.requires_grad_(True)
        self.names = trainable_names(model)
        self.reference = self._make_reference() if cfg.rl.beta > 0 else None
        if sharding == "fsdp":
            shard_modules(model, group)
            count_allgathers(model, group, self._on_allgather)
        if cfg.optim.grad_checkpointing:
            self._checkpoint_blocks()
        self.params = [p for _, p in model.named_parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.optim.learning_rate(), betas=tuple(cfg.optim.adam_betas),
                                           weight_decay=cfg.optim.weight_decay)
        self.ema = [p.detach().clone() for p in self.params] if cfg.optim.ema_decay > 0 else None
        self.num_updates = 0
        self.skips = SkipTracker(cfg.optim.max_skipped_steps)  # steps with non-finite values (rl/nonfinite.py)
        self.current_step: int | None = None  # the step being trained (its update makes version step+1)
        self.codec: compress.Reconstruction | None = None  # a lossy publication codec (start_codec)
        # Called with the forward's slot (this step's forward count) before every training forward,
        # real or padding: with TAG under FSDP the group's generation windows fall between forwards.
        self.before_forward = None
        self.reset_stats()

    # ----- set-up ---------------------------------------------------------------------------
    def _make_reference(self) -> DiTAdapter | None:
        if self.lora:
            return None  # the reference is the same model with its LoRA disabled
        ref = copy.copy(self.adapter)
        ref.transformer = copy.deepcopy(self.adapter.transformer).requires_grad_(False)
        ref.blocks = ref._block_list()
        return ref

    def _checkpoint_blocks(self) -> None:
        """Wrap every block's forward in torch.utils.checkpoint (diffusers' own flag only covers
        model.forward, which the split never calls: docs/MODELS.md)."""
        for block in self.adapter.blocks:
            fwd = block.forward
            block.forward = lambda *a, _f=fwd, **kw: checkpoint(_f, *a, use_reentrant=False, **kw)

    def reset_stats(self) -> None:
        self.sums = {k: 0.0 for k in STAT_KEYS}
        self.max_staleness = 0
        self.num_transitions = 0
        self.num_forwards = 0
        self.num_allgathers = 0
        self.nonfinite_advantages = 0

    def _on_allgather(self) -> None:
        self.num_allgathers += 1

    def begin_step(self) -> None:
        """Count only the training phase's all-gathers (colocated FSDP generation gathers too)."""
        self.num_allgathers = 0

    # ----- training -------------------------------------------------------------------------
    def _start_forward(self) -> None:
        """Count a training forward, real or padding, after letting `before_forward` run."""
        if self.before_forward is not None:
            self.before_forward(self.num_forwards)
        self.num_forwards += 1

    def train(self, item: TrainChunk | TransitionBatch) -> None:
        """Forward + backward of every transition of `item` this trainer trains."""
        if not torch.isfinite(item.advantages).all():  # from non-finite rewards: the step will be skipped
            self.nonfinite_advantages += 1
        if isinstance(item, TransitionBatch):
            self.train_transitions(item)
        else:
            self.train_chunk(item)

    def train_chunk(self, chunk: TrainChunk) -> None:
        """Forward + backward of every trained transition of a chunk, one timestep per forward."""
        dev = self.device
        ids = chunk.sample_ids.tolist()
        cond = chunk.cond.to(dev)
        neg = chunk.neg_cond.to(dev) if chunk.neg_cond is not None else None
        spec = self.spec
        for t in spec.forward_timesteps(chunk.step, tuple(ids)):
            rows = [j for j, i in enumerate(ids) if t in spec.timesteps(chunk.step, i) and chunk.keep[j]]
            self._start_forward()
            if not rows:
                self._dummy_forward(chunk, t, cond, neg)
                continue
            sel = torch.tensor(rows)
            whole = len(rows) == len(ids)  # keep the generation batch intact: bitwise-equal forwards
            c = cond if whole else cond.select(sel)
            n = neg if (neg is None or whole) else neg.select(sel)
            x_t = chunk.latents[sel, t].to(dev)
            x_next = chunk.latents[sel, t + 1].to(dev)
            with self.slowdown():
                loss = self._transition_loss(x_t, x_next, chunk.sigmas, t, c, n, chunk.log_probs[sel, t].to(dev),
                                             chunk.advantages[sel].to(dev))
                loss.backward()
            self._count(len(rows), chunk.version)

    def _transition_loss(self, x_t, x_next, sigmas, t, cond, neg, logp_old, adv) -> Tensor:
        s = self.sampling
        sigma, sigma_next = sigmas[t].item(), sigmas[t + 1].item()
        sigma_vec = sigmas[t].to(self.device).expand(x_t.shape[0])
        with autocast(self.device, self.cfg.model.dtype):
            v = sampler.guided_velocity(self.adapter, x_t, sigma_vec, cond, neg, s)
        out = sampler.sde_step(x_t, v, sigma, sigma_next, sde_type=s.sde_type, noise_level=s.noise_level_at(t),
                               x_next=x_next)
        return self._loss(out, lambda: self._reference_mean(x_t, sigma_vec, cond, neg, t, sigmas), logp_old, adv)

    def _loss(self, out: sampler.StepOutput, reference_mean, logp_old, adv, record: bool = True) -> Tensor:
        """Sum over transitions of the clipped policy loss plus beta x KL to the reference policy
        (`reference_mean()` gives the reference step's mean; called only when beta > 0)."""
        policy, ratio = algorithm.clipped_policy_loss(out.log_prob, logp_old, adv, self.cfg.rl.clip_range)
        loss, kl = policy, None
        if self.cfg.rl.beta > 0:
            kl = algorithm.kl_to_reference(out.mean, reference_mean(), out.std)
            loss = loss + self.cfg.rl.beta * kl
        if record:
            self._record_stats(loss, policy, ratio, out.log_prob, logp_old, kl)
        return loss.sum()

    @torch.no_grad()
    def _record_stats(self, loss, policy, ratio, logp_new, logp_old, kl) -> None:
        """Add per-transition sums; finish_step divides by the batch's transition count."""
        eps = self.cfg.rl.clip_range
        if kl is not None:
            self.sums["kl"] += kl.detach().sum().item()
        d = (logp_new - logp_old).detach()
        self.sums["loss"] += loss.detach().sum().item()
        self.sums["policy_loss"] += policy.detach().sum().item()
        self.sums["approx_kl"] += (0.5 * d.pow(2)).sum().item()
        self.sums["clipfrac"] += ((ratio - 1).abs() > eps).float().sum().item()
        self.sums["clipfrac_high"] += (ratio > 1 + eps).float().sum().item()
        self.sums["clipfrac_low"] += (ratio < 1 - eps).float().sum().item()
        self.sums["ratio"] += ratio.detach().sum().item()

    @torch.no_grad()
    def _reference_velocity(self, x_t, sigma_vec, cond, neg) -> Tensor:
        """The reference policy's guided velocity: LoRA disabled, or the frozen copy."""
        lora = self.reference is None
        if lora:
            self.adapter.transformer.disable_adapters()
        try:
            with autocast(self.device, self.cfg.model.dtype):
                return sampler.guided_velocity(self.reference or self.adapter, x_t, sigma_vec, cond, neg,
                                               self.sampling)
        finally:
            if lora:
                self.adapter.transformer.enable_adapters()

    @torch.no_grad()
    def _reference_mean(self, x_t, sigma_vec, cond, neg, t, sigmas) -> Tensor:
        s = self.sampling
        v = self._reference_velocity(x_t, sigma_vec, cond, neg)
        out = sampler.sde_step(x_t, v, sigmas[t].item(), sigmas[t + 1].item(), sde_type=s.sde_type,
                               noise_level=s.noise_level_at(t), x_next=x_t)
        return out.mean

    # ----- TSP: packed micro-batches of (sample, timestep) transitions ---------------------
    def train_transitions(self, batch: TransitionBatch) -> None:
        """Forward + backward of this trainer's packed micro-batches of one fragment, each mixing
        samples and timesteps (per-sample sigma vectors; CFG runs the unconditional branch of every
        transition in the same packed batch)."""
        cond = batch.cond.to(self.device)
        neg = batch.neg_cond.to(self.device) if batch.neg_cond is not None else None
        for lo, hi in batch.bounds():
            rows = [j for j in range(lo, hi) if batch.keep[j]]
            if not rows:
                if self.sharding == "fsdp":  # the other FSDP ranks run this forward's collectives
                    self._start_forward()
                    self._packed_forward(batch, [lo], cond, neg, weight=0.0)
                continue
            self._start_forward()
            self._packed_forward(batch, rows, cond, neg)
            self._count(len(rows), batch.version)

    def _packed_forward(self, batch: TransitionBatch, rows: list[int], cond, neg, weight: float = 1.0) -> None:
        """One forward + backward over `rows` of `batch`. weight 0 is a dummy that runs the same
        collectives as a real forward (FSDP padding) and records nothing."""
        dev = self.device
        sel = torch.tensor(rows)
        idx = batch.cond_index[sel].to(dev)
        with self.slowdown():
            loss = self._packed_loss(batch.x_t[sel].to(dev), batch.x_next[sel].to(dev), batch.sigma[sel].to(dev),
                                     batch.sigma_next[sel].to(dev), batch.timesteps[sel].tolist(), cond.select(idx),
                                     neg.select(idx) if neg is not None else None, batch.log_probs[sel].to(dev),
                                     batch.advantages[sel].to(dev), record=weight != 0)
            (loss if weight == 1.0 else loss * weight).backward()

    def _packed_loss(self, x_t, x_next, sigma, sigma_next, ts, cond, neg, logp_old, adv, record=True) -> Tensor:
        """Sum of the losses of n transitions at per-transition sigmas (n,) and timesteps `ts`."""
        with autocast(self.device, self.cfg.model.dtype):
            v = sampler.guided_velocity(self.adapter, x_t, sigma, cond, neg, self.sampling)
        out = self._score_steps(x_t, v, sigma, sigma_next, ts, x_next)

        def reference_mean():
            ref_v = self._reference_velocity(x_t, sigma, cond, neg)
            return self._score_steps(x_t, ref_v, sigma, sigma_next, ts, x_t).mean

        return self._loss(out, reference_mean, logp_old, adv, record)

    def _score_steps(self, x_t, v, sigma, sigma_next, ts, x_next) -> sampler.StepOutput:
        """sampler.sde_step over transitions at different timesteps: one call per distinct noise
        level (a windowed sampler is deterministic outside its window), rows put back in order."""
        s = self.sampling
        levels = [s.noise_level_at(t) for t in ts]
        if len(set(levels)) == 1:
            return sampler.sde_step(x_t, v, sigma, sigma_next, sde_type=s.sde_type, noise_level=levels[0],
                                    x_next=x_next)
        parts, order = [], []
        for level in sorted(set(levels)):
            rows = torch.tensor([j for j, l in enumerate(levels) if l == level], device=x_t.device)
            parts.append(sampler.sde_step(x_t[rows], v[rows], sigma[rows], sigma_next[rows], sde_type=s.sde_type,
                                          noise_level=level, x_next=x_next[rows]))
            order.append(rows)
        inverse = torch.argsort(torch.cat(order))
        return sampler.StepOutput(*(torch.cat([getattr(p, k) for p in parts])[inverse]
                                    for k in ("x_next", "log_prob", "mean", "std")))

    def _dummy_forward(self, chunk: TrainChunk, t: int, cond, neg) -> None:
        """A zero-weight forward + backward: keeps FSDP ranks' collectives in step when a rank has
        fewer transitions than another."""
        x = chunk.latents[:1, t].to(self.device)
        sigma_vec = chunk.sigmas[t].to(self.device).expand(1)
        c, n = cond.select([0]), neg.select([0]) if neg is not None else None
        with self.slowdown():
            with autocast(self.device, self.cfg.model.dtype):
                v = sampler.guided_velocity(self.adapter, x, sigma_vec, c, n, self.sampling)
            if self.cfg.rl.beta > 0:  # a real forward also runs the reference (the LoRA-disabled model under FSDP)
                self._reference_velocity(x, sigma_vec, c, n)
            (v.float().sum() * 0.0).backward()

    def pad_forwards(self, count: int, template: TrainChunk | None) -> None:
        """FSDP only: run dummy forwards until this rank has done `count` forwards this step."""
        while self.num_forwards < count:
            if template is None:
                raise RuntimeError("a trainer with no chunk cannot pad FSDP forwards")
            self._start_forward()
            cond = template.cond.to(self.device)
            neg = template.neg_cond.to(self.device) if template.neg_cond is not None else None
            if isinstance(template, TransitionBatch):
                self._packed_forward(template, [0], cond, neg, weight=0.0)
            else:
                self._dummy_forward(template, 0, cond, neg)

    def _count(self, n: int, version: int) -> None:
        """n transitions trained; their staleness is this update's version minus the generating one
        (0 on-policy, at most 1 with TCSS)."""
        stale = 0 if self.current_step is None else self.current_step - version
        self.num_transitions += n
        self.sums["staleness_mean"] += n * stale
        self.sums["staleness_frac_1"] += n * (stale == 1)
        self.max_staleness = max(self.max_staleness, stale)

    def finish_step(self) -> dict[str, float]:
        """Sum gradients and statistics over trainer ranks, normalize by the batch's transition
        count, clip, step, update the EMA. Every trainer rank waits here for the others."""
        counts = torch.tensor([float(self.num_transitions)] + [self.sums[k] for k in STAT_KEYS]
                              + [float(self.nonfinite_advantages)], dtype=torch.float64)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            counts = counts.to(self._comm_device())
            dist.all_reduce(counts, group=self.group)  # sync point: all trainers
            counts = counts.cpu()
        total = counts[0].item()
        if total == 0:
            raise RuntimeError("a training step with no trained transitions (all groups dropped?)")
        world = dist.get_world_size(self.group) if self.group is not None else 1
        if self.sharding == "fsdp":
            # FSDP2's reduce-scatter already averaged over the group: undo the mean, then normalize.
            scale = world / total
        else:
            self._all_reduce_grads()
            scale = 1.0 / total
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(scale)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
        grad_norm = float(full_tensor(grad_norm)) if hasattr(grad_norm, "full_tensor") else float(grad_norm)
        # Before the update and the EMA: the same reduced values on every trainer, the same decision.
        bad = (["advantages (non-finite rewards)"] if counts[-1].item() else []) + SkipTracker.nonfinite(
            {"loss": counts[1].item(), "gradients": grad_norm})
        skip = self.skips.record(self.current_step if self.current_step is not None else self.num_updates, bad)
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.num_updates += 1
        if self.ema is not None and not skip:
            decay = min(self.cfg.optim.ema_decay, (1 + self.num_updates) / (10 + self.num_updates))
            with torch.no_grad():
                for e, p in zip(self.ema, self.params):
                    e.lerp_(p.detach(), 1 - decay)
        stats = {f"train/{k}": counts[1 + i].item() / total for i, k in enumerate(STAT_KEYS)}
        stats["train/staleness_frac_0"] = 1.0 - stats["train/staleness_frac_1"]  # staleness is 0 or 1 by design
        stats["train/staleness_max"] = self._all_reduce_max(float(self.max_staleness))
        stats.update({"train/grad_norm": grad_norm, "train/num_transitions": total,
                      "train/num_forwards": float(self.num_forwards),
                      "train/num_allgathers": float(self.num_allgathers),
                      "train/skipped_steps": float(self.skips.total)})
        self.reset_stats()
        return stats

    def _all_reduce_max(self, value: float) -> float:
        if self.group is None or dist.get_world_size(self.group) == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)  # sync point: all trainers
        return t.item()

    def _comm_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" \
            else torch.device("cpu")

    def _all_reduce_grads(self) -> None:
        """Replicated data parallel: one flat all-reduce (sum) of all gradients."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self._comm_device())
        dist.all_reduce(flat, group=self.group)  # sync point: all trainers
        offset = 0
        for p, g in zip(self.params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(g).to(g.device).clone()
            offset += n

    # ----- weights out ----------------------------------------------------------------------
    def full_weights(self, names: list[str] | None = None) -> dict[str, Tensor]:
        """Unsharded trained weights (under FSDP a collective: every trainer rank must call it)."""
        wanted = set(names or self.names)
        return {n: full_tensor(p.detach()) for n, p in self.adapter.transformer.named_parameters() if n in wanted}

    # ----- publication ----------------------------------------------------------------------
    def start_codec(self, spec: str, names: list[str], residual: dict[str, Tensor] | None = None) -> None:
        """Train through the lossy publication codec `spec` (parallel/compress.py) from the weights
        held now, going on from a resumed run's `residual` (a collective under FSDP)."""
        self.codec = compress.Reconstruction(spec, self.full_weights(names), residual)

    def make_version(self, names: list[str]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The version this update makes, as (wire tensors, the weights receivers rebuild from
        them); every trainer rank calls it (a collective under FSDP). With a lossy codec the
        trainer adopts the rebuilt weights, so it trains the policy the generators sample with;
        what the wire left out waits in the codec's residual."""
        weights = self.full_weights(names)
        if self.codec is None:
            return weights, weights
        wire, held = self.codec.publish(weights)
        params = dict(self.adapter.transformer.named_parameters())
        with torch.no_grad():
            for n, t in held.items():
                copy_full(params[n], t)
        return wire, held





def fsdp_pad_target(plan, facts, intake) -> int:
    """FSDP ranks run collectives inside every forward, so they must run equally many: the forward
    count every trainer pads to (0 without FSDP). Colocated FSDP generation needs equal chunk counts."""
    if facts.train_sharding != "fsdp":
        return 0
    counts = [len(f) for f in intake.forward_fragments(plan)]
    if not facts.disagg:
        gen = [sum(len(f.chunks) for f in plan.fragments if f.replica == r) for r in range(facts.topology.num_replicas)]
        if len(set(gen)) > 1:
            raise ValueError(f"--colocated-sharding fsdp needs every rank to generate equally many chunks, got {gen} "
                             f"(choose --prompts-per-step, --group-size and --micro-batch so they divide evenly)")
    if min(counts) == 0:
        what = "transition (TSP)" if facts.tsp else "chunk"
        raise ValueError(f"--train-sharding fsdp: trainer(s) {[i for i, c in enumerate(counts) if c == 0]} get no "
                         f"{what}; use more samples per step or a smaller --micro-batch")
    return max(counts)


def trainer_step(ctx, trainer: Trainer, plan, local: dict, publish_names: dict[int, list[str]],
                 publisher: WeightPublisher, assistant=None, store=None,
                 reward_std: float | None = None) -> dict[str, float]:
    """One step of a trainer rank: train its work (chunks, or with --tsp its packed transitions of
    every fragment) in plan order as it lands (colocated: from `local`), one optimizer update, then
    publish version k+1 to every generator. With TAG, the `assistant` may generate fragments while
    this rank waits for one (under FSDP: the whole group, between forwards)."""
    tracer, topo, facts, intake, step = ctx.tracer, ctx.topo, ctx.facts, ctx.intake, plan.step
    pad_to = fsdp_pad_target(plan, facts, intake)
    trainer.begin_step()
    trainer.current_step = step
    intake.inbox.update(local)
    if not facts.disagg:
        intake.exchange(plan, ctx.rank)  # colocated TSP: the packed shares move between ranks first
    if assistant is not None:
        assistant.begin_step(plan, reward_std, trainer, intake)

    def helper_s() -> float:  # seconds of TAG windows run inside training (FSDP: between forwards)
        return assistant.window_s if assistant is not None else 0.0

    template, seconds = None, {}
    for need in intake.needs(plan):
        src = None
        if need.key not in intake.inbox:  # with TAG, this rank may generate fragments while it waits
            src = assistant.source_of(need.fragment) if assistant is not None else intake.static_source(plan, need.fragment)
        item = intake.take(plan, need, src)
        with tracer.span("train", "train", step, item.fragment, **intake.span_args(item)):
            t0, helped = time.perf_counter(), helper_s()
            trainer.train(item)
            took = time.perf_counter() - t0 - (helper_s() - helped)
            seconds[item.fragment] = seconds.get(item.fragment, 0.0) + took
        template = item
    if pad_to:
        with tracer.span("pad", "train", step):
            trainer.pad_forwards(pad_to, template)
    t0 = time.perf_counter()
    with tracer.span("optimizer", "optimizer", step):
        stats = trainer.finish_step()  # sync point: all trainers
    update_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if facts.disagg:
        sent = []
        with tracer.span("publish", "publish", step):
            wire, held = trainer.make_version(sorted({n for names in publish_names.values() for n in names}))
            if ctx.rank == topo.trainer_ranks[0]:
                if store is not None:
                    store.put(f"pub/{step + 1}", 1)  # generators may install it at their next fragment boundary
                # Each generator (stage) gets only the weights it holds, encoded once for all of them.
                sent = publisher.publish_all(wire, held, {g: publish_names[g] for g in topo.generator_ranks}, step + 1)
        stats["publish/bytes"] = float(sum(s.num_bytes for s in sent))
        stats["publish/seconds"] = time.perf_counter() - t0
    elif trainer.codec is not None:
        with tracer.span("publish", "publish", step):  # colocated: the codec's update, nothing sent
            trainer.make_version(list(trainer.codec.held))
    if assistant is not None:
        assistant.observe_training(seconds)
        assistant.tracker.observe_update(update_s)
        assistant.tracker.observe_publish(time.perf_counter() - t0)
        stats.update(assistant.end_step())
    return stats
