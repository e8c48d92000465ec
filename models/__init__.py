"""Model families: name -> adapter registry. Adapters know architectures, never ranks."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util

import diffusers.utils.logging as dlog
import torch
import transformers.utils.logging as tlog

from models.adapter import TEXT_ENCODERS, Conditioning, DiTAdapter, SamplingDefaults, State


# name -> "module:class"; imported on first use so one family's import cost is paid only when used.
_ADAPTERS = {
    "flux": "models.flux:FluxAdapter",
    "wan": "models.wan:WanAdapter",
    "qwen_image": "models.qwen_image:QwenImageAdapter",
    "hunyuan_video": "models.hunyuan_video:HunyuanVideoAdapter",
    "sd3": "models.sd3:SD3Adapter",
}


def adapter_class(name: str) -> type[DiTAdapter]:
    if name not in _ADAPTERS:
        raise ValueError(f"unknown model {name!r}; known models: {sorted(_ADAPTERS)}")
    module_name, class_name = _ADAPTERS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def model_names() -> list[str]:
    return sorted(_ADAPTERS)


def load_model(name: str, model_path: str | None = None, *, preset: str = "tiny", seed: int = 0,
               dtype: torch.dtype | dict = torch.float32, device: str | torch.device = "cpu",
               release: tuple[str, ...] = (), host: tuple[str, ...] = ()) -> DiTAdapter:
    """A local diffusers folder when `model_path` is given, else the named preset (built offline).
    `dtype` is one dtype for every component, or {component: dtype, "default": dtype} (`model_dtypes`).
    `release`: components this rank never runs, freed before anything moves to `device`
    (`DiTAdapter.release_components`). `host`: components left in host memory (a sharded trainer's
    transformer, which FSDP2 moves to the device a unit at a time as it shards it: trainer.py)."""
    cls = adapter_class(name)
    _quiet_loading()
    if model_path:
        adapter = cls.from_pretrained(model_path, dtype=dtype)
        adapter.release_components(list(release))
    elif preset in ("tiny", "mid") and hasattr(cls, preset):
        adapter = getattr(cls, preset)(seed=seed)
        adapter.release_components(list(release))
        table = dtype if isinstance(dtype, dict) else {"default": dtype}
        for component, module in adapter.pipe.components.items():
            wanted = table.get(component, table.get("default", torch.float32))
            first = next(module.parameters(), None) if isinstance(module, torch.nn.Module) else None
            if first is not None and first.dtype != wanted:
                module.to(dtype=wanted)
    else:
        known = [p for p in ("tiny", "mid") if hasattr(cls, p)]
        raise ValueError(f"unknown preset {preset!r} for model {name!r}; use --model-path DIR or one of {known}")
    return adapter.to(device=device, except_for=host)


def autocast(device: torch.device, dtype_name: str):
    """Autocast to the compute dtype (--dtype; auto: bf16 on CUDA, float32 elsewhere), with no cache
    of cast weights: a cached cast lives as long as the block, a bf16 copy of every float32 weight a
    forward touches (torch.autocast's cache_enabled). Weights already in the compute dtype (generators,
    FSDP2 mixed precision, frozen weights) are not cast at all. Generation and training use the same
    context, so the first on-policy step sees ratio == 1. float32 runs without autocast."""
    dtype = resolve_dtype(dtype_name, device)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)


__all__ = ["TEXT_ENCODERS", "Conditioning", "DiTAdapter", "SamplingDefaults", "State", "adapter_class", "autocast", "load_model",
           "check_attention", "model_dtypes", "model_names", "resolve_device", "resolve_dtype", "set_attention"]


def _quiet_loading() -> None:
    """Every rank loads the model: no per-component progress bars from diffusers / transformers."""
    dlog.disable_progress_bar()
    tlog.disable_progress_bar()


ATTENTION_BACKENDS = ("sdpa", "flash", "flash_varlen", "sage", "native")


def check_attention(cls: type[DiTAdapter], backend: str) -> None:
    """A backend that cannot run the family's attention mask is a ValueError naming the family,
    before anything loads: diffusers' flash (flash-attn 2) and sage kernels raise at the first
    forward on any mask; flash_varlen turns a mask into per-sample key lengths, right only when the
    mask keeps a prefix of the keys (HunyuanVideo's [image, text] sequence, not Qwen-Image's [text,
    image] with padded text)."""
    if cls.attention_mask is None:
        return
    if backend in ("flash", "sage") or (backend == "flash_varlen" and not cls.mask_is_key_prefix):
        other = "sdpa or flash_varlen" if cls.mask_is_key_prefix else "sdpa"
        raise ValueError(f"--attention {backend} cannot run {cls.family!r}: the model {cls.attention_mask}, and "
                         f"{backend} takes no such mask; use {other}")


def set_attention(adapter: DiTAdapter, backend: str) -> None:
    """Select the attention kernel through diffusers' dispatcher (docs/MODELS.md, "Attention backends").
    flash-attn is an optional GPU dependency: asking for it without the package is a clear error."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
    check_attention(type(adapter), backend)
    if backend == "sdpa":
        return  # diffusers' default ("native") is torch's scaled_dot_product_attention
    if backend.startswith("flash") and importlib.util.find_spec("flash_attn") is None:
        raise ValueError(f"--attention {backend} needs the flash-attn package: "
                         "pip install flash-attn --no-build-isolation (CUDA machines only)")
    if backend == "sage" and importlib.util.find_spec("sageattention") is None:
        raise ValueError("--attention sage needs the sageattention package")
    adapter.transformer.set_attention_backend(backend)


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def model_dtypes(name: str, device: torch.device, master: bool = True) -> dict[str, torch.dtype]:
    """The dtype each pipeline component loads in (--dtype): everything in the compute dtype
    (`resolve_dtype`: auto is bf16 on CUDA, float32 elsewhere), except a trained transformer's
    float32 master weights (`master`: a full fine-tune's trainer; AdamW updates float32 weights).
    Generators, frozen LoRA bases, text encoders and the VAE only run inference."""
    compute = resolve_dtype(name, device)
    return {"transformer": torch.float32 if master else compute, "default": compute}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype of --dtype: `auto` is bfloat16 on CUDA (docs/ALGORITHMS.md defaults) and
    float32 elsewhere."""
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose one of {['auto', *table]}")
    return table[name]
