"""The prepared GPU check (issue 37): what one GPU measures that a CPU cannot, in one command of a
few minutes, written as JSON (docs/gpu_check/README.md).

    python -m scripts.gpu_check --json gpu_check.json                      # every section, on CUDA
    python -m scripts.gpu_check --sections memory,numerics --json out.json # some sections
    python -m scripts.gpu_check --device cpu --json out.json               # the same code on a CPU, tiny

Sections (each selectable with --sections):
- env: GPU, driver, torch, CUDA, NCCL, bf16 and TF32 support (scripts/gpu_check/env.py);
- runtime: the real runtime on one rank (NCCL on a GPU): colocated replicated LoRA, colocated FSDP2
  full fine-tuning and a resume, 2 steps each, the communication trace checked (runs.py);
- memory: peak allocated and reserved memory of a generator's step, a LoRA trainer's forward +
  backward and a full fine-tune's step with fused AdamW at FLUX.1-dev width, beside the FakeTensorMode
  measurement and the memory model (peak_memory.py; docs/gpu_check/expected.json);
- mfu: achieved FLOP/s of those phases at two token counts and three batch sizes beside the
  planner's efficiencies (mfu.py);
- numerics: one SDE step's log-probability in bf16 at batch 1, batch 4 and TSP-packed, in float32
  on the device and on the host: |delta log p| and |ratio - 1| against the clip range (numerics.py).

A section that fails records its error and the others still run; the JSON is rewritten after every
section, so a run stopped early keeps what it measured. Exits 1 if a section failed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch

from models import resolve_device
from scripts.gpu_check import env, mfu, numerics, runs
from scripts.gpu_check import peak_memory
from scripts.gpu_check import model as M

SECTIONS = ("env", "runtime", "memory", "mfu", "numerics")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPECTED = os.path.join(ROOT, "docs", "gpu_check", "expected.json")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)}")
    p.add_argument("--json", default=None, metavar="PATH", help="write every section's figures here")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--size", default=None, choices=sorted(M.SIZES),
                   help="the model: flux (FLUX.1-dev width, 4 + 8 blocks; default on CUDA) or tiny (default on a CPU)")
    p.add_argument("--dtype", default="auto", help="compute dtype of memory and mfu (auto: bf16 on CUDA, float32 on a CPU)")
    p.add_argument("--numerics-dtype", default="bfloat16", help="the rollout's precision in numerics")
    p.add_argument("--expected", default=EXPECTED, help="the figures the memory section compares with")
    p.add_argument("--keep-runs", default=None, metavar="DIR", help="keep the runtime section's run folders here")
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        p.error(f"--sections: unknown {unknown}; choose from {list(SECTIONS)}")
    return args


def device_of(name: str) -> torch.device:
    device = resolve_device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device")
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def section(name: str, args, device: torch.device, size: M.Size, background=None):
    if name == "env":
        return env.run(device)
    if name == "runtime":
        return runs.finish(background.result()) if background is not None else runs.run(device, args.keep_runs)
    if name == "memory":
        figures = None
        if os.path.isfile(args.expected):
            with open(args.expected) as f:
                figures = json.load(f).get("sizes", {}).get(size.name)
        return peak_memory.run(size, device, args.dtype, figures)
    if name == "mfu":
        with M.one_rank(device):
            return mfu.run(size, device, args.dtype)
    return numerics.run(size, device, low=args.numerics_dtype)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = device_of(args.device)
    size = M.pick_size(args.size, device)
    report = {"format": "digenrl-gpu-check/1", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(["python -m scripts.gpu_check", *(argv if argv is not None else sys.argv[1:])]),
              "device": device.type, "size": size.name, "sections": {}, "seconds": {}}
    failed = []
    # On a CPU the runtime section's runs (subprocesses) go on beside the other sections: nothing
    # there is timed for a claim. On a GPU they run alone, first, so they disturb no measurement.
    pool = ThreadPoolExecutor(1)
    background = pool.submit(runs.launch, device, args.keep_runs) \
        if device.type == "cpu" and "runtime" in args.sections and len(args.sections) > 1 else None
    for name in [s for s in args.sections if s != "runtime" or background is None] + \
            (["runtime"] if background is not None else []):
        started = time.time()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            report["sections"][name] = section(name, args, device, size, background)
        except Exception as e:  # noqa: BLE001 - one section's failure is recorded; the others still run
            failed.append(name)
            report["sections"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            print(report["sections"][name]["traceback"], file=sys.stderr, flush=True)
        report["seconds"][name] = round(time.time() - started, 1)
        print(f"[gpu_check] {name}: {'failed' if name in failed else 'done'} in {report['seconds'][name]} s", flush=True)
        if args.json:
            write(args.json, report)
    pool.shutdown()
    print(json.dumps({k: v for k, v in report.items() if k != "sections"}, indent=1))
    return 1 if failed else 0


def write(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
