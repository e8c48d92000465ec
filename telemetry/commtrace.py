"""Record every communication operation a rank posts, so that lab/nccl/replay.py can replay the
job under NCCL's rules offline.

Why: the tests run on gloo, which buffers sends, so a rank that sends and then receives never
blocks there; NCCL does not buffer (a send completes only together with its receive, and ops on one
communicator run in posting order), so the same code can hang in production. Recording what each
rank posts, in order, lets a pure-Python checker find those hangs from a CPU run.

Enable with the environment variable DIGENRL_COMM_TRACE=DIR: every rank then appends one JSON object
per posted op to DIR/rank{R}.jsonl, in posting order:

    {"rank": 0, "op": "send", "group": "world", "peer": 1, "bytes": 4096, "name": "act",
     "where": "parallel/gap.py:212"}

op is one of
    "send" / "recv"   a point-to-point op posted (isend/irecv, or the post half of send/recv);
                      "peer" is the other side's global rank;
    "collective"      "name" is its kind (all_reduce, broadcast, ...), "members" the sorted global
                      ranks of the communicator;
    "wait"            the rank blocks until one of its earlier ops completed; "target" is that op's
                      line index (0-based) in this file. A blocking send/recv is recorded as the
                      post followed by a wait on it;
    "sync"            a device-wide synchronize: blocks until everything posted before completed;
    "new_group"       a process group created (torch's new_group or split_group, from any caller):
                      "ranks" its sorted global ranks, "local_sync" whether only its members took part
                      (use_local_synchronization), "members" the ranks that must all take part (the
                      parent's: the world for new_group), "name" the group's trace name; split_group
                      adds "splits", every group of the split. Creating blocks the rank (no "wait" line);
    "group_start" / "group_end"
                      bracket a grouped p2p call (batch_isend_irecv, i.e. ncclGroupStart/End): the
                      ops between them are launched as one unit, so they do not queue behind each
                      other on their communicator's stream. Use record_batch() so the bracket and its
                      ops are written contiguously even when other threads record.

The recorder imports nothing from the project (only the standard library; torch.distributed is read
from sys.modules for the rank and group names), so any module can call it without import cycles. When the
variable is unset, record() returns None at the cost of one dict lookup.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

ENV = "DIGENRL_COMM_TRACE"

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_lock = threading.Lock()
_file = None          # the open trace file
_key: tuple | None = None  # (directory, rank, pid) the file was opened for
_count = 0            # lines in the file: the index the next record gets
_names: dict[int, tuple[Any, str]] = {}  # id(group) -> (group, name); the group is held so its id stays unique
_plumbing: set[str] = {os.path.abspath(__file__)}  # files whose frames "where" skips (helpers that post ops)


def enabled() -> bool:
    """Whether ops are recorded: read on every call so a test can turn it on with the env var."""
    return bool(os.environ.get(ENV))


def _rank() -> int:
    """The global rank: from torch.distributed once initialized (the truth), else torchrun's RANK."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank())
        except Exception:  # noqa: BLE001 - a half-initialized backend must not break the run
            pass
    return int(os.environ.get("RANK", "0"))


def plumbing(path: str) -> None:
    """Mark a module (its __file__) as communication plumbing: "where" then names the first frame
    outside it, the call site that decided to communicate (rollout.py, not p2p.py)."""
    _plumbing.add(os.path.abspath(path))


def _where(depth: int | None) -> str:
    """file:line relative to the repo: with `depth`, of the frame `depth` levels above record()'s
    caller's caller; else of the first frame of the project that is not plumbing (torch's own
    frames, when a collective is recorded from inside a library, are skipped too)."""
    try:
        frame = sys._getframe(2 if depth is None else depth + 1)
    except ValueError:
        return "?"
    if depth is None:
        first = frame
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            if path.startswith(_ROOT + os.sep) and path not in _plumbing and "site-packages" not in path:
                break
            frame = frame.f_back
        frame = frame or first
    path = os.path.abspath(frame.f_code.co_filename)
    if path.startswith(_ROOT + os.sep):
        path = os.path.relpath(path, _ROOT)
    return f"{path}:{frame.f_lineno}"


def _open_locked(directory: str) -> None:
    """(Re)open DIR/rank{R}.jsonl. Appending to an existing file continues its line numbering, so
    "target" indices stay line numbers of the file; a forked child reopens rather than share a
    buffered handle with its parent."""
    global _file, _key, _count
    key = (directory, _rank(), os.getpid())
    if _file is not None and key == _key:
        return
    if _file is not None:
        try:
            _file.close()
        except OSError:
            pass
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank{key[1]}.jsonl")
    count = 0
    if os.path.exists(path):
        with open(path, "rb") as f:
            count = sum(1 for line in f if line.strip())
    _file = open(path, "a", buffering=1, encoding="utf-8")  # line-buffered: a crash loses no line
    _key, _count = key, count


