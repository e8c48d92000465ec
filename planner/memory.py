"""GPU memory per role (docs/calibration.md, "Memory"): weights, gradients and optimizer state
(LoRA or full fine-tuning, sharded or not), activations with and without checkpointing, text
encoders, the VAE, reward models and the trajectory buffer. A plan whose peak does not fit is
excluded, and `MemoryUse.why` says which items fill the GPU."""
from __future__ import annotations

from dataclasses import dataclass, field

from planner.hardware import GPU
from planner.phases import reward_bytes, text_encoder_bytes, trajectory_bytes, weight_bytes
from planner.specs import lora_params
from planner.workload import Workload

USABLE_FRACTION = 0.92
"""Of a GPU's memory, what tensors may use (allocator fragmentation, NCCL and cuBLAS buffers)."""

CONTEXT_BYTES = 2.5e9
"""CUDA context, communicator buffers and kernel workspaces per process."""

ACT_TRAIN_PER_TOKEN = 34
"""Activation bytes per token per block per hidden unit kept for the backward (bf16, flash
attention: no sequence-squared term; Korthikanti et al.'s 34 s b h per transformer layer)."""

ACT_CKPT_PER_TOKEN = 2
"""With checkpointing, each block keeps only its bf16 input (2 bytes per hidden unit per token)."""

ACT_INFER_PER_TOKEN = 12
"""Live activations of an inference forward (a block's widest intermediate, bf16)."""


@dataclass
class MemoryUse:
    role: str
    capacity: float
    items: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, num_bytes: float) -> "MemoryUse":
        if num_bytes > 0:
            self.items[name] = self.items.get(name, 0.0) + num_bytes
        return self

    @property
    def total(self) -> float:
        return sum(self.items.values())

    @property
    def fits(self) -> bool:
        return self.total <= USABLE_FRACTION * self.capacity

    def why(self) -> str:
        top = sorted(self.items.items(), key=lambda kv: -kv[1])[:4]
        parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in top)
        return (f"{self.role}: {self.total / 1e9:.1f} GB > {USABLE_FRACTION * self.capacity / 1e9:.1f} GB usable "
                f"({parts} GB)")


def activations_train(wl: Workload, transitions: int) -> float:
    """Activations of one training micro-batch (every branch)."""
    tokens = transitions * wl.branches * wl.seq
    h, blocks = wl.spec.hidden, wl.spec.num_blocks
    if wl.gradient_checkpointing:
        return tokens * h * (ACT_CKPT_PER_TOKEN * blocks + ACT_TRAIN_PER_TOKEN)
    return tokens * h * ACT_TRAIN_PER_TOKEN * blocks


def activations_infer(wl: Workload, samples: int) -> float:
    return samples * wl.branches * wl.seq * wl.spec.hidden * ACT_INFER_PER_TOKEN


def largest_block_bytes(wl: Workload) -> float:
    return 2 * max(b.params for b in wl.spec.blocks)


def training_state(wl: Workload, shard: int, *, reference_copy: bool | None = None,
                   grad_bytes_per_param: int = 4) -> dict[str, float]:
    """Weights, gradients and AdamW state of the trainer group, per GPU of a shard group of `shard`.
    Full fine-tuning: fp32 master weights + gradients + two moments; LoRA: frozen bf16 base +
    adapters with their own fp32 state. A KL term keeps a frozen bf16 reference copy for full
    fine-tuning (LoRA's reference is the base with adapters off)."""
    p = wl.spec.params
    out = {}
    if wl.finetune == "full":
        out["weights fp32"] = 4 * p / shard
        out["gradients"] = grad_bytes_per_param * p / shard
        out["optimizer"] = 8 * p / shard
        if reference_copy if reference_copy is not None else wl.kl:
            out["reference copy"] = 2 * p / shard
        if wl.old_policy:  # DiffusionNFT's old policy: an fp32 copy of the trained weights, sharded alike
            out["old policy"] = 4 * p / shard
    else:
        lp = lora_params(wl.spec, wl.lora_rank)
        out["base weights bf16"] = 2 * p / shard
        out["adapters + optimizer"] = 16 * lp + (4 * lp if wl.old_policy else 0)
    if shard > 1:
        out["gathered blocks"] = 2 * largest_block_bytes(wl)
    return out


