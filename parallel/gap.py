"""GAP's block pipeline inside a generator replica (docs/DESIGN.md, GAP).

A replica of S ranks splits the DiT blocks into S contiguous stages (parallel/schedule.py
partitions them by measured cost and rank speed; the schedule is data, checked by its validator).
Stage 0 also holds embed, stage S-1 also holds the head, the SDE step, decode and scoring. Every
denoising step of a micro-batch flows stage 0 -> S-1 as activations (State.acts); the last stage
owns the latent, takes the SDE step and sends the new latent back to stage 0. Rotary tables and
masks are recomputed on each stage from the conditioning (which travels once per micro-batch, with
its first step). One executor runs the schedule: it posts each receive before computing the action
that precedes it and drains its sends at the end. Micro-batches are the plan's chunks, so every
sample sees the same batch as with S = 1 and the trajectories are bitwise the same.

Each link (stage s -> s + 1, and the last stage -> stage 0) is a communicator of its own
(parallel/topology.py): on NCCL a receive posted early holds back the stage's later sends on the
same communicator, and with 2 stages stage 0's receive from stage 1 would sit ahead of its send to
stage 1 (docs/communication.md).

Model-agnostic: the adapter, the encoding and the noise keys come from the rollout.Generator passed
in, and finished fragments go into its FragmentStream, as a one-stage replica's do.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rl import sampler
from parallel import commhooks, p2p
from parallel.schedule import Action, gap_schedule, partition_blocks, validate_schedule
from rl.conditioning import Conditioning, State


@dataclass(frozen=True)
class StageLayout:
    ranks: tuple[int, ...]  # the replica's ranks, stage 0 first
    stage: int
    blocks: tuple[int, int]  # [start, end) of this stage's blocks

    @property
    def num_stages(self) -> int:
        return len(self.ranks)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1


# ----- which weights a stage holds --------------------------------------------------------------
def block_prefixes(adapter) -> list[str]:
    """Parameter-name prefix of every block, in block order."""
    name_of = {id(m): n for n, m in adapter.transformer.named_modules()}
    return [name_of[id(b)] + "." for b in adapter.blocks]


def stage_param_names(adapter, names: list[str], blocks: tuple[int, int], first: bool,
                      last: bool) -> list[str]:
    """The subset of `names` a stage needs: its blocks, and everything outside the blocks (embed,
    head) on the first and last stage."""
    prefixes = block_prefixes(adapter)
    out = []
    for n in names:
        owner = next((i for i, p in enumerate(prefixes) if n.startswith(p)), None)
        if (owner is None and (first or last)) or (owner is not None and blocks[0] <= owner < blocks[1]):
            out.append(n)
    return out


def release_other_blocks(adapter, blocks: tuple[int, int]) -> None:
    """Free the blocks this stage does not run: each generator holds about 1/S of the DiT."""
    for i, block in enumerate(adapter.blocks):
        if not blocks[0] <= i < blocks[1]:
            block.to("meta")


@torch.no_grad()
def measure_block_costs(adapter, sampling: sampler.SamplingConfig, batch: int,
                        repeats: int = 2, cond: Conditioning | None = None) -> list[float]:
    """Seconds per block for one micro-batch on this rank (the last of `repeats` runs), with the
    conditioning `cond` of `batch` prompts (default: empty prompts, encoded here)."""
    shape = adapter.latent_shape(sampling.height, sampling.width, sampling.num_frames)
    cond = adapter.encode_prompts([""] * batch) if cond is None else cond
    x = torch.randn(batch, *shape, device=adapter.device)
    state = adapter.embed(x, torch.full((batch,), 0.5, device=adapter.device), cond, sampling.guidance)
    costs = []
    for i in range(len(adapter.blocks)):
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = adapter.run_block(i, state)
            commhooks.synchronize(x.device)  # start-up only: nothing is posted yet
            cost = time.perf_counter() - t0
        costs.append(cost)
        state = out
    return costs


def plan_stages(costs_by_rank: dict[int, list[float]], replica_ranks: tuple[int, ...]) -> list[tuple[int, int]]:
    """Partition from measurements of every rank of the replica: block costs averaged after
    normalizing each rank's total, stage speeds = 1 / each rank's total time."""
    totals = [sum(costs_by_rank[r]) for r in replica_ranks]
    n = len(costs_by_rank[replica_ranks[0]])
    shares = [sum(costs_by_rank[r][i] / tot for r, tot in zip(replica_ranks, totals)) / len(replica_ranks)
              for i in range(n)]
    return partition_blocks(shares, [1.0 / tot for tot in totals])


# ----- the executor -----------------------------------------------------------------------------
def _cond_payload(prefix: str, cond: Conditioning | None) -> dict[str, Tensor]:
    return {} if cond is None else {prefix + k: v.contiguous() for k, v in cond.tensors.items()}


def _cond_from(prefix: str, tensors: dict[str, Tensor]) -> Conditioning | None:
    sub = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    return Conditioning(sub) if sub else None


class PipelinedReplica:
    """Runs one step's micro-batches of a replica through its stages. `links`: the communicators
    this stage receives on and sends on (ProcessGroups.stage_links; None: the default group)."""

    def __init__(self, generator, layout: StageLayout, links: tuple = (None, None)):
        self.gen, self.layout = generator, layout
        self.recv_group, self.send_group = links
        self.adapter = generator.adapter
        self.sampling: sampler.SamplingConfig = generator.sampling
        self._validated: set[tuple[int, int]] = set()

    def schedule(self, num_microbatches: int) -> list[Action]:
        s, k = self.layout.num_stages, self.sampling.num_steps
        full = gap_schedule(s, num_microbatches, k)
        if (num_microbatches, k) not in self._validated:
            validate_schedule(full, s, num_microbatches, k)
            self._validated.add((num_microbatches, k))
        return full[self.layout.stage]

    def _source(self, a: Action) -> int | None:
        p = a.producer(self.layout.num_stages)
        return None if p is None else self.layout.ranks[p.stage]

    def run_step(self, plan, fragments, version: int, stream, tracer=None) -> None:
        """Generate `fragments` (this replica's, in plan order). On the last stage every fragment
        goes into `stream` (rollout.FragmentStream: decoded, scored, emitted) as soon as its last
        micro-batch finishes. Each action runs under the generator's slow-down (--debug-slow-rank)."""
        chunks = [(f, c) for f in fragments for c in f.chunks]
        actions = self.schedule(len(chunks))
        st = _StepState(plan, chunks, version, stream)

        def post(i: int):
            for j in range(i, len(actions)):
                src = self._source(actions[j])
                if src is not None:
                    return j, p2p.post_recv(src, self.recv_group, device=self.adapter.device)
            return None, None

        pending_at, pending = post(0)
        for i, a in enumerate(actions):
            msg = None
            if pending_at == i:
                msg, meta = pending.wait()  # rank wait: the producing stage's output
                if (meta["mb"], meta["t"]) != (a.mb, a.t):
                    raise p2p.ProtocolError(f"stage received micro-batch {meta['mb']} step {meta['t']}, expected {a}")
                pending_at, pending = post(i + 1)  # posted early: before this action computes
            span = (tracer.span("F", "generate", plan.step, chunks[a.mb][0].index, mb=a.mb, t=a.t)
                    if tracer is not None else contextlib.nullcontext())
            with span, self.gen.slowdown():
                self._act(st, a, msg)
            st.sends = [h for h in st.sends if not h.is_completed()]
        for h in st.sends:
            h.wait()  # drain sends at the end
        if self.layout.last:
            stream.close()

    def _act(self, st: "_StepState", a: Action, msg: dict | None) -> None:
        lay, adapter, plan = self.layout, self.adapter, st.plan
        frag, chunk = st.chunks[a.mb]
        ids = list(chunk.sample_ids)
        cfg, sigmas = self.gen.sampling_for(frag.shape)  # the fragment's shape (one per fragment)
        shape = adapter.latent_shape(cfg.height, cfg.width, cfg.num_frames)
        dev = adapter.device
        next_rank = lay.ranks[(lay.stage + 1) % lay.num_stages]
        if a.t == 0:
            if lay.first:
                cond, neg = self.gen.chunk_inputs(plan, chunk)
            else:
                cond, neg = _cond_from("cond.", msg), _cond_from("neg.", msg)
            st.conds[a.mb] = (cond, neg)
            st.sides[a.mb] = (adapter.side_inputs(shape, cond), adapter.side_inputs(shape, neg) if neg else None)
            if lay.first or lay.last:
                x0 = sampler.initial_latents(cfg, plan.step, self.gen.init_ids(plan, chunk), shape, dev)
                if lay.last:  # the last stage owns the latent and the stored path
                    st.x_of[a.mb] = x0
                    st.paths[a.mb] = sampler.PathRecorder(x0, cfg.record)
        cond, neg = st.conds[a.mb]
        sigma = cfg.model_sigma(sigmas[a.t].to(dev).expand(len(ids)))  # what the model sees (quantised or not)
        with self.gen.autocast(), torch.no_grad():
            if lay.first:
                x = x0 if a.t == 0 else msg["x"]  # the latent comes back from the last stage
                states = [adapter.embed(x, sigma, cond, cfg.guidance)]
                if cfg.cfg_scale != 1.0:
                    states.append(adapter.embed(x, sigma, neg, cfg.guidance))
            else:
                side_c, side_u = st.sides[a.mb]
                states = [State({k[2:]: v for k, v in msg.items() if k.startswith("c.")}, side_c)]
                if cfg.cfg_scale != 1.0:
                    states.append(State({k[2:]: v for k, v in msg.items() if k.startswith("u.")}, side_u))
            for b in range(*lay.blocks):
                states = [adapter.run_block(b, s) for s in states]
            if not lay.last:
                out = {f"{tag}.{k}": v.contiguous() for tag, s in zip("cu", states) for k, v in s.acts.items()}
                if a.t == 0:
                    out.update(_cond_payload("cond.", cond))
                    out.update(_cond_payload("neg.", neg))
                st.sends.append(p2p.isend_framed(out, {"mb": a.mb, "t": a.t}, dst=next_rank, group=self.send_group))
                return
            v = adapter.head(states[0])
            if cfg.cfg_scale != 1.0:
                v = adapter.combine_cfg(v, adapter.head(states[1]), cfg.cfg_scale)
        out = sampler.sample_step(st.x_of[a.mb], v, sigmas, a.t, ids, plan.step, cfg, st.x0_of.pop(a.mb, None))
        st.x_of[a.mb], st.x0_of[a.mb] = out.x_next, out.x0
        st.paths[a.mb].add(out)
        if a.t + 1 < cfg.num_steps:
            st.sends.append(p2p.isend_framed({"x": out.x_next.contiguous()}, {"mb": a.mb, "t": a.t + 1},
                                             dst=next_rank, group=self.send_group))
            return
        st.done[a.mb] = st.paths.pop(a.mb).trajectory(sigmas)
        del st.x_of[a.mb], st.x0_of[a.mb]
        members = [m for m, (f, _) in enumerate(st.chunks) if f.index == frag.index]
        if all(m in st.done for m in members):
            st.stream.push(self.gen.denoised(frag, [st.done.pop(m) for m in members],
                                             [st.conds[m][0] for m in members], [st.conds[m][1] for m in members]),
                           st.version)


@dataclass
class _StepState:
    """What the executor carries between the actions of one step."""

    plan: object
    chunks: list
    version: int
    stream: object  # rollout.FragmentStream (used on the last stage)
    conds: dict = field(default_factory=dict)   # mb -> (cond, neg)
    sides: dict = field(default_factory=dict)   # mb -> (side inputs of cond, of neg)
    x_of: dict = field(default_factory=dict)    # last stage: mb -> current latent
    x0_of: dict = field(default_factory=dict)   # last stage: mb -> the last step's data prediction (dpm2)
    paths: dict = field(default_factory=dict)   # last stage: mb -> its sampler.PathRecorder
    done: dict = field(default_factory=dict)    # last stage: mb -> finished Trajectory
    sends: list = field(default_factory=list)
