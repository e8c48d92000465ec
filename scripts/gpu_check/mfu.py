"""The mfu section: achieved FLOP/s of a generator's forward and of a LoRA and a full fine-tuning
trainer's forward + backward (trainer.Trainer.train: mixed precision, per-block checkpointing) at two
token counts and three batch sizes, beside the efficiency the planner assumes for the same work
(planner/hardware.efficiency, its FLOPs as planner/phases.py prices them: a forward's FLOPs times
`Workload.train_factor`, the recomputed forward included).

A forward's FLOPs are counted by torch (torch.utils.flop_counter.FlopCounterMode: matrix products
and attention) on the model that runs, beside the planner's formula for the same blocks
(planner/specs.block_flops of FLUX.1-dev's spec). Timings: CUDA events around each call, the
median of REPEATS after a warm-up; a CPU is timed by the wall clock, once, without a warm-up.
"""
from __future__ import annotations

import gc
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from planner import hardware
from planner.released_specs import spec_of
from planner.specs import attention_share, block_flops
from rl import sampler
from lab.memory.fake_parts import transition_batch
from scripts.gpu_check import model as M
from scripts.gpu_check.peak_memory import filled

REPEATS = 3
TRAIN_FACTOR = {"LoRA forward + backward": 3, "full fine-tune forward + backward": 4}
"""physical forwards of one trained row with checkpointing (planner/workload.Workload.train_factor:
forward, activation gradients, recomputed forward, and for full fine-tuning weight gradients)"""
GPU_NAMES = {"H100": "h100", "H800": "h800", "H200": "h200", "H20": "h20", "A100": "a100", "L40S": "l40s",
             "B200": "b200"}


def gpu_key(device: torch.device) -> str | None:
    """The planner's GPU (planner/hardware.GPUS) this device is, from its name."""
    if device.type != "cuda":
        return None
    words = torch.cuda.get_device_name(device).upper().replace("-", " ").split()
    return next((key for token, key in GPU_NAMES.items() if token in words), None)


def timed(fn, device: torch.device) -> float:
    """Seconds of one call: median of REPEATS between CUDA events after a warm-up (on a CPU, one
    call by the wall clock: a CPU's figures only show that the section runs)."""
    if device.type != "cuda":
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    fn()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def forward_flops(a, size: M.Size, batch: int, device, dtype: str) -> tuple[float, callable]:
    """A generator's guided velocity for `batch` samples of `size`: (its counted FLOPs, the call)."""
    s = M.sampling(a, size)
    cond = M.conditioning(size, batch, device)
    x = torch.randn(batch, *a.latent_shape(size.height, size.width), device=device)
    sigma = torch.full((batch,), 0.5, device=device)

    @torch.no_grad()
    def call():
        with M.autocast(torch.device(device), dtype):
            sampler.guided_velocity(a, x, sigma, cond, None, s)

    with FlopCounterMode(display=False) as counter:
        call()
    return float(counter.get_total_flops()), call


def planner_row(phase: str, size: M.Size, batch: int, flops: float, seconds: float, key: str | None) -> dict:
    """The measurement beside the planner's efficiency for the same tokens and FLOPs."""
    spec = spec_of(M.RELEASE)
    n_img, n_txt = size.image_tokens(size.height), size.text_tokens
    physical = flops * TRAIN_FACTOR.get(phase, 1)
    g = hardware.gpu(key or "h100")
    eff = hardware.efficiency(g, batch * (n_img + n_txt), attention_share(spec, n_img, n_txt),
                              phase="train" if phase in TRAIN_FACTOR else "rollout")
    row = {"phase": phase, "side": size.height, "tokens_per_sample": n_img + n_txt, "batch": batch,
           "forward_flops": flops, "physical_flops": physical, "seconds": seconds,
           "achieved_tflops": physical / seconds / 1e12, "planner_gpu": g.key, "planner_efficiency": eff,
           "planner_seconds": physical / (g.peak_flops * eff)}
    if key is not None:
        row["fraction_of_peak"] = physical / seconds / g.peak_flops
        row["measured_over_planner"] = seconds / row["planner_seconds"]
    return row


def planner_forward_flops(size: M.Size) -> float:
    """The planner's FLOPs of one sample's forward through this size's blocks (FLUX.1-dev's spec,
    its first `double` double-stream and `single` single-stream blocks)."""
    spec = spec_of(M.RELEASE)
    per_block = block_flops(spec, size.image_tokens(size.height), size.text_tokens)
    kinds = [b.name for b in spec.block_list()]
    first = kinds[0]
    doubles = [f for f, k in zip(per_block, kinds) if k == first][:size.double]
    singles = [f for f, k in zip(per_block, kinds) if k != first][:size.single]
    return sum(doubles) + sum(singles)


def run(size: M.Size, device: torch.device, dtype: str) -> dict:
    """The section: every phase at every (side, batch)."""
    key = gpu_key(device)
    rows, flops = [], {}
    a = M.adapter(size, device, torch.bfloat16)
    for side in size.mfu_sizes:
        at = M.with_side(size, side)
        for b in size.mfu_batches:
            f, call = forward_flops(a, at, b, device, dtype)
            flops[(side, b)] = f
            rows.append(planner_row("generator forward", at, b, f, timed(call, device), key))
    del a
    for lora, phase in ((True, "LoRA forward + backward"), (False, "full fine-tune forward + backward")):
        _free(device)
        trainer = M.trainer(size, lora, device, dtype, max(size.mfu_batches))
        for side in size.mfu_sizes:
            at = M.with_side(size, side)
            s = M.sampling(trainer.adapter, at)
            sigmas = sampler.sigmas_for(trainer.adapter, s)
            for b in size.mfu_batches:
                batch = filled(transition_batch(M.sent(trainer.adapter, at), s, sigmas, 0, b))
                seconds = timed(lambda: trainer.train(batch), device)
                rows.append(planner_row(phase, at, b, flops[(side, b)], seconds, key))
        del trainer
    _free(device)
    return {"size": size.name, "gpu": key, "dtype": dtype, "repeats": REPEATS if device.type == "cuda" else 1,
            "planner_forward_flops_per_sample": {str(s): planner_forward_flops(M.with_side(size, s))
                                                 for s in size.mfu_sizes},
            "rows": rows}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


__all__ = ["gpu_key", "planner_forward_flops", "run", "timed"]
