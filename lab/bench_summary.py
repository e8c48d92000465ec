"""The bench's summaries (lab/bench.py): a run's measured steps as medians, a mode's rounds pooled,
and each --placement auto run against the best fixed mode of its scenario."""
from __future__ import annotations

import json
import os
import statistics
from typing import Any

from lab.bench_modes import AUTO_MODES, STALE_MODES
from telemetry.metrics import read_metrics


def summarize(rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Medians over the steps after the first `warmup`: step time, samples/s, bubble and busy
    fractions. samples/s is the trained samples of a step over the median step time, so that the
    step-time and throughput columns agree."""
    measured = rows[warmup:]
    if not measured:
        raise ValueError(f"{len(rows)} step(s) logged, none left after {warmup} warm-up step(s)")
    step_s = statistics.median(r["perf/step_s"] for r in measured)
    samples_per_step = statistics.median(round(r["perf/samples_per_s"] * r["perf/step_s"]) for r in measured)
    roles = sorted({k[len("perf/busy_fraction/"):] for r in measured for k in r if k.startswith("perf/busy_fraction/")})
    return {
        "measured_steps": [r["step"] for r in measured],
        "step_s": step_s,
        "steps_total_s": sum(r["perf/step_s"] for r in measured),
        "samples_per_step": samples_per_step,
        "samples_per_s": samples_per_step / step_s,
        "bubble_fraction": statistics.median(r["perf/bubble_fraction"] for r in measured),
        "publish_bytes": statistics.median(r.get("publish/bytes", 0.0) for r in measured),
        # --placement auto: a run that switched placement has each role's steps only
        "busy_fraction": {role: statistics.median(r[f"perf/busy_fraction/{role}"] for r in measured
                                                  if f"perf/busy_fraction/{role}" in r) for role in roles},
    }


def median_row(rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The measured step whose time is closest to the median step time."""
    measured = rows[warmup:]
    step_s = statistics.median(r["perf/step_s"] for r in measured)
    return min(measured, key=lambda r: abs(r["perf/step_s"] - step_s))


def pool_rounds(results: list[dict], warmup: int) -> dict:
    """One mode's runs (one per round) as one result: the summary over the measured steps of every
    round (each round's first `warmup` steps left out), each round's median step (`round_step_s`)
    and folder (`output_dirs`; `output_dir` the first round's); failed if a round failed."""
    out = {**results[0], "output_dirs": [r["output_dir"] for r in results]}
    failed = next((r for r in results if r["status"] != "ok"), None)
    if failed is not None:
        return {**out, "status": failed["status"], "error": failed.get("error"), "output_dir": failed["output_dir"]}
    if len(results) > 1:
        out.update(summarize([row for r in results for row in read_metrics(r["output_dir"])[warmup:]], 0))
        out["round_step_s"] = [r["step_s"] for r in results]
        out["wall_s"] = sum(r["wall_s"] for r in results)
    return out


def round_notes(rows: list[dict]) -> list[str]:
    """One line per scenario run in rounds: each mode's median step in each round."""
    out = {}
    for r in rows:
        if r.get("round_step_s"):
            out.setdefault(r["scenario"], []).append(f"{r['mode']} {' / '.join(f'{s:.3f}' for s in r['round_step_s'])}")
    return [f"{sc}: median step s by round: {'; '.join(modes)}" for sc, modes in out.items()]


def compare_auto(rows: list[dict]) -> None:
    """Each --placement auto row of one scenario against the scenario's best fixed mode (on-policy
    ones for `auto`; TCSS ones too for `auto+stale`): `vs_best_fixed`, `best_fixed`, and what the
    run chose and ran (`auto_placement`, `auto_switches`, from its config.json)."""
    for row in rows:
        if row["mode"] not in AUTO_MODES or row["samples_per_s"] is None:
            continue
        stale = row["mode"] in STALE_MODES
        fixed = [r for r in rows if r["mode"] not in AUTO_MODES and r["samples_per_s"] is not None
                 and (stale or r["mode"] not in STALE_MODES)]
        if fixed:
            best = max(fixed, key=lambda r: r["samples_per_s"])
            row["best_fixed"], row["vs_best_fixed"] = best["mode"], row["samples_per_s"] / best["samples_per_s"]
        records = [auto_record(d) for d in row.get("output_dirs", [row["output_dir"]])]
        if all(r is not None for r in records):
            row["auto_placement"] = _rounds_label(r.get("running") for r in records)
            row["auto_chosen"] = _rounds_label(r.get("chosen") for r in records)
            row["auto_switches"] = sum(len(r.get("switches") or []) for r in records)
            # The whole measured stretch: its steps (trial steps included) and the switches inside it,
            # against the best fixed mode's steps: what a run of this length gains or loses.
            first = row["measured_steps"][0]  # a switch after the step before it precedes a measured step
            switch_s = sum(s["switch_s"] for r in records for s in r.get("switches") or []
                           if s["after_step"] >= first - 1)
            if fixed:
                row["switch_s"] = switch_s
                row["vs_best_fixed_run"] = best["steps_total_s"] / (row["steps_total_s"] + switch_s)


def auto_record(out_dir: str) -> dict | None:
    """A --placement auto run's placement record (its config.json's run.placement), or None."""
    path = os.path.join(out_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return (json.load(f).get("run") or {}).get("placement") or {}


def _rounds_label(placements) -> str | None:
    """The label of the placement each round's record names, once if every round named the same."""
    labels = list(dict.fromkeys((p or {}).get("label") for p in placements))
    return labels[0] if len(labels) == 1 else " / ".join(map(str, labels))


def auto_notes(rows: list[dict]) -> list[str]:
    """One line per --placement auto row: what it ran and how it compares."""
    out = []
    for r in rows:
        if r.get("vs_best_fixed") is None:
            continue
        out.append(f"{r['scenario']}: {r['mode']} chose {r.get('auto_chosen')}, ran {r.get('auto_placement')} "
                   f"({r.get('auto_switches', 0)} switch(es) inside the run): {r['vs_best_fixed']:.2f}x the best fixed "
                   f"mode ({r['best_fixed']}) by median step, {r.get('vs_best_fixed_run', float('nan')):.2f}x over the "
                   f"measured steps with trials and switches, {r['ratio']:.2f}x the colocated baseline")
    return out