def generator_memory(wl: Workload, g: GPU, *, stages: int = 1, stage: int = 0, micro: int,
                     fragment_samples: int, scores: bool = True) -> MemoryUse:
    """One rank of a generator replica of `stages` stages (stage 0 encodes prompts; the last stage
    decodes, scores and keeps the fragment's trajectories until they are sent)."""
    m = MemoryUse(f"generator stage {stage}" if stages > 1 else "generator", g.memory_bytes)
    m.add("DiT weights bf16", weight_bytes(wl) / stages)
    if wl.finetune == "lora":
        m.add("adapters", 2 * lora_params(wl.spec, wl.lora_rank) / stages)
    m.add("activations", activations_infer(wl, micro) * (min(micro, stages) if stages > 1 else 1))
    if stage == 0:
        m.add("text encoders", text_encoder_bytes(wl))
    if stage == stages - 1:
        m.add("VAE", 2 * wl.spec.vae.params)
        if scores:
            m.add("reward models", reward_bytes(wl))
        m.add("trajectory buffer", trajectory_bytes(wl, fragment_samples))
    m.add("staging for the next version", weight_bytes(wl) / stages if wl.finetune == "full" else 0.0)
    return m.add("context", CONTEXT_BYTES)


def trainer_memory(wl: Workload, g: GPU, *, shard: int, micro: int, buffered_samples: int,
                   generates: bool = False) -> MemoryUse:
    """One trainer rank: its shard of the training state, one micro-batch of activations, the
    landed trajectories it has not trained, and with TAG what generation needs besides."""
    m = MemoryUse("trainer", g.memory_bytes)
    for name, b in training_state(wl, shard).items():
        m.add(name, b)
    m.add("activations", activations_train(wl, micro))
    m.add("trajectory buffer", trajectory_bytes(wl, buffered_samples))
    if generates:
        m.add("text encoders", text_encoder_bytes(wl))
        m.add("VAE", 2 * wl.spec.vae.params)
        m.add("reward models", reward_bytes(wl))
    return m.add("context", CONTEXT_BYTES)


def colocated_memory(wl: Workload, g: GPU, *, num_gpus: int, variant: str, rollout_micro: int,
                     train_micro: int, samples_per_gpu: int, resident_aux: bool = True,
                     shard: int | None = None) -> MemoryUse:
    """Every rank generates, scores and trains. variant: replicate (a full bf16 rollout copy beside
    the training state), fsdp (generation gathers the training shards), sleepwake (the rollout copy
    and the training state take turns: the peak is the larger phase plus what stays)."""
    shard = num_gpus if shard is None else shard
    state = training_state(wl, shard if (wl.finetune == "full" or variant != "replicate") else 1)
    m = MemoryUse(f"colocated ({variant})", g.memory_bytes)
    if variant == "sleepwake":
        train_phase = sum(state.values()) + activations_train(wl, train_micro)
        roll_phase = weight_bytes(wl) + activations_infer(wl, rollout_micro)
        m.add("larger phase (offloaded other)", max(train_phase, roll_phase))
    else:
        for name, b in state.items():
            m.add(name, b)
        if variant == "replicate" and wl.finetune == "full":
            m.add("rollout copy bf16", weight_bytes(wl))
        m.add("activations", max(activations_train(wl, train_micro), activations_infer(wl, rollout_micro)))
    if resident_aux:
        m.add("text encoders", text_encoder_bytes(wl))
        m.add("VAE", 2 * wl.spec.vae.params)
        m.add("reward models", reward_bytes(wl))
    m.add("trajectory buffer", trajectory_bytes(wl, samples_per_gpu))
    return m.add("context", CONTEXT_BYTES)


def max_micro_batch(fits, start: int, limit: int = 64) -> int:
    """The largest micro-batch b <= limit (powers of two from `start` down) for which fits(b)."""
    b = start
    while b > 1 and not fits(b):
        b //= 2
    while b * 2 <= limit and fits(b * 2) and b * 2 <= start:
        b *= 2
    return b if fits(b) else 0


__all__ = ["ACT_TRAIN_PER_TOKEN", "CONTEXT_BYTES", "MemoryUse", "USABLE_FRACTION", "activations_infer",
           "activations_train", "colocated_memory", "generator_memory", "max_micro_batch", "trainer_memory",
           "training_state"]
