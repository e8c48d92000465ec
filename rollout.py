"""Rollout: sample trajectories with the flow-matching SDE sampler.

As a command it samples and saves images (and optionally the trajectories) for evaluation and
inspection:

    python rollout.py --model flux --model-path DIR --prompt "a red circle" --steps 20 --out-dir out/

As a module it is the generator role's core: `generate_fragment` samples, decodes and returns
everything training needs for a set of samples.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import algorithm
import sampler
from models import Conditioning, DiTAdapter, load_model, model_names, resolve_device, resolve_dtype, set_attention
from models import ATTENTION_BACKENDS
from prompts import load_prompts


def encode_batch(adapter: DiTAdapter, prompts: list[str], negative_prompt: str | None,
                 cfg: sampler.SamplingConfig) -> tuple[Conditioning, Conditioning | None]:
    cond = adapter.encode_prompts(prompts)
    neg = adapter.encode_prompts([negative_prompt or ""] * len(prompts)) if cfg.cfg_scale != 1.0 else None
    return cond, neg


def sample_images(adapter: DiTAdapter, prompts: list[str], cfg: sampler.SamplingConfig, *, step: int = 0,
                  first_sample_id: int = 0, batch_size: int = 8, negative_prompt: str | None = None):
    """Sample one image per prompt in micro-batches. Sample j gets the global id first_sample_id + j,
    so the result does not depend on batch_size. Returns (trajectory, images [B,3,H,W] in [0,1])."""
    trajs, images = [], []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        cond, neg = encode_batch(adapter, chunk, negative_prompt, cfg)
        ids = list(range(first_sample_id + start, first_sample_id + start + len(chunk)))
        traj = sampler.denoise(adapter, cond, neg, ids, step, cfg)
        trajs.append(traj)
        images.append(adapter.decode(traj.latents[:, -1]).cpu())
    traj = sampler.Trajectory(latents=torch.cat([t.latents for t in trajs]).cpu(),
                              log_probs=torch.cat([t.log_probs for t in trajs]).cpu(), sigmas=trajs[0].sigmas)
    return traj, torch.cat(images)


@dataclass
class FragmentResult:
    """A generated, decoded and scored fragment: its training chunks and what the logs need."""

    chunks: list  # list[intake.TrainChunk], in plan order
    sample_ids: list[int]
    rewards: dict[str, list[float]]  # per reward name, and "combined"
    zero_std: list[bool]
    images: torch.Tensor  # (n, 3, H, W) in [0, 1], on CPU
    prompts: list[str]


class Generator:
    """The generator role's work for one replica of one stage (GAP stages come with the GAP issue):
    sample, decode and score whole fragments with the current policy version."""

    def __init__(self, adapter: DiTAdapter, sampling: sampler.SamplingConfig, rewards, records, *, seed: int,
                 negative_prompt: str = "", same_group_noise: bool = False, adv_clip: float = 5.0,
                 drop_zero_std: bool = False, autocast_ctx=None):
        from scoring import LocalScorer

        if not hasattr(rewards, "submit"):  # a RewardSet: score on this rank
            rewards = LocalScorer(rewards)
        self.adapter, self.sampling, self.rewards, self.records = adapter, sampling, rewards, records
        self.seed, self.negative_prompt = seed, negative_prompt
        self.same_group_noise, self.adv_clip, self.drop_zero_std = same_group_noise, adv_clip, drop_zero_std
        self.autocast = autocast_ctx or contextlib.nullcontext
        self.sigmas = sampler.sigmas_for(adapter, sampling)

    def chunk_inputs(self, plan, chunk):
        """(records, cond, neg_cond, init_ids) of a chunk: its prompts encoded, and the keys of its initial noise."""
        g = plan.group_size
        records = [self.records[plan.prompt_indices[i // g]] for i in chunk.sample_ids]
        cond, neg = encode_batch(self.adapter, [r.prompt for r in records], self.negative_prompt, self.sampling)
        return records, cond, neg, self.init_ids(plan, chunk)

    def init_ids(self, plan, chunk) -> list[int]:
        """Keys of the initial noise: the sample ids, or the group's (a negative id) when a group shares it."""
        g = plan.group_size
        return [-1 - i // g for i in chunk.sample_ids] if self.same_group_noise else list(chunk.sample_ids)

    def generate_fragment(self, plan, fragment, version: int, reward_std: float | None = None) -> FragmentResult:
        return self.complete(self.start_fragment(plan, fragment, version, reward_std))

    def start_fragment(self, plan, fragment, version: int, reward_std: float | None = None):
        """Denoise and decode a fragment and submit it for scoring (see `complete`)."""
        trajs, conds, negs = [], [], []
        for chunk in fragment.chunks:
            _, cond, neg, init_ids = self.chunk_inputs(plan, chunk)
            with self.autocast():
                trajs.append(sampler.denoise(self.adapter, cond, neg, list(chunk.sample_ids), plan.step,
                                             self.sampling, init_ids=init_ids, sigmas=self.sigmas))
            conds.append(cond)
            negs.append(neg)
        return self.start_scoring(plan, fragment, trajs, conds, negs, version, reward_std)

    def finish_fragment(self, plan, fragment, trajs, conds, negs, version: int,
                        reward_std: float | None) -> FragmentResult:
        """Decode and score a denoised fragment, compute its group advantages, cut it into chunks."""
        return self.complete(self.start_scoring(plan, fragment, trajs, conds, negs, version, reward_std))

    def start_scoring(self, plan, fragment, trajs, conds, negs, version: int, reward_std: float | None):
        """Decode a denoised fragment and hand it to the scorer (local: scored now; remote: sent)."""
        g = plan.group_size
        with self.autocast():
            images = torch.cat([self.adapter.decode(t.latents[:, -1]).cpu() for t in trajs])
        records = [self.records[plan.prompt_indices[i // g]] for i in fragment.sample_ids]
        ticket = self.rewards.submit(plan.step, fragment.index, images, [r.prompt for r in records],
                                     [r.metadata for r in records])
        return (plan, fragment, trajs, conds, negs, version, reward_std, images, ticket)

    def complete(self, pending) -> FragmentResult:
        """Wait for a fragment's scores, then compute its group advantages and cut it into chunks."""
        from intake import TrainChunk

        plan, fragment, trajs, conds, negs, version, reward_std, images, ticket = pending
        g = plan.group_size
        scores = self.rewards.wait(ticket)
        combined = scores.pop("combined")
        ids = list(fragment.sample_ids)
        prompts = [self.records[plan.prompt_indices[i // g]].prompt for i in ids]
        group_ids = torch.tensor([i // g for i in ids])
        adv = algorithm.group_advantages(combined, group_ids, adv_clip=self.adv_clip, std=reward_std)
        zero_std = algorithm.zero_std_groups(combined, group_ids)
        keep = ~zero_std if self.drop_zero_std else torch.ones_like(zero_std)
        chunks, start = [], 0
        for chunk, traj, cond, neg in zip(fragment.chunks, trajs, conds, negs):
            n = len(chunk.sample_ids)
            sl = slice(start, start + n)
            chunks.append(TrainChunk(plan.step, fragment.index, chunk.index, version,
                                     torch.tensor(chunk.sample_ids, dtype=torch.int64), traj.latents.cpu(),
                                     traj.log_probs.cpu(), adv[sl].clone(), keep[sl].clone(), traj.sigmas.cpu(),
                                     cond.to("cpu"), neg.to("cpu") if neg is not None else None))
            start += n
        rewards = {name: v.float().cpu().tolist() for name, v in scores.items()}
        rewards["combined"] = combined.tolist()
        return FragmentResult(chunks, ids, rewards, zero_std.tolist(), images, prompts)


class VersionSync:
    """Which policy version a generator rank runs (DESIGN.md 5.5, 5.6).

    Before step k a generator must hold version k - lag (lag 0: on-policy; lag 1: TCSS). Newer
    versions the trainers have announced are installed at fragment boundaries, never inside a
    trajectory. The stages of a GAP replica switch together: stage 0 picks the version of a step
    and the other stages install exactly that one, so no micro-batch mixes versions."""

    def __init__(self, receiver, store, trainer_rank: int, start_version: int, lag: int, layout=None,
                 replica: int | None = None, tracer=None):
        self.receiver, self.store, self.src = receiver, store, trainer_rank
        self.version, self.lag, self.layout, self.replica, self.tracer = start_version, lag, layout, replica, tracer

    def _install_next(self, step: int) -> None:
        with self.tracer.span("receive_weights", "publish", step, version=self.version + 1):
            got = self.receiver.receive(src=self.src)  # rank wait: trainer 0 sends version + 1
        assert got == self.version + 1, (got, self.version)
        with self.tracer.span("install", "publish", step, version=got):
            self.receiver.install()  # verified against the trainer's checksum
        self.version = got

    def _install_announced(self, step: int) -> None:
        while self.store.ready(f"pub/{self.version + 1}"):
            self._install_next(step)

    def at_step_start(self, step: int) -> int:
        need = step - self.lag
        if self.layout is not None and not self.layout.first:
            need = max(need, self.store.get(f"rv/{self.replica}/{step}"))  # stage 0's choice
            while self.version < need:
                self._install_next(step)
            return self.version
        while self.version < need:
            self._install_next(step)
        self._install_announced(step)
        if self.layout is not None:
            self.store.put(f"rv/{self.replica}/{step}", self.version)
        return self.version

    def at_fragment_boundary(self, step: int) -> int:
        if self.layout is None:  # a GAP replica switches only between steps
            self._install_announced(step)
        return self.version

    def drain(self, last_version: int, step: int) -> None:
        """Receive every publication still addressed to this rank (the trainers' sends complete)."""
        while self.version < last_version:
            self._install_next(step)


def generator_step(ctx, generator: Generator, versions: VersionSync | None, plan,
                   get_reward_std: Callable[[], float | None], slow: float = 1.0, replica=None, store=None,
                   deferred: list | None = None) -> tuple[list[FragmentResult], dict]:
    """One step of a generator rank: generate, decode and score this replica's fragments
    depth-first, streaming every chunk to its trainer as soon as its fragment is scored; new
    versions are installed only between fragments. Colocated ranks keep their chunks (returned).
    With TAG the replica's fragments are the ones it claims as it gets to them (a GAP replica: a
    round at a time, tag.claimed_rounds). `get_reward_std` gives the advantage std; it is called once
    this step's weights are installed, since the trainer publishes the std after those weights."""
    from parallel import p2p
    from intake import route_chunks

    tracer, topo, step = ctx.tracer, ctx.topo, plan.step
    version = versions.at_step_start(step) if versions is not None else step
    reward_std = get_reward_std()
    me = topo.replica_of(ctx.rank)
    results, local, handles = [], {}, []
    board = None
    if ctx.cfg.topology.tag:  # TAG: fragments are claimed at run time, by replicas and idle trainers
        from tag import FragmentBoard, claimed_rounds, publish_replica_cost

        board = FragmentBoard(store, step, len(plan.fragments))
    cost, last_emit = None, time.time()

    def emit(result):
        nonlocal cost, last_emit
        results.append(result)
        if ctx.disagg:
            for dst, tensors, meta in route_chunks(ctx, plan, result.chunks):
                handles.append(p2p.isend_payload(tensors, meta, dst=dst))
        else:
            local.update({chunk.chunk: chunk for chunk in result.chunks})
        if board is not None:  # TAG: mark the fragment landed, share this replica's time per fragment
            board.land(result.chunks[0].fragment)
            now = time.time()
            cost = now - last_emit if cost is None else 0.7 * cost + 0.3 * (now - last_emit)
            last_emit = now
            publish_replica_cost(store, me, cost)

    planned = [f for f in plan.fragments if f.replica == me]
    if replica is not None:  # a GAP replica of several stages; the last one emits the fragments
        rounds = [planned] if board is None else claimed_rounds(board, store, plan, replica.layout, me)
        for fragments in rounds:
            replica.run_step(plan, fragments, version=version, reward_std=reward_std, emit=emit, tracer=tracer,
                             slow=slow)
        mine = []
    elif board is not None:
        def claimed():
            while (f := board.claim(ctx.rank, me)) is not None:
                yield plan.fragments[f]
        mine = claimed()
    else:
        mine = planned

    # With scorer ranks, fragment i's scores are collected after fragment i+1 is denoised, so the
    # scorer works while this rank generates; local scoring completes a fragment at once.
    lag = getattr(generator.rewards, "scorer_ranks", None) is not None
    pending = None
    for fragment in mine:
        if versions is not None:
            version = versions.at_fragment_boundary(step)
        with tracer.span("generate", "generate", step, fragment.index, version=version):
            t0 = time.perf_counter()
            started = generator.start_fragment(plan, fragment, version=version, reward_std=reward_std)
            if slow > 1:  # --debug-slow-rank: emulate a slower GPU
                time.sleep((time.perf_counter() - t0) * (slow - 1))
        if pending is not None:
            with tracer.span("wait_scores", "comm", step, pending[1].index):
                emit(generator.complete(pending))
        pending = started if lag else None
        if not lag:
            emit(generator.complete(started))
    if pending is not None:
        with tracer.span("wait_scores", "comm", step, pending[1].index):
            emit(generator.complete(pending))
    if deferred is not None:
        # TCSS: step k's sends complete while step k+1 is generated; the caller drains them later.
        deferred.append((step, handles))
        handles = [h for s, hs in deferred if s < step for h in hs]
        deferred[:] = [(s, hs) for s, hs in deferred if s >= step]
    with tracer.span("send_wait", "comm", step):
        for h in handles:
            h.wait()  # drain sends: this step's, or with TCSS the previous step's
    return results, local


def save_images(images: torch.Tensor, out_dir: str, first_index: int = 0) -> list[str]:
    """One PNG per sample: 0000.png, 0001.png, ... (video: the frames side by side)."""
    from PIL import Image

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for j, img in enumerate(images):
        if img.dim() == 4:  # (3, F, H, W) -> frames left to right
            img = torch.cat(list(img.unbind(1)), dim=-1)
        arr = (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        path = os.path.join(out_dir, f"{first_index + j:04d}.png")
        Image.fromarray(arr).save(path)
        paths.append(path)
    return paths


def save_trajectory(traj: sampler.Trajectory, path: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file({"latents": traj.latents.float().contiguous(), "sigmas": traj.sigmas.float().contiguous(),
               "log_probs": traj.log_probs.float().contiguous()}, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Sample images (and trajectories) with the flow-matching SDE sampler.")
    p.add_argument("--model", default="flux", help=f"model family, one of {model_names()}")
    p.add_argument("--model-path", default=None,
                   help="local diffusers folder (e.g. a FLUX.1-dev download); omit to use the offline tiny preset")
    p.add_argument("--checkpoint", default=None,
                   help="a training checkpoint folder (checkpoints/step-N) whose trained weights to load")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    src.add_argument("--prompts", help="prompt file: .txt (one per line) or .jsonl (field 'prompt')")
    p.add_argument("--height", type=int, default=None, help="image height in pixels (family default)")
    p.add_argument("--width", type=int, default=None, help="image width in pixels (family default)")
    p.add_argument("--num-frames", type=int, default=None, help="video families: number of frames")
    p.add_argument("--steps", type=int, default=None, help="denoising steps K (family default)")
    p.add_argument("--noise-level", type=float, default=None,
                   help="SDE noise level a (sde/cps) or eta (dance); 0 = deterministic ODE sampling")
    p.add_argument("--sde-type", choices=sampler.SDE_TYPES, default="sde", help="sampler step type")
    p.add_argument("--guidance", type=float, default=None, help="guidance-embedding scale (FLUX: 3.5)")
    p.add_argument("--cfg-scale", type=float, default=None, help="classifier-free guidance scale (1 = off)")
    p.add_argument("--negative-prompt", default="", help="negative prompt for CFG")
    p.add_argument("--seed", type=int, default=0, help="seed; sample i's noise depends on (seed, i) only")
    p.add_argument("--batch-size", type=int, default=8, help="samples per forward pass")
    p.add_argument("--out-dir", default=None, help="write one PNG per sample: 0000.png, 0001.png, ...")
    p.add_argument("--save-trajectory", default=None,
                   help="write a safetensors file with latents [B,K+1,C,H,W], sigmas [K+1], log_probs [B,K]")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (bf16 on CUDA)")
    p.add_argument("--attention", default="sdpa", choices=ATTENTION_BACKENDS, help="attention kernel")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = resolve_device(args.device)
    records = load_prompts(args.prompts) if args.prompts else None
    prompts = [r.prompt for r in records] if records else args.prompt
    adapter = load_model(args.model, args.model_path, device=device, dtype=resolve_dtype(args.dtype, device))
    set_attention(adapter, args.attention)
    if args.checkpoint:
        from checkpoint import load_trained_weights

        load_trained_weights(adapter, args.checkpoint)
    cfg = sampler.SamplingConfig.for_adapter(
        adapter, height=args.height, width=args.width, num_steps=args.steps, sde_type=args.sde_type,
        noise_level=args.noise_level, guidance=args.guidance, cfg_scale=args.cfg_scale, seed=args.seed,
        num_frames=args.num_frames)
    adapter.latent_shape(cfg.height, cfg.width, cfg.num_frames)  # fail on a bad size before any work
    traj, images = sample_images(adapter, prompts, cfg, batch_size=args.batch_size,
                                 negative_prompt=args.negative_prompt)
    if args.out_dir:
        save_images(images, args.out_dir)
    if args.save_trajectory:
        save_trajectory(traj, args.save_trajectory)
    print(f"sampled {len(prompts)} image(s) of {cfg.height}x{cfg.width} with {cfg.num_steps} {cfg.sde_type} steps "
          f"(noise level {cfg.noise_level})" + (f" -> {args.out_dir}" if args.out_dir else ""))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:  # user errors: one clear line, no stack trace from inside diffusers
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
