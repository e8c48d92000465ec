"""One run per folder, never mixed (README, "Reliability").

- A run refuses an --output-dir that already holds a run's files (RUN_ENTRIES), unless --resume
  continues the run in that very folder or --overwrite removes them first. Other files (a SLURM
  log, a launcher's stdout) neither count nor get removed.
- --resume takes the newest checkpoint whose manifest verifies (checkpoint_files.find_valid), names
  the ones it passed over, checks that the checkpoint was trained with the same model, LoRA and
  algorithm (everything that changes what its weights mean) and that --steps leaves work to do.
- Continuing in the same folder cuts the run back to the checkpoint: metrics.jsonl keeps the rows
  up to it (the later ones move to discarded/), newer checkpoints, unfinished writes and later
  sample grids move to discarded/ too, and TensorBoard purges the later events (telemetry/metrics.py).

`check` runs inside RunConfig.validate on every rank, before anything loads; `prepare` runs once,
on rank 0, before any other rank writes into the folder.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass

from checkpointing import checkpoint
from checkpointing import files as checkpoint_files

RUN_ENTRIES = ("config.json", "metrics.jsonl", "tb", "trace", "checkpoints", "samples", "eval", "discarded")
# (section, field, flag): settings that change what a checkpoint's weights mean
WEIGHT_MEANING = (("model", "model", "--model"), ("model", "model_path", "--model-path"),
                  ("model", "preset", "--preset"), ("optim", "lora_rank", "--lora-rank"),
                  ("optim", "lora_alpha", "--lora-alpha"), ("optim", "lora_targets", "--lora-targets"),
                  ("rl", "algorithm", "--algorithm"), ("sampling", "sde_type", "--sde-type"))


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues from."""

    path: str
    step: int
    skipped: tuple[tuple[str, str], ...]  # (folder, why) of newer folders passed over
    same_folder: bool  # the run continues in the folder it resumes from
    config: dict  # the checkpoint's run config
    has_stale: bool  # written with --tcss: holds the generators' version step - 1


def _meaning(cfg: dict, section: str, name: str):
    value = cfg.get(section, {}).get(name)
    if name == "lora_alpha" and value is None:
        rank = cfg.get("optim", {}).get("lora_rank", 0)
        return 2 * rank if rank else None
    if name == "model_path" and value:
        return os.path.realpath(value)
    if name == "preset" and cfg.get("model", {}).get("model_path"):
        return None  # a model folder: the preset plays no part
    return value


def config_differences(saved: dict, current: dict) -> list[str]:
    """The settings that change the weights' meaning and differ: ['--lora-rank 4 (this run: 8)', ...]."""
    out = []
    for section, name, flag in WEIGHT_MEANING:
        a, b = _meaning(saved, section, name), _meaning(current, section, name)
        if a != b:
            out.append(f"{flag} {a} (this run: {b})")
    return out


def _entries(folder: str) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def check(cfg) -> ResumePoint | None:
    """Every error about the run folder and --resume, before anything loads (ValueError naming it)."""
    o = cfg.output
    out = o.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--output-dir {out!r} is a file, not a folder")
    resume = None
    if o.resume:
        if not os.path.isdir(o.resume):
            raise ValueError(f"--resume {o.resume!r} is not a folder")
        found = checkpoint.find_checkpoint(o.resume)
        if found.path is None:
            why = f": skipped {found.skipped_text()}" if found.skipped else " (no checkpoints/step-N folder)"
            raise ValueError(f"--resume {o.resume!r} holds no valid checkpoint{why}")
        saved = found.manifest.get("config") or {}
        differences = config_differences(saved, cfg.to_dict())
        if differences:
            raise ValueError(f"--resume {found.path}: the checkpoint was trained with " + ", ".join(differences)
                             + "; these change what its weights mean")
        if cfg.rl.steps <= found.step:
            raise ValueError(f"--steps {cfg.rl.steps} is not above the step of the checkpoint {found.path} "
                             f"({found.step}): there is nothing to train; raise --steps")
        resume = ResumePoint(found.path, found.step, tuple(found.skipped), _same(o.resume, out), saved,
                             checkpoint.STALE_FILE in found.manifest.get("files", {}))
    held = [e for e in _entries(out) if e in RUN_ENTRIES]  # a launcher's logs beside them do not count
    if held and not o.overwrite and not (resume and resume.same_folder):
        listed = ", ".join(held[:5]) + (" ..." if len(held) > 5 else "")
        raise ValueError(f"--output-dir {out!r} already holds a run ({listed}): continue its run with --resume {out} "
                         f"--output-dir {out}, start over with --overwrite (removes its run files), or choose "
                         f"another folder")
    if o.overwrite and resume and resume.same_folder:
        raise ValueError(f"--overwrite would delete the checkpoints --resume {o.resume!r} continues from")
    return resume


