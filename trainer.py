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

DiffusionNFT (--algorithm nft) trains the same way on clean records: a transition is a (sample,
sigma) pair whose clean latent the trainer noises itself, against the old policy this trainer keeps
(rl/old_policy.py), which is also what it publishes for the generators to sample with.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rl import algorithms
from rl import sampler
from config.schema import RunConfig
from models import DiTAdapter, autocast, resolve_dtype
from models.lora import trainable_names
from rl import nft, old_policy
from rl.conditioning import Conditioning
from rl.nonfinite import SkipTracker
from parallel import compress
from parallel.fsdp import count_allgathers, full_tensor, local_part, own_group, shard_modules
from parallel.intake import TrainChunk, TrainingSpec, TransitionBatch
from parallel.publish import Outgoing, WeightPublisher
from telemetry.tracing import Slowdown

COUNTS = ("staleness_mean", "staleness_frac_1")
"""per-transition statistics the trainer counts itself, beside its loss's"""


@dataclass
class Transitions:
    """The (sample, timestep) transitions one training forward trains, at their own timesteps (a
    chunk's rows at one timestep, or a TSP micro-batch that mixes samples and timesteps)."""

    x_t: Tensor  # (n, *latent) float32
    x_next: Tensor  # (n, *latent) float32: the stored next latent whose log-probability is scored
    sigma: Tensor  # (n,)
    sigma_next: Tensor  # (n,)
    timesteps: list[int]  # n step indices t (the noise level of each)
    cond: Conditioning
    neg: Conditioning | None
    logp_old: Tensor  # (n,)
    adv: Tensor  # (n,)
    sample_ids: list[int] | None = None  # n sample ids of the step (the keys of forward-process noise)
    step: int | None = None  # the step the transitions belong to (its window, its noise)


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
        if any(p.dtype != torch.float32 for p in self.trained_params()):
            raise RuntimeError("trained weights must be float32 (models.model_dtypes(master=True), models.lora)")
        # Every forward computes in the compute dtype: the generators hold the weights in it, and
        # inputs are cast to it alike everywhere (DiTAdapter.compute_dtype).
        self.compute_dtype = resolve_dtype(cfg.model.dtype, self.device)
        adapter.compute_dtype = self.compute_dtype
        self.loss = algorithms.algorithm(cfg.rl.algorithm).loss(cfg.rl)
        self.reference = self._make_reference() if self.loss.needs_reference else None
        # Mixed precision as FSDP2 does it (float32 weights, each unit cast to the compute dtype for
        # its forward, float32 gradients): over the trainer group, or for a replicated trainer over
        # this rank alone, so that every forward computes with exactly the weights generators hold.
        mixed = self.compute_dtype if self.compute_dtype != torch.float32 else None
        engine = group if sharding == "fsdp" else (own_group() if mixed is not None else None)
        if engine is not None:
            adapter.enclosing = shard_modules(model, engine, mixed)  # one root: all-gathers overlap compute
            count_allgathers(model, engine, self._on_allgather)
        if cfg.optim.grad_checkpointing:
            self._checkpoint_blocks()
        self.params = self.trained_params()
        # Fused AdamW on CUDA: one kernel over all parameters, no foreach temporaries (a float32
        # copy per parameter group: +11 GiB for FLUX full fine-tuning); the default elsewhere.
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.optim.learning_rate(), betas=tuple(cfg.optim.adam_betas),
                                           weight_decay=cfg.optim.weight_decay,
                                           fused=True if self.device.type == "cuda" else None)
        self.ema = [p.detach().clone() for p in self.params] if cfg.optim.ema_decay > 0 else None
        # DiffusionNFT's old policy: what the generators sample with and the loss contrasts against.
        self.old = old_policy.OldPolicy(self.params, old_policy.schedule(cfg.rl.old_policy_decay),
                                        cfg.rl.old_policy_interval) if self.loss.forward_process else None
        self.num_updates = 0
        self.skips = SkipTracker(cfg.optim.max_skipped_steps)  # steps with non-finite values (rl/nonfinite.py)
        self.current_step: int | None = None  # the step being trained (its update makes version step+1)
        self.codec: compress.Reconstruction | None = None  # a lossy publication codec (start_codec)
        # Called with the forward's slot (this step's forward count) before every training forward,
        # real or padding: with TAG under FSDP the group's generation windows fall between forwards.
        self.before_forward = None
        self.reset_stats()

    # ----- set-up ---------------------------------------------------------------------------
    def trained_params(self) -> list[Tensor]:
        return [p for p in self.adapter.transformer.parameters() if p.requires_grad]

    def _make_reference(self) -> DiTAdapter | None:
        """The frozen reference policy of the KL term: LoRA's base, or a copy of the initial weights
        in the compute dtype (frozen weights are held as generators hold them)."""
        if self.lora:
            return None  # the reference is the same model with its LoRA disabled
        ref = copy.copy(self.adapter)
        ref.transformer = copy.deepcopy(self.adapter.transformer).requires_grad_(False).to(self.compute_dtype)
        ref.blocks = ref._block_list()
        ref.enclosing = None
        return ref

    def _checkpoint_blocks(self) -> None:
        """Wrap every block's forward in torch.utils.checkpoint (diffusers' own flag only covers
        model.forward, which the split never calls: docs/MODELS.md)."""
        for block in self.adapter.blocks:
            fwd = block.forward
            block.forward = lambda *a, _f=fwd, **kw: checkpoint(_f, *a, use_reentrant=False, **kw)

    def reset_stats(self) -> None:
        self.loss_sums = torch.zeros(len(self.loss.STATS), dtype=torch.float64, device=self.device)
        self.counts = {k: 0.0 for k in COUNTS}
        self.max_staleness = 0
        self.num_transitions = 0
        self.num_forwards = 0
        self.num_allgathers = 0
        self.nonfinite_advantages = torch.zeros((), dtype=torch.int64, device=self.device)  # items with any

    @property
    def sums(self) -> dict[str, float]:
        """This step's statistic sums so far, by name (reads the device: for tests and reports,
        not for the training loop)."""
        return {**dict(zip(self.loss.STATS, self.loss_sums.tolist())), **self.counts}

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
        """Forward + backward of every transition of `item` this trainer trains. The item's tensors
        stay where they arrived (the device, on NCCL); its row metadata is read on the host once."""
        # Non-finite rewards make the step skip; counted on the device, read once per step.
        self.nonfinite_advantages += (~torch.isfinite(item.advantages)).any().to(self.device)
        if isinstance(item, TransitionBatch):
            self.train_transitions(item)
        else:
            self.train_chunk(item)

    def train_chunk(self, chunk: TrainChunk) -> None:
        """Every trained transition of a chunk, one timestep per forward."""
        host = _Host.of(chunk)
        ids, keep = host.sample_ids, host.keep
        cond = chunk.cond.to(self.device)
        neg = chunk.neg_cond.to(self.device) if chunk.neg_cond is not None else None
        spec = self.spec
        for t in spec.forward_timesteps(chunk.step, tuple(ids)):
            rows = [j for j, i in enumerate(ids) if t in spec.timesteps(chunk.step, i) and keep[j]]
            self._start_forward()
            if not rows:  # keeps FSDP ranks' forward counts equal
                self._forward(self._chunk_rows(chunk, [0], t, host, cond, neg), weight=0.0)
                continue
            self._forward(self._chunk_rows(chunk, rows, t, host, cond, neg))
            self._count(len(rows), chunk.version)

    def _chunk_rows(self, chunk: TrainChunk, rows: list[int], t: int, host: "_Host", cond, neg) -> Transitions:
        dev, n = self.device, len(rows)
        whole = n == len(chunk.sample_ids)  # keep the generation batch intact: bitwise-equal forwards
        sel = _index(rows, chunk.latents.device)
        x_t, x_next, logp = chunk.at(sel, t)
        small = _index(rows, chunk.advantages.device)
        return Transitions(x_t.to(dev), x_next.to(dev),
                           torch.full((n,), host.sigmas[t], device=dev), torch.full((n,), host.sigmas[t + 1], device=dev),
                           [t] * n, cond if whole else cond.select(_index(rows, dev)),
                           neg if (neg is None or whole) else neg.select(_index(rows, dev)),
                           logp.to(dev), chunk.advantages[small].to(dev), [host.sample_ids[j] for j in rows], chunk.step)

    def train_transitions(self, batch: TransitionBatch) -> None:
        """This trainer's packed micro-batches of one fragment (TSP), each mixing samples and
        timesteps (per-sample sigma vectors; CFG runs the unconditional branch of every transition
        in the same packed batch)."""
        cond = batch.cond.to(self.device)
        neg = batch.neg_cond.to(self.device) if batch.neg_cond is not None else None
        host = _Host.of(batch)
        for lo, hi in batch.bounds():
            rows = [j for j in range(lo, hi) if host.keep[j]]
            if not rows:
                if self.sharding == "fsdp":  # the other FSDP ranks run this forward's collectives
                    self._start_forward()
                    self._forward(self._packed_rows(batch, [lo], host, cond, neg), weight=0.0)
                continue
            self._start_forward()
            self._forward(self._packed_rows(batch, rows, host, cond, neg))
            self._count(len(rows), batch.version)

    def _packed_rows(self, batch: TransitionBatch, rows: list[int], host: "_Host", cond, neg) -> Transitions:
        dev = self.device
        sel = _index(rows, batch.x_t.device)
        idx = batch.cond_index[_index(rows, batch.cond_index.device)].to(dev)
        small = _index(rows, batch.sigma.device)
        return Transitions(batch.x_t[sel].to(dev), batch.x_next[sel].to(dev), batch.sigma[small].to(dev),
                           batch.sigma_next[small].to(dev), [host.timesteps[j] for j in rows], cond.select(idx),
                           neg.select(idx) if neg is not None else None, batch.log_probs[small].to(dev),
                           batch.advantages[small].to(dev), [host.sample_ids[j] for j in rows], batch.step)

    def _forward(self, tr: Transitions, weight: float = 1.0) -> None:
        """One forward + backward of the loss of `tr`. Weight 0 is padding: the same computation
        and collectives as a real forward (FSDP ranks must run equally many), nothing recorded."""
        with self.slowdown():
            if self.old is not None:
                loss, stats = self._forward_process_loss(tr)
            else:
                with autocast(self.device, self.cfg.model.dtype):
                    v = sampler.guided_velocity(self.adapter, tr.x_t, tr.sigma, tr.cond, tr.neg, self.sampling)
                out = self._score_steps(tr, v, tr.x_next)
                mean_ref = self._score_steps(tr, self._reference_velocity(tr), tr.x_t).mean \
                    if self.loss.needs_reference else None
                loss, stats = self.loss(out.log_prob, tr.logp_old, tr.adv, out.mean, mean_ref, out.std)
            (loss if weight == 1.0 else loss * weight).backward()
        if weight:
            self.loss_sums += stats

    def _forward_process_loss(self, tr: Transitions) -> tuple[Tensor, Tensor]:
        """DiffusionNFT (rl/nft.py): each transition's clean sample x0 noised at its sigma with the
        noise keyed by (seed, step, sample, t), x_t = (1 - sigma) x0 + sigma eps; the old policy's and
        the reference's velocities without gradient (before the trained forward: the old policy's
        exchange writes the parameters in place), then the trained policy's."""
        x0 = tr.x_t.float()
        noised = dataclasses.replace(tr, x_t=nft.noised(x0, tr.sigma, tr.sample_ids, tr.timesteps, self.cfg.seed,
                                                        tr.step))
        with torch.no_grad(), self.old.swapped(), autocast(self.device, self.cfg.model.dtype):
            v_old = sampler.guided_velocity(self.adapter, noised.x_t, tr.sigma, tr.cond, tr.neg, self.sampling)
        v_ref = self._reference_velocity(noised) if self.loss.needs_reference else None
        with autocast(self.device, self.cfg.model.dtype):
            v = sampler.guided_velocity(self.adapter, noised.x_t, tr.sigma, tr.cond, tr.neg, self.sampling)
        return self.loss(x0, noised.x_t, tr.sigma, v, v_old, tr.adv, v_ref)

    def sampling_policy(self):
        """The policy the generators sample with, in the parameters for a block (colocated ranks and
        TAG helpers generate with the trainer's model): DiffusionNFT's old policy, else the trained
        weights as they are."""
        return self.old.swapped() if self.old is not None else contextlib.nullcontext()

    @torch.no_grad()
    def _reference_velocity(self, tr: Transitions) -> Tensor:
        """The reference policy's guided velocity: LoRA disabled, or the frozen copy."""
        lora = self.reference is None
        if lora:
            self.adapter.transformer.disable_adapters()
        try:
            with autocast(self.device, self.cfg.model.dtype):
                return sampler.guided_velocity(self.reference or self.adapter, tr.x_t, tr.sigma, tr.cond, tr.neg,
                                               self.sampling)
        finally:
            if lora:
                self.adapter.transformer.enable_adapters()

    def _score_steps(self, tr: Transitions, v: Tensor, x_next: Tensor) -> sampler.StepOutput:
        """sampler.sde_step over transitions at different timesteps: one call per distinct noise
        level (a windowed sampler is deterministic outside its window), rows put back in order."""
        s = self.sampling
        levels = [s.noise_level_at(t, tr.step) for t in tr.timesteps]
        if len(set(levels)) == 1:
            return sampler.sde_step(tr.x_t, v, tr.sigma, tr.sigma_next, sde_type=s.sde_type, noise_level=levels[0],
                                    x_next=x_next)
        parts, order = [], []
        for level in sorted(set(levels)):
            rows = sampler.to_device(torch.tensor([j for j, l in enumerate(levels) if l == level]), tr.x_t.device)
            parts.append(sampler.sde_step(tr.x_t[rows], v[rows], tr.sigma[rows], tr.sigma_next[rows],
                                          sde_type=s.sde_type, noise_level=level, x_next=x_next[rows]))
            order.append(rows)
        inverse = torch.argsort(torch.cat(order))
        return sampler.StepOutput(*(torch.cat([getattr(p, k) for p in parts])[inverse]
                                    for k in ("x_next", "log_prob", "mean", "std")))

    def pad_forwards(self, count: int, template: TrainChunk | TransitionBatch | None) -> None:
        """FSDP only: run padding forwards until this rank has done `count` forwards this step."""
        while self.num_forwards < count:
            if template is None:
                raise RuntimeError("a trainer with no chunk cannot pad FSDP forwards")
            self._start_forward()
            cond = template.cond.to(self.device)
            neg = template.neg_cond.to(self.device) if template.neg_cond is not None else None
            host = _Host.of(template)
            rows = self._packed_rows(template, [0], host, cond, neg) if isinstance(template, TransitionBatch) \
                else self._chunk_rows(template, [0], 0, host, cond, neg)
            self._forward(rows, weight=0.0)

    def _count(self, n: int, version: int) -> None:
        """n transitions trained; their staleness is this update's version minus the generating one
        (0 on-policy, at most 1 with TCSS)."""
        stale = 0 if self.current_step is None else self.current_step - version
        self.num_transitions += n
        self.counts["staleness_mean"] += n * stale
        self.counts["staleness_frac_1"] += n * (stale == 1)
        self.max_staleness = max(self.max_staleness, stale)

    def finish_step(self) -> dict[str, float]:
        """Sum gradients and statistics over trainer ranks, normalize by the batch's transition
        count, clip, step, update the EMA. Every trainer rank waits here for the others."""
        names = self.loss.STATS + COUNTS
        host = torch.tensor([float(self.num_transitions)] + [self.counts[k] for k in COUNTS], dtype=torch.float64)
        on_device = torch.cat([self.loss_sums, self.nonfinite_advantages.reshape(1).double()]).cpu()  # the step's one read
        counts = torch.cat([host[:1], on_device[:-1], host[1:], on_device[-1:]])
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
            {"loss": counts[1 + names.index("loss")].item(), "gradients": grad_norm})
        skip = self.skips.record(self.current_step if self.current_step is not None else self.num_updates, bad)
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.num_updates += 1
        if self.old is not None and not skip:
            self.old.after_update(self.num_updates)  # NFT: the soft update, after the optimizer's
        if self.ema is not None and not skip:
            decay = min(self.cfg.optim.ema_decay, (1 + self.num_updates) / (10 + self.num_updates))
            with torch.no_grad():
                for e, p in zip(self.ema, self.params):
                    e.lerp_(p.detach(), 1 - decay)
        stats = {f"train/{k}": counts[1 + i].item() / total for i, k in enumerate(names)}
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
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [local_part(p.grad)[0] for p in self.params]  # whole: a replicated trainer's own FSDP is one rank
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self._comm_device())
        dist.all_reduce(flat, group=self.group)  # sync point: all trainers
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n

    # ----- weights out ----------------------------------------------------------------------
    def weights(self, names: list[str] | None = None) -> dict[str, Tensor]:
        """The trained weights by name, as this rank holds them (under FSDP: its shards)."""
        wanted = set(names or self.names)
        return {n: p for n, p in self.adapter.transformer.named_parameters() if n in wanted}

    def sampling_tensors(self, names: list[str]) -> dict[str, Tensor]:
        """The tensors of the policy the generators sample with, by name, as this rank holds them
        (under FSDP its shards): the trained weights, or DiffusionNFT's old policy."""
        if self.old is None:
            params = dict(self.adapter.transformer.named_parameters())
            return {n: params[n] for n in names}
        index = {n: i for i, n in enumerate(self.names)}
        return {n: self.old.tensors[index[n]] for n in names}

    # ----- publication ----------------------------------------------------------------------
    def start_codec(self, spec: str, names: list[str], residual: dict[str, Tensor] | None = None) -> None:
        """Train through the lossy publication codec `spec` (parallel/compress.py) from the weights
        held now, going on from a resumed run's `residual`. The codec's state is sharded as the
        weights are, in the dtype the generators hold (the compute dtype)."""
        self.codec = compress.Reconstruction(spec, self.sampling_tensors(names), residual, self.compute_dtype)

    def current_version(self, names: list[str]) -> Outgoing:
        """The version the generators hold of the weights `names`, as they hold it: the sampling
        policy's weights (the trained ones; DiffusionNFT: the old policy) cast to the compute dtype,
        or a lossy codec's reconstruction. Every trainer rank calls it (under FSDP a collective:
        checksums)."""
        if self.codec is None:
            return Outgoing.of(self.sampling_tensors(names), dtype=self.compute_dtype)
        return Outgoing.of({n: self.codec.held[n] for n in names})

    def make_version(self, names: list[str]) -> Outgoing:
        """The version this update makes, for publication (every trainer rank calls it; under FSDP
        a collective). Without a lossy codec, the sampling policy's weights in the compute dtype,
        cast and gathered a bucket at a time as they are sent. With one, the codec encodes this
        rank's shards and the trainer adopts what receivers rebuild, so it trains against the policy
        the generators sample with; what the wire left out waits in the codec's residual."""
        if self.codec is None:
            return self.current_version(names)
        targets = self.sampling_tensors(names)
        wire, held = self.codec.publish(targets)
        with torch.no_grad():
            for n, t in held.items():
                local_part(targets[n])[0].copy_(local_part(t)[0])
        return Outgoing.of(wire, held, self.codec.spec)


