"""The start-up probe's training cost against the training forwards the bench's fixed runs measured.

    python -m lab.forward_check BENCH_DIR [--scenarios window,fits]

For each scenario and round of a `lab.bench --scenarios ... --rounds N` folder: the --placement
auto runs' probes (runtime/autoplace.py: per rank, `forward_s` a forward's fixed cost and `row_s`
a transition's, averaged over the auto runs of that round) predict each training span of the
round's fixed runs, micro_batches x forward_s + transitions x row_s of the rank that ran it; the
spans' medians (their traces, steps after the first), by mode, rank and size, are beside them.
The probe never timed these spans: a check of the prediction against what it was not fitted to.
Beside it, what one size alone predicts (a forward of the probe's transitions divided by them,
per transition: the planner's cost before the fixed one).
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics


def probe_costs(round_dir: str) -> tuple[list[float], list[float], int] | None:
    """(forward_s, row_s) per rank, averaged over the round's auto runs, and the transitions of the
    probe's larger forward; None without such a run."""
    probes, size = [], None
    for path in sorted(glob.glob(os.path.join(round_dir, "auto*", "config.json"))):
        with open(path) as f:
            config = json.load(f)
        probe = ((config.get("run") or {}).get("placement") or {}).get("probe")
        if probe and probe.get("forward_s"):
            probes.append(probe)
            t = config["topology"]
            size = t["train_micro_batch"] if t.get("tsp") else config["rl"]["micro_batch"]
    if not probes:
        return None
    ranks = range(len(probes[0]["row_s"]))
    return ([statistics.fmean(p["forward_s"][r] for p in probes) for r in ranks],
            [statistics.fmean(p["row_s"][r] for p in probes) for r in ranks], size)


def train_spans(mode_dir: str) -> dict[tuple[int, int, int], list[float]]:
    """{(rank, micro_batches, transitions): seconds of each training span after the first step}."""
    out = collections.defaultdict(list)
    for path in glob.glob(os.path.join(mode_dir, "trace", "rank*.json")):
        rank = int(os.path.basename(path)[len("rank"):-len(".json")])
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        for e in events:
            a = e.get("args") or {}
            if e.get("ph") == "X" and e.get("name") == "train" and a.get("step", 0) >= 1:
                out[(rank, a["micro_batches"], a["transitions"])].append(e["dur"] / 1e6)
    return out


def rows(bench_dir: str, scenarios: list[str], least: int = 8) -> list[dict]:
    out = []
    for scenario in scenarios:
        for round_dir in sorted(glob.glob(os.path.join(bench_dir, scenario, "round*"))):
            costs = probe_costs(round_dir)
            if costs is None:
                continue
            forward_s, row_s, size = costs
            for mode_dir in sorted(glob.glob(os.path.join(round_dir, "*"))):
                mode = os.path.basename(mode_dir)
                if mode.startswith("auto"):
                    continue
                for (rank, mb, n), spans in sorted(train_spans(mode_dir).items()):
                    if len(spans) < least or rank >= len(row_s):
                        continue
                    measured = statistics.median(spans)
                    predicted = mb * forward_s[rank] + n * row_s[rank]
                    out.append({"scenario": scenario, "round": os.path.basename(round_dir), "mode": mode,
                                "rank": rank, "micro_batches": mb, "transitions": n, "spans": len(spans),
                                "measured_s": measured, "predicted_s": predicted,
                                "one_size_s": n * (forward_s[rank] / size + row_s[rank])})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("bench_dir")
    p.add_argument("--scenarios", default="window,fits")
    args = p.parse_args(argv)
    for r in rows(args.bench_dir, args.scenarios.split(",")):
        print(f"{r['scenario']} {r['round']} {r['mode']:22s} rank {r['rank']}: {r['micro_batches']} forward(s) of "
              f"{r['transitions']:3d} transitions, measured {r['measured_s']:.4f} s (median of {r['spans']}), "
              f"predicted {r['predicted_s']:.4f} s ({r['predicted_s'] / r['measured_s']:.2f}x; "
              f"one size alone {r['one_size_s'] / r['measured_s']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
