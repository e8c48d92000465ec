"""LoRA on a DiT through peft (docs/ALGORITHMS.md: attention projections, optionally the feed-forward),
and the LoRAs users bring (--init-lora) in the formats the peers save them.

Every rank applies the same config with the same seed, so generators and trainers hold the same
adapter structure and the same initial weights (version 0); with --init-lora every rank copies the
same file's weights into it.

The formats read (docs/peer-formats.md):
- a peft folder, `adapter_config.json` + `adapter_model.safetensors` (Flow-GRPO's
  `PeftModel.save_pretrained`, and every LoRA checkpoint of this project), keys
  `base_model.model.<module>.lora_A.weight`;
- a diffusers LoRA file, `pytorch_lora_weights.safetensors` (`save_lora_weights`: diffusers'
  scripts, DanceGRPO), keys `transformer.<module>.lora_A.weight`; rank, alpha and targets from its
  `lora_adapter_metadata`, or DanceGRPO's `lora_config.json` beside it, else alpha = rank and the
  targets from the keys (what diffusers' loader assumes).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from peft import LoraConfig
from safetensors import safe_open
from torch import nn

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
FEED_FORWARD = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
                "ffn.net.0.proj", "ffn.net.2", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                "txt_mlp.net.2"]
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
DIFFUSERS_WEIGHTS, DANCE_CONFIG = "pytorch_lora_weights.safetensors", "lora_config.json"
PEFT_PREFIX, DIFFUSERS_PREFIX = "base_model.model.", "transformer."
ADAPTER = "default"  # peft's adapter name inside parameter names: <module>.lora_A.default.weight
PLAIN = {"use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
         "layers_pattern": None, "modules_to_save": None, "bias": "none", "lora_bias": False, "target_parameters": None,
         "exclude_modules": None, "layer_replication": None}
"""LoRA options this project trains as plain LoRA only: a file that sets one otherwise is refused"""


def split_targets(which: str, any_layer: bool = False) -> list[str]:
    """--lora-targets: attn, attn+ff, or names of attention and feed-forward layers separated by
    commas (`any_layer`: of any layer, as an --init-lora adapter's targets may be)."""
    if which == "attn":
        return list(ATTENTION)
    if which == "attn+ff":
        return ATTENTION + FEED_FORWARD
    names = [w.strip() for w in which.split(",")]
    known = ATTENTION + FEED_FORWARD
    if not all(names) or not (any_layer or all(any(n == k or n.endswith("." + k) for k in known) for n in names)):
        raise ValueError(f"unknown --lora-targets {which!r}; choose attn, attn+ff, or attention and feed-forward layer "
                         f"names separated by commas (module-name suffixes ending in one of {known})")
    return names


def lora_targets(transformer: nn.Module, which: str) -> list[str]:
    """Module-name suffixes present in this transformer for `attn`, `attn+ff` or a list of names
    (every listed name must name a linear layer of the model)."""
    wanted = split_targets(which, any_layer=True)
    names = [n for n, m in transformer.named_modules() if isinstance(m, nn.Linear)]
    present = [w for w in wanted if any(n == w or n.endswith("." + w) for n in names)]
    if which not in ("attn", "attn+ff") and present != wanted:
        missing = [w for w in wanted if w not in present]
        raise ValueError(f"--lora-targets: {missing} name no linear layer of {type(transformer).__name__}")
    if not present:
        raise ValueError(f"no LoRA target {wanted} found in {type(transformer).__name__}")
    return present


@dataclass(frozen=True)
class LoraFile:
    """A LoRA a user brings: what its config says and which modules its weights cover (read
    without loading the weights)."""

    path: str
    """the folder or file given"""
    weights: str
    """the safetensors file holding the weights"""
    prefix: str
    """what the file's keys put before the module name"""
    rank: int
    alpha: float
    targets: tuple[str, ...]
    """target_modules: module-name suffixes"""
    modules: tuple[str, ...]
    """the modules the file holds lora_A and lora_B for"""

    def lora_targets(self) -> str:
        """The targets as --lora-targets spells them (what config.json records)."""
        return ",".join(self.targets)


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}: {path} cannot be read ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {path} holds no JSON object")
    return data


