"""Replay the communication each rank recorded (telemetry/commtrace.py) under NCCL's rules and find
deadlocks that gloo, which buffers sends, hides in the tests.

The model is deliberately conservative, so that a trace it passes cannot hang on NCCL for ordering
reasons (it says nothing about timeouts, sizes or data):

* every (communicator, rank) has ONE FIFO stream: an op starts only when the op posted before it on
  the same communicator by the same rank completed (NCCL queues a communicator's kernels on one
  stream, and PyTorch may fuse p2p to different peers onto it);
* a send and its receive complete together, and only when both are at the head of their streams:
  no buffering at any size (NCCL's small-message eager path is not relied upon). The k-th send from
  A to B on group G matches the k-th receive on B from A on G; their byte counts must agree;
* a collective completes when every member has it at the head of its stream on that communicator;
  the members must post a communicator's collectives in the same order (same names);
* posting never blocks; a "wait" blocks the rank's further posting until its target completed, a
  "sync" until everything the rank posted before it completed;
* a grouped p2p call (lines between "group_start" and "group_end", i.e. batch_isend_irecv /
  ncclGroupStart..End) is posted at its "group_end" as one unit per communicator: the unit's ops are
  at the head together, match independently, and the unit (and so each of its ops, as NCCL returns
  one work for the group) completes when all of them matched. Brackets nest; the outermost counts;
  a wait inside a bracket is malformed (it would hang before the group is launched);
* different communicators proceed independently;
* creating a group ("new_group") is a collective of every rank of its parent (the world for
  new_group), matched by order on a stream of the parent's own (ncclCommSplit is not queued behind
  the parent's kernels), and the rank waits for it; which group each rank creates, and whether
  every rank takes part, is NCCL's creation rule (lab/nccl/creation.py), reported as mismatches.

The replay runs to a fixpoint in time linear in the number of ops (every op is posted, activated
and completed once). Whatever cannot complete is explained (lab/nccl/findings.py): for each stuck rank, the line it is
blocked on and the head-of-stream ops that cannot complete, with the rank each one waits for; the
cycles of that wait-for graph are the deadlocks. Ops left incomplete with no counterpart at all are
"unmatched"; bytes, collective order and membership disagreements are "mismatches".

Pure Python, no torch: it runs anywhere the traces can be read.
"""
from __future__ import annotations

import json
import os
import re
from collections import deque

from lab.nccl import creation as creation_rule
from lab.nccl.findings import _CREATE, _NOP, _POST, _SYNC, _WAIT, COMM_OPS, Blocked, HeadOp, OpRef, Replay, Result, _ref, explain

OPS = COMM_OPS + ("wait", "sync", "group_start", "group_end")
_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")


class TraceError(ValueError):
    """The traces cannot be read or are malformed (not a finding about the run)."""


# ---------------------------------------------------------------------------------------- loading

def load(directory: str) -> dict[int, list[dict]]:
    """Read DIR/rank{R}.jsonl into {rank: [line, ...]} in rank order. Raises TraceError on anything
    unreadable, so that a broken trace is never mistaken for a clean run."""
    try:
        names = os.listdir(directory)
    except OSError as e:
        raise TraceError(f"{directory}: {e.strerror or e}") from e
    traces: dict[int, list[dict]] = {}
    for fname in names:
        m = _RANK_FILE.match(fname)
        if not m:
            continue
        rank = int(m.group(1))
        path = os.path.join(directory, fname)
        lines = []
        try:
            with open(path, encoding="utf-8") as f:
                for lineno, text in enumerate(f, 1):
                    if not text.strip():
                        continue
                    try:
                        entry = json.loads(text)
                    except json.JSONDecodeError as e:
                        raise TraceError(f"{path}:{lineno}: not JSON ({e.msg})") from e
                    if not isinstance(entry, dict):
                        raise TraceError(f"{path}:{lineno}: not a JSON object")
                    if entry.get("rank", rank) != rank:
                        raise TraceError(f"{path}:{lineno}: rank {entry.get('rank')} in the file of rank {rank}")
                    lines.append(entry)
        except OSError as e:
            raise TraceError(f"{path}: {e.strerror or e}") from e
        traces[rank] = lines
    if not traces:
        raise TraceError(f"{directory}: no rank*.jsonl trace files")
    return dict(sorted(traces.items()))


