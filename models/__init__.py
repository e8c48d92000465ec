"""Model families: name -> adapter registry. Adapters know architectures, never ranks."""
from __future__ import annotations

import importlib

import torch

from models.base import Conditioning, DiTAdapter, SamplingDefaults, State


# name -> "module:class"; imported on first use so one family's import cost is paid only when used.
_ADAPTERS = {
    "flux": "models.flux:FluxAdapter",
    "wan": "models.wan:WanAdapter",
    "qwen_image": "models.qwen_image:QwenImageAdapter",
    "hunyuan_video": "models.hunyuan_video:HunyuanVideoAdapter",
    "sd3": "models.sd3:SD3Adapter",
}


def _registry() -> dict[str, str]:
    return _ADAPTERS


def adapter_class(name: str) -> type[DiTAdapter]:
    registry = _registry()
    if name not in registry:
        raise ValueError(f"unknown model {name!r}; known models: {sorted(registry)}")
    module_name, class_name = registry[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def model_names() -> list[str]:
    return sorted(_registry())


def load_model(name: str, model_path: str | None = None, *, preset: str = "tiny", seed: int = 0,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DiTAdapter:
    """A local diffusers folder when `model_path` is given, else the named preset (built offline)."""
    cls = adapter_class(name)
    if model_path:
        adapter = cls.from_pretrained(model_path, dtype=dtype)
    elif preset == "tiny":
        adapter = cls.tiny(seed=seed).to(dtype=dtype)
    else:
        raise ValueError(f"unknown preset {preset!r} for model {name!r}; use --model-path DIR or preset 'tiny'")
    return adapter.to(device=device)


__all__ = ["Conditioning", "DiTAdapter", "SamplingDefaults", "State", "adapter_class", "load_model", "model_names"]
