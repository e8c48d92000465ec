"""The memory section: three phases at FLUX.1-dev width (scripts/gpu_check/model.py), each measured on
the GPU (torch.cuda.max_memory_allocated and max_memory_reserved over the phase) beside what the
project predicts for the same configuration without a GPU:

- "fake": the same phase function run under FakeTensorMode with torch's memory trackers, as
  lab/memory/measure.py measures a rank (lab/memory/fake_run.py, lab/memory/trackers.py);
- "model": the memory model (planner/memory.py) for the same sizes, the items the phase holds.

The phases, in the order a step runs them:
- "generator step": one denoising step of a generator's micro-batch (bf16 weights, no gradient):
  the guided velocity under autocast and the SDE step (rl/sampler.py);
- "LoRA forward + backward": a LoRA trainer (bf16 base, float32 adapters, its mixed precision,
  per-block checkpointing) training one packed micro-batch after one update (its AdamW state
  exists, gradients held), trainer.Trainer.train;
- "full fine-tune step": a full fine-tuning trainer's forward + backward and then its optimizer
  step with fused AdamW (float32 weights), the larger of the two peaks.

The expected figures at FLUX width are computed on a CPU beforehand (scripts/gpu_check/expected.py,
docs/gpu_check/expected.json); at the tiny size the CPU computes them in the run.
"""
from __future__ import annotations

import gc
import math

import torch
from torch.distributed.fsdp import FSDPModule

from models.lora import lora_targets
from planner import memory as planner_memory
from rl import sampler
from lab.memory import fake_run
from lab.memory.trackers import FSDPTracker, Tracker
from lab.memory.fake_parts import transition_batch
from scripts.gpu_check import model as M

GiB = 1024 ** 3
PHASES = ("generator step", "LoRA forward + backward", "full fine-tune step")


# ----- the phases, the same code on a GPU and on fake tensors ----------------------------------------
def generator_step(a, size: M.Size, device, dtype: str) -> None:
    """Denoising step 0 of a micro-batch, as rl/sampler.denoise takes it (no gradient)."""
    s = M.sampling(a, size)
    sigmas = sampler.sigmas_for(a, s)
    cond = M.conditioning(size, size.batch, device)
    x = torch.randn(size.batch, *a.latent_shape(size.height, size.width), device=device)
    with torch.no_grad():
        sigma = torch.full((size.batch,), float(sigmas[0]), device=device)
        with M.autocast(torch.device(device), dtype):
            v = sampler.guided_velocity(a, x, sigma, cond, None, s)
        sampler.sample_step(x, v, sigmas, 0, list(range(size.batch)), 0, s)


def steady(trainer, size: M.Size):
    """The trainer as lab/memory/measure.py measures it: after one update from zero gradients (its
    optimizer state exists) and holding gradients of earlier micro-batches; and a packed
    micro-batch of `size.batch` transitions to train (lab/memory/fake_parts.py)."""
    for p in trainer.params:
        p.grad = torch.zeros_like(p)
    trainer.num_transitions = 1
    finish(trainer)
    for p in trainer.params:
        p.grad = torch.zeros_like(p)
    a = trainer.adapter
    sigmas = sampler.sigmas_for(a, trainer.sampling)
    return transition_batch(M.sent(a, size), trainer.sampling, sigmas, min(trainer.spec.timesteps(0, 0)), size.batch)


def filled(batch):
    """The stand-in batch with random latents and conditioning (lab/memory/fake_parts.py leaves them
    unset: fake tensors have no values, but a GPU would train on whatever its memory held)."""
    g = torch.Generator().manual_seed(0)
    for t in (batch.x_t, batch.x_next, *batch.cond.tensors.values()):
        if t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return batch


def finish(trainer) -> None:
    """Trainer.finish_step with the step's loss sums as host zeros (lab/memory/measure.py's `_finish`:
    a fake run's losses hold no values)."""
    trainer.current_step = 0
    trainer.num_transitions = max(trainer.num_transitions, 1)
    trainer.loss_sums = torch.tensor([0.0] * trainer.loss_sums.numel(), dtype=trainer.loss_sums.dtype)
    trainer.nonfinite_advantages = torch.tensor(0.0)
    trainer.finish_step()


