"""What one rank can do, found at start-up: its speed (a short probe of the run's own model).
(Whether the run fits its memory, --memory-budget-gb, is runtime/budget.py's check_budget.)

The speeds are gathered on every rank and set the share of fragments of each generator replica
(parallel.plan.replica_speeds), the GAP stage partition, and BTS's first estimate of how fast a
trainer generates. Speeds are measured under the rank's --debug-slow-rank slow-down, so an
emulated slow device is seen as slow, as a real one would be.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import torch
import torch.distributed as dist

from rl import algorithms, sampler
from models import autocast
from parallel import commhooks
from parallel.fsdp import shard_modules
from prompts import resolutions as prompt_shapes
from telemetry.tracing import Slowdown


def _timed(fn, slowdown: Slowdown, device: torch.device, repeats: int = 3) -> float:
    """The fastest of `repeats` calls of `fn`, in seconds: the first pays one-off costs, and the
    minimum is the least disturbed by other processes sharing the device or the CPU."""
    best = float("inf")
    for _ in range(repeats):
        commhooks.synchronize(device)  # start-up, before any rank posts a send: nothing else to wait for
        start = time.perf_counter()
        with slowdown():
            fn()
            commhooks.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def probe_conditioning(ctx):
    """The conditioning of `micro_batch` empty prompts, which every rank's probe runs with: the
    first rank encodes it (rank 0 always encodes: a generator's first stage, or colocated) and
    every rank receives it, since trainers and GAP stages hold no text encoder. A sync point."""
    batch = [ctx.adapter.encode_prompts([""] * ctx.cfg.rl.micro_batch).to("cpu")] if ctx.rank == 0 else [None]
    dist.broadcast_object_list(batch, src=0)  # sync point: every rank
    return batch[0].to(ctx.device)


def probe_speed(adapter, sampling, micro_batch: int, slowdown: Slowdown, autocast,
                training: bool = True, cond=None, generation: bool = True, repeats: int = 3) -> dict[str, float]:
    """{["generate_s"][, "train_s"]}: with `generation` one denoising forward (no grad) and, with
    `training`, one training forward + backward of the run's transformer at the run's micro-batch
    and resolution.
    Trainers probe training as they train: after FSDP2 shards the model (a collective over the
    trainers, which all probe), with the run's activation checkpointing and under the trainer's
    autocast; generators, whose weights are frozen, never run a backward. Draws its inputs from a
    private generator (the global RNG is untouched) and leaves no gradient behind."""
    shape = adapter.latent_shape(sampling.height, sampling.width, sampling.num_frames)
    device = adapter.device
    rng = torch.Generator().manual_seed(0)
    x = torch.randn(micro_batch, *shape, generator=rng).to(device)
    sigma = torch.full((micro_batch,), 0.5, device=device)
    cond = adapter.encode_prompts([""] * micro_batch) if cond is None else cond

    def generate():
        with torch.no_grad(), autocast():
            adapter.velocity(x, sigma, cond, sampling.guidance)

    def train():
        with torch.enable_grad(), autocast():
            v = adapter.velocity(x, sigma, cond, sampling.guidance)
        v.float().square().mean().backward()
        for p in adapter.transformer.parameters():
            p.grad = None

    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):  # whatever the model draws (dropout) leaves the run's RNG as it was
        out = {"generate_s": _timed(generate, slowdown, device, repeats)} if generation else {}
        if training:
            out["train_s"] = _timed(train, slowdown, device, repeats)
        return out


def forward_and_row_s(rows: int, rows_s: float, few: int, few_s: float | None) -> tuple[float, float]:
    """(seconds a training forward costs whatever its rows, seconds per row) from a forward of
    `rows` rows taking `rows_s` and one of `few` rows taking `few_s` (None: not measured; then all
    of it per row). Timings that fit no positive line (noise) count per row alone."""
    if few_s is None or few >= rows or few_s >= rows_s:
        return 0.0, rows_s / rows
    per_row = (rows_s - few_s) / (rows - few)
    fixed = rows_s - per_row * rows
    return (fixed, per_row) if fixed > 0 else (0.0, rows_s / rows)


def probe_sharding(adapter, sampling, micro_batch: int, slowdown: Slowdown, autocast, cond,
                   param_dtype: torch.dtype | None) -> dict[str, float]:
    """probe_speed's two forwards with the transformer sharded by FSDP2 over every rank, as colocated
    FSDP2 ranks and FSDP2 trainers shard it (`shard_modules`, with the trainers' mixed precision
    `param_dtype`): against probe_speed's, what FSDP2 adds to a forward (its all-gathers, their
    copies and hooks, the ranks' lockstep) and to a training forward and backward (gathered twice,
    reduce-scattered once). Shards `adapter`'s transformer in place: the caller's probe model is not
    run replicated again. A collective of every rank (each forward gathers)."""
    adapter.enclosing = shard_modules(adapter.transformer, dist.group.WORLD, param_dtype)
    return probe_speed(adapter, sampling, micro_batch, slowdown, autocast, cond=cond)


def probe_shapes(adapter, sampling, micro_batch: int, shapes, slowdown: Slowdown, autocast, cond) -> dict:
    """{shape: seconds} to generate one chunk of `micro_batch` samples at each shape (height, width,
    frames): encoding its prompts, K denoising steps (one step timed, counted K times: the forward,
    the seeded noise and the SDE step) and decoding, each where this rank does it (a GAP stage that
    does not encode or decode counts neither). The measured cost of the run's prompt shapes
    (prompt_shapes.measured_table). `cond`: the probe's conditioning (`probe_conditioning`). Like
    probe_speed, it leaves the run's RNG as it was."""
    device = adapter.device
    encodes = adapter.prompt_cache is not None or all(adapter.holds(n) for n in adapter.text_encoders())

    def encode():
        return adapter.encode_prompts([""] * micro_batch)

    out = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        encode_s = _timed(encode, slowdown, device) if encodes else 0.0
        for shape in shapes:
            cfg = dataclasses.replace(sampling, height=shape[0], width=shape[1], num_frames=shape[2], num_steps=1,
                                      sde_window=None, post_compress=0.0)  # one step of the full schedule
            sigmas = sampler.sigmas_for(adapter, cfg)
            neg = cond if cfg.cfg_scale != 1.0 else None
            latents = []

            def step():
                with torch.no_grad(), autocast():
                    latents[:] = [sampler.denoise(adapter, cond, neg, list(range(micro_batch)), 0, cfg,
                                                  sigmas=sigmas).latents[:, -1]]

            def decode():
                with torch.no_grad(), autocast():
                    adapter.decode(latents[0])

            step_s = _timed(step, slowdown, device)
            decode_s = _timed(decode, slowdown, device) if adapter.holds("vae") else 0.0
            out[shape] = encode_s + sampling.num_steps * step_s + decode_s
    return out


