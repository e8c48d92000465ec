"""The trainer's intake (DESIGN.md 5.2-5.4): what a scored fragment becomes on the wire, where it
goes, and how a trainer rank takes in the fragments of a step.

Without TSP a fragment travels as whole chunks, each to its planned trainer (TrainChunk). With
TSP every trainer gets its packed share of every fragment (TransitionBatch). The intakes yield a
trainer's work in plan order, as each piece lands.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

import algorithm
import sampler
from config import RunConfig
from models import Conditioning
from parallel import tsp

@dataclass
class TrainChunk:
    """What a trainer needs for one chunk of samples (DESIGN.md, "trajectory")."""

    step: int
    fragment: int
    chunk: int
    version: int
    sample_ids: Tensor   # (n,) int64
    latents: Tensor      # (n, K+1, *latent_shape) float32
    log_probs: Tensor    # (n, K) float32, under the generating policy (pi_old)
    advantages: Tensor   # (n,) float32
    keep: Tensor         # (n,) bool: False for dropped zero-std groups
    sigmas: Tensor       # (K+1,) float32
    cond: Conditioning
    neg_cond: Conditioning | None

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        tensors = {"sample_ids": self.sample_ids, "latents": self.latents, "log_probs": self.log_probs,
                   "advantages": self.advantages, "keep": self.keep, "sigmas": self.sigmas, **self.cond.state_dict()}
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
                   Conditioning.from_state_dict(neg) if neg else None)


@dataclass
class TransitionBatch:
    """TSP: one trainer's share of one fragment, its packed micro-batches transition by transition
    (DESIGN.md 5.3). Conditioning is carried once per sample involved; `cond_index` maps each
    transition to its sample's row."""

    step: int
    fragment: int
    version: int
    micro_batches: tuple[int, ...]  # step-wide micro-batch indices (parallel.tsp.MicroBatch.index)
    sizes: tuple[int, ...]          # transitions per micro-batch; rows are consecutive
    sample_ids: Tensor   # (n,) int64
    timesteps: Tensor    # (n,) int64: t of each transition
    x_t: Tensor          # (n, *latent_shape) float32
    x_next: Tensor       # (n, *latent_shape) float32
    sigma: Tensor        # (n,) float32
    sigma_next: Tensor   # (n,) float32
    log_probs: Tensor    # (n,) float32 under the generating policy (pi_old)
    advantages: Tensor   # (n,) float32
    keep: Tensor         # (n,) bool
    cond_index: Tensor   # (n,) int64 rows of cond / neg_cond
    cond: Conditioning   # (u rows): the samples involved
    neg_cond: Conditioning | None

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
        return cls(first.step, first.fragment, first.version, tuple(m.index for m in micro_batches),
                   tuple(len(m.transitions) for m in micro_batches),
                   sample_ids=torch.tensor([int(c.sample_ids[j]) for c, j, _, _ in rows], dtype=torch.int64),
                   timesteps=torch.tensor([t for _, _, t, _ in rows], dtype=torch.int64),
                   x_t=torch.stack([c.latents[j, t] for c, j, t, _ in rows]),
                   x_next=torch.stack([c.latents[j, t + 1] for c, j, t, _ in rows]),
                   sigma=torch.stack([c.sigmas[t] for c, _, t, _ in rows]),
                   sigma_next=torch.stack([c.sigmas[t + 1] for c, _, t, _ in rows]),
                   log_probs=torch.stack([c.log_probs[j, t] for c, j, t, _ in rows]),
                   advantages=torch.stack([c.advantages[j] for c, j, _, _ in rows]),
                   keep=torch.stack([c.keep[j] for c, j, _, _ in rows]),
                   cond_index=torch.tensor([u for _, _, _, u in rows], dtype=torch.int64),
                   cond=Conditioning.cat(conds), neg_cond=Conditioning.cat(negs) if negs else None)

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
        if self.neg_cond is not None:
            tensors.update({"neg." + k: v for k, v in self.neg_cond.state_dict().items()})
        meta = {"kind": "transitions", "step": self.step, "fragment": self.fragment, "version": self.version,
                "micro_batches": list(self.micro_batches), "sizes": list(self.sizes)}
        return {k: v.contiguous() for k, v in tensors.items()}, meta

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "TransitionBatch":
        assert meta["kind"] == "transitions", meta
        neg = {k[len("neg."):]: v for k, v in tensors.items() if k.startswith("neg.")}
        return cls(meta["step"], meta["fragment"], meta["version"], tuple(meta["micro_batches"]),
                   tuple(meta["sizes"]), **{k: tensors[k] for k in cls._ROWS},
                   cond=Conditioning.from_state_dict(tensors),
                   neg_cond=Conditioning.from_state_dict(neg) if neg else None)


def tsp_packing(cfg: RunConfig, sampling: sampler.SamplingConfig, plan, num_trainers: int) -> tsp.Packing:
    """The step's TSP packing: a pure function of (seed, step, config), computed alike by the
    generator that routes a fragment and by every trainer that receives a share of it."""
    rl = cfg.rl
    micro_batch = cfg.topology.train_micro_batch or rl.micro_batch
    return _packing(tuple(f.sample_ids for f in plan.fragments), plan.step, rl.algorithm, sampling.num_steps,
                    rl.timestep_fraction, cfg.seed, sampling.sde_window, micro_batch, num_trainers)


