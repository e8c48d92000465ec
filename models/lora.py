"""LoRA on a DiT through peft (docs/ALGORITHMS.md: attention projections, optionally the feed-forward).

Every rank applies the same config with the same seed, so generators and trainers hold the same
adapter structure and the same initial weights (version 0)."""
from __future__ import annotations

import torch
from peft import LoraConfig
from torch import nn

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
FEED_FORWARD = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
                "ffn.net.0.proj", "ffn.net.2", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                "txt_mlp.net.2"]


def lora_targets(transformer: nn.Module, which: str) -> list[str]:
    """Module-name suffixes present in this transformer for `attn` or `attn+ff`."""
    if which not in ("attn", "attn+ff"):
        raise ValueError(f"unknown --lora-targets {which!r}; choose attn or attn+ff")
    wanted = ATTENTION + (FEED_FORWARD if which == "attn+ff" else [])
    names = [n for n, m in transformer.named_modules() if isinstance(m, nn.Linear)]
    present = [w for w in wanted if any(n == w or n.endswith("." + w) for n in names)]
    if not present:
        raise ValueError(f"no LoRA target {wanted} found in {type(transformer).__name__}")
    return present


def apply_lora(transformer: nn.Module, rank: int, alpha: float | None, which: str = "attn", seed: int = 0) -> None:
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1 (0 means full fine-tuning and applies no LoRA), got {rank}")
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, init_lora_weights="gaussian",
                        target_modules=lora_targets(transformer, which))
    transformer.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # identical lora_A on every rank
        transformer.add_adapter(config)
    for p in transformer.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # the trained weights stay float32 on a half-precision base (AdamW's updates)


def trainable_names(transformer: nn.Module) -> list[str]:
    return [n for n, p in transformer.named_parameters() if p.requires_grad]