def gather_speeds(ctx, out_dir: str, cond, shapes=None, training: bool = False) -> list[dict | None]:
    """Every rank's start-up speed probe (`probe_speed` with the conditioning `cond`, training only on
    trainers: `training`; scorer ranks: None), gathered on every rank; the first rank writes them to
    DIR/speeds.json. With prompts of several shapes, generator ranks also time a chunk at each shape
    ("shape_s", for the dispatch's costs)."""
    mine = None
    if not ctx.topo.is_scorer(ctx.rank):
        amp = lambda: autocast(ctx.device, ctx.cfg.model.dtype)  # noqa: E731
        mine = probe_speed(ctx.adapter, ctx.sampling, ctx.cfg.rl.micro_batch, ctx.slowdown, amp, training, cond)
        if shapes is not None and ctx.topo.is_generator(ctx.rank):
            seconds = probe_shapes(ctx.adapter, ctx.sampling, ctx.cfg.rl.micro_batch,
                                   sorted(shapes.costs, key=prompt_shapes.shape_name), ctx.slowdown, amp, cond)
            mine["shape_s"] = {prompt_shapes.shape_name(k): s for k, s in seconds.items()}
    everyone = [None] * ctx.topo.world_size
    dist.all_gather_object(everyone, mine)  # sync point
    write_speeds(ctx, out_dir, everyone)
    return everyone


