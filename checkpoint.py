"""Checkpoints in the layouts diffusers loads, plus the full run state for --resume.

DIR/checkpoints/step-N/ holds the state after N optimizer updates (policy version N):
- full fine-tuning: transformer/ (config.json + diffusion_pytorch_model.safetensors), loadable with
  `<Family>Transformer.from_pretrained(DIR, subfolder="transformer")`;
- LoRA: pytorch_lora_weights.safetensors, loadable with `pipe.load_lora_weights(DIR)`;
- ema.safetensors (if --ema-decay > 0), trainer_state.pt (optimizer, update count, RNG, running
  reward std and the std of the last steps, skipped-step counters), config.json (the run's
  config), state.json (step, version);
- with --tcss, stale.safetensors: the published tensors of version N-1, which the generators hold
  when the trainers reach version N (step N is generated with them), so a resume is exact;
- manifest.json, written last: every file's size and SHA-256 (checkpoint_files.py writes the
  folder atomically and verifies it before anything loads).

trainer_state.pt holds only containers, numbers and tensors and is read with
`torch.load(weights_only=True)`: a crafted file cannot run code.
"""
from __future__ import annotations

import json
import os
import re
import signal

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import distribute_tensor

import checkpoint_files

# Adapters (models.DiTAdapter) are passed in: this module imports no model family.
LORA_FILE = "pytorch_lora_weights.safetensors"
ADAPTER = ".default"  # peft's adapter name inside parameter names
STALE_FILE = "stale.safetensors"
# Test hook: the writer of checkpoint step N SIGKILLs itself after writing the files, before the
# manifest (a crash in the middle of a checkpoint write). Unset in normal runs.
KILL_ENV = "DIGENRL_DEBUG_KILL_IN_SAVE"


def checkpoint_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step-{step}")


def find_checkpoint(run_dir: str) -> checkpoint_files.Found:
    """The newest checkpoint of a run folder whose manifest verifies, and those passed over."""
    return checkpoint_files.find_valid(os.path.join(run_dir, "checkpoints"))


def to_diffusers_lora(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """peft parameter names -> the names `save_lora_weights` expects (the adapter name dropped)."""
    return {n.replace(ADAPTER, ""): t for n, t in weights.items()}


def from_diffusers_lora(flat: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for n, t in flat.items():
        n = n[len("transformer."):] if n.startswith("transformer.") else n
        out[re.sub(r"\.(lora_[AB])\.", rf".\1{ADAPTER}.", n)] = t
    return out


def save_weights(path: str, adapter: "DiTAdapter", weights: dict[str, Tensor], lora: bool, lora_config=None) -> None:
    os.makedirs(path, exist_ok=True)
    weights = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in weights.items()}
    if lora:
        metadata = lora_config.to_dict() if lora_config is not None else None
        if metadata is not None:
            metadata = {k: (sorted(v) if isinstance(v, set) else v) for k, v in metadata.items()}
        adapter.pipeline_class.save_lora_weights(path, transformer_lora_layers=to_diffusers_lora(weights),
                                                 transformer_lora_adapter_metadata=metadata)
    else:
        sub = os.path.join(path, "transformer")
        os.makedirs(sub, exist_ok=True)
        adapter.transformer.save_config(sub)
        save_file(weights, os.path.join(sub, "diffusion_pytorch_model.safetensors"))


def save_checkpoint(path: str, adapter: "DiTAdapter", weights: dict[str, Tensor], *, lora: bool, step: int,
                    trainer_state: dict, ema: dict[str, Tensor] | None = None, lora_config=None,
                    stale: dict[str, Tensor] | None = None, config: dict | None = None) -> None:
    """Write checkpoint `path` atomically (checkpoint_files.write_atomic): complete, or not there."""
    def write(tmp: str) -> None:
        save_weights(tmp, adapter, weights, lora, lora_config)
        if ema is not None:
            save_file({n: t.detach().cpu().contiguous() for n, t in ema.items()}, os.path.join(tmp, "ema.safetensors"))
        if stale is not None:
            save_file({n: t.detach().cpu().contiguous() for n, t in stale.items()}, os.path.join(tmp, STALE_FILE))
        torch.save(trainer_state, os.path.join(tmp, "trainer_state.pt"))
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump({"step": step, "version": step, "lora": lora}, f)
        if config is not None:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config, f, indent=2)

    def crash_hook(tmp: str) -> None:
        if os.environ.get(KILL_ENV, "").strip() == str(step):
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_files.write_atomic(path, write, {"step": step, "version": step, "lora": lora, "config": config},
                                  before_manifest=crash_hook)


