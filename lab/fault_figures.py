"""The fault figures of docs/reliability.md: inject each fault into a tiny run under
torchrun and print, as a markdown table, the seconds until the other ranks and torchrun have
exited, the line the run printed, the checkpoint left behind and the bytes of it that changed.

    python -m lab.fault_figures [--repeats 2] [--out /tmp/fault-figures] [--only NAME,...]

Faults: kill -9 of the generator, of the trainer and of torchrun (1 + 1 ranks) and of a generator of
2 + 2 ranks, SIGSTOP of the generator (alive, silent), SIGTERM and SIGINT on one rank, SIGTERM to
torchrun (what SLURM does at a time limit), an exception raised by the generator, the trainer and a
scorer (DIGENRL_DEBUG_RAISE), kill -9 of a scorer (1 + 1 + 1 ranks), --overwrite of a live run, a
kill of the checkpoint writer in the middle of a checkpoint (DIGENRL_DEBUG_KILL_IN_SAVE), and a reward
service (a stand-in on 127.0.0.1 that scores jpeg_compressibility) that trickles its answer, hangs or
answers NaN, from its first request or after two steps (the seconds count from the first bad request).
"""
import argparse
import hashlib
import http.server
import os
import shutil
import signal
import threading
import time

import torch

from checkpointing import manifest as checkpoint_files
from lab.launch import TINY, alive, torchrun, torchrun_background, worker_pids
from rewards import build_reward
from rewards.wire import decode_request, encode_scores

BASE = [*TINY, "--lora-rank", "4", "--log-images-every", "0"]


def _rows(run: str) -> int:
    path = os.path.join(run, "metrics.jsonl")
    return len(open(path).read().splitlines()) if os.path.isfile(path) else 0


def _bytes_changed(before: dict[str, str]) -> int:
    """Bytes of the files in `before` (path -> SHA-256, taken earlier) that are now missing or differ."""
    lost = 0
    for path, digest in before.items():
        if not os.path.isfile(path) or _sha(path) != digest:
            lost += os.path.getsize(path) if os.path.isfile(path) else 1
    return lost


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _saved(run: str) -> dict[str, str]:
    """Every file of the run's verified checkpoints, with its SHA-256."""
    root = os.path.join(run, "checkpoints")
    out = {}
    for _, path in checkpoint_files.step_dirs(root):
        for folder, _, names in os.walk(path):
            out.update({os.path.join(folder, n): _sha(os.path.join(folder, n)) for n in names})
    return out


def _said(text: str) -> str:
    for line in text.splitlines():
        for key in ("error: ", "stopped on a signal"):
            if key in line and "traceback :" not in line:
                return line[line.index(key):][:150]
    return ""


def fault(out: str, name: str, sig: int, target, extra=(), nproc: int = 2, env=None) -> dict:
    """Start a run, wait for two steps, send `sig` to rank `target` (or to torchrun; None: nothing,
    the run's own DIGENRL_DEBUG_RAISE fails a rank), time every other process's exit."""
    run, log = os.path.join(out, name.replace(" ", "_")), os.path.join(out, name.replace(" ", "_") + ".log")
    shutil.rmtree(run, ignore_errors=True)
    proc = torchrun_background(nproc, [*BASE, *extra, "--steps", "500", "--save-every", "1", "--keep-checkpoints", "0",
                                       "--output-dir", run], log, env=env)
    try:
        while _rows(run) < 2 and target is not None:
            if proc.poll() is not None:
                raise SystemExit(f"{name}: the run ended early\n{open(log).read()[-2000:]}")
            time.sleep(0.2)
        while len(pids := worker_pids(proc.pid)) < nproc:
            time.sleep(0.05)
        if target is None:  # the failing rank is the first to go
            while all(alive(p) for p in pids.values()):
                time.sleep(0.02)
            target = next(r for r, p in pids.items() if not alive(p))
        start = time.monotonic()
        before = _saved(run)
        if sig is None:
            others = [p for r, p in pids.items() if r != target]
        elif target == "torchrun":
            os.kill(proc.pid, sig)
            others = list(pids.values())
        else:
            os.kill(pids[target], sig)
            others = [p for r, p in pids.items() if r != target]
        while any(alive(p) for p in others) and time.monotonic() - start < 120:
            time.sleep(0.05)
        ranks_s = time.monotonic() - start
        proc.wait(timeout=120)
        all_s = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this script started
            proc.wait()
    found = checkpoint_files.find_valid(os.path.join(run, "checkpoints"))
    return {"fault": name, "ranks_s": ranks_s, "torchrun_s": all_s, "steps": _rows(run), "checkpoint": found.step,
            "lost": _bytes_changed(before), "lock": os.path.exists(os.path.join(run, "run.lock")),
            "said": _said(open(log).read())}


