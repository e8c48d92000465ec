"""Run safety of one rank: heartbeats, faults blamed on the rank that failed, stop on signal,
adaptive timeouts.

Every rank runs a heartbeat thread over a store connection of its own (parallel/store.py; a
blocking get holds its connection, so the main thread's waits never delay a beat):

- Faults. A rank whose own code raises (anything but a broken connection to a peer) publishes
  its error first, to guard/fault: "trainer rank 1 failed at step 0: RuntimeError: ...". Every
  other rank polls it each beat, prints it and exits (3; 2 when it was a user error). A rank whose
  connection to a peer broke looks for that report (the peer wrote it before it exited), and only
  when none comes blames silence: a peer whose beat has not changed for SILENCE_BEATS beats and
  a second. The heartbeat thread itself reports a peer silent for --heartbeat-timeout-s (5 s while
  a stop is under way, when every rank should be beating): "generator rank 0 (replica 0) stopped
  answering at step 17".
- Torchrun's death. A worker whose parent (torchrun's agent) is gone says so in one line and exits
  3, without touching the store the agent hosted (each touch of a dead store prints a C++ trace).
- Signals. SIGTERM and SIGINT reach the thread through signal.set_wakeup_fd, even while the main
  thread waits in a collective. The rank that claims guard/stop/claim first decides the stop step
  S = 1 + the highest step any rank has begun (each rank writes guard/began/{rank} before it
  checks for a stop, so no rank has begun S); every rank finishes the steps before S, the trainers
  write checkpoint step-S, and all exit with code 4; --stop-grace-s bounds the whole stop. A second
  SIGTERM or SIGINT 2 s or more after the first exits at once (128 + N), without a checkpoint; one
  within 2 s belongs to the same stop: SLURM and a terminal's Ctrl-C signal every process of the job,
  and torchrun forwards its own copy, so each rank receives the one request twice.
- Timeouts. After each step, collectives, point-to-point and store waits time out after 5 x the
  slowest step so far (at least 60 s, and 60 s beyond --reward-timeout-s when a reward service
  scores: a fragment may wait that long for its scores before its generator reports the service);
  before the first, after --dist-timeout-s or 5 x the step the start-up probe predicts, whichever
  is longer (`expect_step`), and never before the reward service's floor either; around scheduled
  checkpoints and evaluations, and at the end, after --dist-timeout-s or the step's timeout,
  whichever is longer.
  Each point-to-point wait counts from when it starts (parallel/p2p.py). The NCCL watchdog counts
  an op from when it was posted, and an op may stay posted through a long evaluation or checkpoint:
  the point-to-point communicators get `pending_timeout_s` as theirs, a backstop; a dead or silent
  rank is named by the heartbeats long before.
- Exits. Every way out that runs code (shutdown, a fault, a second signal) runs the exit hooks
  (`at_exit`: rank 0 releases the run folder's lock, checkpointing/lock.py).

Exit codes (docs/reliability.md): 0 done; 1 unexpected error (traceback); 2 user error, one
line; 3 the run stopped on a fault it names (a peer failed, died or stopped answering, torchrun
died, non-finite values N steps in a row, a timeout, the stop grace ran out); 4 stopped by
SIGTERM/SIGINT after writing a checkpoint; 128 + N a second signal N.
"""
from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from tqdm import tqdm

from config.preflight import RAISE_ENV
from rl.nonfinite import RunAbort
from parallel import p2p, torchapi
from parallel.store import StepStore
from parallel import store_keys as keys

EXIT_OK, EXIT_ERROR, EXIT_USER, EXIT_ABORT, EXIT_STOPPED = 0, 1, 2, 3, 4
STOP_SILENCE_S = 5.0  # during a stop every rank beats: a silent one is gone
SILENCE_BEATS = 4  # a peer is silent only when its beat stayed the same this many beats (and a second)
SECOND_SIGNAL_S = 2.0  # a signal this soon after the first is the same request (torchrun forwards its copy)
MIN_TIMEOUT_S, TIMEOUT_FACTOR = 60.0, 5.0
PENDING_S = 6 * 3600.0  # the watchdog backstop of point-to-point communicators (module docstring)
_ACTIVE: "RunGuard | None" = None
_EXIT_HOOKS: list = []


def active() -> "RunGuard | None":
    return _ACTIVE


def at_exit(hook) -> None:
    """Run `hook()` on every way out of this process that runs code (run_exit_hooks)."""
    _EXIT_HOOKS.append(hook)


