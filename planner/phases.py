"""Seconds of each phase of an RL step on one GPU (or one FSDP group): rollout forwards, training
micro-batches, reference forwards, VAE decode, rewards, text encoding, the optimizer, host copies
and transfers. Both the DigenRL plans (lab/planning/placements.py) and the peer-system models
(lab/planning/peer_systems.py) are built from these, so every system pays the same price for the same work.

Conventions (docs/calibration.md): a forward of b samples with CFG runs both branches in one batch
(2b rows) unless `cfg_batched` is False; an FSDP forward all-gathers the bf16 weights once per
forward and a training micro-batch twice (forward, and backward after resharding) plus a gradient
reduce-scatter for full fine-tuning; a partial micro-batch pays a whole gather; communication
overlaps compute by `hardware.FSDP_OVERLAP` of the shorter.
"""
from __future__ import annotations

from parallel import compress
from planner.hardware import GPU, FSDP_OVERLAP, Sharding, aux_s, compute_s, memory_bound_s, overlapped_s
from planner.specs import lora_params, text_encode_flops, vae_decode_flops
from planner.workload import Workload, reward_model

TEXT_EMBED_DIM = 4096
"""Width of the stored prompt conditioning (T5 / umT5 / Llama 4096, Qwen2.5-VL 3584)."""


def split(total: int, micro: int) -> list[int]:
    """`total` items in micro-batches of at most `micro`, the last one partial."""
    if total <= 0:
        return []
    full, rest = divmod(total, micro)
    return [micro] * full + ([rest] if rest else [])


def weight_bytes(wl: Workload, bytes_per_param: int = 2) -> float:
    """DiT weights (what a forward gathers: bf16 unless a system gathers fp32; what a rollout
    replica holds)."""
    return bytes_per_param * wl.spec.params


def grad_reduce_bytes(wl: Workload, grad_bytes_per_param: int = 2) -> float:
    """Gradient bytes reduced per backward: every weight for full fine-tuning, the adapters for LoRA."""
    if wl.finetune == "full":
        return grad_bytes_per_param * wl.spec.params
    return grad_bytes_per_param * lora_params(wl.spec, wl.lora_rank)


def rollout_forward_s(wl: Workload, g: GPU, batch: int, *, sharding: Sharding | None = None,
                      cfg_batched: bool = True, overlap: float = FSDP_OVERLAP, gather_bytes: int = 2) -> float:
    """One denoising step of `batch` samples (every branch); `gather_bytes` per parameter of an FSDP
    all-gather (2: bf16 mixed precision, 4: fp32 parameters)."""
    calls = 1 if cfg_batched or wl.branches == 1 else wl.branches
    rows = batch * (wl.branches if calls == 1 else 1)
    compute = calls * compute_s(g, rows * wl.fwd_flops, rows * wl.seq, wl.attn_share, wl.kernels, "rollout")
    gather = calls * sharding.gather_s(g, weight_bytes(wl, gather_bytes)) if sharding is not None else 0.0
    return overlapped_s(compute, gather, overlap)


def denoise_s(wl: Workload, g: GPU, samples: int, micro: int, **kw) -> float:
    """K denoising steps of `samples` samples in forwards of at most `micro` samples (keywords of
    `rollout_forward_s`)."""
    return wl.sampling_steps * sum(rollout_forward_s(wl, g, b, **kw) for b in split(samples, micro))


def train_micro_batch_s(wl: Workload, g: GPU, transitions: int, *, sharding: Sharding | None = None,
                        cfg_batched: bool = True, overlap: float = FSDP_OVERLAP,
                        grad_bytes_per_param: int = 2, gather_bytes: int = 2, with_reference: bool = False) -> float:
    """Forward + backward of one micro-batch of `transitions` (sample, timestep) pairs, with the
    algorithm's forwards without gradient (`wl.frozen_forwards`: DiffusionNFT's old policy) and,
    `with_reference`, the KL reference's forward inside it (DigenRL's trainer runs both per
    micro-batch; the peer models price their reference forward as a phase of its own). Every extra
    forward gathers the weights again under FSDP."""
    calls = 1 if cfg_batched or wl.branches == 1 else wl.branches
    rows = transitions * (wl.branches if calls == 1 else 1)
    reference = int(with_reference and wl.kl)
    compute = calls * compute_s(g, rows * wl.fwd_flops * (wl.train_factor + reference), rows * wl.seq,
                                wl.attn_share, wl.kernels, "train")
    comm = 0.0
    if sharding is not None and sharding.shard > 1:
        comm = calls * (2 + wl.frozen_forwards + reference) * sharding.gather_s(g, weight_bytes(wl, gather_bytes))
        comm += sharding.grad_sync_s(g, grad_reduce_bytes(wl, grad_bytes_per_param)) if wl.finetune == "full" else 0.0
    return overlapped_s(compute, comm, overlap)


def train_s(wl: Workload, g: GPU, transitions: int, micro: int, **kw) -> float:
    return sum(train_micro_batch_s(wl, g, m, **kw) for m in split(transitions, micro))


def reference_s(wl: Workload, g: GPU, transitions: int, micro: int, **kw) -> float:
    """Forward-only passes over `transitions` (a KL reference, or recomputed old log-probs), with
    the rollout's forward cost (keywords of `rollout_forward_s`)."""
    return sum(rollout_forward_s(wl, g, m, **kw) for m in split(transitions, micro))


def decode_s(wl: Workload, g: GPU, samples: int) -> float:
    return aux_s(g, samples * vae_decode_flops(wl.spec, wl.resolution))