def read_trained_weights(path: str) -> tuple[dict[str, Tensor], bool]:
    """(weights by the transformer's own parameter names, is_lora)."""
    lora_path = os.path.join(path, LORA_FILE)
    if os.path.isfile(lora_path):
        return from_diffusers_lora(load_file(lora_path)), True
    full = os.path.join(path, "transformer", "diffusion_pytorch_model.safetensors")
    if os.path.isfile(full):
        return load_file(full), False
    raise ValueError(f"checkpoint {path!r} holds neither {LORA_FILE} nor transformer/ weights")


def load_trained_weights(adapter: "DiTAdapter", path: str) -> None:
    """Sampling from a checkpoint (scripts/sample.py --checkpoint): LoRA through diffusers' own loader."""
    if os.path.isfile(os.path.join(path, LORA_FILE)):
        adapter.pipe.load_lora_weights(path)
        return
    weights, _ = read_trained_weights(path)
    adapter.transformer.load_state_dict(weights, strict=True)


def install_weights(module: torch.nn.Module, weights: dict[str, Tensor]) -> None:
    """Copy named weights into a (possibly FSDP-sharded) module in place."""
    params = dict(module.named_parameters())
    missing = [n for n in weights if n not in params]
    if missing:
        raise ValueError(f"checkpoint weights not in the model: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    shapes = [f"{n}: checkpoint {list(t.shape)}, model {list(params[n].shape)}" for n, t in weights.items()
              if tuple(t.shape) != tuple(params[n].shape)]
    if shapes:
        raise ValueError(f"checkpoint weights do not fit the model (another --lora-rank or base model?): "
                         f"{'; '.join(shapes[:3])}{' ...' if len(shapes) > 3 else ''}")
    with torch.no_grad():
        for n, t in weights.items():
            p = params[n]
            if hasattr(p, "distribute_tensor") or hasattr(p, "device_mesh"):
                p.copy_(distribute_tensor(t.to(p.dtype), p.device_mesh, p.placements))
            else:
                p.copy_(t.to(device=p.device, dtype=p.dtype))


# ----- the run state of --resume ------------------------------------------------------------------
def save_run_state(out_dir: str, done: int, trainer, adapter, running, lora_config, write: bool, *,
                   extra: dict | None = None, stale: dict[str, Tensor] | None = None, config: dict | None = None,
                   keep: int = 0) -> str | None:
    """After `done` updates: every trainer rank gathers the full state (collectives under FSDP);
    the one with `write` writes checkpoints/step-`done` atomically and prunes to the newest `keep`.
    `extra` joins trainer_state.pt; `stale` is the TCSS generators' version (done - 1)."""
    weights = trainer.full_weights()
    ema = trainer.ema_weights()
    if trainer.sharding == "fsdp":
        optim = get_optimizer_state_dict(trainer.adapter.transformer, trainer.optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        optim = trainer.optimizer.state_dict()
    if not write:
        return None
    state = {"optimizer": optim, "num_updates": trainer.num_updates, "running_std": running.state_dict(),
             "torch_rng": torch.get_rng_state(), "step": done, **(extra or {})}
    path = checkpoint_dir(out_dir, done)
    save_checkpoint(path, adapter, weights, lora=trainer.lora, step=done, trainer_state=state, ema=ema,
                    lora_config=lora_config, stale=stale, config=config)
    checkpoint_files.prune(os.path.dirname(path), keep, protect=(path,))
    return path


def restore_run_state(path: str, adapter, trainer, running, use_stale: bool = False) -> dict:
    """Every rank installs checkpoint `path`'s weights (with `use_stale`, the TCSS generators'
    version N-1 on top); trainers also restore the optimizer and the EMA. Returns trainer_state.pt
    (its "step" is the checkpoint's)."""
    weights, _ = read_trained_weights(path)
    install_weights(adapter.transformer, weights)
    stale_path = os.path.join(path, STALE_FILE)
    if use_stale and os.path.isfile(stale_path):
        install_weights(adapter.transformer, load_file(stale_path))
    state = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=True)
    running.load_state_dict(state["running_std"])
    if trainer is not None:
        trainer.num_updates = state["num_updates"]
        if trainer.sharding == "fsdp":
            set_optimizer_state_dict(trainer.adapter.transformer, trainer.optimizer, state["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
        else:
            trainer.optimizer.load_state_dict(state["optimizer"])
        ema_path = os.path.join(path, "ema.safetensors")
        if trainer.ema is not None and os.path.isfile(ema_path):
            ema = load_file(ema_path)
            with torch.no_grad():
                for e, n in zip(trainer.ema, trainer.names):
                    if hasattr(e, "device_mesh"):  # FSDP: this rank's shard of the full tensor
                        e.copy_(distribute_tensor(ema[n].to(e.dtype), e.device_mesh, e.placements))
                    else:
                        e.copy_(ema[n].to(e.device, e.dtype))
    torch.set_rng_state(state["torch_rng"])
    return state
