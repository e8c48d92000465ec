"""Published step times as data (anchors), and the planner's predictions of them
(docs/calibration.md, "Validation against published runs").

A row describes a run the way its authors ran it (schema in `FIELDS`), one JSON object per line of
a .jsonl file. Rows with "fit": true were used to fit the constants of the model; every other row
is held out and must be predicted within its `tolerance` (default 0.25). The only constants fitted
on step times are VeRL-Omni's (`fit_overheads`): its mechanism model leaves a large part of the
step unexplained (single-controller orchestration, the generative judge's decoding), and that
remainder is fitted as a fixed time per step plus a time per sample a GPU holds, from the fit rows
alone, then added to the held-out rows of the same system. DanceGRPO has no fitted constant.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from planner.hardware import gpu
from lab.planning.placements import Pool, best_colocated, enumerate_plans, recommend
from lab.planning.peer_systems import Prediction, predict_system
from planner.workload import Workload

SYSTEM_NAMES = ("verl-omni", "dance-grpo", "flow-grpo", "genrl", "colocated", "digenrl")
FIELDS = {"name": str, "system": str, "model": str, "gpu": str, "num_gpus": int, "height": int, "width": int,
          "frames": int, "sampling_steps": int, "trained_timesteps": int, "prompts_per_step": int, "group_size": int,
          "cfg_scale": (int, float), "finetune": str, "lora_rank": int, "gradient_checkpointing": bool,
          "published_step_s": (int, float)}
OPTIONAL = {"tolerance": (int, float, type(None)), "fit": bool, "source": str, "note": str, "reward": str,
            "text_tokens": int, "reward_gpus": int, "param_offload": bool, "accumulation": int}
SYSTEM_KWARGS = {"reward_gpus": ("verl-omni",), "param_offload": ("verl-omni",), "accumulation": ("dance-grpo",)}
FITTED_OVERHEAD = ("verl-omni",)
DEFAULT_TOLERANCE = 0.25


@dataclass
class RowResult:
    name: str
    system: str
    predicted_step_s: float
    published_step_s: float
    fit: bool
    tolerance: float
    mechanism_step_s: float
    overhead_s: float

    @property
    def rel_error(self) -> float:
        return (self.predicted_step_s - self.published_step_s) / self.published_step_s

    @property
    def within_tolerance(self) -> bool:
        return abs(self.rel_error) <= self.tolerance

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "predicted_step_s": round(self.predicted_step_s, 3),
                "published_step_s": self.published_step_s, "rel_error": round(self.rel_error, 4)}


def check_row(row: dict[str, Any]) -> None:
    """ValueError naming the row and the field when a row does not follow the schema."""
    name = row.get("name", "<unnamed>")
    for key, typ in FIELDS.items():
        if key not in row:
            raise ValueError(f"published row {name!r}: missing field {key!r}")
        if not isinstance(row[key], typ) or (typ is int and isinstance(row[key], bool)):
            raise ValueError(f"published row {name!r}: field {key!r} must be {typ}, got {row[key]!r}")
    for key in row:
        if key not in FIELDS and key not in OPTIONAL:
            raise ValueError(f"published row {name!r}: unknown field {key!r}")
        if key in OPTIONAL and not isinstance(row[key], OPTIONAL[key]):
            raise ValueError(f"published row {name!r}: field {key!r} must be {OPTIONAL[key]}, got {row[key]!r}")
    if row["system"] not in SYSTEM_NAMES:
        raise ValueError(f"published row {name!r}: system must be one of {SYSTEM_NAMES}, got {row['system']!r}")
    if row["finetune"] not in ("lora", "full"):
        raise ValueError(f"published row {name!r}: finetune must be lora or full")
    gpu(row["gpu"])
    if row["published_step_s"] <= 0 or row["num_gpus"] < 1:
        raise ValueError(f"published row {name!r}: published_step_s and num_gpus must be positive")


def load_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file (blank lines skipped), each checked against the schema."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON object ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected one JSON object per line, got {type(row).__name__}")
            check_row(row)
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    names = [r["name"] for r in rows]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: row names repeat: {sorted(n for n in set(names) if names.count(n) > 1)}")
    return rows


DEFAULT_REWARD = {"verl-omni": "ocr_vlm", "dance-grpo": "hpsv2", "flow-grpo": "pickscore", "genrl": "ocr_cpu",
                  "colocated": "pickscore", "digenrl": "pickscore"}


def workload_of(row: dict[str, Any]) -> Workload:
    return Workload(row["model"], row["height"], row["width"], row["frames"], row["sampling_steps"],
                    row["trained_timesteps"], row["prompts_per_step"], row["group_size"], float(row["cfg_scale"]),
                    row["finetune"], row["lora_rank"] if row["finetune"] == "lora" else 32,
                    row["gradient_checkpointing"], text_tokens=row.get("text_tokens"),
                    rewards=(row.get("reward") or DEFAULT_REWARD[row["system"]],))


def mechanism_prediction(row: dict[str, Any]) -> Prediction:
    """The model's prediction of a row without any fitted step-time constant."""
    wl, g, n = workload_of(row), gpu(row["gpu"]), row["num_gpus"]
    if row["system"] in ("colocated", "digenrl"):
        preds, _ = enumerate_plans(wl, [Pool(g, n)])
        best = best_colocated(preds) if row["system"] == "colocated" else recommend(preds)
        if best is None:
            raise ValueError(f"published row {row['name']!r}: no feasible {row['system']} plan")
        return best
    kwargs = {k: row[k] for k in SYSTEM_KWARGS if k in row and row["system"] in SYSTEM_KWARGS[k]}
    return predict_system(row["system"], wl, g, n, **kwargs)