def run_exit_hooks() -> None:
    while _EXIT_HOOKS:
        try:
            _EXIT_HOOKS.pop()()
        except Exception:  # noqa: BLE001 - an exit goes on
            pass


def say(line: str) -> None:
    """A line on stderr, on a line of its own even while the logging rank's progress bar is drawn."""
    tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()


def write_error_file(line: str) -> None:
    """torchrun's summary shows this line as the root cause instead of a link (its error file)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass


def pending_timeout_s(dist_timeout_s: float) -> float:
    """The NCCL watchdog timeout of a point-to-point communicator: it counts from posting, and a
    fragment sent before the trainers' evaluation or checkpoint waits for all of it."""
    return max(float(dist_timeout_s), PENDING_S)


def timeout_floor_s(reward_timeout_s: float, remote: bool) -> float:
    """The shortest adaptive timeout: MIN_TIMEOUT_S, beyond --reward-timeout-s when a reward service
    scores (its deadline, retries included, counts from a fragment's submission; a peer waiting
    for that fragment must outwait it, or it would blame the generator for the service's delay)."""
    return MIN_TIMEOUT_S + (float(reward_timeout_s) if remote else 0.0)


def first_line(exc: BaseException) -> str:
    """'Type: the first line of the message', without a backend's source location and advice."""
    return f"{type(exc).__name__}: {p2p.backend_detail(exc)}"


def is_comm_error(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, (p2p.PeerError, dist.DistError)) or any(
        s in text for s in ("Connection closed", "Connection reset", "Timed out", "timeout", "pair closure"))


