"""Run the runtime, memory and checkpoint tests under the oldest stack DigenRL supports (what a GPU
machine may ship: torch 2.11, transformers 5.17, with diffusers), on this CPU, and write what passed
into docs/versions.md. Not part of CI: building the environment downloads about 5 GB.

    python3 -m lab.check_stack                          # builds .venv-gpu-stack if missing (minutes)
    python3 -m lab.check_stack --venv /path/to/venv     # an environment already built

The environment gets the pinned stack (STACK) and requirements.txt's ranges for everything else; the
tests run as CI runs them (HF_HUB_OFFLINE=1, pytest -q) with a JUnit report, whose counts and
failures (each failing test with the last line of its error) the page records beside the versions.
Only the standard library: it runs under any python3, outside the environment it checks.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STACK = ["torch==2.11.0", "transformers==5.17.0", "diffusers==0.42.1"]
"""the GPU machine's torch and transformers (docs/gpu_check/README.md), with the diffusers it lacks"""
TESTS = ["tests/test_runtime.py", "tests/test_memory.py", "tests/test_checkpoints.py", "tests/test_gpu_check.py"]
"""the runtime through torchrun, the memory measurement (FakeTensorMode) and model, checkpoints, and
the prepared GPU check run on a CPU"""
SHOWN = ["torch", "transformers", "diffusers", "peft", "accelerate", "huggingface_hub", "safetensors", "numpy"]


def build(venv: str) -> None:
    """The environment: created if missing, then the stack and requirements.txt installed (a no-op
    once they are)."""
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", *STACK, "-r",
                    os.path.join(ROOT, "requirements.txt")], check=True)


def versions(venv: str) -> dict[str, str]:
    out = subprocess.run([os.path.join(venv, "bin", "pip"), "list", "--format=freeze"], capture_output=True,
                         text=True, check=True).stdout
    pins = dict(line.split("==", 1) for line in out.split() if "==" in line)
    norm = {k.lower().replace("-", "_"): v for k, v in pins.items()}
    return {name: norm.get(name, "absent") for name in SHOWN}


def run_tests(venv: str, tests: list[str], report: str) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    started = time.time()
    subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={report}", *tests], cwd=ROOT, env=env)
    return time.time() - started


def results(report: str) -> tuple[dict[str, dict[str, int]], list[tuple[str, str]]]:
    """Per test file {passed, failed, skipped} and each failure (test id, the last line of its error)."""
    counts: dict[str, dict[str, int]] = {}
    failures = []
    for case in ET.parse(report).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        row = counts.setdefault(path, {"passed": 0, "failed": 0, "skipped": 0})
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            row["failed"] += 1
            failures.append((f"{path}::{case.get('name')}", cause(bad.text or bad.get("message") or "")))
        elif case.find("skipped") is not None:
            row["skipped"] += 1
        else:
            row["passed"] += 1
    return counts, failures


def cause(text: str) -> str:
    """The line of a failure that names its cause: the last pytest `E` line naming an error (a
    torchrun failure's last lines are its banner), else the last `E` line, else the last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    marked = [line[1:].strip() for line in lines if line.startswith("E ")]
    named = [line for line in marked if "Error" in line or "Exception" in line or "assert" in line]
    return (named or [m for m in marked if m.strip("=-")] or lines or [""])[-1][:300]


def page(command: str, vers: dict[str, str], counts, failures, seconds: float) -> str:
    total = {k: sum(r[k] for r in counts.values()) for k in ("passed", "failed", "skipped")}
    lines = ["# DigenRL on the versions users have", "",
             "Written by `python3 -m lab.check_stack` (do not edit by hand): the runtime, memory and checkpoint",
             "tests, and the prepared GPU check on a CPU, run under the oldest stack requirements.txt admits (a GPU",
             "machine's torch 2.11 and transformers 5.17, with diffusers), on a CPU. CI runs the whole suite on",
             "requirements.lock's versions.", "",
             f"- command: `{command}`",
             f"- date: {datetime.date.today().isoformat()}, {platform.machine()} CPU, Python {platform.python_version()}",
             f"- {seconds / 60:.1f} minutes", "",
             "| package | version |", "|---|---|", *[f"| {k} | {v} |" for k, v in vers.items()], "",
             f"**{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped**", "",
             "| test file | passed | failed | skipped |", "|---|---|---|---|",
             *[f"| {k} | {r['passed']} | {r['failed']} | {r['skipped']} |" for k, r in sorted(counts.items())], ""]
    if failures:
        lines += ["## Failures", "", "Each failing test and the last line of its error.", ""]
        lines += [f"- `{test}`: `{why}`" for test, why in failures]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--venv", default=os.path.join(ROOT, ".venv-gpu-stack"), help="the environment (built if missing)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "versions.md"))
    p.add_argument("tests", nargs="*", default=TESTS, help=f"test files (default: {' '.join(TESTS)})")
    args = p.parse_args(argv)
    build(args.venv)
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "junit.xml")
        seconds = run_tests(args.venv, args.tests, report)
        counts, failures = results(report)
    command = "python3 -m lab.check_stack" + ("" if args.tests == TESTS else " " + " ".join(args.tests))
    with open(args.out, "w") as f:
        f.write(page(command, versions(args.venv), counts, failures, seconds))
    print(f"wrote {args.out}: " + ", ".join(f"{sum(r[k] for r in counts.values())} {k}"
                                           for k in ("passed", "failed", "skipped")))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
