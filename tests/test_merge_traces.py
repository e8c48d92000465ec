"""scripts/merge_traces.py: the rank traces of a run folder into one Perfetto file."""
import json
import os
import subprocess
import sys

from telemetry.tracing import Tracer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = ["-m", "scripts.merge_traces"]


def _run(*args):
    return subprocess.run([sys.executable, *SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_merges_every_rank_of_a_run_in_rank_order(tmp_path):
    t0 = 1_700_000_000_000_000.0
    for rank, role in ((10, "trainer"), (2, "generator")):
        tracer = Tracer(rank, role)
        tracer.record("work", "train" if role == "trainer" else "generate", step=0, start_us=t0 + rank * 1e5,
                      dur_us=5e5)
        tracer.save(str(tmp_path / "run" / "trace" / f"rank{rank}.json"))
    out = _run(str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    merged = tmp_path / "run" / "trace" / "merged.json"
    assert f"{merged}: 2 trace(s), ranks [2, 10], 2 spans over 1.30 s" in out.stdout
    events = json.loads(merged.read_text())["traceEvents"]
    names = [e["args"]["name"] for e in events if e.get("name") == "process_name"]
    assert names == ["rank 2 (generator)", "rank 10 (trainer)"]  # rank order, not file-name order
    again = _run(str(tmp_path / "run"))  # the merged file is not merged into itself
    assert "2 trace(s)" in again.stdout and len(json.loads(merged.read_text())["traceEvents"]) == len(events)


def test_a_folder_without_traces_is_a_clear_error(tmp_path):
    out = _run(str(tmp_path))
    assert out.returncode == 2 and "holds no rank traces" in out.stderr
