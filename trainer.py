"""The trainer role: replays trajectories as (sample, timestep) transitions with the clipped
Flow-GRPO / DanceGRPO loss, accumulates gradients over the fragments of a logical batch, steps
the optimizer once per batch (or per part of it), and hands out the new version's weights for publication.

The loss of an update is the mean over all the transitions it trains (docs/ALGORITHMS.md). Each
forward adds the *sum* of its transitions' losses; `update` sums gradients over trainer ranks and
divides by the update's transition count, so every placement computes the same gradient up to
reduction order (docs/DESIGN.md, placement invariance). A step makes one update over all its
transitions, or with --updates-per-rollout N one per part of its samples (rl/updates.py), each
trained after the update before; `end_step` then reports the step.

Without TSP a chunk of samples goes whole to one trainer, which runs one forward per trained
timestep. With --tsp every trainer receives a `TransitionBatch`: its share of each fragment's
transitions, packed by `parallel.tsp` into micro-batches that mix samples and timesteps. Which of
the two a run uses is its intake's choice (parallel/trainer_intake.py).

What a forward computes is the algorithm's (rl/algorithms/, `Algorithm.forward`): the trainer hands
it the transitions and its policies' velocities, and it returns the loss terms. An algorithm may keep
state beside the weights (`Algorithm.trainer_state`: DiffusionNFT's old policy, which its trainers
train against and publish for the generators to sample with).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rl import algorithms
from rl import ema, sampler
from rl.advantages import StepEnd
from rl.gradients import SplitGradients
from config.schema import RunConfig
from models import DiTAdapter, autocast, resolve_dtype
from models.lora import trainable_names
from rl.transitions import Transitions
from rl.nonfinite import SkipTracker
from rl.updates import UpdateSums, step_stats
from parallel import compress
from parallel import forward_rows
from parallel.fsdp import count_allgathers, full_tensor, local_part, shard_modules
from parallel.trainer_intake import TrainChunk, TrainingSpec, TransitionBatch
from parallel.p2p import comm_device
from parallel.publish import Outgoing
from telemetry.tracing import Slowdown

COUNTS = ("staleness_mean", "staleness_frac_1")
"""per-transition statistics the trainer counts itself, beside its loss's"""


