"""Checkpoint folders that are complete or absent: atomic writes, manifests, verification, pruning.

A checkpoint is written into `step-N.tmp/`; every file is fsync'd, then `manifest.json` (each file's
size and SHA-256, plus what the writer adds: step, run config) is written and fsync'd last, the
folder is renamed to `step-N/` and the parent folder fsync'd. A crash at any moment leaves either
the previous checkpoints untouched and a `.tmp` folder that nothing loads, or the complete new one.

Loading trusts nothing: `find_valid` verifies the manifest of each `step-N/`, newest first (its
files' sizes and hashes, and that it records step N: a folder copied in under another step's name
is not that step), and returns the newest that passes with the list of those it skipped and why.
A process verifies a folder once while its files stay unchanged (the command line and validation
both look for the checkpoint a resume continues). Pure file-system code: no torch, no process group.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field

MANIFEST = "manifest.json"
FORMAT = 2  # 2: the run state in state/ (sharded safetensors), the export in --export-dtype
PIN_FILE = "KEEP"  # a checkpoint folder holding a file of this name is never pruned
_STEP_DIR = re.compile(r"step-(\d+)")
_CHUNK = 1 << 20
_VERIFIED: dict[str, tuple[tuple, dict]] = {}  # folder -> (its files' stat signature, verified manifest)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    """Make a folder's entries (creations, renames) durable. A no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj) -> None:
    """Write JSON beside `path`, fsync it, rename it over `path`: readers see the old or the new file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _files_under(root: str) -> list[str]:
    out = []
    for folder, _, names in os.walk(root):
        for name in names:
            out.append(os.path.relpath(os.path.join(folder, name), root))
    return sorted(out)


def temporary(final: str) -> str:
    """The folder a checkpoint is written into before `commit` renames it to `final`."""
    return final + ".tmp"


def begin(final: str) -> str:
    """Create the empty temporary folder of checkpoint `final` (removing a stale one) and return it."""
    tmp = temporary(final)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def commit(final: str, meta: dict, before_manifest=None) -> None:
    """Finish checkpoint `final` once every file is in its temporary folder (written by any number
    of processes): fsync them, write the manifest last (`meta` beside the file list), rename the
    folder to `final`. `before_manifest(tmp)` runs after the files and before the manifest (a test
    hook). An existing `final` is replaced only once the new folder is complete."""
    tmp = temporary(final)
    files = {}
    for rel in _files_under(tmp):
        path = os.path.join(tmp, rel)
        fsync_file(path)
        files[rel] = {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}
    for folder, _, _ in os.walk(tmp):
        fsync_dir(folder)
    if before_manifest is not None:
        before_manifest(tmp)
    write_json_atomic(os.path.join(tmp, MANIFEST), {"format": FORMAT, "files": files, **meta})
    fsync_dir(tmp)
    old = None
    if os.path.exists(final):
        old = f"{final}.old-{os.getpid()}-{int(time.time())}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_atomic(final: str, write_files, meta: dict, before_manifest=None) -> None:
    """Create the checkpoint folder `final` atomically from one process: `write_files(tmp)` writes
    the content into the temporary folder, then `commit`."""
    write_files(begin(final))
    commit(final, meta, before_manifest)


def _signature(path: str, files) -> tuple | None:
    """(name, size, mtime, inode) of the manifest and every file it lists; None if one is missing."""
    try:
        return tuple((rel, st.st_size, st.st_mtime_ns, st.st_ino)
                     for rel in (MANIFEST, *sorted(files)) for st in [os.stat(os.path.join(path, rel))])
    except OSError:
        return None


def read_manifest(path: str) -> dict:
    """The manifest of a checkpoint folder, verified: every file it lists exists with its size and
    SHA-256. ValueError naming the first problem otherwise."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        raise ValueError(f"no {MANIFEST} (the write did not finish)")
    try:
        with open(file) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ValueError(f"{MANIFEST} is damaged ({e})") from None
    cached = _VERIFIED.get(os.path.abspath(path))
    signature = _signature(path, files) if isinstance(files, dict) else None
    if cached is not None and signature is not None and cached[0] == signature:
        return json.loads(json.dumps(cached[1]))  # a copy: callers may change theirs
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{MANIFEST} has format {manifest.get('format')!r}, this version reads {FORMAT}")
    for rel, entry in files.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise ValueError(f"{rel} is missing")
        size = os.path.getsize(full)
        if size != entry["bytes"]:
            raise ValueError(f"{rel} has {size} bytes, the manifest says {entry['bytes']}")
        if sha256_file(full) != entry["sha256"]:
            raise ValueError(f"{rel} does not match its SHA-256 in the manifest")
    if signature is not None:
        _VERIFIED[os.path.abspath(path)] = (signature, json.loads(json.dumps(manifest)))
    return manifest


@dataclass
class Found:
    """The newest valid checkpoint (`path` None when there is none) and the folders passed over."""

    path: str | None
    step: int | None
    manifest: dict | None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (folder, why)

    def skipped_text(self) -> str:
        return "; ".join(f"{p} ({why})" for p, why in self.skipped)


def step_dirs(root: str) -> list[tuple[int, str]]:
    """(step, path) of every `step-N` folder under `root`, newest first (`.tmp` folders excluded)."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, d)) for d in os.listdir(root)
             if (m := _STEP_DIR.fullmatch(d)) and os.path.isdir(os.path.join(root, d))]
    return sorted(found, reverse=True)


def unfinished_dirs(root: str) -> list[str]:
    """Folders a writer left behind: `step-N.tmp` (an unfinished write) and `step-N.old-*`."""
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, d) for d in os.listdir(root)
                  if re.fullmatch(r"step-\d+\.(tmp|old-.*)", d))


def find_valid(root: str, pinned_only: str | None = None) -> Found:
    """The newest `step-N/` under `root` whose manifest verifies; newer ones that fail are listed
    in `skipped` with the reason, and so are unfinished writes. `pinned_only`: only folders holding
    a KEEP file count, the others are skipped for this reason (a live run's, which it may prune)."""
    skipped = [(p, "an unfinished write") for p in unfinished_dirs(root)]
    for step, path in step_dirs(root):
        if pinned_only and not os.path.exists(os.path.join(path, PIN_FILE)):
            skipped.append((path, pinned_only))
            continue
        try:
            manifest = read_manifest(path)
        except ValueError as e:
            skipped.append((path, str(e)))
            continue
        if manifest.get("step") != step:
            skipped.append((path, f"its {MANIFEST} records step {manifest.get('step')}, not {step}: a copy of another "
                                  f"checkpoint under this name"))
            continue
        return Found(path, step, manifest, skipped)
    return Found(None, None, None, skipped)


def prune(root: str, keep: int, protect: tuple[str, ...] = ()) -> list[str]:
    """Remove all but the newest `keep` checkpoints (0: keep all). Pinned folders (a KEEP file
    inside) stay and do not count toward `keep`; `protect` counts but is never removed. Returns the
    removed folders."""
    if keep <= 0:
        return []
    removed, kept = [], 0
    protect = {os.path.abspath(p) for p in protect}
    for _, path in step_dirs(root):
        if os.path.exists(os.path.join(path, PIN_FILE)):
            continue
        kept += 1
        if kept > keep and os.path.abspath(path) not in protect:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
