"""The peer systems, modelled as they run (docs/calibration.md, "Peer systems"), and the prediction
record every planner result shares.

Each peer runs colocated: every GPU generates, scores and trains in lockstep, so a step is the sum
of its phases on the busiest rank. VeRL-Omni also runs separate-async (dedicated rollout GPUs,
PRs #315 / #575, with delta weight sync for full fine-tuning, PR #613): `verl_omni_separate`, and
`verl_omni_best` is the stronger of its two on-policy modes. What differs is how each system runs
its phases, read from its code and scripts:

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

SYSTEMS = ("verl-omni", "verl-omni-separate", "dance-grpo", "flow-grpo", "genrl")

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


def _verl_actor(w: Workload, g: GPU, n: int, *, log_prob_micro: int, train_micro: int, mini_batch_prompts: int,
                param_offload: bool, optimizer_offload: bool) -> list[tuple[str, str, float]]:
    """VeRL-Omni's FSDP actor on n GPUs: old log-prob recompute and the mini-batch updates, with
    parameters and optimizer state brought from the host and back around them when offloaded."""
    full = w.finetune == "full"
    p = w.spec.params
    actor_param_bytes = (4 if full else 2) * p / n
    opt_bytes = (8 * p if full else 16 * lora_params(w.spec, w.lora_rank)) / n if optimizer_offload else 0.0
    trans = ceil_div(w.samples, n) * w.trained_timesteps
    shard = Sharding.fsdp(n)
    load = ph.host_copy_s(g, actor_param_bytes) if param_offload else 0.0
    return [
        ("load actor params", "switch", load),
        ("old log-prob recompute", "train", ph.reference_s(w, g, trans, log_prob_micro, sharding=shard)),
        ("offload actor params", "switch", load),
        ("load actor params + optimizer", "switch", load + ph.host_copy_s(g, opt_bytes)),
        ("update actor (fwd+bwd, ckpt)", "train", ph.train_s(w, g, trans, train_micro, sharding=shard,
                                                             grad_bytes_per_param=4)),
        ("optimizer", "optimizer", ceil_div(w.prompts_per_step, mini_batch_prompts) * ph.optimizer_s(w, g, n)),
        ("offload actor params + optimizer", "switch", load + ph.host_copy_s(g, opt_bytes)),
    ]


def _verl_workload(wl: Workload) -> Workload:
    return wl.with_(kernels=Kernels(wl.kernels.compiled, "fa3"), gradient_checkpointing=True)  # actor defaults


def verl_omni(wl: Workload, g: GPU, n: int, *, reward_gpus: int = 0, rollout_batch: int | None = None,
              log_prob_micro: int = 32, train_micro: int = 16, mini_batch_prompts: int = 16,
              param_offload: bool = True, optimizer_offload: bool = True) -> Prediction:
    """VeRL-Omni's FlowGRPO recipe (hybrid engine, sync trainer)."""
    w = _verl_workload(wl)
    rollout_batch = rollout_batch or (32 if w.finetune == "full" else 8)
    per_gpu = ceil_div(w.samples, n)
    rm = [reward_model(r) for r in w.rewards]
    rm_bytes = sum(2 * r.params for r in rm)
    reward_on_gen = reward_gpus == 0
    reward = ph.reward_s(w, g, per_gpu if reward_on_gen else ceil_div(w.samples, reward_gpus), tensor_parallel=1)
    steps = [
        ("wake rollout engine", "switch", ph.host_copy_s(g, ph.weight_bytes(w))),
        ("weight sync to rollout", "switch", sync_s(ph.publish_bytes(w))),
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
    steps += _verl_actor(w, g, n, log_prob_micro=log_prob_micro, train_micro=train_micro,
                         mini_batch_prompts=mini_batch_prompts, param_offload=param_offload,
                         optimizer_offload=optimizer_offload)
    mem = colocated_memory(w, g, num_gpus=n, variant="sleepwake", rollout_micro=rollout_batch,
                           train_micro=train_micro, samples_per_gpu=per_gpu, resident_aux=False)
    notes = ["rollout engine, reward model and actor state take turns on the GPU (host offload)"]
    pred = lockstep("verl-omni", f"VeRL-Omni ({n}x{g.key})", w, g, n, steps, mem,
                    {"rollout_batch": rollout_batch, "train_micro": train_micro, "reward_gpus": reward_gpus}, notes)
    if reward_gpus:
        pred.pools.append((g, reward_gpus))
    return pred


DELTA_FIXED_S = 1.07
DELTA_SCAN_BYTES_S = 14.8e9
DELTA_PAYLOAD = 0.068
"""Delta weight sync (verl `delta_sharded`, VeRL-Omni PR #613 for separate-async full-weight runs):
each actor rank diffs its shard against a host snapshot and broadcasts only the changed bf16
elements as (position, value) pairs. Fitted on verl issue #7060's two offload-off rows (H100,
timing_s/update_weights: 32B 6.2 s, 72B 12.0-13.0 s with "changed_ratio 2.1-2.6%, payload
8.6-10.9 GB", i.e. 6.8% of the bf16 bytes on the wire): a fixed 1.07 s, the snapshot diff at
14.8 GB/s of bf16 weights, the payload at SYNC_BYTES_S. Two rows, two constants: no held-out LLM
row of the same setting exists (the 7B offload-on row, 3.9-4.9 s against 2.2 s predicted, pays host
copies this leaves out). Held out, another engine: verl PR #7324 (TorchTitan, A800, Qwen3-8B) synced
in 3.00 s (8 + 8 GPUs) and 3.34 s (16 + 16) against 2.34 s predicted. No diffusion figure exists:
PR #613's recipe is "NOT YET GPU-VERIFIED"."""


def delta_sync_s(num_bytes: float) -> float:
    """A steady-state delta sync of `num_bytes` of bf16 weights (the first sync sends them all)."""
    return DELTA_FIXED_S + num_bytes / DELTA_SCAN_BYTES_S + DELTA_PAYLOAD * num_bytes / SYNC_BYTES_S


def separate_async_step_s(train_s: float, gen_work_s: float, standalone: int, hybrid: int = 0,
                          switch_s: float = 0.0, overlap: bool = True, switch: bool = False) -> float:
    """A step of VeRL-Omni's separate-async trainer (PRs #315, #575) from its two loads: `train_s` on
    the actor (hybrid) GPUs, `gen_work_s` of generation in replica-seconds (the time one standalone
    replica takes for the step's batch). On-policy (`overlap` False: sync_compatible, the recipe's
    setting) generation and training alternate; overlapped (off-policy, trajectories one version
    stale) the standalone replicas generate the next batch during training. With `switch` (#575,
    overlapped only) the hybrid replicas join generation when training ends and the batch is still
    short, for `switch_s` per step (switch_to_rollout + switch_to_trainer)."""
    if not overlap:
        return gen_work_s / standalone + train_s
    left = gen_work_s - standalone * train_s  # replica-seconds still to generate when training ends
    if left <= 0:
        return train_s
    if switch and hybrid:
        return train_s + left / (standalone + hybrid) + switch_s
    return train_s + left / standalone


def verl_omni_separate(wl: Workload, g: GPU, n: int, *, rollout_gpus: int, rollout_gpu: GPU | None = None,
                       reward_gpus: int = 0, delta: bool | None = None, overlap: bool = False,
                       rollout_batch: int | None = None, log_prob_micro: int = 32, train_micro: int = 16,
                       mini_batch_prompts: int = 16, param_offload: bool = True,
                       optimizer_offload: bool = True) -> Prediction:
    """VeRL-Omni's separate-async mode: `n` actor GPUs of `g` train (FSDP, offloading as in its hybrid
    engine), `rollout_gpus` standalone GPUs (of `rollout_gpu`, default `g`) generate, decode and score
    (or a dedicated reward pool scores), and every step ends with a weight sync to the standalone
    replicas: a full NCCL broadcast, or with `delta` (default: on for full fine-tuning, where #613
    applies; LoRA syncs adapters) a delta sync. On-policy by default (the shipped recipe: PARAMETER_
    SYNC_STEP=1, MAX_OFF_POLICY_THRESHOLD=1, SYNC_COMPATIBLE=1, "rollout and training no longer
    overlap"); `overlap` models its default asynchronous mode, one version stale."""
    w, rg = _verl_workload(wl), rollout_gpu or g
    full = w.finetune == "full"
    delta = full if delta is None else delta
    if delta and not full:
        raise ValueError("delta sync is for full fine-tuning (VeRL-Omni refuses it with LoRA: adapters are small)")
    rollout_batch = rollout_batch or (32 if full else 8)
    per_rollout = ceil_div(w.samples, rollout_gpus)
    reward = ph.reward_s(w, rg, per_rollout) if not reward_gpus else (
        ph.reward_s(w, rg, ceil_div(w.samples, reward_gpus)) / max(1, ceil_div(per_rollout, rollout_batch)))
    gen = [("text encode", "score", ph.text_s(w, rg, ceil_div(w.prompts_per_step, rollout_gpus))),
           ("rollout (standalone vLLM-Omni)", "generate", ph.denoise_s(w, rg, per_rollout, rollout_batch)),
           ("VAE decode", "score", ph.decode_s(w, rg, per_rollout)),
           ("reward" if not reward_gpus else "reward tail (dedicated GPUs)", "score", reward)]
    sync_bytes = ph.publish_bytes(w)
    sync = delta_sync_s(sync_bytes) if delta else sync_s(sync_bytes)
    actor = _verl_actor(w, g, n, log_prob_micro=log_prob_micro, train_micro=train_micro,
                        mini_batch_prompts=mini_batch_prompts, param_offload=param_offload,
                        optimizer_offload=optimizer_offload)
    actor.append(("weight sync to standalone" + (" (delta)" if delta else ""), "switch", sync))
    gen_s, train_s = sum(x for _, _, x in gen), sum(x for _, _, x in actor)
    step = separate_async_step_s(train_s, gen_s * rollout_gpus, rollout_gpus, overlap=overlap)
    segs, t0 = [], 0.0 if overlap else gen_s
    for lane, phases, start in (("standalone GPUs", gen, 0.0), ("actor GPUs", actor, t0)):
        for name, kind, secs in phases:
            if secs > 0:
                segs.append(Segment(lane, name, kind, start, start + secs))
                start += secs
    busy = (sum(x for _, k, x in gen if k in BUSY_KINDS) * rollout_gpus
            + sum(x for _, k, x in actor if k in BUSY_KINDS) * n) / ((n + rollout_gpus) * step)
    mem = colocated_memory(w, g, num_gpus=n, variant="sleepwake", rollout_micro=rollout_batch,
                           train_micro=train_micro, samples_per_gpu=ceil_div(w.samples, n), resident_aux=False)
    mode = "overlapped, 1 stale" if overlap else "on-policy"
    pools = [(g, n), (rg, rollout_gpus)] + ([(rg, reward_gpus)] if reward_gpus else [])
    notes = [f"separate-async ({mode}): {n} actor + {rollout_gpus} standalone rollout GPUs"
             + (f" + {reward_gpus} reward" if reward_gpus else "") + ("; delta weight sync" if delta else "")]
    return Prediction("verl-omni-separate", f"VeRL-Omni separate-async {mode} ({n}x{g.key}+{rollout_gpus}x{rg.key})",
                      w, pools, step, 1 - busy, {"actor GPU": mem}, segs,
                      {"rollout_gpus": rollout_gpus, "delta": delta, "stale": overlap}, notes,
                      [] if mem.fits else [mem.why()])


def verl_omni_best(wl: Workload, g: GPU, n: int, *, rollout_gpu: GPU | None = None, **kw) -> Prediction:
    """The stronger of VeRL-Omni's two on-policy modes on n GPUs: its colocated hybrid engine, or
    separate-async at its best split of actor and standalone GPUs (with `rollout_gpu`, a pool of
    that type generates: n/2 of each, as the mixed testbed has them). Infeasible modes lose."""
    if rollout_gpu is not None and rollout_gpu.key != g.key:
        candidates = [verl_omni(wl, rollout_gpu, n, **kw),
                      verl_omni_separate(wl, g, n // 2, rollout_gpus=n - n // 2, rollout_gpu=rollout_gpu, **kw)]
    else:
        candidates = [verl_omni(wl, g, n, **kw)] + [verl_omni_separate(wl, g, n - r, rollout_gpus=r, **kw)
                                                     for r in range(1, n)]
    return min(candidates, key=lambda p: (not p.feasible, p.step_s))


def dance_grpo_system(wl: Workload, g: GPU, n: int, *, accumulation: int = 4) -> Prediction:
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


def flow_grpo_system(wl: Workload, g: GPU, n: int, *, micro: int | None = None) -> Prediction:
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


def verl_omni_best_separate(wl: Workload, g: GPU, n: int, **kw) -> Prediction:
    """Separate-async on n GPUs in all, at its fastest split into actor and standalone GPUs."""
    splits = [verl_omni_separate(wl, g, n - r, rollout_gpus=r, **kw) for r in range(1, n)]
    return min(splits, key=lambda p: (not p.feasible, p.step_s))


def predict_system(system: str, wl: Workload, g: GPU, n: int, **kw) -> Prediction:
    fn = {"verl-omni": verl_omni, "verl-omni-separate": verl_omni_best_separate, "dance-grpo": dance_grpo_system,
          "flow-grpo": flow_grpo_system, "genrl": genrl}.get(system)
    if fn is None:
        raise ValueError(f"unknown system {system!r}; known: {list(SYSTEMS)}")
    return fn(wl, g, n, **kw)


__all__ = ["BUSY_KINDS", "Prediction", "SYSTEMS", "Segment", "dance_grpo_system", "delta_sync_s", "flow_grpo_system",
           "genrl", "lockstep", "predict_system", "separate_async_step_s", "sync_s", "verl_omni", "verl_omni_best",
           "verl_omni_best_separate", "verl_omni_separate"]