# ----- measured on the GPU -------------------------------------------------------------------------
def on_device(device: torch.device, fn) -> dict:
    """fn's peak of allocated and reserved memory (the caching allocator's own counters, reset before
    it: c10/cuda/CUDACachingAllocator's peak statistics), in GiB, and what was allocated before."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # reserved = what the phase needs, not blocks cached by earlier work
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GiB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GiB, "before_gib": before / GiB}


def measure_device(size: M.Size, device: torch.device, dtype: str) -> dict[str, dict]:
    """Each phase on the GPU, one model at a time (each freed before the next is built)."""
    out = {}
    a = M.adapter(size, device, torch.bfloat16)
    out["generator step"] = on_device(device, lambda: generator_step(a, size, device, dtype))
    del a
    for lora, phase in ((True, "LoRA forward + backward"), (False, "full fine-tune step")):
        _free(device)
        trainer = M.trainer(size, lora, device, dtype, size.batch)
        batch = filled(steady(trainer, size))
        got = on_device(device, lambda: trainer.train(batch))
        if not lora:  # the step's peak: its forward + backward, or its optimizer step
            step = on_device(device, lambda: finish(trainer))
            got = max(got, step, key=lambda m: m["peak_allocated_gib"])
        got["skipped_updates"] = trainer.skips.total  # a non-finite step skips its update (and its memory)
        out[phase] = got
        del trainer, batch
    _free(device)
    return out


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----- predicted without a GPU ---------------------------------------------------------------------
def measure_fake(size: M.Size, dtype: str = "auto") -> dict[str, dict]:
    """Each phase under FakeTensorMode as on a CUDA device (lab/memory/fake_run.FakeRun: bf16
    autocast; trainer.adamw is fused on a CPU as on CUDA), with torch's trackers: {phase: {category: GiB, "total": GiB}}."""
    out = {}
    with fake_run.fake_world(1, 0), fake_run.FakeRun() as run:
        def build(size, weights):
            a = M.adapter(size, "meta", weights)
            fake_run.fake_module(a.transformer, run.mode, weights)
            return a

        a = build(size, torch.bfloat16)
        out["generator step"] = _tracked(run, Tracker(), [], lambda: generator_step(a, size, "cpu", dtype))
        del a
        for lora, phase in ((True, "LoRA forward + backward"), (False, "full fine-tune step")):
            trainer = M.trainer(size, lora, "meta", dtype, size.batch, build=build)
            batch = steady(trainer, size)
            got = _tracked(run, _tracker(trainer), [trainer.optimizer], lambda: trainer.train(batch), batch)
            if not lora:
                step = _tracked(run, _tracker(trainer), [trainer.optimizer], lambda: finish(trainer), batch)
                got = max(got, step, key=lambda m: m["total"])
            out[phase] = got
            del trainer, batch
    return out


def _tracker(trainer):
    """FSDPMemTracker where the transformer runs as FSDP2 units (the trainer's mixed precision), as
    lab/memory/measure.py chooses."""
    if any(isinstance(m, FSDPModule) for m in trainer.adapter.transformer.modules()):
        return FSDPTracker(trainer.adapter.transformer, trainer.optimizer)
    return Tracker()


def _tracked(run, tracker, optimizers, fn, host=None) -> dict:
    tracker.hold(run.mode, optimizers, host=_tensors(host))
    with tracker, tracker.window() as peak:
        fn()
    return {k: v / GiB for k, v in peak.items()}


def _tensors(batch) -> list:
    if batch is None:
        return []
    return [v for v in vars(batch).values() if isinstance(v, torch.Tensor)] + \
        [t for c in (batch.cond, batch.neg_cond) if c is not None for t in c.tensors.values()]


