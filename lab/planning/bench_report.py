"""The bench's report: console and markdown tables, notes, and the scenario figures (a bar chart
of the ratios to each scenario's colocated baseline, and a timeline of one step per mode drawn
from the rank traces)."""
from __future__ import annotations

import json
import os
import shlex
import statistics
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from lab.planning import fit
from lab.planning.profile import DeviceProfile
from telemetry.tracing import Span, Tracer

COLORS = {"generate": "tab:green", "score": "tab:olive", "train": "tab:blue", "optimizer": "tab:purple",
          "comm": "tab:gray", "publish": "tab:orange", "eval": "tab:brown"}


def table_rows(results: list[dict[str, Any]], baselines: tuple[str, ...]) -> tuple[list[str], list[list[str]]]:
    """Header and cells, shared by the console and the markdown table."""
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    header = ["mode", "ranks", "step s", "samples/s", "bubble", "busy by role",
              *[f"x {b}" for b in baselines], "status"]
    rows = []
    for r in results:
        ok = r["status"] == "ok"
        busy = " ".join(f"{role} {v:.2f}" for role, v in r.get("busy_fraction", {}).items()) or "-"
        rows.append([r["mode"], f"{r['nproc']}{'*' if r['exceeds_cores'] else ''}",
                     num(r.get("step_s") if ok else None, ".3f"), num(r.get("samples_per_s") if ok else None, ".2f"),
                     num(r.get("bubble_fraction") if ok else None, ".3f"), busy if ok else "-",
                     *[num(r["ratio_vs"][b], ".2f") for b in baselines], r["status"]])
    return header, rows


def console_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def notes(report: dict[str, Any]) -> list[str]:
    w = report["workload"]
    if "model" in w:
        lines = [f"model {w['model']}, {w['resolution']}, {w['prompts_per_step']} prompts x {w['group_size']} samples "
                 f"per step, {w['sample_steps']} sample steps, micro-batch {w['micro_batch']}, LoRA rank "
                 f"{w['lora_rank']}; {w['steps']} steps, the first {w['warmup']} left out, medians over the rest; "
                 f"{report['cpu_count']} CPU cores"]
    else:
        lines = [f"workload {shlex.join(w['flags'])}; {report['cpu_count']} CPU cores"]
    if any(r["exceeds_cores"] for r in report["modes"]):
        lines.append(f"* more ranks than the {report['cpu_count']} CPU cores: ranks time-share cores")
    lines.append(report["bubble_definition"])
    for r in report["modes"]:
        c = r.get("bubble_check")
        if c:
            busy = " + ".join(f"{b:.3f}" for b in c["busy_s"])
            lines.append(f"{r['mode']}, step {c['step']} (from the traces): ideal = ({busy}) / {len(c['busy_s'])} = "
                         f"{c['ideal_s']:.3f} s, actual {c['actual_s']:.3f} s, bubble {c['bubble']:.3f} "
                         f"(logged {c['logged_bubble']:.3f})")
    lines += [f"{r['mode']} {r['status']}: {r.get('error') or 'see ' + r['output_dir'] + '/stderr.log'}"
              for r in report["modes"] if r["status"] != "ok"]
    return lines