def overwrite_live(out: str) -> dict:
    """--overwrite into a live run's folder, through torchrun: refused; the live run loses nothing."""
    run, log = os.path.join(out, "live"), os.path.join(out, "live.log")
    shutil.rmtree(run, ignore_errors=True)
    proc = torchrun_background(2, [*BASE, "--steps", "500", "--save-every", "1", "--keep-checkpoints", "0",
                                    "--output-dir", run], log)
    try:
        while _rows(run) < 2:
            time.sleep(0.2)
        before = _saved(run)
        start = time.monotonic()
        second = torchrun(2, [*BASE, "--overwrite", "--output-dir", run], check=False)
        refused_s = time.monotonic() - start
        rows = _rows(run)
        while _rows(run) == rows and proc.poll() is None:
            time.sleep(0.2)  # the live run goes on
        going = proc.poll() is None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the session this script started: a stop with a checkpoint
        proc.wait(timeout=60)
    return {"fault": "--overwrite of a live run", "code": second.returncode, "refused_s": refused_s, "going": going,
            "lost": _bytes_changed(before), "said": _said(second.stderr)}


def kill_in_write(out: str) -> dict:
    run = os.path.join(out, "kill_in_write")
    shutil.rmtree(run, ignore_errors=True)
    proc = torchrun(2, [*BASE, "--steps", "3", "--save-every", "1", "--output-dir", run],
                    env={"DIGENRL_DEBUG_KILL_IN_SAVE": "2"}, check=False)

    def size(folder):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)

    root = os.path.join(run, "checkpoints")
    found = checkpoint_files.find_valid(root)
    return {"fault": "kill -9 of the writer inside checkpoint step-2", "code": proc.returncode,
            "valid": found.step, "valid_bytes": size(found.path), "partial_bytes": size(os.path.join(root, "step-2.tmp")),
            "said": _said(proc.stderr)}


class _Service(http.server.BaseHTTPRequestHandler):
    """A reward service that scores jpeg_compressibility until `mode` turns bad: "trickle" (its
    headers, then a byte every 2 s), "hang" (never answers) or "nan" (NaN scores); `since`: when
    the first bad request came."""

    mode, since, reward = "ok", None, None

    def do_POST(self):  # noqa: N802 - the name http.server calls
        body = self.rfile.read(int(self.headers["Content-Length"]))
        cls = type(self)
        if cls.mode != "ok" and cls.since is None:
            cls.since = time.monotonic()
        try:
            if cls.mode == "hang":
                time.sleep(3600)
            self.send_response(200)
            if cls.mode == "trickle":
                self.send_header("Content-Length", "1000000")
                self.end_headers()
                for _ in range(1000000):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(2.0)
            images, prompts, metadata = decode_request(body)
            scores = cls.reward(images, prompts, metadata)
            answer = encode_scores("jpeg_compressibility", torch.full_like(scores, float("nan"))
                                   if cls.mode == "nan" else scores)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
        except OSError:
            pass  # the run gave up on it

    def log_message(self, *args):
        pass


def service_fault(out: str, name: str, mode: str, after_rows: int, extra=()) -> dict:
    """A run scoring through a stand-in service that turns to `mode` once the run has logged
    `after_rows` steps: the seconds from the first bad request until every rank has exited."""
    handler = type("Service", (_Service,), {"reward": build_reward("jpeg_compressibility")})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    at = BASE.index("--reward")
    args = [*BASE[:at], *BASE[at + 2:], "--reward", f"http://127.0.0.1:{httpd.server_address[1]}/jpeg_compressibility"]
    run, log = os.path.join(out, name.replace(" ", "_")), os.path.join(out, name.replace(" ", "_") + ".log")
    shutil.rmtree(run, ignore_errors=True)
    proc = torchrun_background(2, [*args, *extra, "--steps", "500", "--save-every", "1", "--keep-checkpoints", "0",
                                   "--output-dir", run], log)
    try:
        while _rows(run) < after_rows:
            if proc.poll() is not None:
                raise SystemExit(f"{name}: the run ended early\n{open(log).read()[-2000:]}")
            time.sleep(0.2)
        before = _saved(run)
        handler.mode = mode
        proc.wait(timeout=900)
        ended = time.monotonic()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this script started
            proc.wait()
        httpd.shutdown()
    seconds = ended - handler.since if handler.since is not None else float("nan")
    found = checkpoint_files.find_valid(os.path.join(run, "checkpoints"))
    return {"fault": name, "ranks_s": seconds, "torchrun_s": seconds, "steps": _rows(run),
            "checkpoint": found.step, "lost": _bytes_changed(before),
            "lock": os.path.exists(os.path.join(run, "run.lock")), "said": _said(open(log).read())}


