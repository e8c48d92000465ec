"""lab/nccl/replay.py replays recorded communication under NCCL's rules (no buffering, one FIFO
stream per communicator and rank): each hand-reduced pattern below runs on gloo yet hangs on NCCL,
and must be reported as a deadlock naming the right ranks, while its fixed form must pass."""
import json
import os
import subprocess
import sys
import time
from datetime import timedelta

from parallel import p2p
from telemetry import commtrace
from lab.nccl import replay

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Trace:
    """Builds per-rank traces in the recorder's format; every op's "where" is its label, so the
    assertions can check that the report points at the right lines."""

    def __init__(self):
        self.lines: dict[int, list[dict]] = {}

    def _add(self, rank, op, group="world", peer=None, nbytes=0, name="", where=None, **extra):
        lines = self.lines.setdefault(rank, [])
        lines.append({"rank": rank, "op": op, "group": group, "peer": peer, "bytes": nbytes, "name": name,
                      "where": where or f"r{rank}.py:{len(lines)}", **extra})
        return len(lines) - 1

    def isend(self, rank, peer, group="world", nbytes=64, name="", where=None):
        return self._add(rank, "send", group, peer, nbytes, name, where)

    def irecv(self, rank, peer, group="world", nbytes=64, name="", where=None):
        return self._add(rank, "recv", group, peer, nbytes, name, where)

    def wait(self, rank, target, where=None):
        return self._add(rank, "wait", self.lines[rank][target]["group"], where=where, target=target)

    def send(self, rank, peer, group="world", nbytes=64, name="", where=None):
        """Blocking send: the post, then a wait on it (as the recorder writes it)."""
        i = self.isend(rank, peer, group, nbytes, name, where)
        self.wait(rank, i, where)
        return i

    def recv(self, rank, peer, group="world", nbytes=64, name="", where=None):
        i = self.irecv(rank, peer, group, nbytes, name, where)
        self.wait(rank, i, where)
        return i

    def sync(self, rank, where=None):
        return self._add(rank, "sync", "", where=where)

    def collective(self, rank, name, members, group="world", nbytes=64, where=None):
        return self._add(rank, "collective", group, None, nbytes, name, where, members=sorted(members))

    def batch(self, rank, ops, where=None):
        """batch_isend_irecv: ops = [("send"|"recv", peer, group, nbytes)], bracketed; returns indices."""
        self._add(rank, "group_start", "", where=where)
        out = [self._add(rank, op, group, peer, nbytes, "", where) for op, peer, group, nbytes in ops]
        self._add(rank, "group_end", "", where=where)
        return out

    def check(self):
        return replay.check(self.lines)


def assert_deadlock(result, ranks, *wheres):
    assert not result.ok, result.message
    assert result.deadlock, result.message
    assert result.deadlocked_ranks() == set(ranks), result.message
    assert "DEADLOCK" in result.message
    for r in ranks:
        assert f"rank {r}" in result.message
    for w in wheres:
        assert w in result.message, (w, result.message)


def assert_ok(result):
    assert result.ok, result.message
    assert result.message.startswith("ok: ")


# ------------------------------------------------------------------ 1. device-wide sync

def _sync_case(with_sync: bool, one_communicator: bool = False):
    t = Trace()
    fwd = "world" if one_communicator else "fwd"
    # stage 0: irecv the gradient from stage 1, (a traced span synchronizes the device), send activations
    g = t.irecv(0, 1, "world", name="grad", where="stage0.py:10")
    if with_sync:
        t.sync(0, where="tracing.py:span")
    t.send(0, 1, fwd, name="act", where="stage0.py:20")
    t.wait(0, g, where="stage0.py:30")
    # stage 1: needs the activations before it can send the gradient back
    t.recv(1, 0, fwd, name="act", where="stage1.py:10")
    t.send(1, 0, "world", name="grad", where="stage1.py:20")
    return t.check()


