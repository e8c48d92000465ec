"""The placement-invariance runs record their communication (DIGENRL_COMM_TRACE) and these helpers
check it under NCCL's rules (lab/nccl/replay.py): no buffered sends, one FIFO stream per
communicator and rank, collectives in one order on every member. A run passes `traced(out)` as its
environment; `assert_nccl_ok(out, ...)` then replays what every rank posted, and checks that the
traffic the mode must have was recorded at all (a check of an empty trace proves nothing)."""
from pathlib import Path

from telemetry import commtrace
from lab.nccl import replay


def traced(out, name: str = "comm") -> dict:
    """The environment that records a run's communication into OUT/NAME."""
    return {commtrace.ENV: str(Path(out) / name)}


# FSDP2's collectives by the name the trace records: through the functional collectives (torch
# 2.13: all_gather_single, reduce_scatter_single) or c10d's tensor collectives (torch 2.11).
ALL_GATHER = "all_gather_single|all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single|reduce_scatter_tensor"


def assert_nccl_ok(out, communicators=(), collectives=(), name: str = "comm") -> replay.Result:
    """Every rank's recorded operations complete under NCCL's rules; `communicators` (names or
    name prefixes) all carried traffic, and `collectives` ("group:name") were posted."""
    traces = replay.load(str(Path(out) / name))
    result = replay.check(traces)
    assert result.ok, f"{out}:\n{result.message}"
    lines = [line for rank_lines in traces.values() for line in rank_lines]
    used = {line["group"] for line in lines if line["op"] in ("send", "recv", "collective")}
    for c in communicators:
        assert any(g == c or g.startswith(c) for g in used), (out, c, sorted(used))
    posted = {f"{line['group']}:{line['name']}" for line in lines if line["op"] == "collective"}
    for c in collectives:  # "group:a|b": any of the names
        group, names = c.split(":", 1)
        assert any(f"{group}:{n}" in posted for n in names.split("|")), (out, c, sorted(posted))
    return result


def created(out, name: str = "comm") -> dict[int, list[str]]:
    """The groups each rank created, by name, in order (the "new_group" lines of its trace)."""
    traces = replay.load(str(Path(out) / name))
    return {r: [line["name"] for line in lines if line["op"] == "new_group"] for r, lines in traces.items()}


def merged(out, prefixes, into: str = "world", name: str = "comm") -> replay.Result:
    """The recorded run replayed as if the communicators named by `prefixes` were one (`into`), as
    the code had them before each kind of traffic got its own: the check must find the crossing."""
    traces = replay.load(str(Path(out) / name))
    for lines in traces.values():
        for line in lines:
            if any(line["group"].startswith(p) for p in prefixes):
                line["group"] = into
    return replay.check(traces)

