"""Checkpoints in the layouts diffusers loads, plus the run state of --resume, written by every
trainer rank: nothing is gathered whole onto one rank.

DIR/checkpoints/step-N/ holds the state after N optimizer updates (policy version N):
- the export, in --export-dtype (bfloat16 by default), in the peers' layouts (checkpointing/export.py,
  docs/peer-formats.md):
  - full fine-tuning: a pipeline folder, transformer/ (config.json + diffusion_pytorch_model
    .safetensors, or with several trainer ranks one file per rank,
    `diffusion_pytorch_model-0000i-of-0000W.safetensors`, and diffusers' index.json) beside
    model_index.json and the untouched components (links to --model-path's), loadable with
    `<Family>Pipeline.from_pretrained(DIR)` or `<Family>Transformer.from_pretrained(DIR, subfolder="transformer")`;
  - LoRA: pytorch_lora_weights.safetensors, loadable with `pipe.load_lora_weights(DIR)`, and a peft
    folder's adapter_config.json + adapter_model.safetensors, loadable with
    `PeftModel.from_pretrained(transformer, DIR)` or `--init-lora DIR`;
  - ema/ (if --ema-decay > 0): the EMA weights in the same layouts, loadable with
    `pipe.load_lora_weights(DIR/ema)` or `scripts/sample.py --checkpoint DIR/ema`;
- state/: the run state of --resume in float32, saved with torch.distributed.checkpoint in
  safetensors files (each trainer rank writes the shards it holds: under FSDP2 its slice of every
  weight, AdamW moment and EMA tensor; replicated tensors are written once): `model.<name>`,
  `ema.<name>`, `optim.<name>.<exp_avg|exp_avg_sq|step>`. It loads back into any sharding, and
  whole (`read_state`);
- trainer_state.pt (update count, RNG, running reward std and the std of the last steps,
  skipped-step counters), config.json (the run's config), state.json (step, version);
- with --tcss, stale.safetensors: the published tensors of version N-1, which the generators hold
  when the trainers reach version N (step N is generated with them), so a resume is exact;
- manifest.json, written last: every file's size and SHA-256 (checkpointing/manifest.py writes the
  folder atomically and verifies it before anything loads).

trainer_state.pt holds only containers, numbers and tensors and is read with
`torch.load(weights_only=True)`; state/ is safetensors: a crafted checkpoint cannot run code.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from checkpointing import manifest as checkpoint_files
from checkpointing.export import EXPORT_DTYPES, LORA_FILE, WEIGHTS_NAME, export_weights
from models.lora import PEFT_CONFIG, apply_lora, read_lora_file
from parallel.fsdp import copy_full, full_tensor
from rl.nonfinite import RunAbort

# Adapters (models.DiTAdapter) are passed in: this module imports no model family.
STALE_FILE = "stale.safetensors"
STATE_DIR = "state"
RESIDUAL = "residual."  # state/ keys of the publication codec's residual (parallel/compress.py)
SAMPLED = "old."  # state/ keys of the weights the generators sample with when an algorithm's trainers keep
#                   them apart from the trained ones (Trainer.sampled_copy: DiffusionNFT's old policy)
EMA_DIR = "ema"
# Test hook: the writer of checkpoint step N SIGKILLs itself after writing the files, before the
# manifest (a crash in the middle of a checkpoint write). Unset in normal runs.
KILL_ENV = "DIGENRL_DEBUG_KILL_IN_SAVE"


def checkpoint_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step-{step}")


def find_checkpoint(run_dir: str, pinned_only: str | None = None) -> checkpoint_files.Found:
    """The newest checkpoint of a run folder whose manifest verifies (`pinned_only`: and that holds
    a KEEP file), and those passed over."""
    return checkpoint_files.find_valid(os.path.join(run_dir, "checkpoints"), pinned_only)


def _read_transformer(path: str) -> dict[str, Tensor]:
    """The exported transformer of a full fine-tune (one file, or several with diffusers' index.json)
    in a checkpoint folder or its ema/, in the export's dtype."""
    sub = os.path.join(path, "transformer")
    single = os.path.join(sub, f"{WEIGHTS_NAME}.safetensors")
    index = os.path.join(sub, f"{WEIGHTS_NAME}.safetensors.index.json")
    if os.path.isfile(single):
        return load_file(single)
    if not os.path.isfile(index):
        raise ValueError(f"checkpoint {path!r} holds neither {LORA_FILE} nor transformer/ weights")
    with open(index) as f:
        names = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for name in names:
        out.update(load_file(os.path.join(sub, name)))
    return out


def verify_checkpoint(path: str) -> dict:
    """A checkpoint folder (checkpoints/step-N, or its ema/) as scripts.sample and scripts.eval read
    it, verified as --resume verifies it (checkpointing/manifest.py): every file step-N's manifest
    lists, with its size and SHA-256. Returns the manifest; a ValueError names the first file that
    does not match, before any model loads."""
    folder = os.path.normpath(path)
    if not os.path.isdir(folder):
        raise ValueError(f"--checkpoint {path!r} is not a folder")
    root = folder
    if os.path.basename(folder) == EMA_DIR and not os.path.isfile(os.path.join(folder, checkpoint_files.MANIFEST)):
        root = os.path.dirname(folder)  # ema/ is listed in its checkpoint's manifest
    try:
        return checkpoint_files.read_manifest(root)
    except ValueError as e:
        raise ValueError(f"--checkpoint {path!r}: {e}; a checkpoint whose bytes are not those its run wrote is not "
                         f"read (another checkpoints/step-N folder of the run, or its ema/)") from None


def load_trained_weights(adapter: "DiTAdapter", path: str) -> None:
    """Sampling from a checkpoint or its ema/ (scripts/sample.py --checkpoint): LoRA through
    diffusers' own loader, a peft folder (a Flow-GRPO checkpoint's lora/) as --init-lora reads it,
    a full fine-tune into the transformer (cast to its dtype)."""
    if os.path.isfile(os.path.join(path, LORA_FILE)):
        adapter.pipe.load_lora_weights(path)
        return
    if os.path.isfile(os.path.join(path, PEFT_CONFIG)):
        lora, dtype = read_lora_file(path), next(adapter.transformer.parameters()).dtype
        apply_lora(adapter.transformer, lora.rank, lora.alpha, lora.lora_targets(), init=lora)
        adapter.transformer.requires_grad_(False).to(dtype)  # sampled in the base's dtype, as diffusers' loader does
        return
    adapter.transformer.load_state_dict(_read_transformer(path), strict=True)


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
            copy_full(params[n], t)


# ----- the run state of --resume: sharded, float32 --------------------------------------------
def _scalar_view(t: Tensor) -> Tensor:
    """safetensors shards hold tensors of at least one dimension: AdamW's step count travels as [1]."""
    return t.reshape(1) if t.dim() == 0 else t


def _optimizer_tensors(trainer, for_load: bool = False) -> tuple[dict, dict[str, Tensor]]:
    """(the optimizer's state dict keyed by parameter name, its tensors flattened to
    `optim.<name>.<key>`, views into it). Saving before the first update writes none (initialising
    the state would count a step); loading initialises it (torch's zero-gradient, zero-lr step) so
    that there are tensors to load into."""
    if not trainer.optimizer.state and not for_load:
        return {}, {}
    osd = get_optimizer_state_dict(trainer.adapter.transformer, trainer.optimizer)
    flat = {f"optim.{name}.{key}": _scalar_view(t) for name, entry in osd["state"].items()
            for key, t in entry.items() if isinstance(t, Tensor)}
    return osd, flat


def _state_tensors(trainer) -> dict[str, Tensor]:
    """Every tensor of the run state this trainer rank holds (its shards under FSDP)."""
    params = dict(trainer.adapter.transformer.named_parameters())
    out = {f"model.{n}": params[n].detach() for n in trainer.names}
    if trainer.ema is not None:
        out.update({f"ema.{n}": e for n, e in zip(trainer.names, trainer.ema)})
    sampled = trainer.sampled_copy()  # what the generators sample with, kept apart from the weights
    if sampled is not None:
        out.update({f"{SAMPLED}{n}": t for n, t in sampled.items()})
    out.update(_optimizer_tensors(trainer)[1])
    if trainer.codec is not None:  # whole tensors, the same on every trainer rank
        out.update({f"{RESIDUAL}{n}": r for n, r in trainer.codec.residual.items()})
    return out


def read_state(path: str, prefix: str = "model.", missing_ok: bool = False) -> dict[str, Tensor]:
    """The whole tensors under `prefix` of a checkpoint's state/ (float32, as trained), read by
    this process alone whatever sharding wrote them ({} if there are none and `missing_ok`)."""
    folder = os.path.join(path, STATE_DIR)
    meta = HuggingFaceStorageReader(folder).read_metadata().state_dict_metadata
    targets = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith(prefix)}
    if not targets:
        if missing_ok:
            return {}
        raise ValueError(f"checkpoint {path!r} holds no {prefix}* tensors in {STATE_DIR}/")
    with warnings.catch_warnings():  # outside a process group torch says it loads in one process: it does
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(folder), no_dist=True)
    return {k[len(prefix):]: v for k, v in targets.items()}