def write_speeds(ctx, out_dir: str, speeds: list[dict | None]) -> None:
    """DIR/speeds.json (the first rank writes it): every rank's speeds, with its role."""
    if ctx.rank == 0:
        with open(os.path.join(out_dir, "speeds.json"), "w") as f:
            json.dump([{"rank": r, "role": ctx.topo.role(r), **(s or {})} for r, s in enumerate(speeds)], f, indent=1)


def probe_generation(ctx, repeats: int) -> tuple[float, float]:
    """(seconds, bytes per sample): one chunk of the run's micro-batch as a generator makes it:
    its prompts (the run's first ones) encoded, K denoising steps with the run's sampler, decoded
    and scored; and the bytes of what each sample sends to its trainers (the trajectory the
    algorithm carries and the conditioning): the fastest of `repeats` (the first pays one-off
    costs). For --placement auto: every rank holds every component (runtime/autoplace.py). Like
    probe_speed, it leaves the run's RNG as it was."""
    adapter, s, b = ctx.adapter, ctx.sampling, ctx.cfg.rl.micro_batch
    records = [ctx.records[i % len(ctx.records)] for i in range(b)]
    prompts = [r.prompt for r in records]
    sigmas = sampler.sigmas_for(adapter, s)
    amp = lambda: autocast(ctx.device, ctx.cfg.model.dtype)  # noqa: E731
    carried = algorithms.algorithm(ctx.cfg.rl.algorithm).carried
    out = {}

    def chunk():
        with torch.no_grad(), amp():
            cond = adapter.encode_prompts(prompts)
            neg = adapter.encode_prompts([ctx.cfg.sampling.negative_prompt or ""] * b) if s.cfg_scale != 1.0 else None
            traj = sampler.denoise(adapter, cond, neg, list(range(b)), 0, s, sigmas=sigmas)
            images = adapter.decode(traj.latents[:, -1]).float().cpu()
        if ctx.rewards is not None:
            ctx.rewards.score(images, prompts, [r.metadata for r in records])
        out["traj"], out["cond"] = carried(traj), cond

    with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
        seconds = _timed(chunk, ctx.slowdown, ctx.device, repeats)
    traj = out["traj"]
    tensors = [traj.latents, traj.log_probs, *traj.steps.values(), *out["cond"].tensors.values()]
    return seconds, sum(t.numel() * t.element_size() for t in tensors) / b


def probe_link(rank: int, world_size: int, device: torch.device, nbytes: int = 1 << 22,
               repeats: int = 3) -> tuple[float, float]:
    """(bytes per second, latency in seconds) between rank 0 and every other rank, one at a time:
    a send of `nbytes` answered by one byte, and a byte answered by a byte, each the fastest of
    `repeats`; the slowest pair counts. Every rank calls it (a sync point); the result is rank 0's,
    broadcast. A world of one rank has no link: (inf, 0)."""
    if world_size == 1:
        return float("inf"), 0.0
    big = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    small = torch.zeros(1, dtype=torch.float32, device=device)
    result = torch.zeros(2, dtype=torch.float64)
    if rank == 0:
        bandwidth, latency = float("inf"), 0.0
        for peer in range(1, world_size):
            times = {}
            for name, payload in (("small", small), ("big", big)):
                best = float("inf")
                for _ in range(repeats):
                    commhooks.synchronize(device)
                    start = time.perf_counter()
                    dist.send(payload, peer)  # rank wait: the peer receives, then answers
                    dist.recv(small, peer)
                    commhooks.synchronize(device)  # on NCCL a recv returns once posted: wait for the answer
                    best = min(best, time.perf_counter() - start)
                times[name] = best
            latency = max(latency, times["small"] / 2)
            bandwidth = min(bandwidth, nbytes / max(times["big"] - times["small"], 1e-9))
        result[:] = torch.tensor([bandwidth, latency], dtype=torch.float64)
    else:
        for name, payload in (("small", small), ("big", big)):
            for _ in range(repeats):
                dist.recv(payload, 0)  # rank wait: rank 0 measures one peer at a time
                dist.send(small, 0)
    everyone = [result.tolist()]
    dist.broadcast_object_list(everyone, src=0)  # sync point
    return everyone[0][0], everyone[0][1]
