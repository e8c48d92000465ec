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
* different communicators proceed independently.

The replay runs to a fixpoint in time linear in the number of ops (every op is posted, activated
and completed once). Whatever cannot complete is explained: for each stuck rank, the line it is
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
from dataclasses import dataclass, field

COMM_OPS = ("send", "recv", "collective")
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


# ---------------------------------------------------------------------------------------- results

@dataclass
class OpRef:
    """One line of one rank's trace, enough to print it."""
    rank: int
    line: int
    op: str
    group: str
    peer: int | None
    name: str
    nbytes: int
    where: str
    target: int | None = None  # for a wait: the line it waits on

    def describe(self, with_rank: bool = True) -> str:
        if self.op == "send":
            what = f"send to rank {self.peer}"
        elif self.op == "recv":
            what = f"recv from rank {self.peer}"
        elif self.op == "collective":
            what = f"collective {self.name or '?'}"
        elif self.op == "wait":
            what = f"wait on line {self.target}"
        else:
            what = self.op
        tag = f" {self.name!r}" if self.name and self.op in ("send", "recv") else ""
        size = f" {self.nbytes} B" if self.op in COMM_OPS else ""
        grp = f" on [{self.group}]" if self.op in COMM_OPS else ""
        who = f"rank {self.rank} line {self.line}" if with_rank else f"line {self.line}"
        return f"{who}: {what}{tag}{grp}{size} ({self.where})"


@dataclass
class HeadOp:
    """A head-of-stream op that cannot complete, why, and the ranks it waits for."""
    op: OpRef
    reason: str
    waits_for: list[int]


@dataclass
class Blocked:
    """A rank that could not finish: the line it is stuck on (None: it reached the end of its trace
    with ops incomplete) and what stands in the way."""
    rank: int
    line: int | None
    at: OpRef | None
    reason: str
    heads: list[HeadOp]
    depends_on: list[int]


@dataclass
class Result:
    ok: bool
    message: str
    n_ops: int
    n_ranks: int
    n_groups: int
    cycles: list[list[int]] = field(default_factory=list)  # wait-for cycles, each a list of ranks
    blocked: dict[int, Blocked] = field(default_factory=dict)
    unmatched: list[OpRef] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    @property
    def deadlock(self) -> bool:
        return bool(self.cycles)

    def deadlocked_ranks(self) -> set[int]:
        return {r for c in self.cycles for r in c}


# ---------------------------------------------------------------------------------------- checking

_POST, _WAIT, _SYNC, _NOP = 0, 1, 2, 3


def _ref(traces, rank: int, line: int) -> OpRef:
    e = traces[rank][line]
    try:
        nbytes = int(e.get("bytes") or 0)
    except (TypeError, ValueError):
        nbytes = 0
    return OpRef(rank, line, str(e.get("op")), str(e.get("group", "")), e.get("peer"), str(e.get("name", "")),
                 nbytes, str(e.get("where", "?")), e.get("target"))


