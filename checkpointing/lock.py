"""One live run per folder: DIR/run.lock names the process that holds the folder (docs/reliability.md).

Rank 0 takes the lock before it writes anything into the folder, holds it for the run's life and
removes it on every way out that runs code (train_disagg.shutdown, the guard's exits). A run
killed without warning (kill -9, a lost node) leaves the file behind, naming its host and pid:

- on this host, a holder whose process is gone (or whose pid now names a younger process, or a
  boot ago) is stale: the next run names it and takes the lock over;
- on another host nothing here can tell whether the holder lives: the run refuses, names the host
  and pid, and says how to free the folder (remove the file once that run is known to be gone);
- a holder of the same launch is this run: the ranks of one launch read the lock their rank 0
  took. A launch is known by its own id (`set_launch`: a random id its ranks share through the
  rendezvous store, parallel/store.launch_id), never by the launcher's: torchrun's rdzv id is the
  same for every launch of a SLURM allocation (scripts/slurm/launch.sh passes $SLURM_JOB_ID).

Every rank reads the lock before anything loads (`check`), so a folder a live run holds is refused
on every rank alike, --overwrite and --resume included. The file appears whole or not at all
(written beside, then hard-linked into place, which fails if another run linked first).

Taking over a stale lock is atomic, so that of N launches racing for one folder exactly one wins:
a racer first creates a takeover marker `run.lock.takeover-K` (a hard link, which fails if the
name exists), then checks that the lock is still the very one it judged (its bytes, which hold a
random nonce, and its inode), and renames its own lock over it. Only the holder of a marker may
replace the lock, and a marker stays until a winner has replaced the lock, so a racer that judged
the same stale lock later finds either a live marker (it waits, then meets the winner's live lock)
or a lock that is no longer the one it judged. A racer that died holding marker K leaves it
behind: the next takes K + 1 (markers are never removed by anyone but a winner, so two live racers
never hold the lowest free marker at once), and the winner removes every marker up to its own.
Pure file system code: no torch, no process group.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid

LOCK = "run.lock"
WAIT_S = 10.0  # how long a launch waits for another's takeover of the same folder to finish
_HELD: list[str] = []  # the lock files this process holds
_LAUNCH: list[str] = []  # this launch's id (set_launch), else one drawn for this process


def set_launch(launch: str) -> None:
    """The id every rank of this launch shares (parallel.store.launch_id), before any `check`."""
    _LAUNCH[:] = [launch]


def job_id() -> str:
    """What every rank of one launch shares and another launch does not."""
    if not _LAUNCH:
        _LAUNCH.append(uuid.uuid4().hex)  # a process alone: its own launch
    return f"launch {_LAUNCH[0]}"


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
    """This process, as a lock file records it (the nonce makes every lock file one of a kind)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "boot": _boot_id(),
            "start_ticks": _start_ticks(os.getpid()), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "nonce": uuid.uuid4().hex, "command": " ".join(sys.argv[1:])[:300]}


def _parse(path: str, data: bytes, folder: str) -> dict:
    try:
        record = json.loads(data)
        if not isinstance(record, dict) or not {"host", "pid", "job"} <= set(record):
            raise ValueError("not a lock record")
        return record
    except ValueError as e:  # UnicodeDecodeError included
        raise ValueError(f"{path} is not a lock this program wrote ({e}): remove it if no run uses "
                         f"{folder!r}") from None


def _snapshot(path: str) -> tuple[bytes, int] | None:
    """(the bytes, the inode) of the lock file at `path`, None when there is none."""
    try:
        with open(path, "rb") as f:
            return f.read(), os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror})") from None


def read(folder: str) -> dict | None:
    """The record of DIR/run.lock, None when there is none; ValueError when it is not one."""
    path = os.path.join(folder, LOCK)
    seen = _snapshot(path)
    return None if seen is None else _parse(path, seen[0], folder)


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


def judge(record: dict | None) -> str:
    """"free" | "ours" | "live" | "stale" | "elsewhere": what a lock record means to this launch."""
    if record is None:
        return "free"
    if record["job"] == job_id():
        return "ours"
    if record["host"] != socket.gethostname():
        return "elsewhere"
    return "live" if alive(record) else "stale"


def state(folder: str) -> tuple[str, dict | None]:
    """(`judge` of the folder's lock, the record)."""
    record = read(folder)
    return judge(record), record


