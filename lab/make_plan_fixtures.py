"""Make the measured-run fixtures of tests/test_planner_fit.py on this machine: for every target
mode, one lab/bench.py invocation of two modes, the fit mode (gap-stream) and the target, run
back to back on the tiny FLUX preset, so that the run the costs are fitted on and the run they
predict see the same machine load; then the run folders reduced to what the planner reads
(config.json, metrics.jsonl, compact traces), and a CPU device profile of lab/calibrate.py.

    python -m lab.make_plan_fixtures --out tests/fixtures/planner_runs [--bench-dir DIR]

With --bench-dir existing pair folders (DIR/<target>/{gap-stream,<target>}) are compacted instead.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from lab.planning.profile import finetune_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIT_MODE = "gap-stream"
TARGETS = ("colocated-replicate,disagg,gap-frag2,gap+tsp,gap+tsp8,slow-gen,gap-2rep,gap-stages,gap+tsp+tag+tcss")
WORKLOAD = ["--preset", "tiny", "--steps", "5", "--warmup", "1", "--prompts-per-step", "4", "--group-size", "4",
            "--micro-batch", "4", "--sample-steps", "8", "--height", "32", "--width", "32"]
KEEP_ARGS = ("step", "fragment")


def compact_trace(src: str, dst: str) -> None:
    with open(src) as f:
        events = json.load(f)["traceEvents"]
    out = []
    for e in events:
        if e.get("ph") == "X":
            out.append({"ph": "X", "name": e["name"], "cat": e["cat"], "ts": round(e["ts"]), "dur": round(e["dur"]),
                        "args": {k: e["args"][k] for k in KEEP_ARGS if k in e["args"]}})
        elif e.get("ph") == "M":
            out.append(e)
    with open(dst, "w") as f:
        json.dump({"traceEvents": out}, f, separators=(",", ":"))


def compact_run(src: str, dst: str) -> None:
    os.makedirs(os.path.join(dst, "trace"), exist_ok=True)
    for name in ("config.json", "metrics.jsonl"):
        shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    for name in sorted(os.listdir(os.path.join(src, "trace"))):
        compact_trace(os.path.join(src, "trace", name), os.path.join(dst, "trace", name))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "planner_runs"))
    ap.add_argument("--bench-dir", default=None, help="compact these pair folders instead of running the bench")
    ap.add_argument("--targets", default=TARGETS)
    a = ap.parse_args(argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    bench = a.bench_dir or os.path.join(ROOT, "runs", "plan-fixtures")
    for target in a.targets.split(","):
        pair = os.path.join(bench, target)
        if not a.bench_dir:
            subprocess.run([sys.executable, "-m", "lab.bench", "--modes",
                            f"{FIT_MODE},{target}", *WORKLOAD, "--no-packing", "--out", pair, "--", "--reward", "jpeg_compressibility"],
                           check=True, env=env, cwd=ROOT)
        for mode in (FIT_MODE, target):
            if os.path.isfile(os.path.join(pair, mode, "metrics.jsonl")):
                compact_run(os.path.join(pair, mode), os.path.join(a.out, target, mode))
        print(f"kept the pair {FIT_MODE} + {target}", flush=True)
    lora = finetune_flags(os.path.join(a.out, target, FIT_MODE))  # the profile trains as the runs train
    subprocess.run([sys.executable, "-m", "lab.calibrate", "--model", "flux", "--preset",
                    "tiny", "--max-batch", "8", "--repeats", "5", *lora, "--out", os.path.join(a.out, "profile-cpu.json")],
                   check=True, env={**env, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