def faults(out: str) -> dict:
    """name -> a function running that fault once."""
    raise_at = {"DIGENRL_DEBUG_RAISE": "{}:2"}
    return {
        "kill -9 generator": lambda: fault(out, "kill -9 generator", signal.SIGKILL, 0),
        "kill -9 trainer": lambda: fault(out, "kill -9 trainer", signal.SIGKILL, 1),
        "kill -9 torchrun": lambda: fault(out, "kill -9 torchrun", signal.SIGKILL, "torchrun"),
        "SIGTERM generator": lambda: fault(out, "SIGTERM generator", signal.SIGTERM, 0),
        "SIGTERM trainer": lambda: fault(out, "SIGTERM trainer", signal.SIGTERM, 1),
        "SIGINT trainer": lambda: fault(out, "SIGINT trainer", signal.SIGINT, 1),
        "SIGTERM torchrun": lambda: fault(out, "SIGTERM torchrun", signal.SIGTERM, "torchrun"),
        "exception generator": lambda: fault(out, "exception generator", None, None,
                                             env={k: v.format(0) for k, v in raise_at.items()}),
        "exception trainer": lambda: fault(out, "exception trainer", None, None,
                                           env={k: v.format(1) for k, v in raise_at.items()}),
        "exception scorer": lambda: fault(out, "exception scorer", None, None, ["--scorers", "1"], 3,
                                          env={k: v.format(2) for k, v in raise_at.items()}),
        "kill -9 scorer": lambda: fault(out, "kill -9 scorer", signal.SIGKILL, 2, ["--scorers", "1"], 3),
        "service trickles from the start": lambda: service_fault(
            out, "service trickles from the start", "trickle", 0, ["--reward-timeout-s", "15", "--dist-timeout-s", "60"]),
        "service trickles after 2 steps": lambda: service_fault(
            out, "service trickles after 2 steps", "trickle", 2, ["--reward-timeout-s", "15"]),
        "service hangs from the start": lambda: service_fault(
            out, "service hangs from the start", "hang", 0, ["--reward-timeout-s", "90", "--dist-timeout-s", "60"]),
        "service answers NaN after 2 steps": lambda: service_fault(out, "service answers NaN after 2 steps", "nan", 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="/tmp/fault-figures")
    p.add_argument("--only", default=None, help="comma-separated fault names (default: all)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    table = faults(args.out)
    only = args.only.split(",") if args.only else None
    rows = []
    for _ in range(args.repeats):
        rows += [run() for name, run in table.items() if only is None or name in only]
    if only is None:
        rows += [fault(args.out, "kill -9 generator of 2+2", signal.SIGKILL, 0, ["--generators", "2", "--trainers", "2"],
                       4), fault(args.out, "SIGSTOP generator", signal.SIGSTOP, 0)]
    print("| fault | other ranks gone (s) | torchrun gone (s) | steps logged | checkpoint | bytes lost | lock left | "
          "first line |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fault']} | {r['ranks_s']:.1f} | {r['torchrun_s']:.1f} | {r['steps']} | {r['checkpoint']} | "
              f"{r['lost']} | {r['lock']} | {r['said']} |")
    if only is None or "overwrite" in only:
        o = overwrite_live(args.out)
        print(f"\n{o['fault']}: exit {o['code']} after {o['refused_s']:.1f} s; the live run went on: {o['going']}; "
              f"bytes of its checkpoints changed: {o['lost']}; {o['said']}")
    if only is None or "kill in write" in only:
        k = kill_in_write(args.out)
        print(f"\n{k['fault']}: exit {k['code']}; newest valid checkpoint step-{k['valid']} ({k['valid_bytes']} "
              f"bytes, intact); partial step-2.tmp {k['partial_bytes']} bytes, skipped by name; {k['said']}")


if __name__ == "__main__":
    main()
