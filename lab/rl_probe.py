"""Probe the policy gradient of one configuration without a training run, on one process.

    python -m lab.rl_probe snr  [--batches 4] [--sde-window 0:3] [--same-group-noise] ...
    python -m lab.rl_probe step [--batches 8] [--etas 1e-4,1e-3] [--direction sign|grad|random] ...
    python -m lab.rl_probe train [--loss grpo|sft] [--steps 30] [--lr 3e-4] [--fixed N] ...

`snr`: the cosine between the Flow-GRPO policy gradients (sum of A * grad log p over the trained
transitions, LoRA parameters) of independent batches of the same prompts. With per-batch
signal-to-noise ratio s, the expected cosine is s^2 / (1 + s^2), and a batch's gradient has cosine
about sqrt(that) to the true gradient: near 0 means the updates are mostly noise.

`step`: one update of the LoRA weights built from the gradient of `--batches` batches, along its
sign (Adam's first step), its raw direction, or a random direction of the same norm, and the paired
change (same prompts, same seeds) of the held-out ODE evaluation reward at each step size.

`train`: a single-process training loop, one AdamW update per batch, with the held-out ODE reward
every `--eval-every` updates. `--loss grpo` is the Flow-GRPO on-policy update (mean over the trained
transitions of -A * ratio); `--loss sft` is its supervised upper bound: flow matching on latents of
correctly rendered scenes for the same prompts (perfect data, at every sigma of the schedule).
`--fixed N` trains on the first N prompts only and evaluates on those same N prompts, each with
`--eval-repeats` fixed seeds: how fast updates sharpen the prompts they see, not generalization.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import NamedTuple

import numpy as np
import torch

from rl import advantages
from rl import sampler
from rewards import shapes_world
from runtime.evaluation import evaluate
from models import load_model
from models.flux import encode_latents
from models.lora import apply_lora
from prompts.sets import load_prompts
from rewards import RewardSet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



class Batch(NamedTuple):
    prompts: list[str]
    cond: object
    traj: sampler.Trajectory
    scores: torch.Tensor  # (n,) combined reward
    adv: torch.Tensor     # (n,) group advantages


def sample_batch(adapter, sampling, records, rewards, *, group_size: int, step: int, same_group_noise: bool) -> Batch:
    """One group per record, noise keyed by `step` as in the runtime, scored and normalized."""
    prompts = [r.prompt for r in records for _ in range(group_size)]
    ids = list(range(len(prompts)))
    init = [-1 - i // group_size for i in ids] if same_group_noise else ids
    cond = adapter.encode_prompts(prompts)
    traj = sampler.denoise(adapter, cond, None, ids, step, sampling, init_ids=init)
    with torch.no_grad():
        images = adapter.decode(traj.latents[:, -1])
    scores = rewards.combine(rewards.score(images, prompts, [r.metadata for r in records for _ in range(group_size)]))
    adv = advantages.group_advantages(scores, torch.tensor(ids) // group_size, adv_clip=5.0)
    return Batch(prompts, cond, traj, scores, adv)


def transition_log_prob(adapter, sampling, batch: Batch, t: int) -> torch.Tensor:
    """(n,) log p(x_{t+1} | x_t) of the batch's stored transitions under the current weights."""
    traj = batch.traj
    v = sampler.guided_velocity(adapter, traj.latents[:, t], traj.sigmas[t].expand(len(batch.prompts)), batch.cond,
                                None, sampling)
    return sampler.sde_step(traj.latents[:, t], v, traj.sigmas[t].item(), traj.sigmas[t + 1].item(),
                            sde_type=sampling.sde_type, noise_level=sampling.noise_level_at(t),
                            x_next=traj.latents[:, t + 1]).log_prob


