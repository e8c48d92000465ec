"""The numerics section (issue 37, item 8): how far an on-policy ratio moves from 1 when the trainer's
forward does not have the generator's batch shape.

A generator samples 4 samples together (rl/sampler.denoise: bf16 weights, autocast, the SDE with
its log-probability); the trainer scores the same transitions again (rl/sampler.score_rows on the
velocity of its own forward, as trainer.py does) in several ways:

- "bf16 batch 4": the generator's batch shape (the ratio is 1 exactly, or the claim fails);
- "bf16 batch 1": every transition alone;
- "bf16 TSP packed": micro-batches of at most 5 that mix samples and timesteps, as parallel/tsp.py packs them;
- "float32 batch 4" and "float32 batch 1": float32 weights, no autocast, on the device;
- "float32 CPU batch 4": the float32 reference on the host (on a GPU machine its first
  CPU_REFERENCE_STEPS steps: the full-width model's float32 forwards take a CPU minutes).

For each: max |delta log p| against the generator's log-probabilities, max |ratio - 1| and the
fraction of transitions whose ratio leaves [1 - eps, 1 + eps] at the clip range eps (1e-4, the
Flow-GRPO default: config --clip-range); and against the float32 CPU reference.
"""
from __future__ import annotations

import math

import torch

from models import autocast
from parallel import tsp
from rl import sampler
from scripts.gpu_check import model as M

NUM_SAMPLES = 4
TSP_MICRO_BATCH = 5
"""TSP's --train-micro-batch here: neither the rollout's 4 nor 1, so packed rows see other batch shapes"""
CPU_REFERENCE_STEPS = 2


def _rows(traj: sampler.Trajectory, transitions):
    idx = torch.tensor([i for i, _ in transitions])
    ts = [t for _, t in transitions]
    x_t = traj.latents[idx, ts]
    x_next = traj.latents[idx, [t + 1 for t in ts]]
    return idx, ts, x_t, x_next


def score(a, s: sampler.SamplingConfig, traj: sampler.Trajectory, cond, batches, dtype: str) -> torch.Tensor:
    """log p of every transition (sample i, step t) scored in the given micro-batches, as the
    trainer scores them: the guided velocity under the run's autocast, then score_rows. (N, K) on the host."""
    device = a.device
    out = torch.full((NUM_SAMPLES, s.num_steps), math.nan, dtype=torch.float64)  # NaN: not scored
    with torch.no_grad():
        for transitions in batches:
            idx, ts, x_t, x_next = _rows(traj, transitions)
            sigma = traj.sigmas[ts].to(device)
            sigma_next = traj.sigmas[[t + 1 for t in ts]].to(device)
            rows = cond.select(idx.to(cond.tensors["pooled"].device)).to(device)
            with autocast(device, dtype):
                v = sampler.guided_velocity(a, x_t.to(device), sigma, rows, None, s)
            got = sampler.score_rows(s, x_t.to(device), v, sigma, sigma_next, ts, x_next.to(device), 0)
            for (i, t), lp in zip(transitions, got.log_prob.double().cpu()):
                out[i, t] = lp
    return out


def by_step(batch: int, steps: int):
    """The trainer without TSP: each timestep's rows in chunks of `batch` samples."""
    return [[(i, t) for i in range(j, min(j + batch, NUM_SAMPLES))] for t in range(steps)
            for j in range(0, NUM_SAMPLES, batch)]


def packed(steps: int):
    """TSP's micro-batches of one fragment of NUM_SAMPLES samples, every step trained, one trainer."""
    transitions = tsp.fragment_transitions(range(NUM_SAMPLES), {i: range(steps) for i in range(NUM_SAMPLES)})
    return [list(m.transitions) for m in tsp.pack([transitions], micro_batch=TSP_MICRO_BATCH, num_trainers=1).micro_batches]


def compare(logp: torch.Tensor, reference: torch.Tensor, clip_range: float) -> dict:
    """The ratio exp(log p - log p_ref) - 1 over the transitions both scored."""
    both = torch.isfinite(logp) & torch.isfinite(reference)
    delta = (logp - reference)[both]
    ratio = torch.exp(delta) - 1
    return {"transitions": int(both.sum()), "max_abs_delta_logp": float(delta.abs().max()),
            "max_abs_ratio_minus_1": float(ratio.abs().max()), "mean_abs_ratio_minus_1": float(ratio.abs().mean()),
            "frac_outside_clip": float((ratio.abs() > clip_range).double().mean())}


def run(size: M.Size, device: torch.device, clip_range: float = 1e-4, low: str = "bfloat16") -> dict:
    """The section: rollout in `low` precision (bf16) at batch 4 on `device`, every way of scoring it again."""
    size = M.with_side(size, size.numerics_side)
    a32 = M.adapter(size, device, torch.float32)
    # The generator's weights: the trainer's float32 weights cast, as a publication sends them.
    a16 = _copy(size, a32, device, M.resolve_dtype(low, device))
    steps = size.numerics_steps
    s = M.sampling(a16, size, steps)
    cond = M.conditioning(size, NUM_SAMPLES, "cpu", seed=1)
    with torch.no_grad(), autocast(device, low):
        traj = sampler.denoise(a16, cond.to(device), None, list(range(NUM_SAMPLES)), 0, s)
    traj = sampler.Trajectory(traj.latents.cpu(), traj.log_probs.cpu(), traj.sigmas.cpu())
    rollout = traj.log_probs.double()
    ways = {f"{_name(low)} batch 4": (a16, by_step(4, steps), low), f"{_name(low)} batch 1": (a16, by_step(1, steps), low),
            f"{_name(low)} TSP packed": (a16, packed(steps), low), "float32 batch 4": (a32, by_step(4, steps), "float32"),
            "float32 batch 1": (a32, by_step(1, steps), "float32")}
    scored = {name: score(a, s, traj, cond, batches, dtype) for name, (a, batches, dtype) in ways.items()}
    del a16
    host = a32 if device.type == "cpu" else _copy(size, a32, "cpu", torch.float32)
    # The host's float32 forwards of the full-width model take a CPU minutes: on a GPU machine the
    # reference scores the first CPU_REFERENCE_STEPS steps only.
    host_steps = steps if device.type == "cpu" else min(steps, CPU_REFERENCE_STEPS)
    scored["float32 CPU batch 4"] = score(host, s, traj, cond, by_step(4, host_steps), "float32")
    reference = scored["float32 CPU batch 4"]
    return {"size": size.name, "side": size.height, "tokens": size.image_tokens(size.height) + size.text_tokens,
            "samples": NUM_SAMPLES, "steps": steps, "tsp_micro_batch": TSP_MICRO_BATCH, "clip_range": clip_range,
            "rollout": f"{_name(low)} batch 4 on {device.type}", "noise_level": s.noise_level,
            "rollout_logp_range": [float(rollout.min()), float(rollout.max())],
            "against_rollout": {k: compare(v, rollout, clip_range) for k, v in scored.items()},
            "against_float32_cpu": {k: compare(v, reference, clip_range) for k, v in scored.items()
                                    if k != "float32 CPU batch 4"} | {"rollout": compare(rollout, reference, clip_range)}}


def _name(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


def _copy(size: M.Size, a32, device, dtype: torch.dtype):
    """The model of `a32` on `device` in `dtype` (made on meta, its tensors assigned: no second
    random initialisation of billions of weights)."""
    a = M.adapter(size, "meta", dtype)
    a.transformer.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in a32.transformer.state_dict().items()},
                                  assign=True)
    return a


__all__ = ["compare", "packed", "run", "score"]