def samples_per_gpu(row: dict[str, Any]) -> float:
    return row["prompts_per_step"] * row["group_size"] / row["num_gpus"]


def fit_overheads(rows: list[dict[str, Any]], mechanism: dict[str, float] | None = None
                  ) -> dict[str, tuple[float, float]]:
    """Per system in FITTED_OVERHEAD: (seconds per step, seconds per sample a GPU holds) of the step
    time its mechanism model leaves unexplained, least squares over its fit rows (one fit row, or
    rows of one load per GPU: the per-step time alone). `mechanism`: each row's mechanism step
    time by name, if already predicted."""
    out = {}
    for system in FITTED_OVERHEAD:
        fit = [r for r in rows if r["system"] == system and r.get("fit")]
        if not fit:
            continue
        x = [samples_per_gpu(r) for r in fit]
        y = [r["published_step_s"] - (mechanism[r["name"]] if mechanism else mechanism_prediction(r).step_s)
             for r in fit]
        mx, my = sum(x) / len(x), sum(y) / len(y)
        sxx = sum((a - mx) ** 2 for a in x)
        slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx if sxx > 0 else 0.0
        out[system] = (my - slope * mx, slope)
    return out


def validate(rows: list[dict[str, Any]]) -> list[RowResult]:
    mechanism = {r["name"]: mechanism_prediction(r).step_s for r in rows}
    overheads = fit_overheads(rows, mechanism)
    out = []
    for r in rows:
        mech = mechanism[r["name"]]
        per_step, per_sample = overheads.get(r["system"], (0.0, 0.0))
        extra = per_step + per_sample * samples_per_gpu(r)
        tolerance = r.get("tolerance")
        out.append(RowResult(r["name"], r["system"], mech + extra, float(r["published_step_s"]), bool(r.get("fit")),
                             DEFAULT_TOLERANCE if tolerance is None else float(tolerance), mech, extra))
    return out


def summary(results: list[RowResult]) -> str:
    lines = [f"{'row':46s} {'system':10s} {'published':>9s} {'predicted':>9s} {'error':>8s}  use"]
    for r in results:
        use = "fit" if r.fit else f"held out (tol {r.tolerance:.0%})"
        ok = " ok" if r.within_tolerance else " OUTSIDE"
        lines.append(f"{r.name:46s} {r.system:10s} {r.published_step_s:9.1f} {r.predicted_step_s:9.1f} "
                     f"{100 * r.rel_error:+7.1f}%  {use}{ok}")
    held = [abs(r.rel_error) for r in results if not r.fit]
    if held:
        lines.append(f"held-out rows: {len(held)}, median |error| {100 * sorted(held)[len(held) // 2]:.1f}%, "
                     f"max {100 * max(held):.1f}%")
    return "\n".join(lines)


__all__ = ["DEFAULT_TOLERANCE", "FIELDS", "OPTIONAL", "RowResult", "check_row", "fit_overheads", "load_rows",
           "mechanism_prediction", "samples_per_gpu", "summary", "validate", "workload_of"]
