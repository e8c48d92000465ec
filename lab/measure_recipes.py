"""Measure every recipe on every topology (recipes/topology/) at the released models' sizes and write
docs/memory/RECIPE-NGPUS.json (scripts/check_recipe.py's --json), which tests/test_memory.py holds
the memory model to. About half an hour on two busy CPU cores.

    python -m lab.measure_recipes [--only dance_grpo/flux_dev] [--out docs/memory] [--gpu h100]
    python -m lab.measure_recipes --table     # the README's table from the records in --out

The generator ranks of a recipe do not depend on the topology (a fragment is the recipe's groups, a
publication the whole model), so they are measured once per recipe and reported with each topology.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import time

from config import cli
from planner import hardware
from lab.memory import measure
from runtime.budget import load_recipe, recipe_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*_grpo", "*.toml")))
TOPOLOGIES = [os.path.join(ROOT, "recipes", "topology", f"{n}gpus.toml") for n in (8, 16, 32)]


def out_name(recipe: str, topology: str) -> str:
    """docs/memory/ file name: the recipe's folder, name and topology (recipes/A/B.toml on 8 GPUs:
    A-B-8gpus.json)."""
    rel = os.path.relpath(recipe, os.path.join(ROOT, "recipes"))[:-len(".toml")].replace(os.sep, "-")
    return f"{rel}-{os.path.basename(topology)[:-len('.toml')]}.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--only", action="append", default=[], help="recipes whose path contains this (repeatable)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "memory"))
    p.add_argument("--gpu", default="h100", help="the GPU the report compares with")
    p.add_argument("--table", action="store_true", help="print the records in --out as a markdown table only")
    p.add_argument("--refresh", action="store_true",
                   help="rewrite the records' model figures from planner/memory.py as it is now, measure nothing")
    args = p.parse_args(argv)
    if args.table:
        print(table(args.out))
        return 0
    if args.refresh:
        refresh(args.out)
        return 0
    os.makedirs(args.out, exist_ok=True)
    gpu = hardware.gpu(args.gpu)
    failed = []
    for recipe in [r for r in RECIPES if not args.only or any(o in r for o in args.only)]:
        try:
            measure_recipe(recipe, gpu, args.out)
        except Exception as e:  # one recipe's failure leaves the others measured
            failed.append(recipe)
            print(f"{recipe}: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


def refresh(out_dir: str) -> None:
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
        with open(path) as f:
            record = json.load(f)
        system, rest = os.path.basename(path)[:-len(".json")].split("-", 1)
        recipe, topology = rest.rsplit("-", 1)
        cfg, table_, facts = load_recipe([os.path.join(ROOT, "recipes", system, f"{recipe}.toml"),
                                          os.path.join(ROOT, "recipes", "topology", f"{topology}.toml")])
        measured = {r["role"]: measure.RankMemory.from_report(r) for r in record["roles"]}
        out = recipe_report(cfg, table_, facts, hardware.gpu(record["gpu"]), measured)
        out["seconds"] = record["seconds"]
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def table(out_dir: str) -> str:
    """Markdown: per recipe and topology, each role's measured peak (its phase and two largest
    categories) and the model's, in GiB."""
    lines = ["| recipe | GPUs | role | measured peak (phase: largest categories) | model |", "|---|---|---|---|---|"]
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json")), key=lambda p: (p.rsplit("-", 1)[0],
                                                                                 int(p.rsplit("-", 1)[1][:-9]))):
        with open(path) as f:
            record = json.load(f)
        for r in record["roles"]:
            what = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["categories"].items(), key=lambda kv: -kv[1])[:2])
            lines.append(f"| {record['recipe']} | {record['gpus']} | {r['role']} | **{r['measured_peak_gib']:.1f}** "
                         f"({r['phase']}: {what}) | {r['predicted_peak_gib']:.1f} |")
    return "\n".join(lines)


def measure_recipe(recipe: str, gpu: hardware.GPU, out_dir: str) -> None:
    """Every topology of one recipe. Replicated trainers (LoRA) hold the same whatever their count,
    so they too are measured once."""
    generator = trainer = None
    for topology in TOPOLOGIES:
        started = time.perf_counter()
        cfg, table, facts = load_recipe([recipe, topology])
        release = table["model_config"]
        sent = measure.sent_by_generators(cfg, facts, release)
        headers = {}
        if trainer is None or facts.train_sharding == "fsdp":
            trainer, headers = measure.measure_trainer(cfg, facts, release, facts.topology.trainer_ranks[0], sent)
        if generator is None:
            g = facts.topology.generator_ranks[0]
            generator = measure.measure_generator(cfg, facts, release, g, sent, headers.get(g))
        out = recipe_report(cfg, table, facts, gpu, {"generator": generator, "trainer": trainer})
        out["seconds"] = round(time.perf_counter() - started, 1)
        with open(os.path.join(out_dir, out_name(recipe, topology)), "w") as f:
            json.dump(out, f, indent=1)
        print(f"{out_name(recipe, topology)}: " + ", ".join(
            f"{r['role']} {r['measured_peak_gib']} GiB ({r['phase']}; model {r['predicted_peak_gib']})"
            for r in out["roles"]), flush=True)


if __name__ == "__main__":
    cli.run(main)
