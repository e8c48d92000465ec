"""NCCL's rule for creating process groups, checked on recorded runs (lab/nccl/creation.py): with
a device bound at init_process_group a new group is a collective of the whole world (ncclCommSplit),
made by every rank in one order. gloo, which these runs use, has no such rule: the recorded
creations must show what NCCL would do."""
import json
import subprocess
import sys
from pathlib import Path

from lab.launch import torchrun_module
from lab.nccl import creation, replay
from traced import traced

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "dist_scripts" / "group_creation.py"


def _line_of(text: str) -> str:
    """file:line of the script's line holding `text` (what the trace's "where" names)."""
    lines = SCRIPT.read_text().splitlines()
    return f"tests/dist_scripts/group_creation.py:{next(i for i, x in enumerate(lines, 1) if text in x)}"


def _creations(out) -> dict[int, list[dict]]:
    traces = replay.load(str(Path(out) / "comm"))
    return {r: [x for x in lines if x["op"] == "new_group"] for r, lines in traces.items()}


def _check_comm(out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.check_comm", str(Path(out) / "comm")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_a_group_created_by_one_rank_alone_is_flagged(tmp_path):
    """The mixed-precision group replicated trainers used to make, `new_group([rank],
    use_local_synchronization=True)` on the trainer alone, recorded from a real 2-rank gloo run
    (where it passes): check_comm fails naming the group, the rank that never joins and the line."""
    torchrun_module(2, "tests.dist_scripts.group_creation", ["alone"], env=traced(tmp_path), timeout=240)
    made = _creations(tmp_path)
    assert [x["local_sync"] for x in made[1]] == [False, True] and len(made[0]) == 1, made
    assert made[1][1]["ranks"] == [1] and made[1][1]["members"] == [0, 1]
    out = _check_comm(tmp_path)
    assert out.returncode == 1, out
    where = _line_of("use_local_synchronization=True")
    flagged = [x for x in out.stdout.splitlines() if "use_local_synchronization=True" in x]
    assert len(flagged) == 1 and where in flagged[0] and "ranks [0] never join" in flagged[0], out.stdout
    # the replay shows the hang itself: rank 1 waits in the creation, rank 0 in the barrier after it
    assert f"rank 1 is blocked at line 1: creation of group ranks:1 on [world] ({where})" in out.stdout, out.stdout


def test_every_rank_creates_every_group_in_one_order(tmp_path):
    """ProcessGroups.create(own=True) makes each trainer's group on every rank, in one order, and
    groups made past commhooks.new_group (new_subgroups) are recorded too, at the line that asked:
    the run passes the check, and FSDP2 over each rank's group computes in bf16."""
    torchrun_module(2, "tests.dist_scripts.group_creation", ["every"], env=traced(tmp_path), timeout=240)
    made = _creations(tmp_path)
    names = [(x["name"], x["ranks"]) for x in made[0]]
    assert names == [("own.t0", [0]), ("own.t1", [1]), ("ranks:0", [0]), ("ranks:1", [1])], names
    assert [(x["name"], x["ranks"]) for x in made[1]] == names
    assert made[0][0]["where"].startswith("parallel/topology.py:")
    assert made[0][2]["where"] == _line_of("dist.new_subgroups(")
    out = _check_comm(tmp_path)
    assert out.returncode == 0 and out.stdout.strip().endswith(", 4 groups created"), out


def _new_group(rank, ranks, name, where, world=(0, 1, 2), local_sync=False, **extra):
    return {"rank": rank, "op": "new_group", "group": "world", "peer": None, "bytes": 0, "name": name,
            "where": where, "members": list(world), "ranks": ranks, "local_sync": local_sync, "via": "new_group",
            **extra}


def test_creations_in_different_orders_and_missing_ones_are_flagged():
    """Two ranks that create two groups in opposite orders, and a rank that skips one: each named
    with the ranks on both sides, the group and its line; the same creations in one order pass."""
    a = {r: _new_group(r, [0, 1], "trainers", "t.py:1") for r in range(3)}
    b = {r: _new_group(r, [2], "own.t2", "t.py:2") for r in range(3)}
    result = replay.check({0: [a[0], b[0]], 1: [a[1], b[1]], 2: [a[2], b[2]]})
    assert result.ok and result.message.endswith("0 communicators, 2 groups created"), result.message
    result = replay.check({0: [a[0], b[0]], 1: [a[1], b[1]], 2: [b[2], a[2]]})
    assert not result.ok
    assert result.mismatches[0].startswith(
        "ranks create groups in different orders: creation #0 on [world] is group trainers [0, 1] at rank 0 line 0 "
        "(t.py:1) on ranks [0, 1], but group own.t2 [2] at rank 2 line 0 (t.py:2) on ranks [2]"), result.mismatches
    result = replay.check({0: [a[0], b[0]], 1: [a[1]], 2: [a[2], b[2]]})
    assert not result.ok and result.mismatches[0].startswith(
        "ranks [1] never create group own.t2 [2] at rank 0 line 1 (t.py:2), their creation #1 on [world]")
    assert "rank 0 is blocked at line 1: creation of group own.t2" in result.message  # and the replay's hang


def test_split_group_is_one_creation_of_its_parent():
    """split_group: every rank of the parent makes one call with every split; the splits are its key."""
    split = {r: _new_group(r, [r % 2], f"ranks:{r % 2}", "s.py:1", world=(0, 1), via="split_group",
                           splits=[[0], [1]]) for r in range(2)}
    assert creation.key(split[0]) == creation.key(split[1]) == "split_group [[0], [1]]"
    assert replay.check({0: [split[0]], 1: [split[1]]}).ok
    other = {**split[1], "splits": [[0, 1]], "ranks": [0, 1]}
    assert not replay.check({0: [split[0]], 1: [other]}).ok


def test_the_recorder_writes_a_creation_line(tmp_path, monkeypatch):
    """The line format docs/communication.md gives, "where" at the caller."""
    from telemetry import commtrace
    monkeypatch.setenv(commtrace.ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    commtrace.reset()
    try:
        commtrace.record_creation([1], True, [0, 1], "ranks:1")
    finally:
        commtrace.reset()
    line = json.loads((tmp_path / "rank1.jsonl").read_text())
    assert {k: line[k] for k in ("op", "group", "name", "ranks", "local_sync", "members", "via")} == {
        "op": "new_group", "group": "world", "name": "ranks:1", "ranks": [1], "local_sync": True, "members": [0, 1],
        "via": "new_group"}
    assert line["where"].startswith("tests/test_group_creation.py:")