def policy_gradient(adapter, params, sampling, records, rewards, *, group_size: int, step: int,
                    same_group_noise: bool, timesteps) -> torch.Tensor:
    """Flat gradient of -sum(A * log p) over `timesteps` of one batch (one group per record);
    noise keyed by `step` as in the runtime."""
    batch = sample_batch(adapter, sampling, records, rewards, group_size=group_size, step=step,
                         same_group_noise=same_group_noise)
    for p in params:
        p.grad = None
    for t in timesteps:
        (-(batch.adv * transition_log_prob(adapter, sampling, batch, t)).sum()).backward()
    return torch.cat([p.grad.reshape(-1) for p in params])


def gradient_cosines(grads: list[torch.Tensor]) -> list[float]:
    return [torch.nn.functional.cosine_similarity(a, b, dim=0).item() for a, b in itertools.combinations(grads, 2)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("probe", choices=("snr", "step", "train"))
    p.add_argument("--model-path", default=os.path.join(ROOT, "assets", "shapes-flux"))
    p.add_argument("--prompts", default=os.path.join(ROOT, "data", "shapes_train.txt"), help="training prompts")
    p.add_argument("--eval-prompts", default=os.path.join(ROOT, "data", "shapes_eval.txt"),
                   help="held-out prompts of `step`")
    p.add_argument("--eval-num-prompts", type=int, default=64)
    p.add_argument("--reward", action="append", default=None, help="NAME[:WEIGHT] (default: shapes)")
    p.add_argument("--prompts-per-batch", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--noise-level", type=float, default=None)
    p.add_argument("--sde-window", default=None, help="START:END: SDE and training only in this window")
    p.add_argument("--same-group-noise", action="store_true")
    p.add_argument("--etas", default="1e-4,3e-4,1e-3", help="`step`: per-parameter step sizes (sign units)")
    p.add_argument("--direction", choices=("sign", "grad", "random"), default="sign")
    p.add_argument("--loss", choices=("grpo", "sft"), default="grpo", help="`train`: the update")
    p.add_argument("--steps", type=int, default=30, help="`train`: updates")
    p.add_argument("--lr", type=float, default=3e-4, help="`train`: AdamW learning rate")
    p.add_argument("--eval-every", type=int, default=10, help="`train`: updates between evaluations")
    p.add_argument("--fixed", type=int, default=0, help="`train`: train and evaluate on the first N prompts only")
    p.add_argument("--eval-repeats", type=int, default=8, help="`train --fixed`: seeds per evaluated prompt")
    p.add_argument("--seed", type=int, default=0)
    return p


def rendered_latents(adapter, prompts: list[str], seed: int) -> torch.Tensor:
    """Latents of a correct random scene for each prompt (the shapes world's ground truth), encoded
    as pretraining encodes them."""
    rng = np.random.default_rng(seed)
    scenes = [shapes_world.render(shapes_world.sample_scene(rng, shapes_world.parse_prompt(p))) for p in prompts]
    return encode_latents(adapter.pipe.vae, shapes_world.scene_pixels(scenes))


def train(args, adapter, params, sampling, rewards, records, timesteps) -> list[float]:
    """The `train` probe; returns the evaluation curve (before the first update, then every
    --eval-every updates)."""
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-4)
    if args.fixed:
        records = records[:args.fixed]
        held_out = records * args.eval_repeats
    else:
        held_out = load_prompts(args.eval_prompts)[:args.eval_num_prompts]

    def eval_now(k: int) -> float:
        r = sum(evaluate(adapter, sampling, held_out, rewards, batch_size=64)[0]["combined"]) / len(held_out)
        print(f"step {k} eval {r:.4f} ({len(held_out)} samples)", flush=True)
        return r

    curve, B, G = [eval_now(0)], args.prompts_per_batch, args.group_size
    for k in range(args.steps):
        batch = sample_batch(adapter, sampling, [records[(k * B + j) % len(records)] for j in range(B)], rewards,
                             group_size=G, step=k, same_group_noise=args.same_group_noise)
        opt.zero_grad()
        if args.loss == "grpo":
            for t in timesteps:
                log_prob = transition_log_prob(adapter, sampling, batch, t)
                ratio = torch.exp(log_prob - log_prob.detach())
                (-(batch.adv * ratio).mean() / len(timesteps)).backward()
        else:
            x0, K = rendered_latents(adapter, batch.prompts, k), sampling.num_steps
            gen = torch.Generator().manual_seed(1000 + k)  # the flow-matching noise of update k
            for t in range(K):
                eps = torch.randn(x0.shape, generator=gen)
                sigma = batch.traj.sigmas[t].expand(len(x0))
                s = sigma.view(-1, *[1] * (x0.dim() - 1))
                v = sampler.guided_velocity(adapter, (1 - s) * x0 + s * eps, sigma, batch.cond, None, sampling)
                ((v - (eps - x0)).pow(2).flatten(1).mean(1).mean() / K).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        print(f"step {k + 1} train reward {batch.scores.mean():.4f} grad norm {grad_norm:.3e}", flush=True)
        if (k + 1) % args.eval_every == 0:
            curve.append(eval_now(k + 1))
    print("eval curve", " ".join(f"{c:.4f}" for c in curve))
    return curve


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    adapter = load_model("flux", args.model_path, preset="auto", seed=args.seed, device=torch.device("cpu"))
    apply_lora(adapter.transformer, args.lora_rank, None, "attn", args.seed)
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    window = tuple(int(x) for x in args.sde_window.split(":")) if args.sde_window else None
    sampling = sampler.SamplingConfig.for_adapter(adapter, noise_level=args.noise_level, sde_window=window,
                                                  seed=args.seed)
    timesteps = range(*window) if window else range(max(1, int(sampling.num_steps * 0.99)))
    rewards = RewardSet(args.reward or ["shapes"], device="cpu")
    records = load_prompts(args.prompts)
    first = records[:args.prompts_per_batch]

    def grad(step, batch_records):
        return policy_gradient(adapter, params, sampling, batch_records, rewards, group_size=args.group_size,
                               step=step, same_group_noise=args.same_group_noise, timesteps=timesteps)

    if args.probe == "train":
        train(args, adapter, params, sampling, rewards, records, timesteps)
        return 0
    if args.probe == "snr":  # the same prompts, independent noise
        grads = [grad(k, first) for k in range(args.batches)]
        cos = gradient_cosines(grads)
        print(f"gradient cosine over {len(cos)} pairs: mean {sum(cos) / len(cos):+.4f} min {min(cos):+.4f} "
              f"max {max(cos):+.4f}; |g| {grads[0].norm():.3e}")
        return 0

    n = args.prompts_per_batch
    total = sum(grad(k, records[k * n:(k + 1) * n]) for k in range(args.batches))
    if args.direction == "random":
        total = torch.randn(total.shape, generator=torch.Generator().manual_seed(args.seed))
    direction = total.sign() if args.direction == "sign" else total / total.norm() * total.numel() ** 0.5
    origin = torch.cat([p.detach().reshape(-1) for p in params])
    held_out = load_prompts(args.eval_prompts)[:args.eval_num_prompts]

    def eval_at(eta: float) -> torch.Tensor:
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(origin - eta * direction, params)
        return torch.tensor(evaluate(adapter, sampling, held_out, rewards, batch_size=64)[0]["combined"])

    base = eval_at(0.0)
    print(f"held-out ODE reward {base.mean():.4f} ({len(base)} prompts); update from "
          f"{args.batches * n * args.group_size} samples along {args.direction}")
    for eta in (float(e) for e in args.etas.split(",")):
        d = eval_at(eta) - base
        print(f"eta {eta:g} (norm {eta * direction.numel() ** 0.5:.3g}): paired change {d.mean():+.4f} "
              f"+- {d.std() / len(d) ** 0.5:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
