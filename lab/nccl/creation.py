"""NCCL's rule for creating process groups, checked on the "new_group" lines of a recorded run
(telemetry/commtrace.py); lab/nccl/replay.py reports what this finds beside its replay.

With a device bound at init_process_group (train_disagg.py binds it on GPUs), torch creates every
new group's NCCL communicator by ncclCommSplit of the world's communicator (torch 2.11-2.13
`distributed_c10d._new_process_group_helper`: a rank outside the group calls
`perform_nocolor_split`), and ncclCommSplit is a collective of every rank of the world, matched by
order. So every rank must create every group, in the same order:

* a group created with use_local_synchronization=True is created by its members alone: the others
  return before the split, and the members wait in ncclCommSplit forever;
* a rank that never creates a group the others create, or creates the groups in another order,
  leaves the others waiting in ncclCommSplit, or splits off the wrong ranks.

split_group is the same rule over its parent group's ranks (every rank of the parent calls it).
The recorded traces are checked under this rule whatever backend recorded them: gloo, which the
tests run on, has no such rule, and an NCCL run without a bound device creates communicators lazily.

Pure Python, no torch.
"""
from __future__ import annotations

WHY = ("with a device bound at init_process_group, NCCL makes every new group by ncclCommSplit of "
       "[{parent}]'s communicator, which every rank of it must join, in one order")


def stream(parent: str) -> str:
    """The replay's pseudo-communicator of the creations split from `parent`: a creation blocks the
    rank until every rank of the parent has reached it (ncclCommSplit is not queued on a stream)."""
    return f"{parent}:creation"


def key(entry: dict) -> str:
    """What a creation asks for, the same string on every rank that makes the same call."""
    if entry.get("via") == "split_group":
        return f"split_group {entry.get('splits')}"
    return f"new_group {entry.get('ranks')}"


def _what(rank: int, line: int, entry: dict) -> str:
    return f"group {entry.get('name', '?')} {entry.get('ranks')} at rank {rank} line {line} ({entry.get('where', '?')})"


def findings(traces: dict[int, list[dict]]) -> list[str]:
    """Every breach of the creation rule in `traces` ({rank: lines}), one message each, naming the
    ranks, the group and where it is created."""
    out: list[str] = []
    creations: dict[str, dict[int, list[tuple[int, dict]]]] = {}  # parent -> rank -> [(line, entry)]
    members: dict[str, list[int]] = {}
    for rank, lines in traces.items():
        for i, e in enumerate(lines):
            if e.get("op") != "new_group":
                continue
            parent = str(e.get("group", "world"))
            members.setdefault(parent, sorted(e.get("members") or traces))
            if e.get("local_sync"):
                absent = [m for m in members[parent] if m not in (e.get("ranks") or ())]
                if absent:
                    out.append(f"{_what(rank, i, e)} is created by its members alone "
                               f"(use_local_synchronization=True), but {WHY.format(parent=parent)}: "
                               f"ranks {absent} never join, so its members wait forever. Create it on every rank, "
                               f"in the same order (parallel/commhooks.new_group)")
                continue  # reported as such; the order below is the order of the world's creations
            creations.setdefault(parent, {}).setdefault(rank, []).append((i, e))
    for parent, by_rank in sorted(creations.items()):
        ranks = [r for r in members[parent] if r in traces]
        seqs = {r: by_rank.get(r, []) for r in ranks}
        for k in range(max((len(s) for s in seqs.values()), default=0)):
            at = {r: s[k] if k < len(s) else None for r, s in seqs.items()}
            made = {r: key(x[1]) for r, x in at.items() if x is not None}
            if len(made) == len(at) and len(set(made.values())) == 1:
                continue
            first = next(r for r in ranks if at[r] is not None)
            line, entry = at[first]
            never = [r for r in ranks if at[r] is None]
            if never:
                out.append(f"ranks {never} never create {_what(first, line, entry)}, their creation #{k} on "
                           f"[{parent}]; {WHY.format(parent=parent)}")
            else:
                other = next(r for r in ranks if made[r] != made[first])
                same = [r for r in ranks if made[r] == made[first]]
                diff = [r for r in ranks if made[r] == made[other]]
                out.append(f"ranks create groups in different orders: creation #{k} on [{parent}] is "
                           f"{_what(first, line, entry)} on ranks {same}, but {_what(other, *at[other])} on "
                           f"ranks {diff}; {WHY.format(parent=parent)}")
            break  # later creations follow from this one
    return out


__all__ = ["WHY", "findings", "key", "stream"]
