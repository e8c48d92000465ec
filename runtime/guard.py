"""Run safety of one rank: heartbeats, faults reported by name, stop on signal, adaptive timeouts.

Every rank runs a heartbeat thread over a store connection of its own (parallel/store.py; a
blocking get holds its connection, so the main thread's waits never delay a beat):

- Beats. Every `interval` seconds the thread writes guard/hb/{rank} = "seq step phase" and reads
  the beats of the peers it watches (all of them up to 16 ranks, else the next two in a ring). A
  peer whose beat has not changed for --heartbeat-timeout-s (5 s while a stop is under way, when
  every rank should be beating) is reported as "generator rank 0 (replica 0) stopped answering at
  step 17". The first report is written to guard/fault; every rank polls it each beat, prints it
  and exits with code 3. A rank that fails writes its own report there before it exits.
- Signals. SIGTERM and SIGINT reach the thread through signal.set_wakeup_fd, even while the main
  thread waits in a collective. The rank that claims guard/stop/claim first decides the stop step
  S = 1 + the highest step any rank has begun (each rank writes guard/began/{rank} before it
  checks for a stop, so no rank has begun S); every rank finishes the steps before S, the trainers
  write checkpoint step-S, and all exit with code 4. A second signal, 2 s or more after the
  first, exits at once; --stop-grace-s bounds the whole stop.
- Timeouts. After each step, collectives, point-to-point and store waits time out after 5 x the
  slowest step so far (at least 60 s); before the first, after --dist-timeout-s or 5 x the step the
  start-up probe predicts, whichever is longer (`expect_step`); around scheduled checkpoints and
  evaluations, and at the end, after --dist-timeout-s or the step's timeout, whichever is longer.
  Each point-to-point wait counts from when it starts (parallel/p2p.py). The NCCL watchdog counts
  an op from when it was posted, and an op may stay posted through a long evaluation or checkpoint:
  the point-to-point communicators get `pending_timeout_s` as theirs, a backstop; a dead or silent
  rank is named by the heartbeats long before.

Exit codes (README, "Reliability"): 0 done; 1 unexpected error (traceback); 2 user error, one
line, before anything loads; 3 the run stopped on a fault it names (a peer died or stopped
answering, non-finite values N steps in a row, a timeout, the stop grace ran out); 4 stopped by
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
from torch.distributed.distributed_c10d import _set_pg_timeout

from rl.nonfinite import RunAbort
from parallel import p2p
from parallel.store import StepStore

EXIT_OK, EXIT_ERROR, EXIT_USER, EXIT_ABORT, EXIT_STOPPED = 0, 1, 2, 3, 4
STOP_SILENCE_S = 5.0  # during a stop every rank beats: a silent one is gone
MIN_TIMEOUT_S, TIMEOUT_FACTOR = 60.0, 5.0
PENDING_S = 6 * 3600.0  # the watchdog backstop of point-to-point communicators (module docstring)
_ACTIVE: "RunGuard | None" = None


def active() -> "RunGuard | None":
    return _ACTIVE


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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


def first_line(exc: BaseException) -> str:
    """'Type: the first line of the message', without a backend's source location and advice."""
    return f"{type(exc).__name__}: {p2p.backend_detail(exc)}"


def is_comm_error(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, (p2p.PeerError, dist.DistError)) or any(
        s in text for s in ("Connection closed", "Connection reset", "Timed out", "timeout", "pair closure"))