def _line(op: str, group: str, peer, nbytes: int, name: str, members, target, where: str) -> dict:
    entry: dict[str, Any] = {"rank": _key[1], "op": op, "group": str(group),
                             "peer": None if peer is None else int(peer), "bytes": int(nbytes),
                             "name": str(name), "where": where}
    if members is not None:
        entry["members"] = sorted(int(m) for m in members)
    if target is not None:
        entry["target"] = int(target)
    return entry


def _write_locked(entry: dict) -> int:
    global _count
    _file.write(json.dumps(entry, separators=(",", ":")) + "\n")
    index = _count
    _count += 1
    return index


def record(op: str, group: str, peer: int | None = None, nbytes: int = 0, name: str = "",
           members=None, target: int | None = None, depth: int | None = None) -> int | None:
    """Append one posted op; returns its line index (the "target" of a later wait on it), or None
    when tracing is off. "where" is the first project frame outside the plumbing (`plumbing`), or
    with `depth` the frame that many levels above record()'s caller (1: the caller's line)."""
    directory = os.environ.get(ENV)
    if not directory:
        return None
    where = _where(depth)
    with _lock:
        _open_locked(directory)
        return _write_locked(_line(op, group, peer, nbytes, name, members, target, where))


def record_creation(ranks, local_sync: bool, members, name: str, group: str = "world", splits=None,
                    via: str = "new_group") -> int | None:
    """Record the creation of a process group over `ranks` (a "new_group" line, see the module
    docstring), before torch creates it: a creation that hangs is on record."""
    directory = os.environ.get(ENV)
    if not directory:
        return None
    where = _where(None)
    with _lock:
        _open_locked(directory)
        entry = _line("new_group", group, None, 0, name, members, None, where)
        entry.update(ranks=sorted(int(r) for r in ranks), local_sync=bool(local_sync), via=via)
        if splits is not None:
            entry["splits"] = [sorted(int(r) for r in s) for s in splits]
        return _write_locked(entry)


def record_batch(ops: list[dict], group: str = "", depth: int | None = None) -> list[int] | None:
    """Record a grouped p2p call (batch_isend_irecv): group_start, the ops, group_end, under one
    lock hold so no other thread's line lands inside the bracket. Each op is a dict with keys op
    ("send"/"recv"), group, peer, and optionally nbytes/bytes and name. Returns the ops' line
    indices (for waits), or None when tracing is off."""
    directory = os.environ.get(ENV)
    if not directory:
        return None
    where = _where(depth)
    with _lock:
        _open_locked(directory)
        _write_locked(_line("group_start", group, None, 0, "", None, None, where))
        indices = [_write_locked(_line(o["op"], o.get("group", group), o.get("peer"),
                                       o.get("nbytes", o.get("bytes", 0)), o.get("name", ""),
                                       o.get("members"), None, where)) for o in ops]
        _write_locked(_line("group_end", group, None, 0, "", None, None, where))
        return indices


def name_group(group, name: str) -> None:
    """Give a ProcessGroup a readable name for traces. Call it on every member with the same name:
    the checker matches ops by this name, so it must be the same everywhere."""
    with _lock:
        _names[id(group)] = (group, str(name))


def group_name(group=None) -> str:
    """A name for `group` that is the same on every member: "world" for the default group, the name
    given to name_group(), else "ranks:" + its sorted global ranks. Two distinct groups over the same
    ranks get the same fallback name and are then checked as one communicator (stricter ordering,
    and their p2p matched together): name them to keep them apart."""
    if group is None:
        return "world"
    entry = _names.get(id(group))
    if entry is not None and entry[0] is group:
        return entry[1]
    dist = sys.modules.get("torch.distributed")  # loaded by whoever created the group
    try:
        if group is dist.GroupMember.WORLD:
            return "world"
        ranks = dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - not a process group we can ask: still give a stable-ish name
        return f"group@{id(group):x}"
    return "ranks:" + ",".join(str(r) for r in sorted(ranks))


def reset() -> None:
    """Close the trace file (tests that switch directories, or before exit)."""
    global _file, _key, _count
    with _lock:
        if _file is not None:
            try:
                _file.close()
            except OSError:
                pass
        _file, _key, _count = None, None, 0


__all__ = ["ENV", "enabled", "group_name", "name_group", "plumbing", "record", "record_batch", "record_creation",
           "reset"]
