"""What a checkpoint is of: the run record that config.json and every checkpoint carry, and what a
resume may change (docs/reliability.md).

The record (`run` in config.json and in each checkpoint's config): the run's id, drawn when it
starts and kept by every resume; the SHA-256 of the prompt files as it read them; and `resumes`,
one entry per resume: the step it continued from, the checkpoint, and every setting it changed
({"optim.lr": [old, new]}). A checkpoint carries the record of the branch that wrote it, so
config.json always tells which settings trained which steps.

A resume compares three things, all before anything loads:
- the checkpoint against the command (whose config starts from the checkpoint's, config/cli.py):
  a change of what the weights mean (model, LoRA shape, the adapter --init-lora started from,
  algorithm, sampler: `WEIGHT_MEANING`) is refused; a change of the data or the update (seed,
  prompts and their content, rewards, the optimizer, sampling, TCSS, a lossy codec) needs
  --resume-anyway; placement, --steps, logging and checkpointing change freely
  (placement-invariant runs train the same weights);
- the checkpoint against the run in the folder it comes from (that folder's config.json): one
  written by another run (another run id, or without ids another seed or prompt file) needs
  --resume-anyway;
- the checkpoint's own step against its folder's name (checkpointing/manifest.py).
Pure dict and file code: no torch, no process group.
"""
from __future__ import annotations

import json
import os
import time
import uuid

# (section, field, flag): settings that change what a checkpoint's weights mean
WEIGHT_MEANING = (("model", "model", "--model"), ("model", "model_path", "--model-path"),
                  ("model", "preset", "--preset"), ("optim", "lora_rank", "--lora-rank"),
                  ("optim", "lora_alpha", "--lora-alpha"), ("optim", "lora_targets", "--lora-targets"),
                  ("optim", "init_lora", "--init-lora"),
                  ("rl", "algorithm", "--algorithm"), ("sampling", "sde_type", "--sde-type"))
FREE = {"rl.steps", "rl.micro_batch", "model.attention", "model.device", "optim.grad_checkpointing",
        "optim.max_skipped_steps"}
"""besides every output.* field and every topology.* field but TRAINING_TOPOLOGY: what a resume
changes without --resume-anyway (how long, where and how fast it runs, what it logs)"""
TRAINING_TOPOLOGY = {"topology.tcss", "topology.publish_compression"}
"""placement flags that change what is trained: staleness and lossy publication"""
PATHS = {"model.model_path", "rl.prompts", "output.eval_prompts", "optim.init_lora"}


def flag(key: str) -> str:
    """'optim.lr' -> '--lr'."""
    return "--" + key.rpartition(".")[2].replace("_", "-")


def _meaning(cfg: dict, section: str, name: str):
    value = cfg.get(section, {}).get(name)
    if name == "lora_alpha" and value is None:
        rank = cfg.get("optim", {}).get("lora_rank", 0)
        return 2 * rank if rank else None
    if name in ("model_path", "init_lora") and value:
        return os.path.realpath(value)
    if name == "preset" and cfg.get("model", {}).get("model_path"):
        return None  # a model folder: the preset plays no part
    return value


def config_differences(saved: dict, current: dict, model_bytes: list[str] | None = None) -> list[str]:
    """The settings that change the weights' meaning and differ: ['--lora-rank 4 (this run: 8)', ...].
    `model_bytes`: the base model's files whose bytes differ from the checkpoint's record
    (checkpointing/digests.differences; [] the same bytes): they, not the folder's path, decide;
    None where there is no record to compare (a preset, an older run): the path stands for them."""
    out = []
    for section, name, flag_name in WEIGHT_MEANING:
        if name == "model_path" and model_bytes is not None:
            if model_bytes:
                more = f" and {len(model_bytes) - 3} more" if len(model_bytes) > 3 else ""
                shown = ", ".join(model_bytes[:3]) + more
                out.append(f"other base model bytes: {shown} in --model-path {current['model']['model_path']} since "
                           f"the checkpoint")
            continue
        a, b = _meaning(saved, section, name), _meaning(current, section, name)
        if a != b:
            out.append(f"{flag_name} {a} (this run: {b})")
    return out