def _load_state(path: str, trainer) -> None:
    """Load this trainer rank's shards of the weights, EMA and AdamW state from state/ in place."""
    folder = os.path.join(path, STATE_DIR)
    saved = set(HuggingFaceStorageReader(folder).read_metadata().state_dict_metadata)
    params = dict(trainer.adapter.transformer.named_parameters())
    targets = {f"model.{n}": params[n].detach() for n in trainer.names}
    if trainer.ema is not None and any(k.startswith("ema.") for k in saved):
        targets.update({f"ema.{n}": e for n, e in zip(trainer.names, trainer.ema)})
    sampled = trainer.sampled_copy()
    if sampled is not None:
        targets.update({f"{SAMPLED}{n}": t for n, t in sampled.items()})
    has_optim = any(k.startswith("optim.") for k in saved)
    osd, flat = _optimizer_tensors(trainer, for_load=True) if has_optim else ({}, {})
    targets.update(flat)
    with torch.no_grad():
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(folder), no_dist=True)
    if has_optim:
        set_optimizer_state_dict(trainer.adapter.transformer, trainer.optimizer, osd)


def save_run_state(out_dir: str, done: int, trainer, adapter, running, lora_config, write: bool, *,
                   extra: dict | None = None, stale: dict[str, Tensor] | None = None, config: dict | None = None,
                   keep: int = 0, export_dtype: str = "bfloat16") -> str | None:
    """After `done` updates, every trainer rank (collectives over the trainer group): each writes
    its shards of the run state and its part of the export into checkpoints/step-`done`.tmp; the
    one with `write` adds the small files, commits the folder atomically and prunes to the newest
    `keep`. `extra` joins trainer_state.pt; `stale` is the TCSS generators' version (done - 1)."""
    path = checkpoint_dir(out_dir, done)
    with _naming_a_full_disk(path, out_dir):  # ENOSPC named with the folder and its free space
        tmp = checkpoint_files.temporary(path)
        if write:
            checkpoint_files.begin(path)
        _barrier(trainer.group)  # the empty folder exists before any rank writes into it
        dcp.save(_state_tensors(trainer), storage_writer=HuggingFaceStorageWriter(os.path.join(tmp, STATE_DIR),
                                                                                save_distributed=True),
                 process_group=trainer.group)
        params = dict(trainer.adapter.transformer.named_parameters())
        dtype = EXPORT_DTYPES[export_dtype]
        export_weights(tmp, adapter, {n: params[n] for n in trainer.names}, lora=trainer.lora, dtype=dtype,
                       group=trainer.group, write=write, lora_config=lora_config, model=config)
        if trainer.ema is not None:
            export_weights(os.path.join(tmp, EMA_DIR), adapter, dict(zip(trainer.names, trainer.ema)),
                           lora=trainer.lora, dtype=dtype, group=trainer.group, write=write, lora_config=lora_config,
                           model=config)
        _barrier(trainer.group)  # every rank's files are complete before the manifest lists them
        if not write:
            return None
        state = {"num_updates": trainer.num_updates, "running_std": running.state_dict(),
                 "torch_rng": torch.get_rng_state(), "step": done, **(extra or {})}
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
        if stale is not None:
            save_file({n: t.detach().cpu().contiguous() for n, t in stale.items()}, os.path.join(tmp, STALE_FILE))
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump({"step": done, "version": done, "lora": trainer.lora}, f)
        if config is not None:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config, f, indent=2)

        def crash_hook(folder: str) -> None:
            if os.environ.get(KILL_ENV, "").strip() == str(done):
                os.kill(os.getpid(), signal.SIGKILL)

        checkpoint_files.commit(path, {"step": done, "version": done, "lora": trainer.lora, "config": config},
                                before_manifest=crash_hook)
        checkpoint_files.prune(os.path.dirname(path), keep, protect=(path,))
        return path