def _locate(path: str) -> tuple[str, str | None, str]:
    """(weights file, config file or None, kind) of a folder or file given as --init-lora."""
    flag = f"--init-lora {path!r}"
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, PEFT_CONFIG)):
            weights = os.path.join(path, PEFT_WEIGHTS)
            if not os.path.isfile(weights):
                raise ValueError(f"{flag}: a peft folder needs {PEFT_WEIGHTS} beside {PEFT_CONFIG} (a pickled "
                                 f"adapter_model.bin is not read: it could run code; save with safe_serialization)")
            return weights, os.path.join(path, PEFT_CONFIG), "peft"
        if os.path.isfile(os.path.join(path, DIFFUSERS_WEIGHTS)):
            dance = os.path.join(path, DANCE_CONFIG)
            return os.path.join(path, DIFFUSERS_WEIGHTS), dance if os.path.isfile(dance) else None, "diffusers"
        raise ValueError(f"{flag}: the folder holds neither a peft adapter ({PEFT_CONFIG} + {PEFT_WEIGHTS}) nor a "
                         f"diffusers LoRA ({DIFFUSERS_WEIGHTS})")
    if os.path.isfile(path) and path.endswith(".safetensors"):
        dance = os.path.join(os.path.dirname(path), DANCE_CONFIG)
        return path, dance if os.path.isfile(dance) else None, "diffusers"
    if os.path.isfile(path):
        raise ValueError(f"{flag}: a LoRA file must be .safetensors (pickled weights are not read: they could run code)")
    raise ValueError(f"{flag}: no such file or folder")


def _lora_keys(weights: str, flag: str) -> tuple[str, dict[str, list[int]], dict[str, str]]:
    """(the keys' prefix, {key without prefix: shape}, the file's metadata); only lora_A / lora_B of
    the transformer, in one naming."""
    try:
        with safe_open(weights, framework="pt") as f:
            shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
            metadata = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
        raise ValueError(f"{flag}: {weights} is not a readable safetensors file ({e})") from None
    if not shapes:
        raise ValueError(f"{flag}: {weights} holds no tensors")
    prefix = next((p for p in (PEFT_PREFIX, DIFFUSERS_PREFIX) if all(k.startswith(p) for k in shapes)), "")
    out = {k[len(prefix):]: s for k, s in shapes.items()}
    odd = [k for k in out if not (k.endswith(".lora_A.weight") or k.endswith(".lora_B.weight"))]
    if odd:
        raise ValueError(f"{flag}: {weights} holds {odd[:3]}: only the transformer's lora_A / lora_B weights of a plain "
                         f"LoRA are read (no DoRA magnitudes, biases, text-encoder LoRAs or kohya names)")
    return prefix, out, metadata


def module_suffix(module: str) -> str:
    """A module name without its block: 'transformer_blocks.0.attn.to_out.0' -> 'attn.to_out.0'
    (the part after the first number), the whole name where there is no number."""
    parts = module.split(".")
    first = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return module if first is None or first == len(parts) - 1 else ".".join(parts[first + 1:])


def _options(config: dict, metadata: dict, kind: str) -> dict:
    """The LoRA options of a file: its peft config, a diffusers file's metadata (`transformer.` keys
    of `lora_adapter_metadata`) or DanceGRPO's lora_config.json ({"lora_params": {lora_rank, ...}})."""
    if kind == "peft":
        return config
    if "lora_params" in config:
        p = config["lora_params"]
        return {"r": p.get("lora_rank"), "lora_alpha": p.get("lora_alpha"), "target_modules": p.get("target_modules")}
    packed = metadata.get("lora_adapter_metadata")
    if packed:
        try:
            table = json.loads(packed)
        except ValueError:
            table = {}
        return {k[len(DIFFUSERS_PREFIX):]: v for k, v in table.items() if k.startswith(DIFFUSERS_PREFIX)}
    return {}


