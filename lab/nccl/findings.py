"""What lab/nccl/replay.py reports: the records of a finding (`OpRef`, `HeadOp`, `Blocked`,
`Result`) and, once a replay has stopped with ops left, the explanation: for each stuck rank the
line it is blocked on and the head-of-stream ops that cannot complete, with the ranks they wait
for; the cycles of that wait-for graph (the deadlocks); unmatched ops and mismatches.

Pure Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

COMM_OPS = ("send", "recv", "collective", "new_group")
_POST, _WAIT, _SYNC, _NOP, _CREATE = 0, 1, 2, 3, 4  # the actions of a rank's replay (_CREATE: post, then wait)


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
        elif self.op == "new_group":
            what = f"creation of group {self.name or '?'}"
        elif self.op == "wait":
            what = f"wait on line {self.target}"
        else:
            what = self.op
        tag = f" {self.name!r}" if self.name and self.op in ("send", "recv") else ""
        size = f" {self.nbytes} B" if self.op in ("send", "recv", "collective") else ""
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


def _ref(traces, rank: int, line: int) -> OpRef:
    e = traces[rank][line]
    try:
        nbytes = int(e.get("bytes") or 0)
    except (TypeError, ValueError):
        nbytes = 0
    return OpRef(rank, line, str(e.get("op")), str(e.get("group", "")), e.get("peer"), str(e.get("name", "")),
                 nbytes, str(e.get("where", "?")), e.get("target"))


@dataclass
class Replay:
    """The state a replay (replay.check) stopped in: the op tables, indexed by op id, and what
    each rank, stream and op reached. Ops are sends, receives and collectives; kinds 0, 1, 2."""

    traces: dict
    ranks: list
    mismatches: list
    groups: set
    n_ops: int
    op_rank: list
    op_line: list
    op_kind: list
    op_unit: list
    op_partner: list  # a p2p op's counterpart, -1 none
    op_inst: list  # a collective's instance, -1 for p2p
    unit_ops: list  # the ops of each unit (a post, or a grouped call's part on one communicator)
    unit_stream: list
    stream_key: list  # stream id -> (communicator, rank)
    actions: dict  # rank -> [(kind, arg)]
    inst_ops: list
    inst_members: list
    inst_size: list
    queues: list  # stream id -> the posted, incomplete units in order
    posted: bytearray
    active: bytearray
    matched: bytearray
    pc: dict  # rank -> the index of the action it stopped at
    stuck: list  # the ranks that could not finish


def explain(s: Replay) -> Result:
    """The finding of a replay that left ranks stuck or found mismatches."""
    traces, ranks, mismatches, n_ops = s.traces, s.ranks, s.mismatches, s.n_ops
    pc, actions, stuck = s.pc, s.actions, s.stuck
    op_rank, op_line, op_kind, op_unit = s.op_rank, s.op_line, s.op_kind, s.op_unit
    op_partner, op_inst = s.op_partner, s.op_inst
    unit_ops, unit_stream, stream_key, queues = s.unit_ops, s.unit_stream, s.stream_key, s.queues
    inst_ops, inst_members, inst_size = s.inst_ops, s.inst_members, s.inst_size
    posted, active, matched, groups = s.posted, s.active, s.matched, s.groups

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
            if kind in (_WAIT, _CREATE):
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
    return Result(False, "\n".join(lines), n_ops, len(ranks), len(groups), cycles, blocked, unmatched, mismatches)


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


__all__ = ["Blocked", "HeadOp", "OpRef", "Replay", "Result", "explain"]
