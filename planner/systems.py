"""The peer systems, modelled as they run (docs/calibration.md, "Peer systems"), and the prediction
record every planner result shares.

Each peer is colocated: every GPU generates, scores and trains in lockstep, so a step is the sum
of its phases on the busiest rank. What differs is how each system runs those phases, read from
its code and scripts:

- VeRL-Omni (hybrid engine): a vLLM-Omni rollout replica on every GPU (bf16, FA3, batched
  requests) that is woken, synced (~5 GB/s effective) and put to sleep every step; a generative
  reward model woken and slept the same way; the FSDP actor with parameters and optimizer state
  offloaded to the host between phases; a forward pass recomputing the old log-probs; mini-batch
  updates with checkpointing.
- DanceGRPO: FSDP over all GPUs with fp32 parameters (gathered in fp32), batch-1 rollout, a
  per-sample per-timestep training loop with checkpointing, prompt embeddings precomputed offline.
- Flow-GRPO: LoRA on replicated weights (FSDP for full fine-tuning), batched rollout with CFG
  concatenated, a per-timestep training loop over micro-batches of samples, every model resident.
- GenRL: accelerate FSDP (full shard) even for LoRA, CFG as two separate forwards in rollout and
  training, a reference forward (KL), reward models moved to the GPU and back every step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from planner import phases as ph
from planner.hardware import GPU, Kernels, Sharding, allreduce_s
from planner.memory import MemoryUse, colocated_memory
from planner.specs import lora_params
from planner.workload import Workload, ceil_div, reward_model

SYSTEMS = ("verl-omni", "dance-grpo", "flow-grpo", "genrl")

SYNC_FIXED_S = 3.3
SYNC_BYTES_S = 5.64e9
"""Weight sync from an FSDP trainer to a colocated rollout engine: verl's full NCCL sync of 7B /
32B / 72B models on H100 took 5.5-6.0 / 14.2 / 28.5-29.1 s, i.e. 3.3 s + bytes / 5.64 GB/s
(spent gathering and staging, not on the wire)."""

BUSY_KINDS = ("generate", "score", "train", "optimizer")
"""Phase kinds that count as busy in the bubble (tracing.BUSY_CATEGORIES)."""


@dataclass
class Segment:
    lane: str
    name: str
    kind: str
    start_s: float
    end_s: float


@dataclass
class Prediction:
    """One predicted configuration (a peer system, a colocated mode or a disaggregated plan)."""

    system: str
    label: str
    workload: Workload
    pools: list[tuple[GPU, int]]
    """(GPU type, count) of every pool the plan uses"""
    step_s: float
    bubble: float
    memory: dict[str, MemoryUse] = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)
    """one step's timeline for the figure (lanes: roles)"""
    knobs: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    why_not: list[str] = field(default_factory=list)
    """empty when feasible; else the reasons the plan is excluded"""

    @property
    def feasible(self) -> bool:
        return not self.why_not

    @property
    def num_gpus(self) -> int:
        return sum(n for _, n in self.pools)

    @property
    def samples_per_s(self) -> float:
        return self.workload.samples / self.step_s

    @property
    def mfu(self) -> float:
        """Model FLOPs of the step over the peak of every GPU used for the whole step."""
        return self.workload.model_flops() / (sum(g.peak_flops * n for g, n in self.pools) * self.step_s)

    @property
    def dollars_per_step(self) -> float:
        return sum(g.price_per_hour * n for g, n in self.pools) * self.step_s / 3600

    @property
    def samples_per_dollar(self) -> float:
        return self.workload.samples / self.dollars_per_step

    @property
    def peak_memory_gb(self) -> dict[str, float]:
        return {role: m.total / 1e9 for role, m in self.memory.items()}

    def gpu_label(self) -> str:
        return "+".join(f"{n}x{g.key}" for g, n in self.pools)


def lockstep(system: str, label: str, wl: Workload, g: GPU, n: int, steps: list[tuple[str, str, float]],
             memory: MemoryUse, knobs: dict, notes: list[str]) -> Prediction:
    """A colocated system whose ranks run the same phases in lockstep: the step is their sum."""
    t, segs = 0.0, []
    for name, kind, secs in steps:
        if secs > 0:
            segs.append(Segment("every GPU", name, kind, t, t + secs))
            t += secs
    busy = sum(s.end_s - s.start_s for s in segs if s.kind in BUSY_KINDS)
    why = [] if memory.fits else [memory.why()]
    return Prediction(system, label, wl, [(g, n)], t, 1 - busy / t if t > 0 else 0.0, {"every GPU": memory}, segs,
                      knobs, notes, why)


def sync_s(num_bytes: float) -> float:
    return SYNC_FIXED_S + num_bytes / SYNC_BYTES_S


