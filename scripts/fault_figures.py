"""The fault figures of the README's "Reliability" section: inject each fault into a tiny run under
torchrun and print, as a markdown table, the seconds until the other ranks and torchrun have
exited, the line the run printed, and the checkpoint left behind.

    python -m scripts.fault_figures [--repeats 2] [--out /tmp/fault-figures]

Faults: kill -9 of the generator and of the trainer (1 + 1 ranks) and of a generator of 2 + 2
ranks, SIGSTOP of the generator (alive, silent), SIGTERM and SIGINT on one rank, SIGTERM to
torchrun (what SLURM does at a time limit), and a kill of the checkpoint writer in the middle of a
checkpoint (DIGENRL_DEBUG_KILL_IN_SAVE).
"""
import argparse
import os
import shutil
import signal
import time

from checkpointing import files as checkpoint_files
from runtime.launch import TINY, alive, torchrun, torchrun_background, worker_pids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


BASE = [*TINY, "--lora-rank", "4", "--log-images-every", "0"]


def _rows(run: str) -> int:
    path = os.path.join(run, "metrics.jsonl")
    return len(open(path).read().splitlines()) if os.path.isfile(path) else 0


def _said(text: str) -> str:
    for line in text.splitlines():
        for key in ("error: ", "stopped on a signal"):
            if key in line and "traceback :" not in line:
                return line[line.index(key):][:150]
    return ""


def fault(out: str, name: str, sig: int, target, extra=(), nproc: int = 2) -> dict:
    run, log = os.path.join(out, name.replace(" ", "_")), os.path.join(out, name.replace(" ", "_") + ".log")
    shutil.rmtree(run, ignore_errors=True)
    proc = torchrun_background(nproc, [*BASE, *extra, "--steps", "500", "--save-every", "1000", "--output-dir", run],
                               log)
    try:
        while _rows(run) < 2:
            if proc.poll() is not None:
                raise SystemExit(f"{name}: the run ended early\n{open(log).read()[-2000:]}")
            time.sleep(0.2)
        pids = worker_pids(proc.pid)
        start = time.monotonic()
        if target == "torchrun":
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
            "said": _said(open(log).read())}


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="/tmp/fault-figures")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for _ in range(args.repeats):
        rows += [fault(args.out, "kill -9 generator", signal.SIGKILL, 0),
                 fault(args.out, "kill -9 trainer", signal.SIGKILL, 1),
                 fault(args.out, "SIGTERM generator", signal.SIGTERM, 0),
                 fault(args.out, "SIGTERM trainer", signal.SIGTERM, 1),
                 fault(args.out, "SIGINT trainer", signal.SIGINT, 1),
                 fault(args.out, "SIGTERM torchrun", signal.SIGTERM, "torchrun")]
    rows += [fault(args.out, "kill -9 generator of 2+2", signal.SIGKILL, 0, ["--generators", "2", "--trainers", "2"], 4),
             fault(args.out, "SIGSTOP generator", signal.SIGSTOP, 0)]
    print("| fault | other ranks gone (s) | torchrun gone (s) | steps logged | checkpoint | first line |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fault']} | {r['ranks_s']:.1f} | {r['torchrun_s']:.1f} | {r['steps']} | {r['checkpoint']} | "
              f"{r['said']} |")
    k = kill_in_write(args.out)
    print(f"\n{k['fault']}: exit {k['code']}; newest valid checkpoint step-{k['valid']} ({k['valid_bytes']} bytes, "
          f"intact); partial step-2.tmp {k['partial_bytes']} bytes, skipped by name; {k['said']}")


if __name__ == "__main__":
    main()