@dataclass
class _Host:
    """An item's row metadata read to the host once (its tensors may live on the device)."""

    sample_ids: list[int]
    keep: list[bool]
    sigmas: list[float] | None = None  # a chunk's K+1 sigmas
    timesteps: list[int] | None = None  # a packed batch's per-row timesteps

    @classmethod
    def of(cls, item: TrainChunk | TransitionBatch) -> "_Host":
        if isinstance(item, TransitionBatch):
            return cls(item.sample_ids.tolist(), item.keep.tolist(), timesteps=item.timesteps.tolist())
        return cls(item.sample_ids.tolist(), item.keep.tolist(), sigmas=item.sigmas.tolist())


def _index(rows: list[int], device: torch.device) -> slice | Tensor:
    """An index of `rows` for tensors on `device`: a slice when the rows are consecutive (the usual
    case: a whole chunk, a packed micro-batch), else an index tensor copied without a device wait."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return sampler.to_device(torch.tensor(rows), device)


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
            names = sorted({n for names in publish_names.values() for n in names})
            out = trainer.make_version(names)  # sync point under FSDP: the version's checksums, from shards
            # Each generator (stage) gets only the weights it holds, encoded once for all of them.
            by_dst = {g: publish_names[g] for g in topo.generator_ranks}
            if ctx.rank == topo.trainer_ranks[0]:
                if store is not None:
                    store.put(f"pub/{step + 1}", 1)  # generators may install it at their next fragment boundary
                # On a communicator apart from the fragments' (docs/communication.md).
                sent = publisher.publish_all(out, by_dst, step + 1, group=ctx.comms.publish)
            else:
                publisher.follow_all(out, by_dst)  # FSDP: the same bucket all-gathers as trainer 0's sends
            publisher.keep_version(out, names, step + 1)  # TCSS: the generators' version at a checkpoint
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
