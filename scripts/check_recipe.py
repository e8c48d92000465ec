"""Check a recipe without weights or GPUs: its config validates on the GPU count it names, and each
role's GPU memory, measured on the roles' own code at the released model's size (lab/memory/measure.py:
FakeTensorMode with torch's memory trackers), fits the GPU it names.

    python -m scripts.check_recipe recipes/dance_grpo/flux_dev.toml --gpu h100 --json OUT.json
    python -m scripts.check_recipe recipes/dance_grpo/hunyuan_video.toml --config recipes/topology/32gpus.toml
    python -m scripts.check_recipe recipes/flow_grpo/qwen_image.toml --predict-only

Prints every role's phases, measured and as the memory model (planner/memory.py) predicts them, and
the categories at the peak, beside the GPU's memory. Exits 0
when every role fits; 1 naming the role, its phase and its largest categories when one does not;
2 on a user error. OUT (--json) holds per role {"role", "phase", "measured_peak_gib",
"predicted_peak_gib", "categories": {...}} and every phase's figures.
"""
from __future__ import annotations

import argparse
import json
import time

from config import cli
from planner import hardware
from lab.memory import measure
from runtime.budget import load_recipe, recipe_report


def print_report(out: dict) -> list[str]:
    """The table; returns a line per role that does not fit."""
    print(f"{out['recipe']}: {out['gpus']} x {out['gpu']} ({out['gpu_memory_gib']:.1f} GiB, "
          f"{out['usable_gib']:.1f} GiB for tensors), {out['topology']}")
    print(f"  {'role':10s} {'peak phase':16s} {'measured':>9s} {'model':>7s}  GiB by category")
    misfits = []
    for r in out["roles"]:
        value = r["measured_peak_gib"] if r["measured_peak_gib"] is not None else r["predicted_peak_gib"]
        cats = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["categories"].items(), key=lambda kv: -kv[1]) if v >= 0.05)
        shown = "-" if r["measured_peak_gib"] is None else f"{r['measured_peak_gib']:.1f}"
        print(f"  {r['role']:10s} {r['phase']:16s} {shown:>9s} {r['predicted_peak_gib']:>7.1f}  {cats}")
        for phase, got in r["phases"].items():
            if phase != r["phase"]:
                seen = "-" if got["measured_gib"] is None else f"{got['measured_gib']:.1f}"
                print(f"  {'':10s}   {phase:14s} {seen:>9s} {got['predicted_gib']:>7.1f}")
        if value > out["usable_gib"]:
            top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["categories"].items(), key=lambda kv: -kv[1])[:3])
            misfits.append(f"a {r['role']} needs {value:.1f} GiB at its {r['phase']}, above the "
                           f"{out['usable_gib']:.1f} GiB a {out['gpu']} has for tensors ({top} GiB)")
    return misfits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("recipe", help="a recipe (.toml)")
    p.add_argument("--config", action="append", default=[], help="more config files after the recipe (a topology)")
    p.add_argument("--gpu", default=None, help=f"check on this GPU instead of the recipe's: {sorted(hardware.GPUS)}")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures of every role and phase here")
    p.add_argument("--predict-only", action="store_true", help="the memory model only (seconds), no measurement")
    args = p.parse_args(argv)
    cfg, recipe, facts = load_recipe([args.recipe, *args.config])
    gpu = hardware.gpu(args.gpu or recipe["gpu"])
    started = time.perf_counter()
    measured = None if args.predict_only else measure.measure_run(cfg, facts, recipe["model_config"])
    out = recipe_report(cfg, recipe, facts, gpu, measured)
    out["seconds"] = round(time.perf_counter() - started, 1)
    misfits = print_report(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    for line in misfits:
        print(f"does not fit: {line}")
    return 1 if misfits else 0


if __name__ == "__main__":
    cli.run(main)