def reward_s(wl: Workload, g: GPU, samples: int, tensor_parallel: int = 1, served: bool = False) -> float:
    """Every reward model on `samples` samples: a prefill of its tokens, and for generative judges
    their decode steps (memory-bound: the weights stream once per generated token, batched). With
    rewards served on GPUs of their own (`wl.reward_gpus`) a rank spends nothing on them; `served`
    prices the service's own GPU."""
    if wl.reward_gpus and not served:
        return 0.0
    total = 0.0
    for name in wl.rewards:
        r = reward_model(name)
        if r.params <= 0:
            continue
        total += aux_s(g, samples * 2 * r.params * r.tokens) / tensor_parallel
        if r.decode_tokens:
            total += r.decode_tokens * memory_bound_s(g, 2 * r.params / tensor_parallel)
    return total


def reward_bytes(wl: Workload) -> float:
    """bf16 reward models a rank holds (none when a reward service holds them)."""
    return 0.0 if wl.reward_gpus else sum(2 * reward_model(n).params for n in wl.rewards)


def text_s(wl: Workload, g: GPU, prompts: int) -> float:
    """Text encoders over `prompts` prompts (the empty negative prompt is encoded once and reused)."""
    return aux_s(g, prompts * text_encode_flops(wl.spec))


def text_encoder_bytes(wl: Workload) -> float:
    return sum(2 * e.params for e in wl.spec.text_encoders)


def optimizer_s(wl: Workload, g: GPU, shard: int = 1) -> float:
    """AdamW over the rank's shard: reads weights, gradients and two moments (fp32), writes three:
    28 bytes per trained parameter through HBM."""
    trained = wl.spec.params if wl.finetune == "full" else lora_params(wl.spec, wl.lora_rank)
    return memory_bound_s(g, 28 * trained / shard)


def host_copy_s(g: GPU, num_bytes: float) -> float:
    """Host <-> device copy (offload, sleep / wake, staging)."""
    return num_bytes / g.pcie_bytes_s


def trajectory_bytes(wl: Workload, samples: int) -> float:
    """What a generator sends per fragment: the latents around every trained step (fp32), log-probs,
    advantages, and the prompt conditioning (bf16, every branch); an algorithm may carry other counts
    (`wl.carried`: DiffusionNFT's clean records one latent and no log-probs)."""
    latents, logps = wl.carried or (wl.trained_timesteps + 1, wl.trained_timesteps)
    from_latents, logps = latents * _latent_bytes(wl), 8 * logps
    cond = wl.branches * wl.n_txt * TEXT_EMBED_DIM * 2
    return samples * (from_latents + logps + 8 + cond)


def _latent_bytes(wl: Workload) -> float:
    r = wl.resolution
    return 4 * wl.spec.latent_channels * r.latent_frames * (r.height // 8) * (r.width // 8)


def publish_bytes(wl: Workload) -> float:
    """bf16 weights a new version carries: every weight, or the adapters."""
    return 2 * (wl.spec.params if wl.finetune == "full" else lora_params(wl.spec, wl.lora_rank))


def trained_tensors(wl: Workload) -> list[tuple[int, int]]:
    """The trained tensors as (elements, how many): full fine-tuning as d x d matrices (a DiT's
    projections are 1-4 of them), LoRA as r x d adapter halves; the remainder as one last tensor.
    Publication codecs count top-k entries and index widths per tensor, so the split matters only
    by rounding."""
    d = wl.spec.hidden
    total = int(wl.spec.params if wl.finetune == "full" else lora_params(wl.spec, wl.lora_rank))
    size = d * d if wl.finetune == "full" else wl.lora_rank * d
    full, rest = divmod(total, size)
    return [(size, full)] + ([(rest, 1)] if rest else [])


def wire_bytes(codec: str, tensors: list[tuple[int, int]], element_size: int) -> int:
    """Bytes a publication of `tensors` ((elements, how many)) puts on the wire with `codec`,
    counted as the runtime counts them (`parallel.compress.wire_bytes`)."""
    return sum(count * compress.wire_bytes(codec, numel, element_size) for numel, count in tensors)


def publish_wire_bytes(wl: Workload) -> float:
    """What one generator replica receives per new version with the workload's codec."""
    return float(wire_bytes(wl.publish_compression, trained_tensors(wl), wl.param_bytes))


CODEC_HBM_BYTES = {"none": 0, "bf16": 0, "delta": 16, "delta-topk": 32}
"""HBM bytes per trained parameter the sending trainer moves to encode a version: the delta codecs
read the new and the held fp32 weights and update the held copy (16 B); top-k adds selection over
the fp32 delta, assumed two more passes of 8 B. bf16 is a cast inside the gather. An assumption: no
measurement pins the top-k cost."""


def encode_s(wl: Workload, g: GPU) -> float:
    trained = wl.spec.params if wl.finetune == "full" else lora_params(wl.spec, wl.lora_rank)
    return memory_bound_s(g, CODEC_HBM_BYTES[compress.parse(wl.publish_compression)[0]] * trained)


__all__ = ["decode_s", "encode_s", "denoise_s", "grad_reduce_bytes", "host_copy_s", "optimizer_s",
           "publish_bytes", "publish_wire_bytes", "reference_s", "reward_bytes", "reward_s", "rollout_forward_s",
           "split", "text_encoder_bytes", "text_s", "train_micro_batch_s", "train_s", "trained_tensors",
           "trajectory_bytes", "weight_bytes", "wire_bytes"]
