"""The model every measuring section of the check runs: FLUX.1-dev's transformer (models/configs/
flux1_dev.json) with random weights and a stated subset of its blocks, driven through the project's
adapter (models/flux.py), LoRA (models/lora.py), sampler (rl/sampler.py) and Trainer (trainer.py).

Only the transformer is built: the check feeds it conditioning of the released shapes (T5's 512
tokens of width 4096, CLIP's pooled 768) instead of running the text encoders, and measures no
decode. Without a VAE, FluxPipeline's latent factor is the released 8, so 1024^2 is 4096 image
tokens, as for the real model (issue 37, item 7).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from diffusers import FluxPipeline, FluxTransformer2DModel

from config.schema import RunConfig
from models import autocast, model_dtypes, resolve_dtype
from models.flux import FluxAdapter
from models.lora import apply_lora
from models.released import released_config
from rl import sampler
from rl.conditioning import Conditioning
from lab.memory.fake_parts import Sent
from trainer import Trainer

RELEASE = "flux1_dev"


@dataclass(frozen=True)
class Size:
    """The model and the shapes a run of the check measures."""

    name: str
    double: int
    """double-stream blocks (FLUX.1-dev: 19)"""
    single: int
    """single-stream blocks (FLUX.1-dev: 38); the subsets keep the released 1:2 ratio, so a block's
    average cost and the attention share are the released model's"""
    heads: int
    head_dim: int
    rope: tuple[int, int, int]
    text_dim: int
    """width of the text encoder's tokens (T5-XXL: 4096)"""
    pooled_dim: int
    """width of the pooled text embedding (CLIP-L: 768)"""
    text_tokens: int
    """text tokens per sample (FLUX.1-dev's T5 length: 512)"""
    height: int
    width: int
    """memory: the image size (1024^2: 4096 image tokens)"""
    batch: int
    """memory: samples per generation forward and transitions per training forward (the FLUX
    Flow-GRPO recipe's micro-batch is 3)"""
    mfu_sizes: tuple[int, ...]
    """mfu: image sides measured (two token counts)"""
    mfu_batches: tuple[int, ...]
    """mfu: batch sizes measured at each"""
    numerics_side: int
    """numerics: the image side of the SDE steps (512: Flow-GRPO's FLUX resolution)"""
    numerics_steps: int = 6
    """numerics: denoising steps sampled and scored again"""
    lora_rank: int = 32
    """the FLUX recipe's rank on the attention projections"""

    def released(self) -> dict:
        """The transformer config: FLUX.1-dev's, with this size's blocks and widths."""
        spec = {k: v for k, v in released_config(RELEASE)["transformer"].items() if k != "_class_name"}
        spec.update(num_layers=self.double, num_single_layers=self.single, num_attention_heads=self.heads,
                    attention_head_dim=self.head_dim, axes_dims_rope=tuple(self.rope),
                    joint_attention_dim=self.text_dim, pooled_projection_dim=self.pooled_dim)
        return spec

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    def image_tokens(self, side: int) -> int:
        return (side // 16) ** 2  # VAE factor 8, then 2x2 packing


FLUX = Size("flux", double=4, single=8, heads=24, head_dim=128, rope=(16, 56, 56), text_dim=4096, pooled_dim=768,
            text_tokens=512, height=1024, width=1024, batch=3, mfu_sizes=(512, 1024), mfu_batches=(1, 2, 4),
            numerics_side=512)
"""FLUX.1-dev at full width, 4 double + 8 single blocks (2.5 B parameters of the released 11.9 B):
a full fine-tune's float32 weights, gradients and fused AdamW moments (16 bytes a parameter, 40 GB)
and its activations fit one 80 GB GPU."""

TINY = Size("tiny", double=1, single=2, heads=2, head_dim=16, rope=(4, 6, 6), text_dim=32, pooled_dim=32,
            text_tokens=8, height=64, width=64, batch=3, mfu_sizes=(32, 64), mfu_batches=(1, 2, 4),
            numerics_side=64, lora_rank=4)
"""The same code at a size a CPU runs in seconds (the test suite's `--device cpu`)."""

FLUX_FEW = Size("flux-few", double=1, single=2, heads=24, head_dim=128, rope=(16, 56, 56), text_dim=4096,
                pooled_dim=768, text_tokens=16, height=64, width=64, batch=1, mfu_sizes=(64,), mfu_batches=(1,),
                numerics_side=64, numerics_steps=3)
"""FLUX.1-dev width (every weight of the released shape) with 1 double + 2 single blocks, 16 image +
16 text tokens and 3 steps: the numerics within reach of two busy CPU cores, whose bf16 is emulated
(docs/gpu_check/cpu-numerics-bf16.json)."""

SIZES = {s.name: s for s in (FLUX, TINY, FLUX_FEW)}


def pick_size(name: str | None, device: torch.device) -> Size:
    """--size, or the device's default: FLUX width on a GPU, tiny on a CPU."""
    name = name or ("flux" if device.type == "cuda" else "tiny")
    if name not in SIZES:
        raise ValueError(f"--size {name!r}: choose one of {sorted(SIZES)}")
    return SIZES[name]


def with_side(size: Size, side: int) -> Size:
    return replace(size, height=side, width=side)


# ----- building ---------------------------------------------------------------------------------
def adapter(size: Size, device, dtype: torch.dtype, seed: int = 0) -> FluxAdapter:
    """The adapter over a randomly initialised transformer of `size`, made on `device` (on "meta":
    shapes only, for a FakeTensorMode measurement), its weights in `dtype`."""
    torch.manual_seed(seed)
    with torch.device(device):
        transformer = FluxTransformer2DModel(**size.released())
    transformer.to(dtype=dtype).eval()
    tokenizer = FluxAdapter.offline_tokenizer("tokenizer_2", size.text_tokens)
    tokenizer.model_max_length = size.text_tokens
    pipe = FluxPipeline(scheduler=FluxAdapter.scheduler(), vae=None, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=tokenizer, transformer=transformer)
    return FluxAdapter(pipe)


def sampling(a: FluxAdapter, size: Size, num_steps: int = 10) -> sampler.SamplingConfig:
    return sampler.SamplingConfig.for_adapter(a, height=size.height, width=size.width, num_steps=num_steps)


def conditioning(size: Size, rows: int, device, seed: int = 0) -> Conditioning:
    """Random conditioning of the released shapes: T5 tokens (rows, L, 4096), pooled CLIP (rows, 768)."""
    g = torch.Generator().manual_seed(seed)
    return Conditioning({"prompt_embeds": torch.randn(rows, size.text_tokens, size.text_dim, generator=g),
                         "pooled": torch.randn(rows, size.pooled_dim, generator=g)}).to(device)


def sent(a: FluxAdapter, size: Size) -> Sent:
    """What a generator sends its trainers, as shapes (lab/memory/fake_parts.py): one sample's conditioning."""
    cond = Conditioning({"prompt_embeds": torch.empty(1, size.text_tokens, size.text_dim),
                         "pooled": torch.empty(1, size.pooled_dim)})
    return Sent.of(cond, None, a.latent_shape(size.height, size.width))


def run_config(size: Size, lora: bool, dtype: str, batch: int) -> RunConfig:
    """A run's config for a trainer of `size`: the FLUX Flow-GRPO recipe's training settings."""
    cfg = RunConfig()
    cfg.model.dtype = dtype
    cfg.optim.lora_rank = size.lora_rank if lora else 0
    cfg.optim.grad_checkpointing = True
    cfg.rl.micro_batch = batch
    return cfg


def trainer(size: Size, lora: bool, device, dtype: str, batch: int, build=None) -> Trainer:
    """A trainer as runtime/context.py and runtime/build.py make one: the transformer in
    `models.model_dtypes` (float32 master weights for a full fine-tune, the compute dtype under
    LoRA adapters), LoRA applied, the Trainer (mixed precision, checkpointing, fused AdamW) as
    runtime/build.make_trainer makes a replicated one: computing on the rank's device, its mixed
    precision over a group of the rank alone, here the world of this one process (`one_rank`).
    `build(size, dtype)` makes the adapter (default: `adapter` on `device`)."""
    cfg = run_config(size, lora, dtype, batch)
    weights = model_dtypes(dtype, torch.device(device) if device != "meta" else torch.device("cuda"),
                           master=not lora)["transformer"]
    a = build(size, weights) if build is not None else adapter(size, device, weights)
    if lora:
        apply_lora(a.transformer, cfg.optim.lora_rank, cfg.optim.lora_alpha, cfg.optim.lora_targets, cfg.seed)
    # In the check's world of one rank (one_rank), the world is the trainer's group of itself alone.
    own = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() == 1 else None
    return Trainer(cfg, a, sampling(a, size), None, "replicate", own_group=own, device=a.device)


@contextlib.contextmanager
def one_rank(device: torch.device):
    """A process group of this process alone (NCCL on CUDA, gloo on a CPU), unless one exists: the
    trainer's mixed precision runs FSDP2 over it, as a replicated trainer's does in a run."""
    if dist.is_initialized():
        yield
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    try:
        yield
    finally:
        dist.destroy_process_group()


__all__ = ["FLUX", "SIZES", "Size", "TINY", "adapter", "autocast", "conditioning", "one_rank", "pick_size",
           "resolve_dtype", "run_config", "sampling", "sent", "trainer", "with_side"]