class Trainer:
    def __init__(self, cfg: RunConfig, adapter: DiTAdapter, sampling: sampler.SamplingConfig, group=None,
                 sharding: str = "replicate", slowdown: Slowdown | None = None, own_group=None,
                 device: torch.device | None = None, helper: bool = False):
        """`slowdown` (--debug-slow-rank) wraps every training forward + backward. `own_group`: a
        replicated trainer's group of itself alone (ProcessGroups.own), which every rank created.
        `helper`: a tail assist's trainer on a generator rank (parallel/tail_assist.py): no optimizer.
        `device`: where this rank computes (default: the transformer's). An FSDP2 trainer's
        transformer may arrive in host memory (runtime/context.py `shards_from_host`): FSDP2 moves
        each unit to the device as it shards it, so the device holds this rank's shards and at most
        one unit whole."""
        self.cfg, self.adapter, self.sampling = cfg, adapter, sampling
        self.slowdown = slowdown or Slowdown()
        self.spec = TrainingSpec.of(cfg, sampling)  # which timesteps of a sample are trained
        self.group, self.sharding = group, sharding
        self.device = device if device is not None else adapter.device
        model = adapter.transformer
        self.lora = cfg.optim.lora_rank > 0
        if not self.lora:
            model.requires_grad_(True)
        self.names = trainable_names(model)
        if not helper and any(p.dtype != torch.float32 for p in self.trained_params()):  # a helper's: the model's
            raise RuntimeError("trained weights must be float32 (models.model_dtypes(master=True), models.lora)")
        # Every forward computes in the compute dtype: the generators hold the weights in it, and
        # inputs are cast to it alike everywhere (DiTAdapter.compute_dtype).
        self.compute_dtype = resolve_dtype(cfg.model.dtype, self.device)
        adapter.compute_dtype = self.compute_dtype
        self.algorithm = algorithms.algorithm(cfg.rl.algorithm)
        self.loss = self.algorithm.loss(cfg.rl)
        self.rule = self.algorithm.advantages(cfg.rl)  # what the end of a step decides (rl.advantages.step_end)
        # The KL reference is copied before FSDP2 shards the model (a sharded module cannot be copied).
        reference = self._reference_copy() if self.loss.needs_reference and not self.lora else None
        # Mixed precision as FSDP2 does it (float32 weights, each unit cast to the compute dtype for
        # its forward, float32 gradients): over the trainer group, or for a replicated trainer over
        # this rank alone, so that every forward computes with exactly the weights generators hold.
        mixed = self.compute_dtype if self.compute_dtype != torch.float32 else None
        engine = group if sharding == "fsdp" else (own_group if mixed is not None else None)
        if sharding != "fsdp" and mixed is not None and engine is None and dist.is_initialized() and not helper:
            raise RuntimeError(f"a replicated trainer computing in {mixed} needs a group of its own, created by every "
                             f"rank: ProcessGroups.create(..., own=True)")
        if engine is not None:
            adapter.enclosing = shard_modules(model, engine, mixed)  # one root: all-gathers overlap compute
            count_allgathers(model, engine, self._on_allgather)
        if next(model.parameters()).device != self.device:  # loaded into host memory and not sharded
            model.to(self.device)
        self.reference = self._make_reference(reference, group if sharding == "fsdp" else None)
        if cfg.optim.grad_checkpointing:
            self._checkpoint_blocks()
        self.params = self.trained_params()
        self.optimizer = adamw(self.params, cfg, self.device) if not helper else None
        self.ema = [p.detach().clone() for p in self.params] if cfg.optim.ema_decay > 0 and not helper else None
        # What the algorithm keeps beside the weights (DiffusionNFT: the old policy the generators sample with).
        self.state = self.algorithm.trainer_state(cfg, self.params)
        self.num_updates = 0
        self.num_checks = 0
        self.skips = SkipTracker(cfg.optim.max_skipped_steps)  # steps with non-finite values (rl/nonfinite.py)
        self.current_step: int | None = None  # the step being trained (its updates make version step+1)
        self.codec: compress.Reconstruction | None = None  # a lossy publication codec (start_codec)
        # Called with the forward's slot (this step's count of planned forwards, real or padding: not
        # the step end's) before each: with TAG under FSDP the group's generation windows fall between forwards.
        self.before_forward = None
        self.items: list | None = None  # this step's chunks or packed batches, kept for its end (begin_step)
        self.grads = SplitGradients(self.params)  # the KL term's apart while the policy term's scale is unknown
        self.scale_later = False
        self.reset_stats()

    # ----- set-up ---------------------------------------------------------------------------
    def trained_params(self) -> list[Tensor]:
        return [p for p in self.adapter.transformer.parameters() if p.requires_grad]

    def _reference_copy(self) -> torch.nn.Module:
        """The transformer with the initial weights copied in the compute dtype, frozen, where the
        weights are (host memory or the device), each weight cast as it is copied: no float32 copy
        of the model is ever made (deepcopy takes a parameter's copy from its memo)."""
        model = self.adapter.transformer
        memo = {id(p): torch.nn.Parameter(p.detach().to(self.compute_dtype, copy=True), requires_grad=False)
                for p in model.parameters()}
        return copy.deepcopy(model, memo).to(self.compute_dtype)  # floating buffers too, as generators cast them

    def _make_reference(self, transformer: torch.nn.Module | None, group) -> DiTAdapter | None:
        """The frozen reference policy of the KL term: LoRA's base (None: the same model with its
        LoRA disabled), or `transformer`, the copy of the initial weights in the compute dtype (held
        as generators hold frozen weights), sharded as the trained weights are: over the FSDP2
        `group` (each reference forward gathers a unit at a time, on every trainer alike: padding
        forwards too), whole on a replicated trainer."""
        if transformer is None:
            return None
        ref = copy.copy(self.adapter)
        ref.transformer = transformer
        ref.blocks = ref._block_list()
        ref.enclosing = shard_modules(transformer, group) if group is not None else None
        if group is None and next(transformer.parameters()).device != self.device:
            transformer.to(self.device)
        return ref

    def _checkpoint_blocks(self) -> None:
        """Wrap every block's forward in torch.utils.checkpoint (diffusers' own flag only covers
        model.forward, which the split never calls: docs/MODELS.md)."""
        for block in self.adapter.blocks:
            fwd = block.forward
            block.forward = lambda *a, _f=fwd, **kw: checkpoint(_f, *a, use_reentrant=False, **kw)

    def reset_stats(self) -> None:
        """A step's counts: its forwards, gathers, staleness, non-finite advantages and updates."""
        self.max_staleness = 0
        self.num_forwards = 0
        self.slot = 0  # planned forwards (real and padding; not the step end's), TAG's and FSDP padding's count
        self.num_allgathers = 0
        self.nonfinite_advantages = torch.zeros((), dtype=torch.int64, device=self.device)  # items with any
        self.updates: list[UpdateSums] = []
        self.reset_update()

    def reset_update(self) -> None:
        """An update's sums: its loss statistics, transitions and staleness."""
        self.loss_sums = torch.zeros(len(self.loss.STATS), dtype=torch.float64, device=self.device)
        self.counts = {k: 0.0 for k in COUNTS}
        self.num_transitions = 0

    @property
    def sums(self) -> dict[str, float]:
        """This step's statistic sums so far, by name (reads the device: for tests and reports,
        not for the training loop)."""
        return {**dict(zip(self.loss.STATS, self.loss_sums.tolist())), **self.counts}

    def _on_allgather(self) -> None:
        self.num_allgathers += 1

    def begin_step(self, keep_items: bool = False, scale_later: bool = False) -> None:
        """Count only the training phase's all-gathers (colocated FSDP generation gathers too).
        `keep_items`: keep what this step trains for its end; `scale_later`: the policy term's scale
        is known only at the end (the global std while streaming), so with beta > 0 the KL term's
        gradient accumulates apart."""
        self.num_allgathers = 0
        self.items = [] if keep_items else None
        self.scale_later = scale_later
        self.grads.begin(apart=scale_later and self.loss.unscaled_term)

    # ----- training -------------------------------------------------------------------------
    def _start_forward(self, late: bool = False) -> None:
        """Count a training forward, after letting `before_forward` run for a planned one (`late`:
        one the step's end decided, after every planned forward of its update)."""
        if not late:
            if self.before_forward is not None:
                self.before_forward(self.slot)
            self.slot += 1
        self.num_forwards += 1

    def admit(self, item: TrainChunk | TransitionBatch) -> None:
        """A piece of this step's work, once, before it trains: non-finite rewards make the step's
        updates skip (counted on the device, read once per update); kept for the step's end."""
        self.nonfinite_advantages += (~torch.isfinite(item.advantages)).any().to(self.device)
        if self.items is not None:
            self.items.append(item)

    def train(self, item: TrainChunk | TransitionBatch, end: StepEnd | None = None, part: int | None = None) -> None:
        """Forward + backward of every transition of `item` this trainer trains: a chunk one
        timestep per forward, a TSP share one packed micro-batch (mixing samples and timesteps) per
        forward. With `end`, only the transitions of the samples the step's end trains again. `part`:
        only those of the step's update `part` (the caller admitted the item); None: the whole item,
        admitted here."""
        if end is None and part is None:
            self.admit(item)
        cond = item.cond.to(self.device)
        neg = item.neg_cond.to(self.device) if item.neg_cond is not None else None
        packed = isinstance(item, TransitionBatch)
        for key, rows in forward_rows.forwards(item, self.spec, end, part):
            if not rows:  # padding keeps FSDP ranks' forward counts equal (the end's: in train_again)
                if end is None and (not packed or self.sharding == "fsdp"):
                    self._start_forward()
                    self._forward(self._transitions(item, key, [(key if packed else 0, 0.0, False)], cond, neg),
                                  pad=True)
                continue
            self._start_forward(late=end is not None)
            self._forward(self._transitions(item, key, rows, cond, neg))
            self._count(sum(c for _, _, c in rows), item.version)

    train_chunk = train_transitions = train  # the names the tests and helpers know

    def _transitions(self, item, key: int, rows, cond, neg) -> Transitions:
        if isinstance(item, TransitionBatch):
            return self._packed_rows(item, rows, cond, neg)
        return self._chunk_rows(item, rows, key, cond, neg)

    def _chunk_rows(self, chunk: TrainChunk, rows: list[tuple[int, float, bool]], t: int, cond, neg) -> Transitions:
        """The rows of a chunk at timestep t. The chunk's tensors stay where they arrived (the device,
        on NCCL): they are indexed there; its small metadata (ids, sigmas, advantages) is on the host."""
        dev, n, js = self.device, len(rows), [j for j, _, _ in rows]
        whole = n == len(chunk.sample_ids)  # keep the generation batch intact: bitwise-equal forwards
        x_t, x_next, logp = chunk.at(_index(js, chunk.latents.device), t)
        host = torch.tensor(js)
        steps = chunk.steps_at(_index(js, chunk.latents.device), t)
        return Transitions(x_t.to(dev), x_next.to(dev),
                           chunk.sigmas[t].to(dev).expand(n), chunk.sigmas[t + 1].to(dev).expand(n), [t] * n,
                           cond if whole else cond.select(_index(js, dev)),
                           neg if (neg is None or whole) else neg.select(_index(js, dev)),
                           logp.to(dev), chunk.advantages[host].to(dev), chunk.sample_ids[host].tolist(), chunk.step,
                           *forward_rows.weights(rows, dev), {k: v.to(dev) for k, v in steps.items()})

    def _packed_rows(self, batch: TransitionBatch, rows: list[tuple[int, float, bool]], cond, neg) -> Transitions:
        """The rows of a packed micro-batch: its latents indexed where they arrived, its metadata
        (ids, sigmas, timesteps, advantages) on the host."""
        dev, js = self.device, [j for j, _, _ in rows]
        sel, device_sel = torch.tensor(js), _index(js, batch.x_t.device)
        idx = batch.cond_index[sel].to(dev)
        return Transitions(batch.x_t[device_sel].to(dev), batch.x_next[device_sel].to(dev), batch.sigma[sel].to(dev),
                           batch.sigma_next[sel].to(dev), batch.timesteps[sel].tolist(), cond.select(idx),
                           neg.select(idx) if neg is not None else None, batch.log_probs[sel].to(dev),
                           batch.advantages[sel].to(dev), batch.sample_ids[sel].tolist(), batch.step,
                           *forward_rows.weights(rows, dev), {k: v[device_sel].to(dev) for k, v in batch.steps.items()})

    def _forward(self, tr: Transitions, pad: bool = False) -> None:
        """One forward + backward of the loss of `tr`, as the algorithm computes it. Padding runs the
        same computation and collectives as a real forward (FSDP ranks must run equally many) and
        records nothing."""
        with self.slowdown():
            terms = self.algorithm.forward(self.loss, self, tr, self.state, pad)
            self.grads.backward(terms.policy, terms.unscaled)
        if not pad:
            self.loss_sums += terms.stats

    def velocity(self, tr: Transitions, x_t: Tensor) -> Tensor:
        """The trained policy's guided velocity at `x_t` and the transitions' sigmas and prompts."""
        with autocast(self.device, self.cfg.model.dtype):
            return sampler.guided_velocity(self.adapter, x_t, tr.sigma, tr.cond, tr.neg, self.sampling)

    @torch.no_grad()
    def reference_velocity(self, tr: Transitions, x_t: Tensor) -> Tensor:
        """The reference policy's guided velocity: LoRA disabled, or the frozen copy."""
        lora = self.reference is None
        if lora:
            self.adapter.transformer.disable_adapters()
        try:
            with autocast(self.device, self.cfg.model.dtype):
                return sampler.guided_velocity(self.reference or self.adapter, x_t, tr.sigma, tr.cond, tr.neg,
                                               self.sampling)
        finally:
            if lora:
                self.adapter.transformer.enable_adapters()

    def ema_swapped(self):
        """A block with the EMA of the trained weights in the parameters (--eval-ema; rl/ema.py)."""
        if self.ema is None:
            raise ValueError("--eval-ema evaluates the EMA of the trained weights: set --ema-decay > 0")
        return ema.swapped(self.ema, self.params)

    def sampling_policy(self):
        """The policy the generators sample with, in the parameters for a block (colocated ranks and
        TAG helpers generate with the trainer's model): the algorithm's (DiffusionNFT: the old
        policy), else the trained weights as they are."""
        return self.algorithm.sampling_policy(self.state)

    def _pad(self, template: TrainChunk | TransitionBatch | None, late: bool = False) -> None:
        if template is None:
            raise RuntimeError("a trainer with no chunk cannot pad FSDP forwards")
        self._start_forward(late)
        cond = template.cond.to(self.device)
        neg = template.neg_cond.to(self.device) if template.neg_cond is not None else None
        self._forward(self._transitions(template, 0, [(0, 0.0, False)], cond, neg), pad=True)

    def pad_forwards(self, count: int, template: TrainChunk | TransitionBatch | None) -> None:
        """FSDP only: run padding forwards until this rank has done `count` planned forwards this step."""
        while self.slot < count:
            self._pad(template)

    def train_again(self, end: StepEnd, template, part: int | None = None) -> int:
        """The step's end: the transitions of the samples it trains again, from the items kept this
        step (`part`: those of the step's update `part`). FSDP ranks agree on the group's most such
        forwards first (their forwards are collectives) and pad to it. Returns this rank's count."""
        count = sum(1 for item in self.items for _, rows in forward_rows.forwards(item, self.spec, end, part) if rows)
        most = count
        if self.sharding == "fsdp":
            most = int(self._all_reduce_max(float(count)))  # sync point: all trainers
        for item in self.items:
            self.train(item, end, part)
        for _ in range(most - count):
            self._pad(template, late=True)
        return count

    def _count(self, n: int, version: int) -> None:
        """n transitions trained; their staleness is this update's version minus the generating one
        (0 on-policy, at most 1 with TCSS)."""
        stale = 0 if self.current_step is None else self.current_step - version
        self.num_transitions += n
        self.counts["staleness_mean"] += n * stale
        self.counts["staleness_frac_1"] += n * (stale == 1)
        self.max_staleness = max(self.max_staleness, stale)

    def finish_step(self, scale: float = 1.0) -> dict[str, float]:
        """The step's one update (`update`), then its end (`end_step`): every trainer waits here."""
        self.update(scale)
        return self.end_step()

    def update(self, scale: float = 1.0) -> UpdateSums:
        """One optimizer update over what this trainer trained since the last. Scale the policy
        term's gradient by `scale` (the global std's 1 / (std + eps), 1 otherwise) and add the KL
        term's; sum gradients and statistics over trainer ranks, normalize by the update's
        transition count, clip, step, update the EMA. Every trainer rank waits here for the others."""
        self.grads.combine(scale)
        names = self.loss.STATS + COUNTS
        host = torch.tensor([float(self.num_transitions)] + [self.counts[k] for k in COUNTS], dtype=torch.float64)
        sums = self.loss.rescale(self.loss_sums, scale) if scale != 1.0 else self.loss_sums
        on_device = torch.cat([sums, self.nonfinite_advantages.reshape(1).double()]).cpu()  # the update's one read
        counts = torch.cat([host[:1], on_device[:-1], host[1:], on_device[-1:]])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            counts = counts.to(comm_device(self.group))
            dist.all_reduce(counts, group=self.group)  # sync point: all trainers
            counts = counts.cpu()
        total = counts[0].item()
        out = UpdateSums(counts[1:-1].tolist(), total, 0.0, False)
        self.updates.append(out)
        self.reset_update()
        self.grads.begin(apart=self.scale_later and self.loss.unscaled_term)  # the next update's accumulation
        if total == 0:  # a part whose samples were all dropped (--drop-zero-std): nothing to step on
            self.optimizer.zero_grad(set_to_none=True)
            return out
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
        out.grad_norm = float(full_tensor(grad_norm)) if hasattr(grad_norm, "full_tensor") else float(grad_norm)
        # Before the update and the EMA: the same reduced values on every trainer, the same decision.
        bad = (["advantages (non-finite rewards)"] if counts[-1].item() else []) + SkipTracker.nonfinite(
            {"loss": counts[1 + names.index("loss")].item(), "gradients": out.grad_norm})
        self.num_checks += 1  # without a current step (in-process use), every update is a step of its own
        out.applied = not self.skips.record(self.current_step if self.current_step is not None else -self.num_checks,
                                            bad)
        if out.applied:
            self.optimizer.step()
            self.num_updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None and out.applied:
            ema.step(self.ema, self.params, self.cfg.optim.ema_decay, self.num_updates)
        return out

    def end_step(self) -> dict[str, float]:
        """The step's end, after its updates: the algorithm's (NFT's soft update of the old policy,
        once per rollout after its updates, as NFT does it after its epoch's), and the step's
        statistics over all its updates."""
        if sum(u.num_transitions for u in self.updates) == 0:
            raise RuntimeError("a training step with no trained transitions (all groups dropped?)")
        if any(u.applied for u in self.updates):
            self.algorithm.after_update(self.state, self.num_updates)
        stats = step_stats(self.loss.STATS + COUNTS, self.updates)
        stats["train/staleness_frac_0"] = 1.0 - stats["train/staleness_frac_1"]  # staleness is 0 or 1 by design
        stats["train/staleness_max"] = self._all_reduce_max(float(self.max_staleness))
        stats.update({"train/num_forwards": float(self.num_forwards),
                      "train/num_allgathers": float(self.num_allgathers),
                      "train/skipped_steps": float(self.skips.total)})
        self.reset_stats()
        self.items = None
        return stats

    def _all_reduce_max(self, value: float) -> float:
        if self.group is None or dist.get_world_size(self.group) == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=comm_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)  # sync point: all trainers
        return t.item()

    def _all_reduce_grads(self) -> None:
        """Replicated data parallel: one flat all-reduce (sum) of all gradients."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [local_part(p.grad)[0] for p in self.params]  # whole: a replicated trainer's own FSDP is one rank
        flat = torch.cat([g.reshape(-1) for g in grads]).to(comm_device(self.group))
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

    def sampled_copy(self) -> dict[str, Tensor] | None:
        """The tensors the generators sample with by name, when the algorithm keeps them apart from
        the trained weights (DiffusionNFT's old policy; None: they are the weights), sharded alike."""
        tensors = self.algorithm.sampled_tensors(self.state)
        return None if tensors is None else dict(zip(self.names, tensors))

    def sampling_tensors(self, names: list[str]) -> dict[str, Tensor]:
        """The tensors of the policy the generators sample with, by name, as this rank holds them
        (under FSDP its shards): the trained weights, or the algorithm's copy (`sampled_copy`)."""
        held = self.sampled_copy() or dict(self.adapter.transformer.named_parameters())
        return {n: held[n] for n in names}

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


def adamw(params: list[Tensor], cfg: RunConfig, device: torch.device, fused: bool | None = True) -> torch.optim.AdamW:
    """AdamW over the trained weights, fused where torch has the kernel (CUDA and CPU): one kernel over
    all parameters and no foreach temporaries (a float32 copy per parameter group: +11 GiB for FLUX
    full fine-tuning), and the CPU runs (the tests) take the path a GPU takes. `fused=None`: torch's
    default implementation (foreach), which tests compare with."""
    return torch.optim.AdamW(params, lr=cfg.optim.learning_rate(), betas=tuple(cfg.optim.adam_betas),
                             weight_decay=cfg.optim.weight_decay,
                             fused=fused if device.type in ("cuda", "cpu") else None)


def _index(rows: list[int], device: torch.device) -> slice | Tensor:
    """An index of `rows` for tensors on `device`: a slice when the rows are consecutive (the usual
    case: a whole chunk, a packed micro-batch), else an index tensor copied without a device wait."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return sampler.to_device(torch.tensor(rows), device)