def test_sync_while_a_receive_needs_the_ranks_own_later_send_deadlocks():
    r = _sync_case(with_sync=True)
    assert_deadlock(r, [0, 1], "tracing.py:span", "stage0.py:10", "stage1.py:10")
    assert r.blocked[0].at.op == "sync"
    assert r.blocked[1].at.op == "wait" and r.blocked[1].at.where == "stage1.py:10"
    assert r.cycles == [[0, 1]]
    assert_ok(_sync_case(with_sync=False))


def test_without_the_sync_one_communicator_still_blocks_at_the_head_of_its_stream():
    # the irecv at the head of stage 0's only stream holds back its send: see case 2
    assert_deadlock(_sync_case(with_sync=False, one_communicator=True), [0, 1])


# ------------------------------------------------------------------ 2. two-stage pipeline

def _pipeline(fix: str | None):
    t = Trace()
    fwd, bwd = ("fwd", "bwd") if fix == "communicators" else ("world", "world")
    if fix == "order":
        t.send(0, 1, fwd, name="act", where="stage0.py:send")
        g = t.irecv(0, 1, bwd, name="grad", where="stage0.py:irecv")
    else:
        g = t.irecv(0, 1, bwd, name="grad", where="stage0.py:irecv")
        t.send(0, 1, fwd, name="act", where="stage0.py:send")
    t.wait(0, g)
    t.recv(1, 0, fwd, name="act", where="stage1.py:recv")
    t.send(1, 0, bwd, name="grad", where="stage1.py:send")
    return t.check()


def test_pipeline_irecv_posted_before_the_send_on_one_communicator_deadlocks():
    r = _pipeline(None)
    assert_deadlock(r, [0, 1], "stage0.py:irecv", "stage0.py:send", "stage1.py:recv")
    # stage 0 is stuck in its blocking send, whose op is queued behind the irecv
    assert r.blocked[0].at.where == "stage0.py:send"
    assert any(h.op.where == "stage0.py:irecv" for h in r.blocked[0].heads)
    assert "[world]" in r.message


def test_pipeline_fixed_by_a_communicator_per_direction_or_by_sending_first():
    assert_ok(_pipeline("communicators"))
    assert_ok(_pipeline("order"))


# ------------------------------------------------------------------ 3. TCSS crossing

def _tcss(separate: bool):
    t = Trace()
    up, down = ("gen2trainer", "trainer2gen") if separate else ("tcss", "tcss")
    gen, trainer = 2, 0
    frag = t.isend(gen, trainer, up, nbytes=64 << 20, name="fragment", where="tcss.py:gen_send")
    for b in range(3):
        t.recv(gen, trainer, down, nbytes=1 << 20, name=f"version{b}", where="tcss.py:gen_recv")
    t.wait(gen, frag, where="tcss.py:gen_wait")
    for b in range(3):
        t.send(trainer, gen, down, nbytes=1 << 20, name=f"version{b}", where="tcss.py:trainer_send")
    t.recv(trainer, gen, up, nbytes=64 << 20, name="fragment", where="tcss.py:trainer_recv")
    return t.check()


def test_tcss_fragment_and_version_crossing_on_one_communicator_deadlocks():
    r = _tcss(separate=False)
    assert_deadlock(r, [0, 2], "tcss.py:gen_send", "tcss.py:trainer_send", "tcss.py:gen_recv")
    assert "rank 0 -> rank 2 -> rank 0" in r.message


def test_tcss_fixed_by_a_communicator_per_direction():
    assert_ok(_tcss(separate=True))


# ------------------------------------------------------------------ 4. trainers exchanging shares

