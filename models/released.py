"""The released configs of the paper's models, checked without their weights.

`models/configs/NAME.json` holds, for each released diffusers folder, the config of every component
that has parameters (transformer, VAE, text encoders) as its config.json gives it, plus the text
lengths its tokenizers use. `meta_adapter(NAME)` builds the family's adapter over those components
on the meta device (shapes and parameter counts, no memory, no download), with the tiny offline
tokenizers standing in for the real ones; `parameter_counts(NAME)` counts each component. The
recipes' memory estimate (runtime/budget.py) and the tests of the embed / blocks / head split at full
scale read them.
"""
from __future__ import annotations

import json
import os

import diffusers
import torch
import transformers
from torch import nn

from models import adapter_class
from models.adapter import DiTAdapter

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
_NOT_MODULES = ("repo", "family", "tokenizer_max_length")


def released_names() -> list[str]:
    return sorted(f[:-len(".json")] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def released_config(name: str) -> dict:
    path = os.path.join(CONFIG_DIR, f"{name}.json")
    if not os.path.isfile(path):
        raise ValueError(f"no released config {name!r}; known: {released_names()}")
    with open(path) as f:
        return json.load(f)


def _build(spec: dict) -> nn.Module:
    """One component from its config on the meta device: a diffusers or a transformers class."""
    spec = dict(spec)
    class_name = spec.pop("_class_name")
    if hasattr(diffusers, class_name):
        with torch.device("meta"):
            return getattr(diffusers, class_name)(**spec)
    cls = getattr(transformers, class_name)
    config = cls.config_class(**spec)
    with torch.device("meta"):
        return cls(config).eval()


def meta_components(name: str) -> dict[str, nn.Module]:
    """transformer, vae and text encoders of a released model, on the meta device."""
    return {k: _build(v) for k, v in released_config(name).items() if k not in _NOT_MODULES}


def parameter_counts(name: str) -> dict[str, int]:
    """Parameters of each component of the released model: {"transformer": n, "vae": n, "text_encoder": n, ...}."""
    return count_parameters(meta_components(name))


def count_parameters(components: dict) -> dict[str, int]:
    """Parameters of each module among `components` (a pipeline's `components` too)."""
    return {k: sum(p.numel() for p in m.parameters()) for k, m in components.items() if isinstance(m, nn.Module)}


def meta_adapter(name: str) -> DiTAdapter:
    """The family's adapter over the released components on the meta device. Tokenizers are the tiny
    offline ones (with the released text lengths): enough to construct the adapter and drive its
    split with conditioning tensors of the released shapes, not to encode prompts."""
    config = released_config(name)
    family = config["family"]
    cls = adapter_class(family)
    parts = meta_components(name)
    lengths = config["tokenizer_max_length"]
    for key, length in lengths.items():
        parts[key] = cls.offline_tokenizer(key, length)
        parts[key].model_max_length = length
    parts["scheduler"] = cls.scheduler()
    return cls(cls.pipeline_class(**parts))

