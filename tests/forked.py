"""Run train_disagg's entry point for a table of cases through tests/bad_input_driver.py: the ranks of
every case forked from one process that imported the entry point once, each case's store hosted as
torchrun's agent hosts it, every rank's exit code, seconds and stderr reported on its own."""
import json
import os
import subprocess
import sys

from lab.launch import ROOT


def run_cases(table: list[dict], limit: float = 90, timeout: float = 900) -> dict[str, dict]:
    """{name: {"name", "ranks": [{"rank", "code", "seconds", "stderr"}]}} of `table`'s cases
    ({"name", "argv", "env", "world"})."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.bad_input_driver", "--limit", str(limit)],
                          input=json.dumps(table), capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["name"]: r for r in map(json.loads, proc.stdout.splitlines())}