# ---------------------------------------------------------------------------------------- checking

def check(traces: dict[int, list[dict]]) -> Result:
    """Replay `traces` ({rank: lines}, as from load()) under the NCCL model of this module. Raises
    TraceError when the traces are malformed (unknown op, wait on a line that is not an earlier op,
    unbalanced brackets); findings about the run are in the Result."""
    ranks = sorted(traces)
    mismatches: list[str] = creation_rule.findings(traces)  # NCCL's rule for creating groups
    creation_streams: set[str] = set()

    # Op tables, indexed by op id (comm ops only).
    op_rank: list[int] = []
    op_line: list[int] = []
    op_kind: list[int] = []      # 0 send, 1 recv, 2 collective
    op_unit: list[int] = []
    op_partner: list[int] = []   # p2p counterpart, -1 none
    op_inst: list[int] = []      # collective instance, -1 for p2p
    unit_ops: list[list[int]] = []
    unit_stream: list[int] = []
    streams: dict[tuple[str, int], int] = {}
    stream_key: list[tuple[str, int]] = []
    actions: dict[int, list[tuple[int, object]]] = {}
    groups: set[str] = set()

    sends: dict[tuple[str, int, int], list[int]] = {}
    recvs: dict[tuple[str, int, int], list[int]] = {}
    coll_count: dict[tuple[str, int], int] = {}
    inst_index: dict[tuple[str, int], int] = {}
    inst_ops: list[list[int]] = []
    inst_members: list[list[int]] = []
    inst_first: list[int] = []   # op id that defined the instance (name, members)
    group_members: dict[str, tuple[list[int], int]] = {}  # group -> (members, defining op)

    def stream_of(group: str, rank: int) -> int:
        key = (group, rank)
        s = streams.get(key)
        if s is None:
            s = streams[key] = len(stream_key)
            stream_key.append(key)
        return s

    for rank in ranks:
        lines = traces[rank]
        acts: list[tuple[int, object]] = []
        lop = [-1] * len(lines)
        depth = 0
        bracket_units: dict[int, int] = {}   # stream -> unit within the open bracket
        bracket_order: list[int] = []
        for i, e in enumerate(lines):
            where = f"rank {rank} line {i} ({e.get('where', '?')})"
            op = e.get("op")
            if op not in OPS:
                raise TraceError(f"{where}: unknown op {op!r}")
            if op in COMM_OPS:
                group = e.get("group")
                if not isinstance(group, str):
                    raise TraceError(f"{where}: {op} without a group name")
                creation = op == "new_group"
                if creation:  # a collective of the parent's ranks on a stream of its own, and the rank waits
                    if depth:
                        raise TraceError(f"{where}: new_group inside a group_start/group_end bracket")
                    group = creation_rule.stream(group)
                    creation_streams.add(group)
                else:
                    groups.add(group)
                oid = len(op_rank)
                op_rank.append(rank)
                op_line.append(i)
                lop[i] = oid
                s = stream_of(group, rank)
                if depth:
                    u = bracket_units.get(s)
                    if u is None:
                        u = bracket_units[s] = len(unit_ops)
                        unit_ops.append([])
                        unit_stream.append(s)
                        bracket_order.append(u)
                else:
                    u = len(unit_ops)
                    unit_ops.append([])
                    unit_stream.append(s)
                    acts.append((_CREATE, oid) if creation else (_POST, (u,)))
                unit_ops[u].append(oid)
                op_unit.append(u)
                op_partner.append(-1)
                if op in ("collective", "new_group"):
                    op_kind.append(2)
                    members = e.get("members", ranks if creation else None)
                    if not isinstance(members, list) or not all(isinstance(m, int) for m in members):
                        raise TraceError(f"{where}: collective without a list of members")
                    members = sorted(set(members))
                    if rank not in members:
                        mismatches.append(f"{where}: collective on [{group}] by a rank not among its "
                                          f"members {members}")
                    known = group_members.get(group)
                    if known is None:
                        group_members[group] = (members, oid)
                    elif known[0] != members:
                        first = _ref(traces, op_rank[known[1]], op_line[known[1]])
                        mismatches.append(f"members of [{group}] differ: {members} at {where}, "
                                          f"{known[0]} at {first.describe()}")
                    k = coll_count.get((group, rank), 0)
                    coll_count[(group, rank)] = k + 1
                    inst = inst_index.get((group, k))
                    if inst is None:
                        inst = inst_index[(group, k)] = len(inst_ops)
                        inst_ops.append([])
                        inst_members.append(members)
                        inst_first.append(oid)
                    else:
                        first = inst_first[inst]
                        fe = traces[op_rank[first]][op_line[first]]
                        if not creation and fe.get("name") != e.get("name"):  # creations: creation_rule.findings
                            mismatches.append(
                                f"collective order mismatch on [{group}], collective #{k}: "
                                f"{e.get('name')!r} at {where} but {fe.get('name')!r} at "
                                f"rank {op_rank[first]} line {op_line[first]} ({fe.get('where', '?')})")
                    inst_ops[inst].append(oid)
                    op_inst.append(inst)
                else:
                    op_inst.append(-1)
                    peer = e.get("peer")
                    if not isinstance(peer, int):
                        raise TraceError(f"{where}: {op} without a peer rank")
                    if op == "send":
                        op_kind.append(0)
                        sends.setdefault((group, rank, peer), []).append(oid)
                    else:
                        op_kind.append(1)
                        recvs.setdefault((group, peer, rank), []).append(oid)
            elif op == "group_start":
                depth += 1
                acts.append((_NOP, None))
            elif op == "group_end":
                if depth == 0:
                    raise TraceError(f"{where}: group_end without group_start")
                depth -= 1
                if depth == 0:
                    acts.append((_POST, tuple(bracket_order)))
                    bracket_units, bracket_order = {}, []
                else:
                    acts.append((_NOP, None))
            elif op == "wait":
                if depth:
                    raise TraceError(f"{where}: wait inside a group_start/group_end bracket")
                t = e.get("target")
                if not isinstance(t, int) or not 0 <= t < i or lop[t] < 0:
                    raise TraceError(f"{where}: wait target {t!r} is not an earlier send/recv/collective line")
                acts.append((_WAIT, lop[t]))
            else:  # sync
                if depth:
                    raise TraceError(f"{where}: sync inside a group_start/group_end bracket")
                acts.append((_SYNC, None))
        if depth:
            raise TraceError(f"rank {rank}: trace ends inside a group_start/group_end bracket")
        actions[rank] = acts

    # Match p2p in order per (group, src, dst).
    for key, slist in sends.items():
        rlist = recvs.get(key, ())
        for a, b in zip(slist, rlist):
            op_partner[a], op_partner[b] = b, a
            ea = traces[op_rank[a]][op_line[a]]
            eb = traces[op_rank[b]][op_line[b]]
            if ea.get("bytes") != eb.get("bytes"):
                mismatches.append(
                    f"bytes differ on [{key[0]}] {key[1]}->{key[2]}: {_ref(traces, op_rank[a], op_line[a]).describe()}"
                    f" vs {_ref(traces, op_rank[b], op_line[b]).describe()}")
    for group, (members, _) in sorted(group_members.items()):
        missing = [m for m in members if m not in traces]
        if missing:
            mismatches.append(f"members {missing} of [{group}] have no trace file")

    # ------------------------------------------------------------------ replay to a fixpoint
    n_ops = len(op_rank)
    n_units = len(unit_ops)
    active = bytearray(n_ops)
    matched = bytearray(n_ops)
    posted = bytearray(n_units)
    unit_left = [len(u) for u in unit_ops]
    unit_done = bytearray(n_units)
    queues = [deque() for _ in stream_key]
    inst_active = [0] * len(inst_ops)
    inst_size = [len(m) for m in inst_members]
    unit_waiters: dict[int, list[int]] = {}
    outstanding = {r: 0 for r in ranks}
    sync_waiting: set[int] = set()
    pc = {r: 0 for r in ranks}
    wake: deque[int] = deque(ranks)
    activate: deque[int] = deque()
    finished: deque[int] = deque()

    def match(o: int) -> None:
        matched[o] = 1
        u = op_unit[o]
        unit_left[u] -= 1
        if unit_left[u] == 0:
            finished.append(u)

    while wake or activate or finished:
        while finished:
            u = finished.popleft()
            unit_done[u] = 1
            r = op_rank[unit_ops[u][0]]
            outstanding[r] -= len(unit_ops[u])
            if outstanding[r] == 0 and r in sync_waiting:
                sync_waiting.discard(r)
                wake.append(r)
            wake.extend(unit_waiters.pop(u, ()))
            q = queues[unit_stream[u]]
            q.popleft()  # a unit completes only at the head of its stream
            if q:
                activate.append(q[0])
        while activate:
            u = activate.popleft()
            for o in unit_ops[u]:
                active[o] = 1
                if op_kind[o] == 2:
                    inst = op_inst[o]
                    inst_active[inst] += 1
                    if inst_active[inst] == inst_size[inst]:
                        for x in inst_ops[inst]:
                            match(x)
                else:
                    p = op_partner[o]
                    if p >= 0 and active[p] and not matched[p]:
                        match(o)
                        match(p)
        if finished:
            continue
        if wake:
            r = wake.popleft()
            acts = actions[r]
            i = pc[r]
            while i < len(acts):
                kind, arg = acts[i]
                if kind == _POST or (kind == _CREATE and not posted[op_unit[arg]]):
                    for u in arg if kind == _POST else (op_unit[arg],):
                        posted[u] = 1
                        q = queues[unit_stream[u]]
                        q.append(u)
                        outstanding[r] += len(unit_ops[u])
                        if len(q) == 1:
                            activate.append(u)
                if kind in (_WAIT, _CREATE):
                    u = op_unit[arg]
                    if not unit_done[u]:
                        unit_waiters.setdefault(u, []).append(r)
                        break
                elif kind == _SYNC:
                    if outstanding[r]:
                        sync_waiting.add(r)
                        break
                i += 1
            pc[r] = i

    stuck = [r for r in ranks if pc[r] < len(actions[r]) or outstanding[r]]
    n_groups = len(groups)
    if not stuck and not mismatches:
        created = sum(1 for group, _ in inst_index if group in creation_streams)  # each made by every rank
        n_comm = n_ops - sum(len(inst_ops[i]) for (group, _), i in inst_index.items() if group in creation_streams)
        return Result(True, f"ok: {n_comm} ops on {len(ranks)} ranks, {n_groups} communicators"
                      + (f", {created} groups created" if created else ""), n_comm, len(ranks), n_groups)

    return explain(Replay(traces, ranks, mismatches, groups, n_ops, op_rank, op_line, op_kind, op_unit, op_partner,
                          op_inst, unit_ops, unit_stream, stream_key, actions, inst_ops, inst_members, inst_size,
                          queues, posted, active, matched, pc, stuck))


__all__ = ["Blocked", "HeadOp", "OpRef", "Result", "TraceError", "check", "load"]
