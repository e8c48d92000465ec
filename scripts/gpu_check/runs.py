"""The runtime section: the real runtime (train_disagg.py under torchrun, one rank: NCCL on a GPU,
gloo on a CPU) at the tiny size, each run 2 steps with its communication recorded
(DIGENRL_COMM_TRACE) and replayed under NCCL's rules (telemetry/replay.py):

- "lora": colocated, replicated LoRA (bf16 on a GPU: the trainer's own mixed precision);
- "full fsdp": colocated, FSDP2 full fine-tuning (--colocated-sharding fsdp);
- "resume": the LoRA run's copy cut back to its step-1 checkpoint, resumed to step 2, its weights
  compared with the uninterrupted run's (tests/test_runtime.py asserts bitwise equality on a CPU;
  a GPU's kernels may differ in the last bit, so the check reports the largest difference).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

from lab.launch import TINY, torchrun, trained_weights
from telemetry import commtrace
from lab.nccl import replay

TIMEOUT_S = 240


def _run(name: str, out: str, args: list[str], device: torch.device) -> dict:
    started = time.time()
    trace = os.path.join(out, "comm")
    proc = torchrun(1, [*TINY, *args, "--steps", "2", "--device", device.type, "--output-dir", out],
                    env={commtrace.ENV: trace}, timeout=TIMEOUT_S, check=False)
    row = {"run": name, "exit_code": proc.returncode, "seconds": round(time.time() - started, 1)}
    if proc.returncode != 0:
        row["error"] = (proc.stderr or proc.stdout)[-2000:]
        return row
    try:
        traces = replay.load(trace)
        result = replay.check(traces)
        row.update(comm_ok=result.ok, comm_message=result.message.splitlines()[0],
                   comm_ops=sum(1 for lines in traces.values() for line in lines
                                if line.get("op") in ("send", "recv", "collective")))
    except replay.TraceError as e:
        row.update(comm_ok=False, comm_message=f"trace unreadable: {e}", comm_ops=0)
    return row


def run(device: torch.device, keep: str | None = None) -> dict:
    """The three runs; their folders under `keep` (else a temporary folder, removed)."""
    return finish(launch(device, keep))


def launch(device: torch.device, keep: str | None = None) -> dict:
    """The runs themselves (subprocesses, and the replay of their traces: no torch in this process,
    so a CPU check runs it in a thread beside the other sections)."""
    root = keep or tempfile.mkdtemp(prefix="gpu_check_runs_")
    lora = os.path.join(root, "lora")
    rows = [_run("lora", lora, ["--mode", "colocated", "--lora-rank", "4", "--save-every", "1"], device),
            _run("full fsdp", os.path.join(root, "full_fsdp"),
                 ["--mode", "colocated", "--colocated-sharding", "fsdp", "--lora-rank", "0"], device)]
    rows.append(_resume(lora, os.path.join(root, "resumed"), device, rows[0]))
    return {"device": device.type, "nproc": 1, "runs": rows, "root": root, "keep": keep is not None}


def finish(launched: dict) -> dict:
    """The resumed run's weights against the uninterrupted run's; the folders removed unless kept."""
    root = launched.pop("root")
    try:
        row = launched["runs"][-1]
        if row["exit_code"] == 0:
            a, b = trained_weights(os.path.join(root, "lora"), 2), trained_weights(os.path.join(root, "resumed"), 2)
            row["max_abs_weight_difference"] = max(float((a[n].float() - b[n].float()).abs().max()) for n in a)
            row["weights_equal"] = all(torch.equal(a[n], b[n]) for n in a)
    finally:
        if not launched.pop("keep"):
            shutil.rmtree(root, ignore_errors=True)
    launched["ok"] = all(r["exit_code"] == 0 and r.get("comm_ok") for r in launched["runs"])
    return launched


def _resume(straight: str, resumed: str, device: torch.device, first: dict) -> dict:
    if first["exit_code"] != 0:
        return {"run": "resume", "exit_code": None, "error": "the LoRA run it resumes failed"}
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("comm"))
    shutil.rmtree(os.path.join(resumed, "checkpoints", "step-2"))
    return _run("resume", resumed, ["--mode", "colocated", "--lora-rank", "4", "--save-every", "1",
                                    "--resume", resumed], device)


__all__ = ["finish", "launch", "run"]