def refusal(folder: str, kind: str, record: dict | None, overwrite: bool = False) -> str | None:
    """The error for a folder another run holds (live, or on a host this one cannot see into)."""
    path = os.path.join(folder, LOCK)
    if kind == "live":
        what = "--overwrite would delete the files of" if overwrite else "--output-dir is the folder of"
        return (f"{what} a live run: {path} is held by {describe(record)}; wait for that run to end or stop it "
                f"(SIGTERM saves a checkpoint), or choose another folder")
    if kind == "elsewhere":
        return (f"{path} is held by {describe(record)}, a host this one cannot check: if that run has ended "
                f"(killed, or its node lost), remove {path} and launch again")
    return None


def _note(folder: str, kind: str, record: dict | None) -> str | None:
    if kind != "stale":
        return None
    return (f"note: {os.path.join(folder, LOCK)} was left by {describe(record)}, which is gone (killed before it "
            f"could remove it): taking it over")


def check(folder: str, overwrite: bool = False) -> str | None:
    """Every rank, before anything loads: ValueError if another run holds the folder (live, or on a
    host this one cannot see into); the note to print when a dead run left its lock."""
    kind, record = state(folder)
    error = refusal(folder, kind, record, overwrite)
    if error:
        raise ValueError(error)
    return _note(folder, kind, record)


def acquire(folder: str) -> str | None:
    """Rank 0: take the folder's lock (creating the folder) before writing anything there; returns
    the note about a stale lock it took over. ValueError when another run holds it."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK)
    mine = holder()
    tmp = f"{path}.{mine['host']}.{mine['pid']}.{mine['nonce'][:8]}.tmp"
    with open(tmp, "w") as f:
        json.dump(mine, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    deadline = time.monotonic() + WAIT_S
    try:
        while True:
            try:
                os.link(tmp, path)  # atomic: fails if any run linked its lock first
                note = None
                break
            except FileExistsError:
                pass
            seen = _snapshot(path)
            if seen is None:
                continue  # removed meanwhile (its run ended): link again
            record = _parse(path, seen[0], folder)
            kind = judge(record)
            error = refusal(folder, kind, record)
            if error:
                raise ValueError(error)
            won, racer = _take_over(path, seen, tmp)  # ours (a second acquire) or stale: replace it
            if won:
                note = _note(folder, kind, record)
                break
            if racer is not None:  # another launch is taking it over: its lock will be live, or gone
                if time.monotonic() > deadline:
                    raise ValueError(f"{path}: {describe(racer)} has been taking over this folder's lock for "
                                     f"{WAIT_S:.0f} s; launch again once it has started or gone")
                time.sleep(0.01)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)
    _HELD.append(path)
    return note


def _marker(path: str, generation: int) -> str:
    return f"{path}.takeover-{generation}"


def _take_over(path: str, seen: tuple[bytes, int], mine: str) -> tuple[bool, dict | None]:
    """Replace the lock `seen` (judged stale or ours) by the lock file `mine`, atomically among
    racers: (True, None) when this process now holds the folder; (False, the record of the live
    racer holding a takeover marker); (False, None) when the lock changed meanwhile. The caller
    judges the lock again unless it won."""
    generation = 0
    while True:
        try:
            os.link(mine, _marker(path, generation))  # atomic: one racer per generation, named inside
            break
        except FileExistsError:
            pass
        other = _snapshot(_marker(path, generation))
        if other is None:
            continue  # removed meanwhile by a winner: try this generation again
        try:
            racer = json.loads(other[0])
        except ValueError:
            racer = {}  # (never: a marker is linked whole)
        if isinstance(racer, dict) and {"host", "pid", "job"} <= set(racer) and (
                racer["host"] != socket.gethostname() or alive(racer)):
            return False, racer  # a live racer is at work (one of another host cannot be checked)
        generation += 1  # a racer died holding this marker: the next generation
    won = False
    try:
        if _snapshot(path) != seen:
            return False, None  # another racer replaced it first
        os.rename(mine, path)  # atomic: the judged lock is gone and ours is in its place
        won = True
        return True, None
    finally:
        for k in range(generation + 1) if won else (generation,):
            try:  # a winner clears the dead racers' markers and its own; a loser only its own
                os.remove(_marker(path, k))
            except FileNotFoundError:
                pass


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
