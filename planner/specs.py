"""The released diffusion transformers as the planner sees them: parameters split by the token
stream they act on, block structure, auxiliary models, and the FLOPs of one denoising forward
(docs/calibration.md, "FLOPs").

Why a split: in an MMDiT a third of the weights are per-sample adaLN modulation (computed once per
sample, not per token), and in a dual-stream block each weight sees only its own stream (image
weights see image tokens, text weights text tokens). "2 x all params x all tokens" therefore
overestimates FLUX, Qwen-Image and HunyuanVideo by about 1.85x. The formula used here:

    F = 2 * (P_img * N_img + P_txt * N_txt + P_mod) + 4 * D * sum over attention layers of S^2

with S = N_img + N_txt for joint attention, and N_img^2 + N_img * N_txt for Wan's self-attention
over video tokens plus cross-attention to the text. N_img = frames_lat * (H/16) * (W/16) with
frames_lat = (F - 1) / 4 + 1 (8x spatial VAE, 2x2 patches, 4x temporal VAE).

Pure Python: no torch, no models/ import (the planner runs without them). The specs themselves are
derived from the released configs in planner/released_specs.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockKind:
    """One kind of transformer block: parameters per block by the stream they act on."""

    name: str
    count: int
    p_img: float
    """weights applied to every image (latent) token"""
    p_txt: float
    """weights applied to every text token (0 for blocks that never see text tokens)"""
    p_mod: float
    """per-sample weights (adaLN modulation): applied once per sample"""
    p_shared: float = 0.0
    """weights applied to image and text tokens alike (single-stream blocks)"""
    attention: str = "joint"
    """joint (softmax over image + text tokens), dual (joint plus an image-only self-attention:
    SD3.5-medium's first 13 blocks) or cross (self-attention over image tokens plus cross-attention
    of image queries to text keys)"""

    @property
    def params(self) -> float:
        return self.p_img + self.p_txt + self.p_mod + self.p_shared


@dataclass(frozen=True)
class AuxModel:
    """A model beside the DiT: a text encoder, the VAE or a reward model."""

    name: str
    params: float
    tokens: int = 0
    """tokens per call (text encoders: padded prompt length; reward VLMs: prompt + image tokens)"""
    decode_tokens: int = 0
    """tokens generated autoregressively per call (generative reward models)"""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    hidden: int
    heads: int
    head_dim: int
    blocks: tuple[BlockKind, ...]
    extra_img: float
    """non-block weights per image token (patch embedding, output projection)"""
    extra_txt: float
    """non-block weights per text token (context embedder, token refiner)"""
    extra_mod: float
    """non-block per-sample weights (timestep / guidance / pooled-text embedders, final modulation)"""
    text_tokens: int
    """text tokens the DiT sees per prompt (padded length for T5 / umT5 / Llama; a typical prompt
    for Qwen-Image, which masks instead of padding)"""
    text_padded: bool
    video: bool
    latent_channels: int
    vae: AuxModel
    vae_decode_flops_per_pixel: float
    """VAE decode FLOPs per output pixel (and frame), measured at one resolution, scaled linearly"""
    text_encoders: tuple[AuxModel, ...]
    guidance_distilled: bool
    """True: guidance is an embedding input (FLUX.1-dev, HunyuanVideo), no CFG branch by default"""
    default_steps: int
    notes: str = ""
    lora_targets_per_block: dict = field(default_factory=dict)

    @property
    def params(self) -> float:
        return (sum(b.count * b.params for b in self.blocks) + self.extra_img + self.extra_txt
                + self.extra_mod)

    @property
    def p_img(self) -> float:
        """Per-image-token parameters (the measured 'effective per-token params')."""
        return sum(b.count * (b.p_img + b.p_shared) for b in self.blocks) + self.extra_img

    @property
    def p_txt(self) -> float:
        return sum(b.count * (b.p_txt + b.p_shared) for b in self.blocks) + self.extra_txt

    @property
    def p_mod(self) -> float:
        return sum(b.count * b.p_mod for b in self.blocks) + self.extra_mod

    @property
    def num_blocks(self) -> int:
        return sum(b.count for b in self.blocks)

    def block_list(self) -> list[BlockKind]:
        """Every block in order (a kind repeated `count` times)."""
        return [b for b in self.blocks for _ in range(b.count)]


@dataclass(frozen=True)
class Resolution:
    height: int
    width: int
    frames: int = 1

    def __post_init__(self):
        if self.height <= 0 or self.width <= 0 or self.height % 16 or self.width % 16:
            raise ValueError(f"height and width must be positive multiples of 16, got {self.height}x{self.width}")
        if self.frames < 1 or (self.frames - 1) % 4:
            raise ValueError(f"frames must be 1 or 4k+1 (4x temporal VAE), got {self.frames}")

    @property
    def latent_frames(self) -> int:
        return (self.frames - 1) // 4 + 1

    @property
    def pixels(self) -> int:
        return self.height * self.width * self.frames


def image_tokens(res: Resolution) -> int:
    """Latent tokens of one sample: 8x spatial VAE, 2x2 patches, 4x temporal VAE."""
    return res.latent_frames * (res.height // 16) * (res.width // 16)


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------

def _seq2(attention: str, n_img: int, n_txt: int) -> int:
    """Query-key pairs of one block's attention (S^2 of 4 * D * S^2)."""
    if attention == "joint":
        return (n_img + n_txt) ** 2
    if attention == "dual":
        return (n_img + n_txt) ** 2 + n_img ** 2
    return n_img ** 2 + n_img * n_txt