def write_report(report: dict[str, Any], json_path: str, md_path: str) -> None:
    """Print the table and its notes; write them as JSON and as markdown."""
    header, rows = table_rows(report["modes"], tuple(report["baselines"]))
    print("\n" + console_table(header, rows))
    for line in notes(report):
        print(line)
    for path in (json_path, md_path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    with open(md_path, "w") as f:
        f.write(markdown_table(header, rows) + "\n\n" + "\n".join(f"- {line}" for line in notes(report)) + "\n")
    print(f"wrote {json_path} and {md_path}")



# ---------------------------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------------------------

SCENARIO_HEADER = ["scenario", "mode", "ranks", "step s", "samples/s", "bubble", "busy by role", "published MB/step",
                   "x baseline", "planner x", "status"]


def scenario_cells(row: dict[str, Any]) -> list[str]:
    ok = row["status"] == "ok"

    def num(v, fmt):
        return format(v, fmt) if ok and v is not None else "-"

    busy = " ".join(f"{k} {v:.2f}" for k, v in row.get("busy_fraction", {}).items()) if ok else "-"
    mode = row["mode"] + (" (baseline)" if row["baseline"] else "") + (" *best*" if row.get("best") else "")
    return [row["scenario"], mode, f"{row['nproc']}{'*' if row['exceeds_cores'] else ''}", num(row.get("step_s"), ".3f"),
            num(row.get("samples_per_s"), ".2f"), num(row.get("bubble"), ".3f"), busy or "-",
            num(row["publish_bytes"] / 1e6 if row.get("publish_bytes") else None, ".3f"),
            num(row.get("ratio"), ".2f"), num(row.get("predicted_ratio"), ".2f"), row["status"]]


def ratio_chart(rows: list[dict[str, Any]], path: str) -> None:
    """One group of bars per scenario: each mode's samples/s over its scenario's baseline."""
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    fig, ax = plt.subplots(figsize=(2.2 + 2.2 * len(scenarios), 3.6))
    x = 0.0
    ticks = []
    for sc in scenarios:
        mine = [r for r in rows if r["scenario"] == sc]
        start = x
        for r in mine:
            value = r.get("ratio") or 0.0
            color = "dimgray" if r["baseline"] else "darkgray" if r["mode"].startswith("colocated") else "tab:blue"
            ax.bar(x, value, width=0.8, color=color)
            ax.text(x, value + 0.02, f"{value:.2f}", ha="center", va="bottom", fontsize=7)
            ax.text(x, 0.02, r["mode"], rotation=90, ha="center", va="bottom", fontsize=7, color="white")
            if r.get("predicted_ratio") is not None:
                ax.plot([x - 0.4, x + 0.4], [r["predicted_ratio"]] * 2, color="tab:red", linewidth=1.5)
            x += 1
        ticks.append(((start + x - 1) / 2, sc))
        x += 0.8
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([t for t, _ in ticks], [n for _, n in ticks])
    ax.set_ylabel("samples/s over the colocated baseline")
    ax.set_title("DigenRL modes (blue) against each scenario's colocated baseline (dark gray); red: planner",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _spans(out_dir: str, step: int) -> list[tuple[int, str, float, float]]:
    """(rank, category, start s, duration s) of one step's spans, from the rank traces."""
    trace_dir = os.path.join(out_dir, "trace")
    out = []
    for fname in sorted(os.listdir(trace_dir)):
        rank = int("".join(c for c in fname if c.isdigit()))
        with open(os.path.join(trace_dir, fname)) as f:
            events = json.load(f)["traceEvents"]
        out += [(rank, e["cat"], e["ts"] / 1e6, e["dur"] / 1e6) for e in events
                if e.get("ph") == "X" and e.get("args", {}).get("step") == step]
    return out


def bubble_check(out_dir: str, row: dict[str, Any]) -> dict[str, Any] | None:
    """The bubble of one step (a metrics.jsonl row) recomputed from the rank traces: per-rank busy
    seconds, ideal, actual, and the logged value to compare with (None when the traces are missing)."""
    step, step_s = row["step"], row["perf/step_s"]
    trace_dir = os.path.join(out_dir, "trace")
    if not os.path.isdir(trace_dir):
        return None
    busy = []
    for fname in sorted(os.listdir(trace_dir), key=lambda f: int("".join(c for c in f if c.isdigit()) or 0)):
        with open(os.path.join(trace_dir, fname)) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        tracer = Tracer(rank=-1, role="")
        tracer.spans = [Span(e["name"], e["cat"], e["args"]["step"], e["args"].get("fragment"), e["ts"], e["dur"])
                        for e in events]
        busy.append(tracer.busy_seconds(step))
    if not busy:
        return None
    ideal = sum(busy) / len(busy)
    return {"step": step, "busy_s": busy, "ideal_s": ideal, "actual_s": step_s, "bubble": 1 - ideal / step_s,
            "logged_bubble": row["perf/bubble_fraction"]}


def timeline(rows: list[dict[str, Any]], path: str) -> None:
    """One panel per mode: a lane per rank, its spans of one measured step colored by kind."""
    runs = [r for r in rows if r["status"] == "ok" and r.get("bubble_check")]
    if not runs:
        return
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 0.9 + 0.75 * len(runs) * 1.4), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        spans = _spans(r["output_dir"], r["bubble_check"]["step"])
        t0 = min((s[2] for s in spans), default=0.0)
        for rank, cat, start, dur in spans:
            ax.barh(rank, dur, left=start - t0, height=0.7, color=COLORS.get(cat, "black"))
        ax.set_yticks(sorted({s[0] for s in spans}))
        ax.set_ylabel("rank", fontsize=7)
        ax.set_title(f"{r['scenario']}: {r['mode']} (step {r['bubble_check']['step']}, bubble {r['bubble']:.2f})",
                     fontsize=8)
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("seconds from the step's first span")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, list(COLORS), loc="upper right", fontsize=7, ncol=len(COLORS))
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_predictions(rows: list[dict[str, Any]], profile_path: str) -> str:
    """Put the planner's ratio beside each measured one (`predicted_ratio`, `predicted_step_s`): per
    scenario, per-unit costs fitted on the baseline's run alone predict every mode from its config
    (lab/planning/fit.py). Returns the report's note on it."""
    profile = DeviceProfile.load(profile_path)
    failed = []
    for sc in dict.fromkeys(r["scenario"] for r in rows):
        mine = [r for r in rows if r["scenario"] == sc and r["status"] == "ok"]
        base = next((r for r in mine if r["baseline"]), None)
        if base is None:
            continue
        try:
            predicted = fit.predict_ratios(base["output_dir"], [r["output_dir"] for r in mine], profile)
        except (ValueError, KeyError, ZeroDivisionError) as e:
            failed.append(f"{sc} ({e})")
            continue
        for r in mine:
            r.update(predicted[r["output_dir"]])
    errors = [abs(r["predicted_ratio"] / r["ratio"] - 1) for r in rows
              if r.get("predicted_ratio") and r.get("ratio") and not r["baseline"]]
    line = (f"planner x: the planner's ratio, its per-unit costs fitted on each scenario's baseline run alone "
            f"(profile {profile_path})")
    if errors:
        line += f"; off the measured ratio by {100 * statistics.median(errors):.0f}% (median), " \
                f"{100 * max(errors):.0f}% (worst) over {len(errors)} modes"
    return line + (f"; not predicted: {'; '.join(failed)}" if failed else "")


def scenario_report(rows: list[dict[str, Any]], notes_lines: list[str], out_dir: str, json_path: str) -> None:
    """Print and write the scenario table (markdown, JSON list of rows) and its two figures."""
    cells = [scenario_cells(r) for r in rows]
    print("\n" + console_table(SCENARIO_HEADER, cells))
    for line in notes_lines:
        print(line)
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(rows, f, indent=2)
    md = os.path.join(out_dir, "scenarios.md")
    with open(md, "w") as f:
        f.write(markdown_table(SCENARIO_HEADER, cells) + "\n\n" + "\n".join(f"- {line}" for line in notes_lines) + "\n")
    ratio_chart(rows, os.path.join(out_dir, "ratios.png"))
    timeline(rows, os.path.join(out_dir, "timeline.png"))
    print(f"wrote {json_path}, {md}, {out_dir}/ratios.png and {out_dir}/timeline.png")
