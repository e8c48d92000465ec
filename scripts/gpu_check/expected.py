"""The memory section's expected figures, computed on a CPU before a GPU is available: for each size,
the FakeTensorMode measurement of each phase (lab/memory/fake_run.py, as lab/memory/measure.py measures a
rank) and the memory model's items (planner/peak_memory.py). The GPU check compares its measurement with
them (scripts/gpu_check/peak_memory.py).

    python -m scripts.gpu_check.expected                 # docs/gpu_check/expected.json (a few minutes)
    python -m scripts.gpu_check.expected --size tiny --out /tmp/x.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

from scripts.gpu_check import peak_memory
from scripts.gpu_check import model as M

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--size", action="append", choices=sorted(M.SIZES), help="default: flux")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "gpu_check", "expected.json"))
    args = p.parse_args(argv)
    sizes = args.size or ["flux"]
    out = {"format": "digenrl-gpu-check-expected/1", "date": datetime.date.today().isoformat(),
           "command": " ".join(["python -m scripts.gpu_check.expected", *(argv if argv is not None else sys.argv[1:])]),
           "torch": torch.__version__, "sizes": {name: peak_memory.expected(M.SIZES[name]) for name in sizes}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for name, figures in out["sizes"].items():
        for phase in peak_memory.PHASES:
            print(f"{name} {phase}: fake {figures['fake'][phase]['total']:.2f} GiB, "
                  f"model {figures['model'][phase]['total']:.2f} GiB")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