class DiskFull(RunAbort):
    """A checkpoint write ran out of space: the run stops (exit 3) naming the folder and its free
    space, not with the bare CheckpointException DCP raises (the previous checkpoints are whole)."""


def no_space(exc: BaseException) -> bool:
    """`exc`, what caused it or a rank's failure it carries (DCP's CheckpointException) is a full
    disk or quota: ENOSPC or EDQUOT, as an OSError or in the message of a writer that reports the
    OS's error as text (safetensors, torch.save)."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(e) for text in ("No space left on device", "Disk quota exceeded", "StorageFull")):
            return True
        if isinstance(e, CheckpointException):
            todo += [failure[0] for failure in e.failures.values()]
        todo += [e.__cause__, e.__context__]
    return False


@contextlib.contextmanager
def _naming_a_full_disk(path: str, out_dir: str):
    try:
        yield
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
        if not no_space(e):
            raise
        try:
            usage = shutil.disk_usage(out_dir)
            room = f"{_size(usage.free)} free of {_size(usage.total)} on its file system"
        except OSError:
            room = "its free space unknown"
        earlier = [p for _, p in checkpoint_files.step_dirs(os.path.dirname(path)) if p != path]
        then = (f"continue from {os.path.basename(earlier[0])} (it and the earlier checkpoints are whole) with "
                f"--resume {out_dir} --output-dir {out_dir}") if earlier else "launch again (no checkpoint came before)"
        raise DiskFull(f"checkpoint {os.path.basename(path)}: no space left on device (ENOSPC) writing into "
                       f"{os.path.dirname(path)}, {room}: free space (the unfinished "
                       f"{os.path.basename(checkpoint_files.temporary(path))} can go), then {then}") from e


def _size(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _barrier(group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.barrier(group=group)  # sync point: all trainers


def restore_run_state(path: str, adapter, trainer, running, use_stale: bool = False) -> dict:
    """Every rank installs checkpoint `path`'s weights from state/ (with `use_stale`, the TCSS
    generators' version N-1 on top); trainers load their own shards of the weights, the optimizer
    and the EMA. Returns trainer_state.pt (its "step" is the checkpoint's)."""
    if trainer is None:  # a generator installs what it samples with: a sampled copy if any, else the weights
        install_weights(adapter.transformer, read_state(path, SAMPLED, missing_ok=True) or read_state(path, "model."))
    else:
        _load_state(path, trainer)
    stale_path = os.path.join(path, STALE_FILE)
    if use_stale and os.path.isfile(stale_path):
        install_weights(adapter.transformer, load_file(stale_path))
    state = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=True)
    running.load_state_dict(state["running_std"])
    if trainer is not None:
        trainer.num_updates = state["num_updates"]
    torch.set_rng_state(state["torch_rng"])
    return state