def verl_omni(wl: Workload, g: GPU, n: int, *, reward_gpus: int = 0, rollout_batch: int | None = None,
              log_prob_micro: int = 32, train_micro: int = 16, mini_batch_prompts: int = 16,
              param_offload: bool = True, optimizer_offload: bool = True) -> Prediction:
    """VeRL-Omni's FlowGRPO recipe (hybrid engine, sync trainer)."""
    full = wl.finetune == "full"
    k_actor = Kernels(wl.kernels.compiled, "fa3")
    w = wl.with_(kernels=k_actor, gradient_checkpointing=True)  # its actor checkpoints by default
    rollout_batch = rollout_batch or (32 if full else 8)
    per_gpu = ceil_div(w.samples, n)
    trans = per_gpu * w.trained_timesteps
    shard = Sharding.fsdp(n)
    p = w.spec.params
    actor_param_bytes = (4 if full else 2) * p / n
    opt_bytes = (8 * p if full else 16 * lora_params(w.spec, w.lora_rank)) / n
    sync_bytes = ph.publish_bytes(w)
    rm = [reward_model(r) for r in w.rewards]
    rm_bytes = sum(2 * r.params for r in rm)
    reward_on_gen = reward_gpus == 0
    reward = ph.reward_s(w, g, per_gpu if reward_on_gen else ceil_div(w.samples, reward_gpus), tensor_parallel=1)
    steps = [
        ("wake rollout engine", "switch", ph.host_copy_s(g, ph.weight_bytes(w))),
        ("weight sync to rollout", "switch", sync_s(sync_bytes)),
        ("text encode", "score", ph.text_s(w, g, ceil_div(w.prompts_per_step, n))),
        ("rollout (vLLM-Omni)", "generate", ph.denoise_s(w, g, per_gpu, rollout_batch)),
        ("VAE decode", "score", ph.decode_s(w, g, per_gpu)),
        ("sleep rollout engine", "switch", ph.host_copy_s(g, ph.weight_bytes(w))),
    ]
    if reward_on_gen:
        steps += [("wake reward model", "switch", ph.host_copy_s(g, rm_bytes / n)),
                  ("reward (generative judge)", "score", reward),
                  ("sleep reward model", "switch", ph.host_copy_s(g, rm_bytes / n))]
    else:  # a dedicated reward GPU scores while the rollout runs: only the last batch's scoring remains
        steps += [("reward tail (dedicated GPU)", "score", reward / max(1, ceil_div(per_gpu, rollout_batch)))]
    load = ph.host_copy_s(g, actor_param_bytes) if param_offload else 0.0
    opt_bytes = opt_bytes if optimizer_offload else 0.0
    steps += [
        ("load actor params", "switch", load),
        ("old log-prob recompute", "train", ph.reference_s(w, g, trans, log_prob_micro, sharding=shard)),
        ("offload actor params", "switch", load),
        ("load actor params + optimizer", "switch", load + ph.host_copy_s(g, opt_bytes)),
        ("update actor (fwd+bwd, ckpt)", "train", ph.train_s(w, g, trans, train_micro, sharding=shard,
                                                             grad_bytes_per_param=4)),
        ("optimizer", "optimizer", ceil_div(w.prompts_per_step, mini_batch_prompts) * ph.optimizer_s(w, g, n)),
        ("offload actor params + optimizer", "switch", load + ph.host_copy_s(g, opt_bytes)),
    ]
    mem = colocated_memory(w, g, num_gpus=n, variant="sleepwake", rollout_micro=rollout_batch,
                           train_micro=train_micro, samples_per_gpu=per_gpu, resident_aux=False)
    notes = ["rollout engine, reward model and actor state take turns on the GPU (host offload)"]
    pred = lockstep("verl-omni", f"VeRL-Omni ({n}x{g.key})", w, g, n, steps, mem,
                    {"rollout_batch": rollout_batch, "train_micro": train_micro, "reward_gpus": reward_gpus}, notes)
    if reward_gpus:
        pred.pools.append((g, reward_gpus))
    return pred


def dance_grpo(wl: Workload, g: GPU, n: int, *, accumulation: int = 4) -> Prediction:
    """DanceGRPO (fastvideo/train_grpo_*.py): FSDP full shard with fp32 parameters, batch-1 rollout,
    per-sample per-timestep training, an optimizer step every `accumulation` samples."""
    per_gpu = ceil_div(wl.samples, n)
    shard = Sharding.fsdp(n)
    trans = per_gpu * wl.trained_timesteps
    steps = [
        ("rollout (batch 1, FSDP)", "generate", ph.denoise_s(wl, g, per_gpu, 1, sharding=shard, gather_bytes=4)),
        ("VAE decode", "score", ph.decode_s(wl, g, per_gpu)),
        ("reward", "score", ph.reward_s(wl, g, per_gpu)),
        ("train (per sample, per timestep)", "train",
         ph.train_s(wl, g, trans, 1, sharding=shard, gather_bytes=4, grad_bytes_per_param=4)),
        ("optimizer", "optimizer", ceil_div(per_gpu, accumulation) * ph.optimizer_s(wl, g, n)),
    ]
    mem = colocated_memory(wl, g, num_gpus=n, variant="fsdp", rollout_micro=1, train_micro=1, samples_per_gpu=per_gpu)
    mem.items.pop("text encoders", None)  # prompt embeddings are precomputed offline
    return lockstep("dance-grpo", f"DanceGRPO ({n}x{g.key})", wl, g, n, steps, mem, {"accumulation": accumulation},
                    ["fp32 FSDP parameters: every gather moves 4 bytes per parameter"])