def flatten(cfg: dict) -> dict:
    """{"seed": 0, "optim.lr": 3e-4, ...}; lists as tuples are lists (JSON), paths resolved."""
    out = {"seed": cfg.get("seed")} if "seed" in cfg else {}
    for section, table in cfg.items():
        if isinstance(table, dict) and section != "run":
            for name, value in table.items():
                key = f"{section}.{name}"
                value = list(value) if isinstance(value, tuple) else value
                out[key] = os.path.realpath(value) if key in PATHS and isinstance(value, str) else value
    return out


def changes(saved: dict, current: dict, ignore=frozenset()) -> dict:
    """Every setting that differs, {key: [checkpoint's, this run's]}, `ignore` ((section, field)) left out."""
    skip = {f"{s}.{n}" for s, n in ignore}
    a, b = flatten(saved), flatten(current)
    return {k: [a.get(k), b[k]] for k in b if k not in skip and k in a and a[k] != b[k]}


def free(key: str) -> bool:
    return key in FREE or key.startswith("output.") or (key.startswith("topology.") and key not in TRAINING_TOPOLOGY)


def needs_anyway(changed: dict, saved_run: dict, prompts_sha256: str | None, same_model: bool = False) -> list[str]:
    """The changes only --resume-anyway allows, named: ['--seed 1 (this run: 0)', ...].
    `same_model`: the model folder holds the checkpoint's bytes, wherever it is now."""
    skip = {"model.model_path"} if same_model else set()
    out = [f"{flag(k)} {old} (this run: {new})" for k, (old, new) in changed.items() if not free(k) and k not in skip]
    then = saved_run.get("prompts_sha256")
    if then and prompts_sha256:
        if then != prompts_sha256:
            out.append(f"the prompt file's content (SHA-256 {then[:12]} at the checkpoint, {prompts_sha256[:12]} now)")
        elif "rl.prompts" in changed:  # the same bytes under another name: the same prompts
            out = [x for x in out if not x.startswith("--prompts ")]
    return out


def foreign(folder: str, saved: dict) -> list[str]:
    """Why the checkpoint `saved` (its config) is not of the run in `folder` (that folder's
    config.json), [] when it is or the folder has no config.json."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            run = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume {folder!r}: {path} cannot be read ({e}); it tells which run the folder "
                         f"holds") from None
    mine, theirs = run.get("run") or {}, saved.get("run") or {}
    out = []
    if mine.get("id") and theirs.get("id") and mine["id"] != theirs["id"]:
        out.append(f"run id {theirs['id'][:12]} (the folder's run: {mine['id'][:12]})")
    if not (mine.get("id") and theirs.get("id")) or out:
        a, b = flatten(saved), flatten(run)
        out += [f"{flag(k)} {a.get(k)} (the folder's run: {b.get(k)})" for k in ("seed", "rl.prompts")
                if k in a and k in b and a[k] != b[k]]
    return out


def new_record(digests: dict) -> dict:
    """The record of a run that starts at step 0."""
    return {"id": uuid.uuid4().hex, "started": time.strftime("%Y-%m-%d %H:%M:%S"), **digests, "resumes": []}


def continued_record(saved_run: dict, digests: dict, step: int, source: str, changed: dict,
                     anyway: list[str]) -> dict:
    """The checkpoint's record (a new id if it has none: an older checkpoint) with this resume added."""
    base = saved_run or {"id": uuid.uuid4().hex, "started": None}
    event = {"step": step, "from": source, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "changed": changed}
    if anyway:
        event["resume_anyway"] = anyway
    return {**base, **digests, "resumes": [*base.get("resumes", []), event]}