class RunGuard:
    def __init__(self, topo, rank: int, store: StepStore, *, heartbeat_timeout_s: float, stop_grace_s: float,
                 dist_timeout_s: float, groups: list, start_step: int):
        self.topo, self.rank, self.world = topo, rank, topo.world_size
        self.me = topo.describe(rank)
        self.data_store, self.main, self.beats = store, store.clone(), store.clone()
        self.silence_s, self.grace_s, self.flat_s = heartbeat_timeout_s, stop_grace_s, float(dist_timeout_s)
        self.interval = max(0.2, min(1.0, heartbeat_timeout_s / 10))
        self.groups = groups  # the process groups this rank belongs to
        self.step, self.phase, self.start_step = start_step, "loading", start_step
        self.stop_at: int | None = None
        self.slowest = 0.0
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
        self._thread: threading.Thread | None = None
        self._wake = -1

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

    def finish(self, code: int) -> None:
        """After the final barrier: a rank that ended well is not 'silent' to its watchers."""
        if code in (EXIT_OK, EXIT_STOPPED):
            try:
                self.main.put(f"guard/done/{self.rank}", 1)
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
        self.main.put(f"guard/began/{self.rank}", step)
        if self.stop_at is None:
            if not self.main.ready("guard/stop/request"):
                return False
            self._stop_since = self._stop_since or time.monotonic()
            deadline = time.monotonic() + 30
            while (at := self.main.get_if_set("guard/stop/at")) is None:
                if time.monotonic() > deadline:
                    raise RunAbort("a stop was requested but no rank decided its step within 30 s")
                time.sleep(0.02)
            self.stop_at = int(at)
        return step >= self.stop_at

    @property
    def stopping(self) -> bool:
        return self.stop_at is not None

    def step_done(self, seconds: float) -> None:
        self.slowest = max(self.slowest, seconds)

    def expect_step(self, seconds: float) -> None:
        """The first step's predicted seconds (the start-up probe): its timeouts scale with it."""
        self.expected = float(seconds)

    def set_timeouts(self, relaxed: bool) -> None:
        """Adaptive timeouts for the coming step (module docstring); `relaxed`: a checkpoint or an
        evaluation is due, or the run ends."""
        if self.slowest:
            t = max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * self.slowest)
            t = max(self.flat_s, t) if relaxed else t
        else:  # a prediction without the first step's one-off costs never shortens --dist-timeout-s
            t = max(self.flat_s, TIMEOUT_FACTOR * self.expected)
        if t == self.timeout_s:
            return
        self.timeout_s = t
        for group in self.groups:
            _set_pg_timeout(timedelta(seconds=t), group)
        self.data_store.set_timeout(t)
        p2p.configure(timeout_s=t)

    # ----- failures (main thread) ------------------------------------------------------------------
    def report(self, description: str) -> str:
        """Publish a fault for every rank (the first report wins); returns the one that stands."""
        try:
            if self.main.add("guard/fault_claim", 1) == 1:
                self.main.put("guard/fault", description)
                return description
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                first = self.main.get_if_set("guard/fault")
                if first is not None:
                    return first
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store may be gone
            pass
        return description

    def diagnose(self, window_s: float) -> str | None:
        """A peer's fault report, or the peers whose beat did not change for `window_s`."""
        try:
            first = {p: self.main.get_if_set(f"guard/hb/{p}") for p in range(self.world) if p != self.rank}
            deadline = time.monotonic() + window_s
            while True:
                fault = self.main.get_if_set("guard/fault")
                if fault is not None:
                    return fault
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.25)
            silent = [p for p, beat in first.items() if self.main.get_if_set(f"guard/hb/{p}") == beat
                      and not self.main.ready(f"guard/done/{p}")]
        except Exception:  # noqa: BLE001
            return None
        return "; ".join(self._silent(p, first[p], window_s) for p in silent) or None

    def explain(self, exc: BaseException) -> tuple[int, str, bool]:
        """(exit code, the one line to print, whether a traceback helps) for an exception of the
        main thread; peers learn of it through guard/fault."""
        self._done.set()  # this rank reports and exits itself: the thread must not race it to the exit
        if isinstance(exc, ValueError) and not isinstance(exc, p2p.PeerError):
            self.report(f"{self.me} stopped on a user error: {exc}")
            return EXIT_USER, f"error: {exc}", False
        if isinstance(exc, RunAbort):
            self.report(f"{self.me} stopped the run at step {self.step}: {exc}")
            return EXIT_ABORT, f"error: {exc}", False
        cause = self.diagnose(4 * self.interval + 1 if is_comm_error(exc) else 0.5)
        if cause is None and isinstance(exc, p2p.PeerError):
            cause = str(exc)
        if cause is not None:
            cause = self.report(cause)
            return EXIT_ABORT, f"error: {cause}; {self.me} stopped at step {self.step} ({first_line(exc)})", False
        line = f"{self.me} failed at step {self.step}: {first_line(exc)}"
        self.report(line)
        return EXIT_ERROR, f"error: {line}", True

    # ----- the heartbeat thread -------------------------------------------------------------------
    def _beat(self, store: StepStore | None = None) -> None:
        self._seq += 1
        (store or self.beats).put(f"guard/hb/{self.rank}", f"{self._seq} {self.step} {self.phase}")

    def _silent(self, peer: int, beat: str | None, age: float) -> str:
        step = beat.split()[1] if beat else "?"
        phase = f"; last phase: {beat.split()[2]}" if beat and len(beat.split()) > 2 else ""
        return f"{self.topo.describe(peer)} stopped answering at step {step} (no heartbeat for {age:.0f} s{phase})"

    def _die(self, code: int, line: str) -> None:
        say(line)
        write_error_file(line)
        sys.stdout.flush()
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
        fault = self.beats.get_if_set("guard/fault")
        if fault is not None:
            self._die(EXIT_ABORT, f"error: {fault}; {self.me} stops")
        if self._signal is not None and not self._decided:
            self._decide_stop()
        if self._stop_since is None and self.beats.ready("guard/stop/request"):
            self._stop_since = time.monotonic()
        if self._stop_since is not None and time.monotonic() - self._stop_since > self.grace_s:
            line = (f"the stop did not finish within --stop-grace-s {self.grace_s:g} s; exiting without a new "
                    f"checkpoint")
            self.beats.put("guard/fault", f"{self.me}: {line}")
            self._die(EXIT_ABORT, f"error: {self.me}: {line}")
        self._watch()

    def _on_signals(self, data: bytes) -> None:
        for sig in data:
            if sig not in (signal.SIGTERM, signal.SIGINT):
                continue
            name, now = signal.Signals(sig).name, time.monotonic()
            if self._signal is None:
                self._signal = (name, now)
            elif now - self._signal[1] >= 2.0:
                self._die(128 + sig, f"error: {self.me}: a second {name}: exiting now, without a checkpoint")

    def _decide_stop(self) -> None:
        self._decided = True
        self._stop_since = self._stop_since or time.monotonic()
        if self.beats.add("guard/stop/claim", 1) != 1:
            return  # another rank decides
        self.beats.put("guard/stop/request", {"rank": self.rank, "signal": self._signal[0]})
        began = [self.beats.get_if_set(f"guard/began/{r}") for r in range(self.world)]
        at = max((int(b) for b in began if b is not None), default=self.start_step - 1) + 1
        self.beats.put("guard/stop/at", at)
        say(f"{self.signal_name} on {self.me}: the run stops before step {at} (every rank finishes the steps before "
            f"it, the trainers write checkpoint step-{at}; --stop-grace-s {self.grace_s:g}; a second signal exits now)")

    @property
    def signal_name(self) -> str | None:
        return self._signal[0] if self._signal else None

    def _watch(self) -> None:
        now = time.monotonic()
        limit = STOP_SILENCE_S if self._stop_since is not None else self.silence_s
        for p in self.peers:
            if p in self._finished:
                continue
            beat = self.beats.get_if_set(f"guard/hb/{p}")
            if p not in self._changed or beat != self._last.get(p):
                self._last[p], self._changed[p] = beat, now
                continue
            age = now - self._changed[p]
            if age > limit:
                if self.beats.ready(f"guard/done/{p}"):
                    self._finished.add(p)
                    continue
                line = self._silent(p, beat, age)
                if self.beats.add("guard/fault_claim", 1) == 1:
                    self.beats.put("guard/fault", line)
                self._die(EXIT_ABORT, f"error: {line}; {self.me} stops")
