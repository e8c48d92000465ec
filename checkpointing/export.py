"""The export of a checkpoint, in the layouts the peers' tools load as they are
(docs/peer-formats.md), written by every trainer rank (nothing is gathered whole onto one rank):

- LoRA: `pytorch_lora_weights.safetensors` (diffusers' `pipe.load_lora_weights(DIR)`), and beside
  it a peft folder's two files, `adapter_config.json` + `adapter_model.safetensors`
  (`PeftModel.from_pretrained(transformer, DIR)`, as Flow-GRPO loads its checkpoints);
- full fine-tuning: a pipeline folder, `transformer/` (config.json + diffusion_pytorch_model
  .safetensors, or with several trainer ranks one file per rank and diffusers' index.json) beside
  `model_index.json` and the components training leaves untouched: links to the base model
  folder's (--model-path; the folder must stay where it is), or for a preset the preset's
  components written out. `<Family>Pipeline.from_pretrained(DIR)` loads it, and so does
  `--model-path DIR` (its digenrl.json, the sampling defaults, is copied).

Adapters (models.DiTAdapter) are passed in: this module imports no model family.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor

from models.lora import ADAPTER, PEFT_CONFIG, PEFT_PREFIX, PEFT_WEIGHTS
from parallel.fsdp import full_tensor

LORA_FILE = "pytorch_lora_weights.safetensors"
WEIGHTS_NAME = "diffusion_pytorch_model"  # diffusers' file names: <name>.safetensors, <name>-i-of-n, index
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PIPELINE_INDEX = "model_index.json"
COPIED = ("digenrl.json",)  # small files of the base folder the export copies (linked: every component folder)


def to_diffusers_lora(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """peft parameter names -> the names `save_lora_weights` expects (the adapter name dropped)."""
    return {n.replace(f".{ADAPTER}", ""): t for n, t in weights.items()}


def to_peft_lora(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """peft parameter names -> the keys `PeftModel.save_pretrained` writes and `from_pretrained` reads."""
    return {PEFT_PREFIX + n: t for n, t in to_diffusers_lora(weights).items()}


def _file_plan(tensors: dict[str, Tensor], ranks: int) -> dict[str, int]:
    """name -> the index of the file (and of the trainer rank writing it) of a transformer export
    over `ranks` files of about equal bytes, names kept in order. Files are numbered from 0 without
    gaps (a huge tensor can leave fewer files than ranks)."""
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    total, before, slot = max(1, sum(sizes)), 0, {}
    for name, size in zip(tensors, sizes):
        slot[name] = min(ranks - 1, before * ranks // total)
        before += size
    numbers = {s: i for i, s in enumerate(sorted(set(slot.values())))}
    return {n: numbers[s] for n, s in slot.items()}


def _shard_name(index: int, files: int) -> str:
    """diffusers' names: one file, or file `index` (from 0) of several with an index.json."""
    return f"{WEIGHTS_NAME}.safetensors" if files == 1 else f"{WEIGHTS_NAME}-{index + 1:05d}-of-{files:05d}.safetensors"


def export_weights(folder: str, adapter: "DiTAdapter", tensors: dict[str, Tensor], *, lora: bool, dtype: torch.dtype,
                   group=None, write: bool = True, lora_config=None, model: dict | None = None) -> None:
    """Write `tensors` (trained weights by parameter name, possibly FSDP-sharded) in the peers' layouts.
    Every trainer rank of `group` calls it: under FSDP each whole tensor is gathered in turn (a
    collective), and a full fine-tune is written as one file per rank, each rank keeping only its
    own file's tensors; LoRA (small) goes into one file written by the rank with `write`.
    `model`: the run's config ({"seed", "model": {...}}) that names the base of a pipeline folder."""
    rank = dist.get_rank(group) if group is not None else 0
    ranks = dist.get_world_size(group) if group is not None else 1
    os.makedirs(folder, exist_ok=True)
    if lora:
        whole = {n: full_tensor(t.detach()).to("cpu", dtype).contiguous() for n, t in tensors.items()}
        if write:
            write_lora(folder, adapter, whole, lora_config)
        return
    sub = os.path.join(folder, "transformer")
    os.makedirs(sub, exist_ok=True)
    plan = _file_plan(tensors, ranks)
    files = max(plan.values()) + 1
    mine = {}
    for name, t in tensors.items():
        whole = full_tensor(t.detach())  # under FSDP every rank gathers every tensor, in the same order
        if plan[name] == rank:
            mine[name] = whole.to("cpu", dtype).contiguous()
        del whole
    if rank < files:
        save_file(mine, os.path.join(sub, _shard_name(rank, files)), metadata={"format": "pt"})
    if write:
        adapter.transformer.save_config(sub)
        if files > 1:
            index = {"metadata": {"total_size": sum(t.numel() * dtype.itemsize for t in tensors.values())},
                     "weight_map": {n: _shard_name(i, files) for n, i in plan.items()}}
            with open(os.path.join(sub, f"{WEIGHTS_NAME}.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        export_pipeline(folder, adapter, model or {})


def write_lora(folder: str, adapter: "DiTAdapter", whole: dict[str, Tensor], lora_config) -> None:
    """A LoRA's whole weights (peft parameter names) as diffusers' file and a peft folder's two files."""
    config = lora_config.to_dict() if lora_config is not None else None
    if config is not None:
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    adapter.pipeline_class.save_lora_weights(folder, transformer_lora_layers=to_diffusers_lora(whole),
                                             transformer_lora_adapter_metadata=config)
    if lora_config is not None:
        save_file(to_peft_lora(whole), os.path.join(folder, PEFT_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(folder, PEFT_CONFIG), "w") as f:
            json.dump({**config, "inference_mode": True, "peft_type": "LORA"}, f, indent=2, sort_keys=True)


def export_pipeline(folder: str, adapter: "DiTAdapter", run: dict) -> None:
    """model_index.json and the untouched components beside a full fine-tune's transformer/: links
    to the base folder's (--model-path), or the preset's components written out."""
    model = run.get("model") or {}
    base = model.get("model_path")
    if base:
        base = os.path.realpath(base)
        shutil.copyfile(os.path.join(base, PIPELINE_INDEX), os.path.join(folder, PIPELINE_INDEX))
        for name in COPIED:
            if os.path.isfile(os.path.join(base, name)):
                shutil.copyfile(os.path.join(base, name), os.path.join(folder, name))
        for name in _components(os.path.join(base, PIPELINE_INDEX)):
            if name != "transformer" and os.path.isdir(os.path.join(base, name)):
                os.symlink(os.path.join(base, name), os.path.join(folder, name), target_is_directory=True)
        return
    # A preset is a function of the seed: built again, its components are the run's base in float32
    # (this rank may hold them in the compute dtype, or have released them).
    pipe = getattr(type(adapter), model.get("preset") or "tiny")(seed=run.get("seed", 0)).pipe
    for name, module in pipe.components.items():
        if name != "transformer" and module is not None:
            module.save_pretrained(os.path.join(folder, name))
    pipe.save_config(folder)


def _components(index_path: str) -> list[str]:
    """The component names a model_index.json lists with a library (not the null ones)."""
    with open(index_path) as f:
        index = json.load(f)
    return [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v and v[0]]