@functools.lru_cache(maxsize=8)
def _packing(fragment_ids, step, algorithm_name, num_steps, fraction, seed, window, micro_batch, num_trainers):
    timesteps = {i: algorithm.trained_timesteps(algorithm_name, num_steps, fraction, seed=seed, step=step,
                                                sample_id=i, window=window)
                 for ids in fragment_ids for i in ids}
    return tsp.pack_step(fragment_ids, timesteps, micro_batch=micro_batch, num_trainers=num_trainers)


def transition_batches(cfg: RunConfig, sampling: sampler.SamplingConfig, plan, num_trainers: int,
                       chunks: list[TrainChunk]) -> list[tuple[int, TransitionBatch]]:
    """TSP: a scored fragment's chunks -> (trainer index, that trainer's TransitionBatch) for every
    trainer that trains part of the fragment."""
    packing = tsp_packing(cfg, sampling, plan, num_trainers)
    fragment = chunks[0].fragment
    return [(r, TransitionBatch.gather(chunks, packing.of(fragment, r))) for r in packing.trainers_of(fragment)]


def route_chunks(ctx, plan, chunks: list[TrainChunk]) -> list[tuple[int, dict[str, Tensor], dict]]:
    """Where a scored fragment's training data goes: (trainer rank, tensors, meta) payloads, sent
    by the generator as soon as the fragment is scored. Each chunk goes whole to its planned
    trainer; with --tsp every trainer that trains part of the fragment gets exactly its transitions."""
    topo = ctx.topo
    if ctx.cfg.topology.tsp:
        return [(topo.trainer_ranks[r], *batch.to_payload())
                for r, batch in transition_batches(ctx.cfg, ctx.sampling, plan, len(topo.trainer_ranks), chunks)]
    out = []
    for chunk in chunks:
        tensors, meta = chunk.to_payload()
        out.append((topo.trainer_ranks[plan.chunks[chunk.chunk].trainer], tensors, meta))
    return out


def static_source(ctx, plan):
    """Where fragments come from without TAG: the last stage of the replica the plan assigns."""
    return lambda f: ctx.topo.replica_ranks(plan.fragments[f].replica)[-1]


def chunk_intake(ctx, plan, local: dict, me: int, source_of=None):
    """This trainer's chunks in plan order: taken from `local` (colocated, or generated here by
    TAG) or received from the rank that generated them, each as soon as the previous one is trained."""
    from parallel import p2p

    source_of = source_of or static_source(ctx, plan)
    for c in plan.chunks:
        if c.trainer != me:
            continue
        if c.index not in local:
            src = source_of(c.fragment)  # with TAG this may generate fragments into `local`
            if c.index not in local:
                with ctx.tracer.span("recv", "comm", plan.step, c.fragment):
                    chunk = TrainChunk.from_payload(*p2p.recv_payload(src, device=torch.device("cpu")))
                assert (chunk.step, chunk.chunk) == (plan.step, c.index), (chunk.step, chunk.chunk, plan.step, c.index)
                local[c.index] = chunk
        yield local.pop(c.index), {"chunk": c.index}


def transition_intake(ctx, plan, local: dict, me: int, source_of=None):
    """TSP: this trainer's TransitionBatch of every fragment it has a share of, in plan order.

    Disagg: received from the rank that generated the fragment as it lands (or taken from `local`
    when TAG generated it here). Colocated: the owner of each fragment routes it like a generator
    would; every rank walks the fragments in the same order, so each blocking send meets its
    receive (no cycle of waiting ranks), and all data moves before training starts (generation
    already finished on every rank)."""
    from parallel import p2p

    topo, step = ctx.topo, plan.step
    source_of = source_of or static_source(ctx, plan)
    packing = tsp_packing(ctx.cfg, ctx.sampling, plan, len(topo.trainer_ranks))
    batches = []
    for f in plan.fragments:
        if not ctx.disagg and topo.replica_ranks(f.replica)[-1] == ctx.rank:
            chunks = [local.pop(c.index) for c in f.chunks]
            for r, batch in transition_batches(ctx.cfg, ctx.sampling, plan, len(topo.trainer_ranks), chunks):
                if r == me:
                    batches.append(batch)
                    continue
                with ctx.tracer.span("send", "comm", step, f.index):
                    p2p.send_payload(*batch.to_payload(), dst=topo.trainer_ranks[r])  # rank wait: the receiver
            continue
        if me not in packing.trainers_of(f.index):
            continue
        key = ("tsp", f.index)
        if key not in local:
            src = source_of(f.index)  # with TAG this may generate fragments into `local`
        if key in local:
            batch = local.pop(key)
        else:
            with ctx.tracer.span("recv", "comm", step, f.index):
                batch = TransitionBatch.from_payload(*p2p.recv_payload(src, device=torch.device("cpu")))
        assert (batch.step, batch.fragment) == (step, f.index), (batch.step, batch.fragment, step, f.index)
        assert batch.micro_batches == tuple(m.index for m in packing.of(f.index, me)), batch.micro_batches
        if ctx.disagg:
            yield batch, {"micro_batches": len(batch.sizes), "transitions": len(batch.keep)}
        else:
            batches.append(batch)
    for batch in batches:  # colocated: everything arrived above
        yield batch, {"micro_batches": len(batch.sizes), "transitions": len(batch.keep)}