class RunGuard:
    def __init__(self, topo, rank: int, store: StepStore, *, heartbeat_timeout_s: float, stop_grace_s: float,
                 dist_timeout_s: float, groups: list, start_step: int, reward_timeout_s: float | None = None):
        """`reward_timeout_s`: --reward-timeout-s when a reward service scores (None: none does); no
        wait times out within 60 s beyond it, before the first step or after (timeout_floor_s)."""
        self.topo, self.rank, self.world = topo, rank, topo.world_size
        self.me = topo.describe(rank)
        self.data_store, self.main, self.beats = store, store.clone(), store.clone()
        self.silence_s, self.grace_s, self.flat_s = heartbeat_timeout_s, stop_grace_s, float(dist_timeout_s)
        self.interval = max(0.2, min(1.0, heartbeat_timeout_s / 10))
        self.groups = groups  # the process groups this rank belongs to
        self.step, self.phase, self.start_step = start_step, "loading", start_step
        self.stop_at: int | None = None
        self.slowest = 0.0
        self.floor_s = timeout_floor_s(reward_timeout_s or 0.0, reward_timeout_s is not None)  # the shortest timeout
        self.served = reward_timeout_s is not None
        self.expected = 0.0  # the step the start-up probe predicts, until one is measured
        self.timeout_s = self.flat_s
        self.peers = [p for p in range(self.world) if p != rank] if self.world <= 16 else \
            sorted({(rank + 1) % self.world, (rank + 2) % self.world} - {rank})
        self._seq = 0
        self._last: dict[int, str | None] = {}
        self._changed: dict[int, float] = {}
        self._finished: set[int] = set()
        self._signal: tuple[str, float] | None = None
        self._stop_since: float | None = None
        self._decided = False
        self._done = threading.Event()
        self._exiting = threading.Lock()  # the first way out (main thread or heartbeat thread) prints and exits
        self._thread: threading.Thread | None = None
        self._wake = -1
        # torchrun's agent, the parent of a worker it started (None otherwise: a shell may end before its job)
        under_agent = "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.parent = os.getppid() if under_agent else None
        fault = os.environ.get(RAISE_ENV, "")
        self._inject = tuple(map(int, fault.split(":"))) if fault else None  # test hook: (rank, step)

    # ----- lifecycle (main thread) ------------------------------------------------------------
    def start(self) -> "RunGuard":
        global _ACTIVE
        _ACTIVE = self
        p2p.configure(timeout_s=self.flat_s, describe=self.topo.describe)
        self._beat()
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        self._wake = read
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: None)  # the thread acts on it (set_wakeup_fd)
        self._thread = threading.Thread(target=self._loop, name="digenrl-heartbeat", daemon=True)
        self._thread.start()
        return self

    def rebind(self, topo, groups: list) -> "RunGuard":
        """The run's placement changed inside the run (--placement auto): the same guard, its
        heartbeats and signals, watches the roles and communicators of `topo` from here on."""
        self.topo, self.me, self.groups = topo, topo.describe(self.rank), groups
        p2p.configure(timeout_s=self.timeout_s, describe=topo.describe)
        return self

    def finish(self, code: int) -> None:
        """After the final barrier: a rank that ended well is not 'silent' to its watchers."""
        if code in (EXIT_OK, EXIT_STOPPED):
            try:
                self.main.put(keys.rank_done(self.rank), 1)
            except Exception:  # noqa: BLE001 - the store may be gone with torchrun
                pass
        self._done.set()

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    # ----- steps, stops and timeouts (main thread) ----------------------------------------------
    def stop_before(self, step: int) -> bool:
        """At the start of each step: True if the run stops before `step` (a signal somewhere)."""
        self.step, self.phase = step, "step"
        self._beat(self.main)  # a rank that dies now is reported at this step
        self.main.put(keys.step_began(self.rank), step)
        if self.stop_at is None:
            if not self.main.ready(keys.STOP_REQUEST):
                return False
            self._stop_since = self._stop_since or time.monotonic()
            deadline = time.monotonic() + 30
            while (at := self.main.get_if_set(keys.STOP_AT)) is None:
                if time.monotonic() > deadline:
                    raise RunAbort("a stop was requested but no rank decided its step within 30 s")
                time.sleep(0.02)
            self.stop_at = int(at)
        return step >= self.stop_at

    @property
    def stopping(self) -> bool:
        return self.stop_at is not None

    def injected_fault(self, step: int) -> None:
        """Test hook (DIGENRL_DEBUG_RAISE=RANK:STEP): this rank's own code fails at that step."""
        if self._inject == (self.rank, step):
            raise RuntimeError(f"injected fault ({RAISE_ENV}={self.rank}:{step})")

    def step_done(self, seconds: float) -> None:
        self.slowest = max(self.slowest, seconds)

    def expect_step(self, seconds: float) -> None:
        """The first step's predicted seconds (the start-up probe): its timeouts scale with it."""
        self.expected = float(seconds)

    def set_timeouts(self, relaxed: bool) -> None:
        """Adaptive timeouts for the coming step (module docstring); `relaxed`: a checkpoint or an
        evaluation is due, or the run ends."""
        if self.slowest:
            t = max(self.floor_s, TIMEOUT_FACTOR * self.slowest)
            t = max(self.flat_s, t) if relaxed else t
        else:  # a prediction without the first step's one-off costs never shortens --dist-timeout-s, and a
            # fragment waits for a reward service from the first step on
            t = max(self.flat_s, TIMEOUT_FACTOR * self.expected, self.floor_s if self.served else 0.0)
        if t == self.timeout_s:
            return
        self.timeout_s = t
        set_pg_timeout = torchapi.optional(  # torch's private setter: no public one changes a live group's
            "torch.distributed.distributed_c10d._set_pg_timeout", "adaptive collective timeouts (runtime/guard.py)",
            "the collective groups keep --dist-timeout-s; point-to-point waits and the store still adapt")
        for group in self.groups if set_pg_timeout is not None else ():
            set_pg_timeout(timedelta(seconds=t), group)
        self.data_store.set_timeout(t)
        p2p.configure(timeout_s=t)

    # ----- failures (main thread) ------------------------------------------------------------------
    @property
    def silence_window_s(self) -> float:
        """How long a peer's beat must stay the same before it counts as silent: several beats and
        a margin, never less than the interval between beats."""
        return SILENCE_BEATS * self.interval + 1.0

    def report(self, description: str, code: int = EXIT_ABORT) -> str:
        """Publish a fault for every rank (the first report wins); returns the one that stands."""
        try:
            if self.main.add(keys.FAULT_CLAIM, 1) == 1:
                _publish_fault(self.main, description, code)
                return description
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                first = _read_fault(self.main)
                if first is not None:
                    return first[0]
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store may be gone
            pass
        return description

    def diagnose(self, window_s: float | None = None) -> str | None:
        """A peer's fault report, or the peers whose beat did not change for `window_s` (default:
        the silence window)."""
        window_s = self.silence_window_s if window_s is None else window_s
        try:
            first = {p: self.main.get_if_set(keys.heartbeat(p)) for p in range(self.world) if p != self.rank}
            deadline = time.monotonic() + window_s
            while True:
                fault = _read_fault(self.main)
                if fault is not None:
                    return fault[0]
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.25)
            silent = [p for p, beat in first.items() if self.main.get_if_set(keys.heartbeat(p)) == beat
                      and not self.main.ready(keys.rank_done(p))]
        except Exception:  # noqa: BLE001
            return None
        return "; ".join(self._silent(p, first[p], window_s) for p in silent) or None

    def explain(self, exc: BaseException) -> tuple[int, str, bool]:
        """(exit code, the one line to print, whether a traceback helps) for an exception of the
        main thread; peers learn of it through guard/fault."""
        # This rank reports and exits itself: the heartbeat thread must not race it to the exit, but it
        # beats on while the main thread waits out a diagnosis, or peers would find this rank silent.
        self._exiting.acquire(timeout=30)  # held by the heartbeat thread only while it ends the process itself
        if isinstance(exc, ValueError) and not isinstance(exc, p2p.PeerError):
            self.report(f"{self.me} stopped on a user error: {exc}", EXIT_USER)
            return EXIT_USER, f"error: {exc}", False
        if isinstance(exc, RunAbort):
            self.report(f"{self.me} stopped the run at step {self.step}: {exc}")
            return EXIT_ABORT, f"error: {exc}", False
        if not is_comm_error(exc):  # this rank's own failure: said first, before any diagnosis
            line = f"{self.me} failed at step {self.step}: {first_line(exc)}"
            stands = self.report(line, EXIT_ERROR)
            if stands != line:  # a peer failed first: this error follows from it
                return self._code_of_fault(), f"error: {stands}; {self.me} stopped at step {self.step} " \
                                              f"({first_line(exc)})", False
            return EXIT_ERROR, f"error: {line}", True
        if self.agent_gone(wait_s=0.5):  # before the store: touching a dead store prints C++ traces
            return EXIT_ABORT, f"error: {self.agent_line()}", False
        cause = self.diagnose()
        if cause is None and isinstance(exc, p2p.PeerError):
            cause = str(exc)
        if cause is not None:
            cause = self.report(cause)
            return self._code_of_fault(), f"error: {cause}; {self.me} stopped at step {self.step} ({first_line(exc)})", \
                False
        line = f"{self.me} failed at step {self.step}: {first_line(exc)}"
        self.report(line, EXIT_ERROR)
        return EXIT_ERROR, f"error: {line}", True

    def _code_of_fault(self) -> int:
        """This rank's exit code for the fault that stands: 2 when it was a user error, else 3."""
        try:
            fault = _read_fault(self.main)
        except Exception:  # noqa: BLE001 - the store may be gone
            fault = None
        return EXIT_USER if fault is not None and fault[1] == EXIT_USER else EXIT_ABORT

    def agent_gone(self, wait_s: float = 0.0) -> bool:
        """torchrun's agent (this worker's parent) has died: the worker was handed to another parent.
        `wait_s`: the kernel closes a dying process's sockets just before it hands its children on."""
        if self.parent is None:
            return False
        deadline = time.monotonic() + wait_s
        while os.getppid() == self.parent:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def agent_line(self) -> str:
        return (f"torchrun (pid {self.parent}) is gone, and the rendezvous store with it: {self.me} stops at step "
                f"{self.step} without a new checkpoint")

    # ----- the heartbeat thread -------------------------------------------------------------------
    def _beat(self, store: StepStore | None = None) -> None:
        self._seq += 1
        (store or self.beats).put(keys.heartbeat(self.rank), f"{self._seq} {self.step} {self.phase}")

    def _silent(self, peer: int, beat: str | None, age: float) -> str:
        step = beat.split()[1] if beat else "?"
        phase = f"; last phase: {beat.split()[2]}" if beat and len(beat.split()) > 2 else ""
        return f"{self.topo.describe(peer)} stopped answering at step {step} (no heartbeat for {age:.0f} s{phase})"

    def _die(self, code: int, line: str) -> None:
        """The heartbeat thread ends the process, unless the main thread is already on its way out."""
        if not self._exiting.acquire(blocking=False):
            self._done.set()
            return
        say(line)
        write_error_file(line)
        sys.stdout.flush()
        run_exit_hooks()
        os._exit(code)

    def _loop(self) -> None:
        store_down_since = None
        while not self._done.is_set():
            try:
                if select.select([self._wake], [], [], self.interval)[0]:
                    self._on_signals(os.read(self._wake, 64))
            except (OSError, ValueError):
                time.sleep(self.interval)
            if self._done.is_set():
                return
            if self.agent_gone():
                self._die(EXIT_ABORT, f"error: {self.agent_line()}")
                return
            try:
                self._tick()
                store_down_since = None
            except Exception as e:  # noqa: BLE001 - the store itself is gone (torchrun died?)
                if self._done.is_set():
                    return
                store_down_since = store_down_since or time.monotonic()
                if time.monotonic() - store_down_since > self.silence_s:
                    self._die(EXIT_ABORT, f"error: {self.me} lost the rendezvous store for {self.silence_s:.0f} s "
                                          f"({first_line(e)}): torchrun or rank 0's host is gone")

    def _tick(self) -> None:
        self._beat()
        fault = _read_fault(self.beats)
        if fault is not None:
            line, code = fault
            self._die(EXIT_USER if code == EXIT_USER else EXIT_ABORT, f"error: {line}; {self.me} stops")
            return
        if self._signal is not None and not self._decided:
            self._decide_stop()
        if self._stop_since is None and self.beats.ready(keys.STOP_REQUEST):
            self._stop_since = time.monotonic()
        if self._stop_since is not None and time.monotonic() - self._stop_since > self.grace_s:
            line = (f"the stop did not finish within --stop-grace-s {self.grace_s:g} s; exiting without a new "
                    f"checkpoint")
            _publish_fault(self.beats, f"{self.me}: {line}", EXIT_ABORT)
            self._die(EXIT_ABORT, f"error: {self.me}: {line}")
            return
        self._watch()

    def _on_signals(self, data: bytes) -> None:
        for sig in data:
            if sig not in (signal.SIGTERM, signal.SIGINT):
                continue
            name, now = signal.Signals(sig).name, time.monotonic()
            if self._signal is None:
                self._signal = (name, now)
            elif now - self._signal[1] >= SECOND_SIGNAL_S:
                self._die(128 + sig, f"error: {self.me}: a second {name}, {now - self._signal[1]:.1f} s after the "
                                     f"first: exiting now (code {128 + sig}), without a checkpoint")

    def _decide_stop(self) -> None:
        self._decided = True
        self._stop_since = self._stop_since or time.monotonic()
        if self.beats.add(keys.STOP_CLAIM, 1) != 1:
            return  # another rank decides
        self.beats.put(keys.STOP_REQUEST, {"rank": self.rank, "signal": self._signal[0]})
        began = [self.beats.get_if_set(keys.step_began(r)) for r in range(self.world)]
        at = max((int(b) for b in began if b is not None), default=self.start_step - 1) + 1
        self.beats.put(keys.STOP_AT, at)
        say(f"{self.signal_name} on {self.me}: the run stops before step {at} (every rank finishes the steps before "
            f"it, the trainers write checkpoint step-{at}; --stop-grace-s {self.grace_s:g}). A second SIGTERM or SIGINT "
            f"{SECOND_SIGNAL_S:g} s or more after this one exits at once without a checkpoint; one sooner is this "
            f"request again (torchrun forwards the signal that SLURM or Ctrl-C also sent every rank)")

    @property
    def signal_name(self) -> str | None:
        return self._signal[0] if self._signal else None

    def _watch(self) -> None:
        now = time.monotonic()
        limit = STOP_SILENCE_S if self._stop_since is not None else self.silence_s
        for p in self.peers:
            if p in self._finished:
                continue
            beat = self.beats.get_if_set(keys.heartbeat(p))
            if p not in self._changed or beat != self._last.get(p):
                self._last[p], self._changed[p] = beat, now
                continue
            age = now - self._changed[p]
            if age > limit:
                if self.beats.ready(keys.rank_done(p)):
                    self._finished.add(p)
                    continue
                line = self._silent(p, beat, age)
                if self.beats.add(keys.FAULT_CLAIM, 1) == 1:
                    _publish_fault(self.beats, line, EXIT_ABORT)
                self._die(EXIT_ABORT, f"error: {line}; {self.me} stops")
                return


def _publish_fault(store: StepStore, line: str, code: int) -> None:
    """The fault every rank prints (the caller holds guard/fault_claim) and the code they exit with."""
    store.put(keys.FAULT, {"line": line, "code": code})


def _read_fault(store: StepStore) -> tuple[str, int] | None:
    fault = store.get_if_set(keys.FAULT)
    if fault is None:
        return None
    return (fault["line"], fault["code"]) if isinstance(fault, dict) else (str(fault), EXIT_ABORT)
