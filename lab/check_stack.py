"""Run the tests under the versions users have, on this CPU, and write what passed into
docs/versions.md. Not part of CI: building an environment downloads about 5 GB.

    python3 -m lab.check_stack                          # the oldest stack: builds .venv-gpu-stack if missing
    python3 -m lab.check_stack --venv /path/to/venv     # an environment already built
    python3 -m lab.check_stack --python /root/.pyenv/versions/3.10.13/bin/python    # another Python

The oldest stack (what a GPU machine may ship: torch 2.11, transformers 5.17) gets the pinned STACK
and requirements.txt's ranges for everything else, and runs the runtime, memory and checkpoint
tests. Another Python (3.10: `--python`) gets requirements.txt as a user of it would install it (the
newest versions for that Python, torch as the lock pins it) in .venv-py<X.Y>, and runs the fast
tier and the integration tests PY_TESTS. The tests run as CI runs them (HF_HUB_OFFLINE=1, pytest -q)
with JUnit reports, whose counts and failures (each failing test with the last line of its error)
the page records beside the versions, each mode in its own section.
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
PY_TESTS = [["-m", "fast"], ["tests/test_runtime.py::test_placement_invariance[lora]", "tests/test_checkpoints.py",
                             "tests/test_peer_formats_runs.py", "tests/test_reward_server.py"]]
"""another Python's runs: the fast tier; then placement invariance, checkpoints (their resume), the
peers' formats and wandb through torchrun, and the reward services (asyncio)"""
PY_PINS = ["torch==2.13.0", "wandb==0.31.0"]
"""requirements.lock's torch and wandb (the optional package whose test the integration runs need)"""
PYTHON_SECTION = "\n## Python "
SHOWN = ["torch", "transformers", "diffusers", "peft", "accelerate", "huggingface_hub", "safetensors", "numpy"]


def build(venv: str, python: str = sys.executable, pins: list[str] = STACK) -> None:
    """The environment: created by `python` if missing, then `pins` and requirements.txt installed
    (a no-op once they are)."""
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        subprocess.run([python, "-m", "venv", venv], check=True)
    subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", *pins, "-r",
                    os.path.join(ROOT, "requirements.txt")], check=True)


def versions(venv: str, shown: list[str]) -> dict[str, str]:
    out = subprocess.run([os.path.join(venv, "bin", "pip"), "list", "--format=freeze"], capture_output=True,
                         text=True, check=True).stdout
    pins = dict(line.split("==", 1) for line in out.split() if "==" in line)
    norm = {k.lower().replace("-", "_"): v for k, v in pins.items()}
    return {name: norm.get(name, "absent") for name in shown}


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


def _body(command: str, vers: dict[str, str], counts, failures, seconds: float, python: str, heading: str) -> list[str]:
    """The command, date, versions, counts per test file and failures of one mode's run."""
    total = {k: sum(r[k] for r in counts.values()) for k in ("passed", "failed", "skipped")}
    lines = [f"- command: `{command}`",
             f"- date: {datetime.date.today().isoformat()}, {platform.machine()} CPU, Python {python}",
             f"- {seconds / 60:.1f} minutes", "",
             "| package | version |", "|---|---|", *[f"| {k} | {v} |" for k, v in vers.items()], "",
             f"**{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped**", "",
             "| test file | passed | failed | skipped |", "|---|---|---|---|",
             *[f"| {k} | {r['passed']} | {r['failed']} | {r['skipped']} |" for k, r in sorted(counts.items())], ""]
    if failures:
        lines += [f"{heading} Failures", "", "Each failing test and the last line of its error.", ""]
        lines += [f"- `{test}`: `{why}`" for test, why in failures]
        lines.append("")
    return lines


def page(command: str, vers: dict[str, str], counts, failures, seconds: float) -> str:
    """The oldest stack's section, the head of the page."""
    lines = ["# DigenRL on the versions users have", "",
             "Written by `python3 -m lab.check_stack` (do not edit by hand): the runtime, memory and checkpoint",
             "tests, and the prepared GPU check on a CPU, run under the oldest stack requirements.txt admits (a GPU",
             "machine's torch 2.11 and transformers 5.17, with diffusers), on a CPU. CI runs the whole suite on",
             "requirements.lock's versions, under Python 3.11; the sections below the first run the tests",
             "under the other Pythons users have (`--python`).", ""]
    return "\n".join(lines + _body(command, vers, counts, failures, seconds, platform.python_version(), "##"))


def python_section(command: str, vers: dict[str, str], counts, failures, seconds: float, python: str) -> str:
    """The section of one other Python: `## Python X.Y`."""
    short = ".".join(python.split(".")[:2])
    lines = [f"## Python {short}", "",
             f"Written by `python3 -m lab.check_stack --python ...`: the fast tier and the integration tests of",
             f"PY_TESTS under Python {python}, with requirements.txt installed as a user of that Python gets it (the",
             "newest versions for it; torch and wandb as requirements.lock pins them).", ""]
    return "\n".join(lines + _body(command, vers, counts, failures, seconds, python, "###"))


def merge_page(old: str, stack: str | None = None, section: str | None = None) -> str:
    """docs/versions.md with the oldest stack's part or one Python's section replaced, the rest kept."""
    head, _, rest = old.partition(PYTHON_SECTION)
    sections = [PYTHON_SECTION.lstrip("\n") + part for part in rest.split(PYTHON_SECTION)] if rest else []
    if section is not None:
        title = section.split("\n", 1)[0]
        sections = [x for x in sections if x.split("\n", 1)[0] != title] + [section]
    body = (stack if stack is not None else head).rstrip("\n")
    return "\n\n".join([body, *[x.strip("\n") for x in sections]]) + "\n"


def interpreter_version(python: str) -> str:
    return subprocess.run([python, "-c", "import platform; print(platform.python_version())"], capture_output=True,
                          text=True, check=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--venv", default=None, help="the environment (built if missing; default: .venv-gpu-stack, or "
                                                ".venv-py<X.Y> with --python)")
    p.add_argument("--python", default=None, help="another Python's interpreter: its section, PY_TESTS")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "versions.md"))
    p.add_argument("tests", nargs="*", default=TESTS, help=f"test files (default: {' '.join(TESTS)})")
    args = p.parse_args(argv)
    python = interpreter_version(args.python) if args.python else None
    venv = args.venv or os.path.join(ROOT, f".venv-py{'.'.join(python.split('.')[:2])}" if python else ".venv-gpu-stack")
    build(venv, args.python or sys.executable, PY_PINS if python else STACK)
    runs = PY_TESTS if python else [args.tests]
    counts, failures, seconds = {}, [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for i, tests in enumerate(runs):
            report = os.path.join(tmp, f"junit{i}.xml")
            seconds += run_tests(venv, tests, report)
            more_counts, more_failures = results(report)
            counts.update(more_counts)
            failures += more_failures
    vers = versions(venv, SHOWN + (["tomli", "wandb"] if python else []))
    old = open(args.out).read() if os.path.isfile(args.out) else ""
    if python:
        text = merge_page(old, section=python_section(f"python3 -m lab.check_stack --python {args.python}", vers,
                                                      counts, failures, seconds, python))
    else:
        command = "python3 -m lab.check_stack" + ("" if args.tests == TESTS else " " + " ".join(args.tests))
        text = merge_page(old, stack=page(command, vers, counts, failures, seconds))
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}: " + ", ".join(f"{sum(r[k] for r in counts.values())} {k}"
                                           for k in ("passed", "failed", "skipped")))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