def attention_flops(spec: ModelSpec, n_img: int, n_txt: int) -> float:
    """Score and value matmuls of one sample, all blocks: 4 * D * S^2 per block."""
    return sum(b.count * 4 * spec.hidden * _seq2(b.attention, n_img, n_txt) for b in spec.blocks)


def dense_flops(spec: ModelSpec, n_img: int, n_txt: int) -> float:
    """Matrix multiplies with weights of one sample: 2 x (per-stream params x stream tokens + per-sample params)."""
    return 2 * (spec.p_img * n_img + spec.p_txt * n_txt + spec.p_mod)


def forward_flops(spec: ModelSpec, n_img: int, n_txt: int | None = None) -> float:
    """One sample, one denoising step, one branch (multiply by 2 for CFG)."""
    n_txt = spec.text_tokens if n_txt is None else n_txt
    return dense_flops(spec, n_img, n_txt) + attention_flops(spec, n_img, n_txt)


def attention_share(spec: ModelSpec, n_img: int, n_txt: int | None = None) -> float:
    n_txt = spec.text_tokens if n_txt is None else n_txt
    return attention_flops(spec, n_img, n_txt) / forward_flops(spec, n_img, n_txt)


def block_flops(spec: ModelSpec, n_img: int, n_txt: int | None = None) -> list[float]:
    """Forward FLOPs of each block in order (the GAP stage partition balances these)."""
    n_txt = spec.text_tokens if n_txt is None else n_txt
    out = []
    for b in spec.block_list():
        dense = 2 * ((b.p_img + b.p_shared) * n_img + (b.p_txt + b.p_shared) * n_txt + b.p_mod)
        out.append(dense + 4 * spec.hidden * _seq2(b.attention, n_img, n_txt))
    return out


def vae_decode_flops(spec: ModelSpec, res: Resolution) -> float:
    return spec.vae_decode_flops_per_pixel * res.pixels


def text_encode_flops(spec: ModelSpec) -> float:
    """All text encoders for one prompt (2 x params x tokens)."""
    return sum(2 * e.params * e.tokens for e in spec.text_encoders)


def lora_params(spec: ModelSpec, rank: int) -> float:
    """Adapters on the attention projections of every block (rank r: r x (d_in + d_out) per matrix)."""
    return sum(b.count * rank * spec.lora_targets_per_block.get(b.name, 0) for b in spec.blocks)


def hidden_bytes(spec: ModelSpec, n_img: int, n_txt: int | None = None) -> float:
    """bf16 hidden states crossing a GAP stage boundary, one sample (both streams)."""
    n_txt = spec.text_tokens if n_txt is None else n_txt
    return 2 * spec.hidden * (n_img + n_txt)


def latent_bytes(spec: ModelSpec, res: Resolution) -> float:
    """One fp32 latent of one sample."""
    return 4 * spec.latent_channels * res.latent_frames * (res.height // 8) * (res.width // 8)


__all__ = ["AuxModel", "BlockKind", "ModelSpec", "Resolution", "attention_flops", "attention_share",
           "block_flops", "dense_flops", "forward_flops", "hidden_bytes", "image_tokens", "latent_bytes",
           "lora_params", "text_encode_flops", "vae_decode_flops"]