def check(traces: dict[int, list[dict]]) -> Result:
    """Replay `traces` ({rank: lines}, as from load()) under the NCCL model of this module. Raises
    TraceError when the traces are malformed (unknown op, wait on a line that is not an earlier op,
    unbalanced brackets); findings about the run are in the Result."""
    ranks = sorted(traces)
    mismatches: list[str] = []

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
                    acts.append((_POST, (u,)))
                unit_ops[u].append(oid)
                op_unit.append(u)
                op_partner.append(-1)
                if op == "collective":
                    op_kind.append(2)
                    members = e.get("members")
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
                        if fe.get("name") != e.get("name"):
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
                if kind == _POST:
                    for u in arg:
                        posted[u] = 1
                        q = queues[unit_stream[u]]
                        q.append(u)
                        outstanding[r] += len(unit_ops[u])
                        if len(q) == 1:
                            activate.append(u)
                elif kind == _WAIT:
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
        return Result(True, f"ok: {n_ops} ops on {len(ranks)} ranks, {n_groups} communicators",
                      n_ops, len(ranks), n_groups)

    # ------------------------------------------------------------------ explain what is stuck
    def ref(o: int) -> OpRef:
        return _ref(traces, op_rank[o], op_line[o])

    def at_line(r: int) -> str:
        i = pc[r]
        if i >= len(actions[r]):
            return f"rank {r} reached the end of its trace"
        return f"rank {r} is blocked at {_ref(traces, r, i).describe(with_rank=False)}"

    def why(o: int) -> HeadOp:
        """Why head-of-stream op o cannot complete, and on which ranks."""
        if op_kind[o] == 2:
            inst = op_inst[o]
            have = {op_rank[x]: x for x in inst_ops[inst]}
            parts, deps = [], []
            for m in inst_members[inst]:
                x = have.get(m)
                if m not in traces:
                    parts.append(f"rank {m} has no trace")
                elif x is None:
                    parts.append(f"rank {m} never posts it (unmatched)")
                elif not posted[op_unit[x]]:
                    parts.append(f"rank {m} has not posted it ({at_line(m)})")
                    deps.append(m)
                elif not active[x]:
                    head = queues[unit_stream[op_unit[x]]][0]
                    parts.append(f"rank {m} has it queued behind {ref(unit_ops[head][0]).describe()}")
                    deps.append(m)
            return HeadOp(ref(o), "; ".join(parts) or "waiting for its members", sorted(set(deps)))
        p = op_partner[o]
        other = "recv" if op_kind[o] == 0 else "send"
        if p < 0:
            e = traces[op_rank[o]][op_line[o]]
            peer = e.get("peer")
            if peer not in traces:
                return HeadOp(ref(o), f"unmatched: rank {peer} has no trace", [])
            return HeadOp(ref(o), f"unmatched: rank {peer} never posts the matching {other}", [])
        s = op_rank[p]
        if not posted[op_unit[p]]:
            return HeadOp(ref(o), f"its {other} {ref(p).describe()} is not posted yet: {at_line(s)}", [s])
        head = queues[unit_stream[op_unit[p]]][0]
        behind = "; ".join(ref(x).describe() for x in unit_ops[head] if not matched[x])
        return HeadOp(ref(o), f"its {other} {ref(p).describe()} is queued behind {behind}", [s])

    def heads_of(stream_ids) -> list[HeadOp]:
        out = []
        for s in stream_ids:
            q = queues[s]
            if q:
                out.extend(why(o) for o in unit_ops[q[0]] if not matched[o])
        return out

    rank_streams: dict[int, list[int]] = {}
    for s, (_, r) in enumerate(stream_key):
        rank_streams.setdefault(r, []).append(s)

    blocked: dict[int, Blocked] = {}
    for r in stuck:
        i = pc[r]
        if i < len(actions[r]):
            kind, arg = actions[r][i]
            at = _ref(traces, r, i)
            if kind == _WAIT:
                target = ref(arg)
                u = op_unit[arg]
                q = queues[unit_stream[u]]
                if q and q[0] == u:
                    reason = f"waits for {target.describe()}"
                else:
                    reason = f"waits for {target.describe()}, queued behind the head of its stream"
                heads = heads_of([unit_stream[u]])
            else:
                reason = "device-wide sync: waits for every op it posted before"
                heads = heads_of(rank_streams.get(r, ()))
        else:
            at, reason = None, "reached the end of its trace with ops incomplete"
            heads = heads_of(rank_streams.get(r, ()))
        deps = sorted({d for h in heads for d in h.waits_for})
        blocked[r] = Blocked(r, i if at else None, at, reason, heads, deps)

    cycles = _cycles({r: b.depends_on for r, b in blocked.items()})

    unmatched: list[OpRef] = []
    for o in range(n_ops):
        if matched[o]:
            continue
        if op_kind[o] == 2:
            inst = op_inst[o]
            if len(inst_ops[inst]) < inst_size[inst] and o == inst_ops[inst][0]:
                unmatched.append(ref(o))
        elif op_partner[o] < 0:
            unmatched.append(ref(o))

    lines: list[str] = []
    in_cycle = {r for c in cycles for r in c}
    if cycles:
        for c in cycles:
            chain = " -> ".join(f"rank {r}" for r in c + [c[0]])
            lines.append(f"DEADLOCK under NCCL (sends are not buffered, one stream per communicator): {chain}")
    elif stuck:
        lines.append(f"HANG under NCCL: ranks {stuck} cannot finish (no wait-for cycle among them)")
    order = [r for c in cycles for r in c] + [r for r in stuck if r not in in_cycle]
    for r in order:
        b = blocked[r]
        if b.at:
            lines.append(f"  rank {r} is blocked at {b.at.describe(with_rank=False)}")
            lines.append(f"    {b.reason}")
        else:
            lines.append(f"  rank {r} {b.reason}")
        for h in b.heads:
            lines.append(f"    head of [{h.op.group}] on rank {h.op.rank}: {h.op.describe(with_rank=False)}")
            lines.append(f"      cannot complete: {h.reason}")
    if unmatched:
        lines.append(f"UNMATCHED: {len(unmatched)} op(s) with no counterpart, never completed:")
        lines.extend(f"  {u.describe()}" for u in unmatched)
    if mismatches:
        lines.append(f"MISMATCH: {len(mismatches)}")
        lines.extend(f"  {m}" for m in mismatches)
    return Result(False, "\n".join(lines), n_ops, len(ranks), n_groups, cycles, blocked, unmatched, mismatches)


def _cycles(graph: dict[int, list[int]]) -> list[list[int]]:
    """One simple cycle per strongly connected component of the wait-for graph that has one (a
    component of 2+ ranks, or a rank waiting on itself), each starting at its lowest rank."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    comps: list[list[int]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph.get(w, ()))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                comps.append(comp)
    cycles = []
    for comp in comps:
        members = set(comp)
        start = min(comp)
        if len(comp) == 1 and start not in graph.get(start, ()):
            continue
        path, seen, v = [], {}, start
        while v not in seen:  # walk inside the component until a rank repeats: that is a cycle
            seen[v] = len(path)
            path.append(v)
            v = min(w for w in graph[v] if w in members)
        cyc = path[seen[v]:]
        k = cyc.index(min(cyc))
        cycles.append(cyc[k:] + cyc[:k])
    cycles.sort()
    return cycles


__all__ = ["Blocked", "HeadOp", "OpRef", "Result", "TraceError", "check", "load"]