def model_figures(size: M.Size) -> dict[str, dict]:
    """planner/memory.py's items for each phase of this configuration (GiB), the whole run's items
    it would add left out (text encoders, VAE, rewards, trajectories, publication, context)."""
    a = M.adapter(size, "meta", torch.float32)
    named = dict(a.transformer.named_parameters())
    dit = sum(p.numel() for p in named.values())
    lora = sum(size.lora_rank * (m.in_features + m.out_features) for n, m in a.transformer.named_modules()
               if isinstance(m, torch.nn.Linear) and any(n == t or n.endswith("." + t)
                                                         for t in lora_targets(a.transformer, "attn")))
    latent = a.latent_shape(size.height, size.width)
    units = [u for c in a.transformer.children() for u in (c if isinstance(c, torch.nn.ModuleList) else [c])]
    tokens = a.image_seq_len(latent) + size.text_tokens

    def shape(lora_params: float, weight_bytes: int) -> planner_memory.RunShape:
        return planner_memory.RunShape(
            family="flux", dit=dit, text=0, vae=0, rewards=0, hidden=size.hidden, blocks=size.double + size.single,
            largest_unit=max(sum(p.numel() for p in u.parameters()) for u in units),
            largest_tensor=max(p.numel() for p in named.values()), tokens=tokens, latent=math.prod(latent),
            pixels=0, steps=1, branches=1, gen_micro=size.batch, train_micro=size.batch,  # pixels: no decode
            fragment=size.batch, lora=lora_params, weight_bytes=weight_bytes, compute_bytes=2, reward_bytes=2,
            checkpointing=True, trainers_sample=False, encodes=False)

    inf = float("inf")
    gen = planner_memory.generator_phases(shape(0.0, 2), inf)["fragment"]
    lora_phases = planner_memory.trainer_phases(shape(float(lora), 2), inf, shard=1, evaluates=False, publishes=False)
    full_phases = planner_memory.trainer_phases(shape(0.0, 4), inf, shard=1, evaluates=False, publishes=False)
    full = max((full_phases["micro-batch"], full_phases["optimizer step"]), key=lambda m: m.tensors)
    leave = {"context", "publication bucket", "trajectories"}
    out = {}
    for phase, use in (("generator step", gen), ("LoRA forward + backward", lora_phases["micro-batch"]),
                       ("full fine-tune step", full)):
        items = {k: v / GiB for k, v in use.items.items() if k not in leave}
        out[phase] = {"items": items, "total": sum(items.values())}
    return out


def expected(size: M.Size) -> dict:
    """What the GPU should measure for `size`: the fake measurement and the memory model, and the
    parameter counts they are for."""
    a = M.adapter(size, "meta", torch.float32)
    return {"size": size.name, "parameters": sum(p.numel() for p in a.transformer.parameters()),
            "tokens": a.image_seq_len(a.latent_shape(size.height, size.width)) + size.text_tokens,
            "batch": size.batch, "fake": measure_fake(size), "model": model_figures(size)}


def run(size: M.Size, device: torch.device, dtype: str, expected_figures: dict | None) -> dict:
    """The section: per phase, what the GPU measured beside the fake measurement and the model (on a
    CPU only those two: a CPU has no allocator statistics)."""
    figures = expected_figures if expected_figures and expected_figures.get("size") == size.name else expected(size)
    measured = {}
    if device.type == "cuda":
        with M.one_rank(device):  # the trainers' mixed precision runs FSDP2 over this rank
            measured = measure_device(size, device, dtype)
    phases = {}
    for phase in PHASES:
        row = {"fake_gib": figures["fake"][phase]["total"], "fake_categories": figures["fake"][phase],
               "model_gib": figures["model"][phase]["total"], "model_items": figures["model"][phase]["items"]}
        got = measured.get(phase)
        if got is not None:
            row.update(got)
            row["allocated_over_fake"] = got["peak_allocated_gib"] / row["fake_gib"]
            row["allocated_over_model"] = got["peak_allocated_gib"] / row["model_gib"]
        phases[phase] = row
    return {"size": size.name, "parameters": figures["parameters"], "tokens": figures["tokens"],
            "batch": figures["batch"], "measured_on": device.type if measured else None, "phases": phases}


__all__ = ["PHASES", "expected", "filled", "generator_step", "measure_device", "measure_fake", "model_figures", "run"]