def flow_grpo(wl: Workload, g: GPU, n: int, *, micro: int | None = None) -> Prediction:
    """Flow-GRPO (scripts/train_*.py): LoRA on replicated weights (FSDP for full fine-tuning),
    rollout in batches with CFG concatenated, a per-timestep training loop over the same batches."""
    micro = micro or wl.rollout_micro_batch
    per_gpu = ceil_div(wl.samples, n)
    shard = Sharding.fsdp(n) if wl.finetune == "full" else None
    trans = per_gpu * wl.trained_timesteps
    grad_sync = (allreduce_s(g, 4 * lora_params(wl.spec, wl.lora_rank), n) if wl.finetune == "lora" else 0.0)
    steps = [
        ("text encode", "score", ph.text_s(wl, g, per_gpu)),
        ("rollout", "generate", ph.denoise_s(wl, g, per_gpu, micro, sharding=shard)),
        ("VAE decode", "score", ph.decode_s(wl, g, per_gpu)),
        ("reward", "score", ph.reward_s(wl, g, per_gpu)),
        ("reference forward (KL)", "train", ph.reference_s(wl, g, trans, micro, sharding=shard) if wl.kl else 0.0),
        ("train (per timestep loop)", "train", ph.train_s(wl, g, trans, micro, sharding=shard)),
        ("optimizer + gradient sync", "optimizer", wl.optimizer_steps * (ph.optimizer_s(wl, g, n if shard else 1)
                                                                          + grad_sync)),
    ]
    mem = colocated_memory(wl, g, num_gpus=n, variant="fsdp" if shard else "replicate", rollout_micro=micro,
                           train_micro=micro, samples_per_gpu=per_gpu)
    return lockstep("flow-grpo", f"Flow-GRPO ({n}x{g.key})", wl, g, n, steps, mem, {"micro": micro},
                    ["every model resident; no switch cost"])


def genrl(wl: Workload, g: GPU, n: int, *, micro: int | None = None) -> Prediction:
    """GenRL (genrl/trainer/wan_trainer.py): accelerate FSDP full shard, checkpointing, CFG as two
    forwards, a reference forward for its KL term, reward models moved in and out every step."""
    micro = micro or wl.rollout_micro_batch
    w = wl.with_(gradient_checkpointing=True)
    per_gpu = ceil_div(w.samples, n)
    shard = Sharding.fsdp(n)
    trans = per_gpu * w.trained_timesteps
    rm_bytes = ph.reward_bytes(w)
    steps = [
        ("text encode", "score", ph.text_s(w, g, per_gpu)),
        ("rollout (FSDP, CFG as two calls)", "generate",
         ph.denoise_s(w, g, per_gpu, micro, sharding=shard, cfg_batched=False)),
        ("VAE decode", "score", ph.decode_s(w, g, per_gpu)),
        ("reward models to GPU", "switch", ph.host_copy_s(g, rm_bytes)),
        ("reward", "score", ph.reward_s(w, g, per_gpu)),
        ("reward models to host", "switch", ph.host_copy_s(g, rm_bytes)),
        ("reference forward (KL)", "train", ph.reference_s(w, g, trans, micro, sharding=shard, cfg_batched=False)),
        ("train (per timestep loop)", "train", ph.train_s(w, g, trans, micro, sharding=shard, cfg_batched=False)),
        ("optimizer", "optimizer", w.optimizer_steps * ph.optimizer_s(w, g, n)),
    ]
    mem = colocated_memory(w, g, num_gpus=n, variant="fsdp", rollout_micro=micro, train_micro=micro,
                           samples_per_gpu=per_gpu, resident_aux=False)
    mem.add("text encoders", ph.text_encoder_bytes(w)).add("VAE", 2 * w.spec.vae.params)
    return lockstep("genrl", f"GenRL ({n}x{g.key})", w, g, n, steps, mem, {"micro": micro},
                    ["reward models offloaded between steps"])


def predict_system(system: str, wl: Workload, g: GPU, n: int, **kw) -> Prediction:
    fn = {"verl-omni": verl_omni, "dance-grpo": dance_grpo, "flow-grpo": flow_grpo, "genrl": genrl}.get(system)
    if fn is None:
        raise ValueError(f"unknown system {system!r}; known: {list(SYSTEMS)}")
    return fn(wl, g, n, **kw)


__all__ = ["BUSY_KINDS", "Prediction", "SYSTEMS", "Segment", "dance_grpo", "flow_grpo", "genrl", "lockstep",
           "predict_system", "sync_s", "verl_omni"]
