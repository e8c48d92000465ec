"""One live run per folder: DIR/run.lock names the process that holds the folder (docs/reliability.md).

Rank 0 takes the lock before it writes anything into the folder, holds it for the run's life and
removes it on every way out that runs code (train_disagg.shutdown, the guard's exits). A run
killed without warning (kill -9, a lost node) leaves the file behind, naming its host and pid:

- on this host, a holder whose process is gone (or whose pid now names a younger process, or a
  boot ago) is stale: the next run names it and takes the lock over;
- on another host nothing here can tell whether the holder lives: the run refuses, names the host
  and pid, and says how to free the folder (remove the file once that run is known to be gone);
- a holder of the same job (TORCHELASTIC_RUN_ID, else MASTER_ADDR:MASTER_PORT) is this run: the
  ranks of one job read the lock their rank 0 took, and a restarted rank 0 takes it back.

Every rank reads the lock before anything loads (`check`), so a folder a live run holds is refused
on every rank alike, --overwrite and --resume included. The file appears whole or not at all
(written beside, then hard-linked into place, which fails if another run linked first). Pure file
system code: no torch, no process group.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time

LOCK = "run.lock"
_HELD: list[str] = []  # the lock files this process holds


def job_id() -> str:
    """What every rank of one launch shares and another launch does not."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        return f"torchrun {run}"
    if os.environ.get("MASTER_PORT"):
        return f"{os.environ.get('MASTER_ADDR', '')}:{os.environ['MASTER_PORT']}"
    return f"pid {os.getpid()}"


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, /proc), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def holder() -> dict:
    """This process, as a lock file records it."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "boot": _boot_id(),
            "start_ticks": _start_ticks(os.getpid()), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv[1:])[:300]}


def read(folder: str) -> dict | None:
    """The record of DIR/run.lock, None when there is none; ValueError when it is not one."""
    path = os.path.join(folder, LOCK)
    try:
        with open(path) as f:
            record = json.load(f)
        if not isinstance(record, dict) or not {"host", "pid", "job"} <= set(record):
            raise ValueError("not a lock record")
        return record
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a lock this program wrote ({e}): remove it if no run uses "
                         f"{folder!r}") from None


def alive(record: dict) -> bool:
    """The holder, a process of this host, still runs: its pid exists, started when the lock says
    (a reused pid does not count), in this boot."""
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if record.get("boot") and _boot_id() and record["boot"] != _boot_id():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    ticks = _start_ticks(pid)
    if record.get("start_ticks") is not None and ticks is not None:
        return ticks == record["start_ticks"]
    return ticks is not None or not os.path.isdir("/proc")


def describe(record: dict) -> str:
    return f"pid {record['pid']} on host {record['host']} (since {record.get('since', '?')}, {record['job']})"


def state(folder: str) -> tuple[str, dict | None]:
    """("free" | "ours" | "live" | "stale" | "elsewhere", the record) of the folder's lock."""
    record = read(folder)
    if record is None:
        return "free", None
    if record["job"] == job_id():
        return "ours", record
    if record["host"] != socket.gethostname():
        return "elsewhere", record
    return ("live" if alive(record) else "stale"), record


def check(folder: str, overwrite: bool = False) -> str | None:
    """Every rank, before anything loads: ValueError if another run holds the folder (live, or on a
    host this one cannot see into); the note to print when a dead run left its lock."""
    kind, record = state(folder)
    path = os.path.join(folder, LOCK)
    if kind == "live":
        what = "--overwrite would delete the files of" if overwrite else "--output-dir is the folder of"
        raise ValueError(f"{what} a live run: {path} is held by {describe(record)}; wait for that run to end or "
                         f"stop it (SIGTERM saves a checkpoint), or choose another folder")
    if kind == "elsewhere":
        raise ValueError(f"{path} is held by {describe(record)}, a host this one cannot check: if that run has "
                         f"ended (killed, or its node lost), remove {path} and launch again")
    if kind == "stale":
        return (f"note: {path} was left by {describe(record)}, which is gone (killed before it could remove it): "
                f"taking it over")
    return None


def acquire(folder: str) -> str | None:
    """Rank 0: take the folder's lock (creating the folder) before writing anything there; returns
    the note about a stale lock it took over. ValueError when another run holds it."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK)
    mine = holder()
    tmp = f"{path}.{mine['host']}.{mine['pid']}.tmp"
    with open(tmp, "w") as f:
        json.dump(mine, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    note = None
    try:
        for _ in range(5):
            try:
                os.link(tmp, path)  # atomic: fails if any run linked its lock first
                break
            except FileExistsError:
                note = check(folder) or note
                _set_aside(path, folder)  # ours (a restarted rank 0) or stale: replace it
        else:
            raise ValueError(f"{path}: another run keeps taking this folder's lock; launch again")
    finally:
        os.remove(tmp)
    _HELD.append(path)
    return note


def _set_aside(path: str, folder: str) -> None:
    """Remove the lock at `path` that `check` judged ours or stale, unless another run replaced it
    meanwhile (then the next attempt reads that one)."""
    aside = f"{path}.{socket.gethostname()}.{os.getpid()}.old"
    try:
        before = read(folder)
        os.rename(path, aside)
    except FileNotFoundError:
        return
    try:
        with open(aside) as f:
            moved = json.load(f)
    except (OSError, ValueError):
        moved = None
    if moved != before:  # another run's fresh lock: put it back
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    os.remove(aside)


def release() -> None:
    """Remove the locks this process holds (each only if it still names this process)."""
    me = (socket.gethostname(), os.getpid())
    while _HELD:
        path = _HELD.pop()
        try:
            with open(path) as f:
                record = json.load(f)
            if (record.get("host"), record.get("pid")) == me:
                os.remove(path)
        except (OSError, ValueError):
            pass
