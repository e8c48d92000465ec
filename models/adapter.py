"""The interface every model family implements: the embed / blocks / head split that GAP needs,
text encoding, latent packing and VAE decode. Adapters know architectures, never ranks."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from rl.conditioning import Conditioning, State  # noqa: F401 - re-exported: adapters build and return them


@dataclass
class SamplingDefaults:
    """A family's defaults, taken from its diffusers pipeline and docs/ALGORITHMS.md."""

    height: int
    width: int
    num_steps: int
    shift: str  # "dynamic" (FLUX, Qwen-Image: mu from the image sequence length) or "static"
    noise_level: float  # Flow-GRPO's `a` for the sde sampler
    guidance: float | None  # guidance-embedding scale (FLUX, HunyuanVideo), None where absent
    cfg_scale: float  # classifier-free guidance scale; 1.0 = no unconditional branch
    dance_eta: float = 0.3
    dance_shift: float = 3.0
    num_frames: int | None = None  # video families only


class DiTAdapter:
    """One diffusion transformer family, split for GAP (docs/DESIGN.md section 7).

    velocity(x) == head(run_block(n-1, ... run_block(0, embed(x)))) exactly, and equals the
    diffusers model's own forward. Latents are in the unpacked VAE-latent layout: [B, C, H, W]
    for images, [B, C, F, H, W] for video. sigma is in [0, 1] (1 = noise) for every family; the
    adapter converts it to the model's own timestep convention.
    """

    family: ClassVar[str]
    pipeline_class: ClassVar[type]
    video: ClassVar[bool] = False
    """samples are videos [B, C, F, H, W] (else images)"""
    static_shift: ClassVar[float | None] = None
    """the scheduler's static timestep shift (None: FLUX and Qwen-Image shift by resolution)"""
    attention_mask: ClassVar[str | None] = None
    """what this family masks in attention, if anything (diffusers' flash and sage kernels take no mask)"""
    mask_is_key_prefix: ClassVar[bool] = False
    """the mask keeps a prefix of the keys of each sample, which flash_varlen's sequence lengths express"""
    release: ClassVar[str]
    """the released config in models/configs/ this family is known by (its full-scale model)"""
    # Components a diffusers folder of this family must have (subfolder names in model_index.json).
    required_components: ClassVar[tuple[str, ...]]
    defaults: ClassVar[SamplingDefaults]
    # The size factors of each preset (VAE downsampling, patch sizes, position-table limits), so a
    # run's --height / --width / --num-frames are checked before any weight loads (config/preflight.py).
    # `geometry` computes the same dict from a folder's transformer and VAE config.json; the tests
    # compare both with the factors a loaded model uses.
    geometry_presets: ClassVar[dict[str, dict]] = {}

    def __init__(self, pipe):
        self.pipe = pipe
        self.transformer: nn.Module = pipe.transformer
        self.blocks: list[nn.Module] = self._block_list()
        self.compute_dtype: torch.dtype | None = None
        """The dtype every forward computes in, when it differs from the weights' (a trainer's float32
        weights under autocast or FSDP2 mixed precision): inputs are cast to it alike on every rank."""
        self.prompt_cache = None
        """Precomputed prompt embeddings (`lookup(prompts) -> Conditioning`), used instead of the text
        encoders: --prompt-embeds (prompts/embeds.py)."""
        self.enclosing = None
        """A callable `enclosing(fn, *args)` that runs one whole velocity (FSDP2's root module over the
        transformer's units: its all-gathers then overlap compute); None runs it directly."""

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32) -> "DiTAdapter":
        check_model_folder(path, cls.required_components, cls.family)
        pipe = cls.pipeline_class.from_pretrained(path, dtype=dtype, local_files_only=True)
        adapter = cls(pipe)
        adapter.defaults = read_folder_defaults(path, cls.defaults)
        return adapter

    @classmethod
    def scheduler(cls):
        """The scheduler the family's released pipeline ships (the tiny presets use it too)."""
        raise NotImplementedError

    @classmethod
    def offline_tokenizer(cls, key: str, length: int):
        """A tiny offline tokenizer standing in for the released `key` tokenizer (tokenizer,
        tokenizer_2, ...) with its text length: enough to build the pipeline on the meta device."""
        raise NotImplementedError

    @classmethod
    def tiny(cls, seed: int = 0) -> "DiTAdapter":
        """A randomly initialised model of this family small enough for CPU tests, built offline."""
        raise NotImplementedError

    def with_sampling(self, **overrides) -> "DiTAdapter":
        """This adapter with sampling defaults of its own: the random presets take a size, frame
        count and step count that run in seconds on a CPU, not the family's full-scale ones."""
        self.defaults = dataclasses.replace(self.defaults, **overrides)
        return self

    def save_pretrained(self, path: str) -> None:
        self.pipe.save_pretrained(path)

    def to(self, device=None, dtype=None, except_for: tuple[str, ...] = ()) -> "DiTAdapter":
        """Every component (but those named in `except_for`) to `device` / `dtype`."""
        for name, module in self.pipe.components.items():
            if isinstance(module, nn.Module) and not _on_meta(module) and name not in except_for:  # released stay
                module.to(device=device, dtype=dtype)
        return self

    @property
    def device(self) -> torch.device:
        """The transformer's device, or where this rank's other components are when it released
        the transformer (scorers, scripts/encode_prompts.py)."""
        for module in (self.transformer, *self.text_encoders().values(), getattr(self.pipe, "vae", None)):
            if isinstance(module, nn.Module) and not _on_meta(module):
                return next(module.parameters()).device
        return next(self.transformer.parameters()).device  # all on meta: a released config's shapes

    @property
    def dtype(self) -> torch.dtype:
        """The transformer's compute dtype (see `compute_dtype`), else its weights' dtype."""
        return self.compute_dtype or next(self.transformer.parameters()).dtype

    # ----- shapes ---------------------------------------------------------------------------
    @classmethod
    def geometry(cls, transformer_config: dict, vae_config: dict) -> dict:
        """The size factors of a model, from its transformer and VAE configs (no weights)."""
        raise NotImplementedError

    @classmethod
    def check_size(cls, geometry: dict, height: int, width: int, num_frames: int | None = None) -> None:
        """ValueError naming the value if a sample of this size does not fit the model's packing.
        Video families get num_frames already defaulted by the caller."""
        raise NotImplementedError

    @classmethod
    def image_tokens(cls, geometry: dict, height: int, width: int, num_frames: int | None = None) -> int:
        """`image_seq_len` of a sample of this size from the size factors alone (no weights), for the
        families whose timesteps shift by it (`defaults.shift` "dynamic")."""
        raise NotImplementedError

    def own_geometry(self) -> dict:
        """The size factors this loaded model uses (equal to `geometry` of its configs)."""
        raise NotImplementedError

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        """Unpacked latent shape of one sample; ValueError if the size does not fit the packing."""
        raise NotImplementedError

    def image_seq_len(self, latent_shape: tuple[int, ...]) -> int:
        """Number of image tokens the transformer sees (drives FLUX/Qwen's dynamic shift)."""
        raise NotImplementedError

    # ----- text -----------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """The prompts' conditioning, batch-first and padded to a fixed length: looked up in
        precomputed embeddings (`prompt_cache`: --prompt-embeds, scripts/encode_prompts.py), else
        encoded by the text encoders, brought to the device first if they were offloaded."""
        if self.prompt_cache is not None:
            return self.prompt_cache.lookup(list(prompts)).to(self.device)
        encoders = self.text_encoders()
        if any(_on_meta(m) for m in encoders.values()):
            raise RuntimeError(f"this rank released its text encoders ({sorted(encoders)}): it must not encode prompts")
        for module in encoders.values():
            if next(module.parameters()).device != self.device:
                module.to(self.device)  # --offload-text-encoders: back until `offload_text_encoders`
        return self._encode_prompts(prompts)

    def _encode_prompts(self, prompts: list[str]) -> Conditioning:
        raise NotImplementedError

    def text_encoders(self) -> dict[str, nn.Module]:
        """The pipeline's text encoder modules by component name."""
        return {n: m for n in TEXT_ENCODERS if isinstance(m := getattr(self.pipe, n, None), nn.Module)}

    def offload_text_encoders(self) -> None:
        """Move the text encoders to host memory (--offload-text-encoders, between steps); the next
        `encode_prompts` brings them back."""
        for module in self.text_encoders().values():
            if not _on_meta(module):
                module.to("cpu")

    def release_components(self, components: list[str]) -> None:
        """Free the pipeline components this rank never runs (a trainer's text encoders and VAE, a
        scorer's transformer): their weights go to the meta device, their configs, the tokenizers and
        the size factors stay, so every rank still checks shapes alike."""
        for name in components:
            module = getattr(self.pipe, name, None)
            if isinstance(module, nn.Module):
                module.to("meta")

    def holds(self, component: str) -> bool:
        """Whether this rank holds the weights of a pipeline component (not released)."""
        module = getattr(self.pipe, component, None)
        return isinstance(module, nn.Module) and not _on_meta(module)

    # ----- the split ------------------------------------------------------------------------
    def _block_list(self) -> list[nn.Module]:
        raise NotImplementedError

    def side_inputs(self, latent_shape: tuple[int, ...], cond: Conditioning) -> dict[str, Any]:
        """Read-only inputs that depend only on shapes and conditioning (rotary tables, masks)."""
        raise NotImplementedError

    def embed(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance: float | None = None) -> State:
        raise NotImplementedError

    def run_block(self, i: int, state: State) -> State:
        raise NotImplementedError

    def head(self, state: State) -> Tensor:
        """Velocity in the unpacked latent layout, same dtype as the model."""
        raise NotImplementedError

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance: float | None = None) -> Tensor:
        if self.enclosing is not None:
            return self.enclosing(self._velocity, latents, sigma, cond, guidance)
        return self._velocity(latents, sigma, cond, guidance)

    def _velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance: float | None) -> Tensor:
        state = self.embed(latents, sigma, cond, guidance)
        for i in range(len(self.blocks)):
            state = self.run_block(i, state)
        return self.head(state)

    def check_no_guidance(self, guidance: float | None) -> None:
        """For families without a guidance embedding: a guidance value is a mistake (use cfg_scale)."""
        if guidance is not None:
            raise ValueError(f"guidance {guidance} given, but {self.family!r} has no guidance embedding (use cfg_scale)")

    def combine_cfg(self, v_cond: Tensor, v_uncond: Tensor, scale: float) -> Tensor:
        """Classifier-free guidance as the family's pipeline does it (override where it differs)."""
        return v_uncond + scale * (v_cond - v_uncond)

    def reference_velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance: float | None = None) -> Tensor:
        """The same velocity through the diffusers model's own forward (the reference for tests)."""
        raise NotImplementedError

    # ----- pixels ---------------------------------------------------------------------------
    def decode(self, latents: Tensor) -> Tensor:
        """Images in [0, 1], float32: [B, 3, H, W] (video: [B, 3, F, H, W])."""
        if not self.holds("vae"):
            raise RuntimeError("this rank released its VAE: it must not decode")
        return self._decode(latents)

    def _decode(self, latents: Tensor) -> Tensor:
        raise NotImplementedError


TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
"""The pipeline components that encode prompts, in every family."""


def _on_meta(module: nn.Module) -> bool:
    first = next(module.parameters(), None)
    return first is not None and first.is_meta


DEFAULTS_FILE = "digenrl.json"
TINY_SAMPLING = {"height": 32, "width": 32, "num_steps": 4}
"""Sampling defaults of every family's `tiny` preset (video families add TINY_FRAMES frames)."""
TINY_FRAMES = 5
MID_SAMPLING = {"height": 64, "width": 64, "num_steps": 8}


def preset_defaults(cls: type, preset: str) -> SamplingDefaults:
    """The sampling defaults a random preset of family `cls` runs with (what its `tiny` / `mid`
    constructor sets), known without building it."""
    over = {"tiny": TINY_SAMPLING, "mid": MID_SAMPLING}.get(preset, {})
    if preset == "tiny" and cls.defaults.num_frames is not None:
        over = {**over, "num_frames": TINY_FRAMES}
    return dataclasses.replace(cls.defaults, **over)


def read_folder_defaults(path: str, defaults: SamplingDefaults) -> SamplingDefaults:
    """A model folder may carry its own sampling defaults (e.g. the shipped 32x32 shapes model) in
    digenrl.json: {"sampling": {"height": 32, "num_steps": 10, ...}}; the family's fill the rest."""
    file = os.path.join(path, DEFAULTS_FILE)
    if not os.path.isfile(file):
        return defaults
    with open(file) as f:
        overrides = json.load(f).get("sampling", {})
    known = {f.name for f in dataclasses.fields(SamplingDefaults)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{file}: unknown sampling default(s) {unknown}; known: {sorted(known)}")
    return dataclasses.replace(defaults, **overrides)


def check_image_frames(family: str, num_frames: int | None) -> None:
    if num_frames not in (None, 1):
        raise ValueError(f"num_frames {num_frames} given for {family!r}, an image model")


def check_packed_image_size(family: str, vae_factor: int, height: int, width: int, num_frames=None) -> None:
    """Image families that pack 2x2 latent patches (FLUX, Qwen-Image): both sides must be positive
    multiples of the VAE factor times 2."""
    check_image_frames(family, num_frames)
    factor = vae_factor * 2  # VAE downsampling times the 2x2 packing
    for name, size in (("height", height), ("width", width)):
        if size <= 0 or size % factor:
            raise ValueError(f"{name} {size} must be a positive multiple of {factor} for {family!r} "
                             f"(VAE factor {vae_factor} x 2x2 packing)")


def packed_image_tokens(vae_factor: int, height: int, width: int) -> int:
    """Image tokens of the families that pack 2x2 latent patches (FLUX, Qwen-Image)."""
    return (height // (2 * vae_factor)) * (width // (2 * vae_factor))


def video_latent_shape(adapter: DiTAdapter, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
    """`latent_shape` of the video families (Wan, HunyuanVideo): (C, F', H / s, W / s) with the
    VAE's spatial factor s and F' = (frames - 1) / temporal factor + 1, after the family's size check."""
    num_frames = adapter.defaults.num_frames if num_frames is None else num_frames
    adapter.check_size(adapter.own_geometry(), height, width, num_frames)
    spatial, temporal = adapter.pipe.vae_scale_factor_spatial, adapter.pipe.vae_scale_factor_temporal
    frames = (num_frames - 1) // temporal + 1
    return (adapter.transformer.config.in_channels, frames, height // spatial, width // spatial)


def to_unit_range(images: Tensor) -> Tensor:
    """VAE output in [-1, 1] -> float32 in [0, 1]."""
    return (images.float() / 2 + 0.5).clamp(0, 1)


def check_model_folder(path: str, required: tuple[str, ...], family: str) -> None:
    """Fail with a message naming what is missing before diffusers raises from deep inside."""
    if not os.path.isdir(path):
        raise ValueError(f"--model-path {path!r} is not a directory (expected a diffusers folder for {family!r})")
    index = os.path.join(path, "model_index.json")
    if not os.path.isfile(index):
        raise ValueError(f"{path!r} has no model_index.json: not a diffusers pipeline folder for {family!r}")
    with open(index) as f:
        listed = json.load(f)
    missing = [c for c in required if c not in listed or not os.path.isdir(os.path.join(path, c))]
    if missing:
        raise ValueError(f"{path!r} is not a complete {family!r} folder: missing component(s) {missing}")