def _exchange(mode: str):
    t = Trace()
    for me, other in ((0, 1), (1, 0)):
        if mode == "naive":
            t.send(me, other, name="share", where=f"trainer{me}.py:send")
            t.recv(me, other, name="share", where=f"trainer{me}.py:recv")
        elif mode == "ordered":  # the lower rank sends first
            if me < other:
                t.send(me, other, name="share", where=f"trainer{me}.py:send")
                t.recv(me, other, name="share", where=f"trainer{me}.py:recv")
            else:
                t.recv(me, other, name="share", where=f"trainer{me}.py:recv")
                t.send(me, other, name="share", where=f"trainer{me}.py:send")
        else:  # batch_isend_irecv: one grouped unit, then wait on both works
            s, rv = t.batch(me, [("send", other, "world", 64), ("recv", other, "world", 64)],
                            where=f"trainer{me}.py:batch")
            t.wait(me, s)
            t.wait(me, rv)
    return t.check()


def test_trainers_both_sending_first_on_one_communicator_deadlock():
    r = _exchange("naive")
    assert_deadlock(r, [0, 1], "trainer0.py:send", "trainer1.py:send")
    assert r.blocked[0].heads[0].op.op == "send" and r.blocked[1].heads[0].op.op == "send"


def test_trainers_exchange_fixed_by_rank_order_or_a_grouped_batch():
    assert_ok(_exchange("ordered"))
    assert_ok(_exchange("batch"))


def test_grouped_batch_on_one_side_is_enough():
    # rank 0's send and recv are at the head together, so rank 1's blocking send matches the recv,
    # then rank 1's recv meets the send still waiting in rank 0's group
    t = Trace()
    s, rv = t.batch(0, [("send", 1, "world", 64), ("recv", 1, "world", 64)])
    t.wait(0, s)
    t.wait(0, rv)
    t.send(1, 0, name="share", where="trainer1.py:send")
    t.recv(1, 0, name="share", where="trainer1.py:recv")
    assert_ok(t.check())


def test_grouped_call_spanning_communicators_and_nested_brackets():
    # one ncclGroupStart/End around p2p on two communicators (nested, as helpers may open their own):
    # each communicator gets one unit, and nothing in the group queues behind the rest of it
    t = Trace()
    t._add(0, "group_start", "")
    a, b = t.batch(0, [("send", 1, "x", 8), ("send", 1, "y", 8)])
    c = t.irecv(0, 1, "x", 8)
    t._add(0, "group_end", "")
    for i in (a, b, c):
        t.wait(0, i)
    t.recv(1, 0, "y", 8)
    t.send(1, 0, "x", 8)
    t.recv(1, 0, "x", 8)
    assert_ok(t.check())


def test_wait_inside_a_group_bracket_is_malformed():
    t = Trace()
    t._add(0, "group_start", "")
    i = t.isend(0, 1)
    t.wait(0, i)
    t._add(0, "group_end", "")
    try:
        t.check()
    except replay.TraceError as e:
        assert "inside a group_start/group_end bracket" in str(e)
    else:
        raise AssertionError("accepted a wait inside a grouped call")


# ------------------------------------------------------------------ 5. generator and scorer

def _scoring(separate: bool):
    t = Trace()
    images, scores = ("images", "scores") if separate else ("world", "world")
    gen, scorer = 1, 3
    h = t.isend(gen, scorer, images, nbytes=1 << 22, name="images f1", where="scoring.py:gen_isend")
    t.recv(gen, scorer, scores, nbytes=256, name="scores f0", where="scoring.py:gen_recv")
    t.wait(gen, h)
    t.send(scorer, gen, scores, nbytes=256, name="scores f0", where="scoring.py:scorer_send")
    t.recv(scorer, gen, images, nbytes=1 << 22, name="images f1", where="scoring.py:scorer_recv")
    return t.check()


def test_generator_and_scorer_crossing_without_buffering_deadlocks():
    r = _scoring(separate=False)
    assert_deadlock(r, [1, 3], "scoring.py:gen_isend", "scoring.py:scorer_send")


def test_generator_and_scorer_fixed_by_a_communicator_for_scores():
    assert_ok(_scoring(separate=True))