def read_lora_file(path: str) -> LoraFile:
    """--init-lora PATH, read and checked without the model: a ValueError names what is wrong."""
    flag = f"--init-lora {path!r}"
    weights, config_path, kind = _locate(path)
    config = _read_json(config_path, flag) if config_path else {}
    prefix, shapes, metadata = _lora_keys(weights, flag)
    options = _options(config, metadata, kind)
    if kind == "peft" and options.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{flag}: peft_type {options.get('peft_type')!r}; only LORA adapters are read")
    fancy = {k: options[k] for k, plain in PLAIN.items() if options.get(k, plain) not in (plain, None, {}, False)}
    if fancy:
        raise ValueError(f"{flag}: {fancy}: only plain LoRA (one rank and alpha, every target module) is trained here")
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in shapes})
    unpaired = [m for m in modules if f"{m}.lora_A.weight" not in shapes or f"{m}.lora_B.weight" not in shapes]
    if unpaired:
        raise ValueError(f"{flag}: {unpaired[:3]} lack lora_A or lora_B")
    ranks = sorted({shapes[f"{m}.lora_A.weight"][0] for m in modules})
    if len(ranks) != 1:
        raise ValueError(f"{flag}: its modules have ranks {ranks}; only one rank for every module is trained here")
    rank = ranks[0]
    if options.get("r") not in (None, rank):
        raise ValueError(f"{flag}: its config says r={options['r']}, its weights have rank {rank}")
    alpha = options.get("lora_alpha")
    alpha = float(alpha if alpha is not None else rank)  # diffusers' loader: no alpha recorded means alpha = rank
    targets = options.get("target_modules")
    if not isinstance(targets, list) or not targets:  # a regex, or not recorded: the suffixes of the weights' modules
        targets = sorted({module_suffix(m) for m in modules})
    return LoraFile(path, weights, prefix, rank, alpha, tuple(sorted(targets)), tuple(modules))


def apply_lora(transformer: nn.Module, rank: int, alpha: float | None, which: str = "attn", seed: int = 0,
               init: LoraFile | None = None) -> None:
    """Add the run's LoRA (seeded: the same lora_A on every rank); with `init`, its weights are
    copied from the file, whose modules and shapes must fit (a ValueError before any rank waits)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1 (0 means full fine-tuning and applies no LoRA), got {rank}")
    if init is not None:
        check_fits(transformer, init)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, init_lora_weights="gaussian",
                        target_modules=lora_targets(transformer, which))
    transformer.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # identical lora_A on every rank
        transformer.add_adapter(config)
    if init is not None:
        load_lora_file(transformer, init)
    for p in transformer.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # the trained weights stay float32 on a half-precision base (AdamW's updates)


def check_fits(transformer: nn.Module, lora: LoraFile) -> None:
    """Every module of the file is a linear layer of the model whose sizes its weights fit, and its
    targets name no module it holds no weights for."""
    flag = f"--init-lora {lora.path!r}"
    linear = {n: m for n, m in transformer.named_modules() if isinstance(m, nn.Linear)}
    missing = [m for m in lora.modules if m not in linear]
    if missing:
        raise ValueError(f"{flag}: {len(missing)} of its {len(lora.modules)} modules are not linear layers of "
                         f"{type(transformer).__name__}: {missing[:3]} (a LoRA of another model?)")
    with safe_open(lora.weights, framework="pt") as f:
        for m in lora.modules:
            a = list(f.get_slice(f"{lora.prefix}{m}.lora_A.weight").get_shape())
            b = list(f.get_slice(f"{lora.prefix}{m}.lora_B.weight").get_shape())
            want_a, want_b = [lora.rank, linear[m].in_features], [linear[m].out_features, lora.rank]
            if a != want_a or b != want_b:
                raise ValueError(f"{flag}: {m} has lora_A {a} and lora_B {b}; the model's layer needs {want_a} and "
                                 f"{want_b} (a LoRA of another model size?)")
    covered = sorted(n for n in linear if any(n == t or n.endswith("." + t) for t in lora.targets))
    extra, unnamed = sorted(set(covered) - set(lora.modules)), sorted(set(lora.modules) - set(covered))
    if extra or unnamed:
        raise ValueError(f"{flag}: its targets {list(lora.targets)} "
                         + (f"also name {len(extra)} layers it holds no weights for: {extra[:3]}" if extra else
                            f"do not name {len(unnamed)} layers it holds weights for: {unnamed[:3]}"))


def load_lora_file(transformer: nn.Module, lora: LoraFile) -> None:
    """Copy a file's LoRA weights (checked by `check_fits`) into the adapters `apply_lora` added."""
    params = dict(transformer.named_parameters())
    with safe_open(lora.weights, framework="pt") as f, torch.no_grad():
        for m in lora.modules:
            for part in ("A", "B"):
                target = params[f"{m}.lora_{part}.{ADAPTER}.weight"]
                target.copy_(f.get_tensor(f"{lora.prefix}{m}.lora_{part}.weight").to(target.dtype))


def trainable_names(transformer: nn.Module) -> list[str]:
    return [n for n, p in transformer.named_parameters() if p.requires_grad]
