"""One run per folder, never mixed (README, "Reliability").

- Before anything loads, every rank checks the output folder: a file where a folder should be,
  a folder it cannot create or write into (a probe file), a path too long for the deepest file
  the run writes there, and the folder's lock (checkpointing/lock.py: a live run's folder is
  refused, --overwrite and --resume included).
- A run refuses an --output-dir that already holds a run's files (RUN_ENTRIES), unless --resume
  continues the run in that very folder or --overwrite removes them first. Other files (a SLURM
  log, a launcher's stdout) neither count nor get removed.
- --resume takes the newest checkpoint whose manifest verifies (checkpoint_files.find_valid), names
  the ones it passed over, and checks it against the command and the run it came from
  (checkpointing/runrecord.py), and that --steps leaves work to do.
- Continuing in the same folder cuts the run back to the checkpoint: metrics.jsonl keeps the rows
  up to it (the later ones move to discarded/), newer checkpoints, unfinished writes, later
  sample grids and the previous config.json move to discarded/ too, and TensorBoard purges the
  later events (telemetry/metrics.py).

`check` runs inside config.validate on every rank, before anything loads; rank 0 takes the lock
right after it (train_disagg.py), and `prepare` runs on rank 0 once every rank has loaded its
model and passed the checks that need it, before any rank writes into the folder: a run that
fails on a user error leaves no config.json behind, and the corrected command runs as is.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass

from checkpointing import checkpoint, digests, lock
from checkpointing import manifest as checkpoint_files
from checkpointing import runrecord

RUN_ENTRIES = ("config.json", "metrics.jsonl", "tb", "trace", "checkpoints", "samples", "eval", "discarded")
DEEPEST = os.path.join("discarded", "20990101-000000-resume-at-step-{steps}", "checkpoints", "step-{steps}.tmp", "ema",
                       "transformer", "diffusion_pytorch_model-00001-of-00064.safetensors.index.json")
"""longer than any path the run writes under its folder (a checkpoint's export shards, moved aside)"""


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues from."""

    path: str
    step: int
    skipped: tuple[tuple[str, str], ...]  # (folder, why) of newer folders passed over
    same_folder: bool  # the run continues in the folder it resumes from
    config: dict  # the checkpoint's run config
    has_stale: bool  # written with --tcss: holds the generators' version step - 1
    changed: dict  # {setting: [the checkpoint's, this run's]}: what config.json's history records
    anyway: tuple[str, ...] = ()  # the differences --resume-anyway let through
    notes: tuple[str, ...] = ()  # what rank 0 says about the resume (a moved model folder)


def _entries(folder: str) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def same_folder(a: str, b: str) -> bool:
    """`a` and `b` are one folder: the same (device, inode), whatever names lead there (a symlink,
    a bind mount or another mount of it, which realpath cannot see through)."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def check_writable(out: str, steps: int) -> None:
    """The run can create `out` and write into it, and its deepest path fits the file system:
    ValueError naming the folder and the reason otherwise. Creates nothing but a probe file
    (removed at once) in `out` or its nearest existing parent."""
    existing, missing = out, []
    while not os.path.lexists(existing):
        parent = os.path.dirname(existing.rstrip("/")) or "."
        missing.append(os.path.basename(existing.rstrip("/")))
        existing = parent
    if not os.path.isdir(existing):
        raise ValueError(f"--output-dir {out!r}: {existing!r} is {'a file' if os.path.exists(existing) else 'a broken link'}, "
                         f"not a folder")
    name_max, path_max = _limit(existing, "PC_NAME_MAX", 255), _limit(existing, "PC_PATH_MAX", 4096)
    for name in missing:
        if len(name.encode()) > name_max:
            raise ValueError(f"--output-dir {out!r}: the folder name {name[:32]!r}... has {len(name.encode())} bytes; "
                             f"this file system allows {name_max}")
    deepest = os.path.join(out, DEEPEST.format(steps=steps))
    if len(deepest.encode()) >= path_max:
        raise ValueError(f"--output-dir {out!r} is too long ({len(out.encode())} bytes): the run writes paths of up to "
                         f"{len(deepest.encode())} bytes under it, and this file system takes {path_max - 1}")
    probe = os.path.join(existing, f".digenrl-write-probe-{socket.gethostname()}-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        raise ValueError(f"--output-dir {out!r}: cannot write into {existing!r} ({e.strerror}): a read-only file "
                         f"system, a full disk or no permission") from None


def _limit(path: str, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):
        return default


def check(cfg, prompts_sha256: str | None = None, not_carried=frozenset(), model_digest: dict | None = None
          ) -> ResumePoint | None:
    """Every error about the run folder and --resume, before anything loads (ValueError naming it).
    `prompts_sha256`: the training prompts as this run read them; `not_carried`: settings a resume
    neither compares nor records (where the run goes, the test hooks); `model_digest`: the model
    folder's bytes (checkpointing/digests.py)."""
    o = cfg.output
    out = o.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--output-dir {out!r} is a file, not a folder")
    check_writable(out, cfg.rl.steps)
    lock.check(out, o.overwrite)  # a live run's folder: refused on every rank alike
    resume = _resume_point(cfg, prompts_sha256, not_carried, model_digest) if o.resume else None
    held = [e for e in _entries(out) if e in RUN_ENTRIES]  # a launcher's logs beside them do not count
    if held and not o.overwrite and not (resume and resume.same_folder):
        listed = ", ".join(held[:5]) + (" ..." if len(held) > 5 else "")
        raise ValueError(f"--output-dir {out!r} already holds a run ({listed}): continue its run with --resume {out} "
                         f"--output-dir {out}, start over with --overwrite (removes its run files), or choose "
                         f"another folder")
    if o.overwrite and resume and resume.same_folder:
        raise ValueError(f"--overwrite would delete the checkpoints --resume {o.resume!r} continues from"
                         + ("" if os.path.realpath(o.resume) == os.path.realpath(out) else
                            f" ({o.resume!r} and --output-dir {out!r} are one folder)"))
    if resume and resume.same_folder:
        check_metrics(out)  # cut back and replayed once the model has loaded: its bytes are checked now
    return resume


def _source(resume_dir: str, output_dir: str) -> tuple[str | None, str | None]:
    """(why each unpinned checkpoint is passed over, the refusal when none is pinned) when another
    run lives in the folder --resume reads (it prunes its checkpoints as it goes); (None, None)
    when no run does, or when it is this run's own folder (whose lock `check` judged)."""
    if same_folder(resume_dir, output_dir):
        return None, None
    kind, record = lock.state(resume_dir)
    if kind not in ("live", "elsewhere"):
        return None, None
    who = lock.describe(record) + (", a host this one cannot check" if kind == "elsewhere" else "")
    skip = f"not pinned, and the live run in {resume_dir} ({who}) may prune it"
    refuse = (f"--resume {resume_dir!r} is the folder of a live run, {who}, which prunes its checkpoints as it goes, "
              f"and none of them is pinned: pin the one to continue from (a file named {checkpoint_files.PIN_FILE} in "
              f"its folder, e.g. touch {os.path.join(resume_dir, 'checkpoints', 'step-N', checkpoint_files.PIN_FILE)}: "
              f"never pruned), copy it to a folder of its own, or wait for that run to end")
    return skip, refuse


def _resume_point(cfg, prompts_sha256: str | None, not_carried, model_digest: dict | None = None) -> ResumePoint:
    """The checkpoint --resume continues from, checked against the command and its own run."""
    o = cfg.output
    if not os.path.isdir(o.resume):
        raise ValueError(f"--resume {o.resume!r} is not a folder")
    skip, refuse = _source(o.resume, o.output_dir)
    found = checkpoint.find_checkpoint(o.resume, pinned_only=skip)
    if found.path is None:
        if refuse and any(why == skip for _, why in found.skipped):
            raise ValueError(refuse)
        why = f": skipped {found.skipped_text()}" if found.skipped else " (no checkpoints/step-N folder)"
        raise ValueError(f"--resume {o.resume!r} holds no valid checkpoint{why}")
    saved, current = found.manifest.get("config") or {}, cfg.to_dict()
    model_bytes = digests.differences((saved.get("run") or {}).get("model_digest"), model_digest)
    differences = runrecord.config_differences(saved, current, model_bytes)
    if differences:
        raise ValueError(f"--resume {found.path}: the checkpoint was trained with " + ", ".join(differences)
                         + "; these change what its weights mean")
    if cfg.rl.steps <= found.step:
        raise ValueError(f"--steps {cfg.rl.steps} is not above the step of the checkpoint {found.path} "
                         f"({found.step}): there is nothing to train; raise --steps")
    changed = runrecord.changes(saved, current, not_carried)
    anyway = runrecord.needs_anyway(changed, saved.get("run") or {}, prompts_sha256, same_model=model_bytes == [])
    other = runrecord.foreign(o.resume, saved)
    if (anyway or other) and not getattr(o, "resume_anyway", False):
        why = [f"it was not written by the run in {o.resume} ({'; '.join(other)})"] if other else []
        why += [f"this run changes {', '.join(anyway)}"] if anyway else []
        raise ValueError(f"--resume {found.path}: {' and '.join(why)}; resume with --resume-anyway to go on with "
                         f"this run's settings (config.json records the change at step {found.step})")
    notes = ()
    if model_bytes == [] and "model.model_path" in changed:
        was, now = changed["model.model_path"]
        notes = (f"--model-path {now} holds the bytes the checkpoint was trained on, in {was} then (a moved or "
                 f"copied folder): going on",)
    return ResumePoint(found.path, found.step, tuple(found.skipped), same_folder(o.resume, o.output_dir), saved,
                       checkpoint.STALE_FILE in found.manifest.get("files", {}), changed, tuple(other + anyway), notes)


def check_metrics(out: str) -> None:
    """A resume in place reads the folder's metrics.jsonl: every line UTF-8 JSON, each whole row
    an object with an integer step (a torn last line of a killed run is set aside, not an error).
    ValueError naming the file and line otherwise, before the model loads."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: line {n} holds the byte 0x{raw[e.start]:02x}, not UTF-8 ({e.reason}); a run "
                                 f"writes it as UTF-8 JSON: repair the line or remove it, then resume") from None
            try:
                row = json.loads(line) if line.strip() else {"step": 0}
            except ValueError:
                continue  # a torn line: cut_back sets it aside
            if not isinstance(row, dict) or isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int):
                raise ValueError(f"{path}: line {n} is not a row this program wrote (an object with an integer "
                                 f"'step'): repair the line or remove it, then resume")


def prepare(cfg, resume: ResumePoint | None, digests: dict, say=print) -> dict:
    """Rank 0, once every rank has loaded and passed its checks, before any rank writes: clear
    (--overwrite) or cut back (resume in place), then write config.json with the run record
    (runrecord: the id, the prompt files' digests, the history of resumes), which it returns."""
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
    if resume is None:
        record = runrecord.new_record(digests)
    else:
        for path, why in resume.skipped:
            say(f"resume: skipped {path}: {why}")
        for why in resume.anyway:
            say(f"resume: --resume-anyway: {why}")
        for note in resume.notes:
            say(f"resume: {note}")
        say(f"resume: continuing from {resume.path} (step {resume.step})")
        record = runrecord.continued_record(resume.config.get("run") or {}, digests, resume.step, resume.path,
                                            resume.changed, list(resume.anyway))
    cfg.save(os.path.join(out, "config.json"), record)
    return record


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
        if os.path.isfile(os.path.join(out, "config.json")):  # the run's description before this resume
            shutil.copy2(os.path.join(out, "config.json"), os.path.join(aside, "config.json"))
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