def prepare(cfg, resume: ResumePoint | None, say=print) -> None:
    """Rank 0, before any rank writes: clear (--overwrite) or cut back (resume in place), then
    write config.json."""
    out = cfg.output.output_dir
    os.makedirs(out, exist_ok=True)
    if cfg.output.overwrite:
        removed = [e for e in RUN_ENTRIES if os.path.lexists(os.path.join(out, e))]
        for e in removed:
            path = os.path.join(out, e)
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        if removed:
            say(f"--overwrite: removed {', '.join(removed)} from {out}")
    elif resume is not None and resume.same_folder:
        cut_back(out, resume.step, say)
    if resume is not None:
        for path, why in resume.skipped:
            say(f"resume: skipped {path}: {why}")
        say(f"resume: continuing from {resume.path} (step {resume.step})")
    checkpoint_files.write_json_atomic(os.path.join(out, "config.json"), cfg.to_dict())


def is_eval_row(row: dict) -> bool:
    """An evaluation record (logged at the version it evaluates), not a training step's."""
    keys = [k for k in row if k not in ("step", "time")]
    return bool(keys) and all(k.startswith("eval/") for k in keys)


def kept_row(row: dict, step: int) -> bool:
    """Rows a run resumed at checkpoint `step` keeps: training steps before it, evaluations up to it."""
    return row["step"] <= step if is_eval_row(row) else row["step"] < step


def cut_back(out: str, step: int, say=print) -> str | None:
    """Move everything a run wrote past checkpoint `step` into discarded/<time>-step-<step>/."""
    aside = os.path.join(out, "discarded", time.strftime("%Y%m%d-%H%M%S") + f"-resume-at-step-{step}")
    moved: list[str] = []

    def move(path: str, rel: str) -> None:
        target = os.path.join(aside, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.move(path, target)
        moved.append(rel)

    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.isfile(metrics):
        keep, drop = [], []
        with open(metrics) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    drop.append(line)  # a torn last line of a killed run
                    continue
                (keep if kept_row(row, step) else drop).append(line)
        if drop:
            os.makedirs(aside, exist_ok=True)
            with open(os.path.join(aside, "metrics.jsonl"), "w") as f:
                f.writelines(line if line.endswith("\n") else line + "\n" for line in drop)
            tmp = metrics + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(line if line.endswith("\n") else line + "\n" for line in keep)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, metrics)
            moved.append(f"metrics.jsonl ({len(drop)} rows)")
    root = os.path.join(out, "checkpoints")
    for s, path in checkpoint_files.step_dirs(root):
        if s > step:
            move(path, os.path.join("checkpoints", os.path.basename(path)))
    for path in checkpoint_files.unfinished_dirs(root):
        move(path, os.path.join("checkpoints", os.path.basename(path)))
    for tag, first_dropped in (("samples", step), ("eval", step + 1)):
        folder = os.path.join(out, tag)
        for name in _entries(folder):
            m = re.fullmatch(r"step-(\d+)\.(png|txt)", name)
            if m and int(m.group(1)) >= first_dropped:
                move(os.path.join(folder, name), os.path.join(tag, name))
    if moved:
        say(f"resume: moved what the run wrote after step {step} to {aside}: {', '.join(moved[:6])}"
            + (" ..." if len(moved) > 6 else ""))
        return aside
    return None


def rows_to_replay(out: str, step: int) -> list[dict]:
    """Kept rows at or after `step` (evaluations of the checkpoint's version): TensorBoard purges
    every event from `step` on, so they are written to it again."""
    metrics = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(metrics):
        return []
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["step"] >= step]