# ------------------------------------------------------------------ collectives, clean runs, unmatched

def test_collective_order_mismatch_is_an_error():
    t = Trace()
    t.collective(0, "all_reduce", [0, 1], where="a.py:1")
    t.collective(0, "broadcast", [0, 1], where="a.py:2")
    t.collective(1, "broadcast", [0, 1], where="b.py:1")
    t.collective(1, "all_reduce", [0, 1], where="b.py:2")
    r = t.check()
    assert not r.ok
    assert any("collective order mismatch" in m for m in r.mismatches), r.message
    assert "a.py:1" in r.message and "b.py:1" in r.message


def test_missing_collective_and_unmatched_isend_are_reported():
    t = Trace()
    t.collective(0, "barrier", [0, 1])
    t.isend(1, 0, name="orphan", where="orphan.py:7")
    r = t.check()
    assert not r.ok and not r.deadlock
    names = {(u.rank, u.op) for u in r.unmatched}
    assert names == {(0, "collective"), (1, "send")}, r.message
    assert "UNMATCHED" in r.message and "orphan.py:7" in r.message
    assert "never posts" in r.message


def test_bytes_mismatch_is_reported():
    t = Trace()
    t.send(0, 1, nbytes=100)
    t.recv(1, 0, nbytes=96, where="short.py:3")
    r = t.check()
    assert not r.ok and not r.blocked
    assert "bytes differ" in r.message and "short.py:3" in r.message


def test_clean_multi_rank_trace_passes():
    t = Trace()
    world, trainers = [0, 1, 2, 3], [0, 1]
    for r in world:
        t.collective(r, "barrier", world)
    for r in trainers:  # trainers reduce gradients on their own communicator
        t.collective(r, "all_reduce", trainers, group="dp")
    # trainer 0 publishes to generators 2 and 3 on per-pair communicators, non-blocking
    hs = [t.isend(0, g, f"pub{g}", nbytes=1 << 20, name="weights") for g in (2, 3)]
    for g in (2, 3):
        t.recv(g, 0, f"pub{g}", nbytes=1 << 20, name="weights")
    for h in hs:
        t.wait(0, h)
    # generators 2 and 3 exchange with a grouped call, then everyone synchronizes and meets again
    for me, other in ((2, 3), (3, 2)):
        for i in t.batch(me, [("recv", other, "gen", 8), ("send", other, "gen", 8)]):
            t.wait(me, i)
    for r in world:
        t.sync(r)
        t.collective(r, "all_reduce", world)
    r = t.check()
    assert_ok(r)
    assert r.message == f"ok: {r.n_ops} ops on 4 ranks, 5 communicators"
    assert r.n_ops == 4 + 2 + 2 + 2 + 4 + 4


def test_replay_is_fast_on_a_long_trace():
    t = Trace()
    ranks, steps = 8, 700  # a ring of 8 ranks: ~17k lines
    for s in range(steps):
        for r in range(ranks):
            nxt, prv = (r + 1) % ranks, (r - 1) % ranks
            a = t.isend(r, nxt, f"ring{r}", name=f"s{s}")
            b = t.irecv(r, prv, f"ring{prv}", name=f"s{s}")
            t.wait(r, a)
            t.wait(r, b)
        if s % 100 == 0:
            for r in range(ranks):
                t.collective(r, "all_reduce", range(ranks))
    start = time.perf_counter()
    r = t.check()
    assert_ok(r)
    assert time.perf_counter() - start < 5.0


# ------------------------------------------------------------------ recorder and CLI

def test_recorder_writes_the_trace_format(tmp_path, monkeypatch):
    monkeypatch.setenv(commtrace.ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    commtrace.reset()
    try:
        assert commtrace.enabled()
        assert commtrace.group_name(None) == "world"
        pg = object()
        commtrace.name_group(pg, "fwd")
        assert commtrace.group_name(pg) == "fwd"
        i = commtrace.record("send", "world", peer=3, nbytes=12, name="self")
        j = commtrace.record("recv", "world", peer=3, nbytes=12, name="self")
        assert (i, j) == (0, 1)
        assert commtrace.record("wait", "world", target=i) == 2
        assert commtrace.record("collective", "world", nbytes=8, name="all_reduce", members=[3]) == 3
        assert commtrace.record_batch([{"op": "send", "group": "g", "peer": 3, "nbytes": 4},
                                       {"op": "recv", "group": "g", "peer": 3, "nbytes": 4}]) == [5, 6]
        commtrace.record("sync", "")
    finally:
        commtrace.reset()
    lines = [json.loads(x) for x in (tmp_path / "rank3.jsonl").read_text().splitlines()]
    assert [x["op"] for x in lines] == ["send", "recv", "wait", "collective", "group_start", "send", "recv",
                                        "group_end", "sync"]
    assert lines[0] == {"rank": 3, "op": "send", "group": "world", "peer": 3, "bytes": 12, "name": "self",
                        "where": lines[0]["where"]}
    assert lines[0]["where"].startswith("tests/test_comm_check.py:")
    assert lines[2]["target"] == 0 and lines[3]["members"] == [3]
    traces = replay.load(str(tmp_path))
    assert list(traces) == [3]
    # a self send posted before its receive on one communicator is stuck at the head of the stream
    r = replay.check(traces)
    assert r.deadlock and r.cycles == [[3]], r.message
    # reopening appends and continues the line numbering
    monkeypatch.setenv(commtrace.ENV, str(tmp_path))
    try:
        assert commtrace.record("sync", "") == 9
    finally:
        commtrace.reset()
    monkeypatch.delenv(commtrace.ENV)
    assert not commtrace.enabled() and commtrace.record("send", "world", peer=0) is None


def _write(tmp_path, trace: Trace):
    for rank, lines in trace.lines.items():
        (tmp_path / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _cli(path):
    return subprocess.run([sys.executable, "-m", "scripts.check_comm", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_cli_exit_codes(tmp_path):
    ok, bad, broken = tmp_path / "ok", tmp_path / "bad", tmp_path / "broken"
    for d in (ok, bad, broken):
        d.mkdir()
    t = Trace()
    t.send(0, 1)
    t.recv(1, 0)
    _write(ok, t)
    t = Trace()
    t.send(0, 1, where="x.py:1")
    t.recv(0, 1)
    t.send(1, 0, where="y.py:2")
    t.recv(1, 0)
    _write(bad, t)
    (broken / "rank0.jsonl").write_text('{"op": "send"\n')
    out = _cli(ok)
    assert out.returncode == 0 and out.stdout.strip() == "ok: 2 ops on 2 ranks, 1 communicators", out
    out = _cli(bad)
    assert out.returncode == 1 and "rank 0 -> rank 1 -> rank 0" in out.stdout and "y.py:2" in out.stdout, out
    out = _cli(broken)
    assert out.returncode == 2 and "not JSON" in out.stderr, out
    assert _cli(tmp_path / "missing").returncode == 2


# ------------------------------------------------------------------ waits counted from when they start

def test_a_wait_is_bounded_from_when_it_starts_not_from_posting(monkeypatch):
    """NCCL counts work.wait(timeout) from posting: p2p.wait adds the time an op has been posted, so
    a fragment sent before a long evaluation still gets the whole allowance once its wait starts."""
    class Work:
        def wait(self, timeout):
            self.timeout = timeout

    monkeypatch.setattr(p2p, "_timeout_s", 60.0)
    monkeypatch.setattr(p2p.time, "monotonic", lambda: 1000.0)
    op = p2p.Posted(Work(), peer=1, group=None, posted_s=1000.0 - 900.0, line=None)  # posted 900 s ago
    p2p.wait(op, "send to")
    assert op.work.timeout == timedelta(seconds=960.0)
