"""The paper-scale table (docs/planner.md): 4 models x {16, 32} GPUs x three
testbeds (H100; H800 with its slower NVLink; a mixed pool of H20 and H100), each cell the best
on-policy DigenRL plan against the modelled peers (as they run) and our own best colocated plan.

    python -m lab.paper_table --out docs/planner [--page docs/planner.md] [--quick]

Writes OUT/paper-table.md and .json, OUT/cross-site.json, one step timeline per mode
(OUT/timeline-*.png) for the reference cell, and with --page replaces that page's section between
its markers. Every number is a prediction of the cost model of docs/calibration.md.

Below it, the cross-site table: FLUX full fine-tuning with the generators on H20 in one site and
the trainers on H100 in another, joined by a 25 Gb/s link, publishing uncompressed (fp32) or with
delta-topk:0.01, against the best colocated plan of the same GPUs in one site.

Peers on the mixed testbed run in lockstep, so they are modelled on N GPUs of the slower type,
except VeRL-Omni, whose column is the stronger of its two on-policy modes (lab.planning.peer_systems.
verl_omni_best): its colocated hybrid engine, or separate-async at its best split of actor and
standalone rollout GPUs (on the mixed testbed: actors on the H100 half, rollout on the H20 half),
with delta weight sync for full fine-tuning; "(sep)" marks the cells where separate-async is the
stronger. It is its mechanism model without the per-step overhead fitted on its published runs (so
its column understates VeRL-Omni's measured step times; see docs/calibration.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomllib is the standard library's copy of tomli (3.11)
    import tomli as tomllib

from lab.planning import timeline as plot_timeline
from planner.hardware import gpu
from lab.planning.placements import Pool, best_colocated, enumerate_plans, recommend
from lab.planning.peer_systems import Prediction
from lab.planning.peer_systems import predict_system, verl_omni_best
from planner import phases as ph
from planner.workload import Workload, for_algorithm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


WORKLOADS = {
    # DanceGRPO's FLUX setting, scaled to 24 prompts x 16 images.
    "flux": Workload("flux", 720, 720, 1, 16, 9, 24, 16, 1.0, "full", 32, True, rewards=("hpsv2",)),
    # Flow-GRPO's Wan setting (240x416x33, 20 steps, CFG 4.5), LoRA, 16 prompts x 8 videos.
    "wan": Workload("wan", 240, 416, 33, 20, 19, 16, 8, 4.5, "lora", 32, True, rewards=("videoalign",)),
    # VeRL-Omni's Qwen-Image setting (512^2, 10 steps, CFG 4, an SDE window of 2, 32 x 16).
    "qwen_image": Workload("qwen_image", 512, 512, 1, 10, 2, 32, 16, 4.0, "lora", 64, True, rewards=("ocr_vlm",)),
    # DanceGRPO's HunyuanVideo setting (480^2 x 53, 16 steps, 60% of them trained), 16 x 8 videos.
    "hunyuan_video": Workload("hunyuan_video", 480, 480, 53, 16, 9, 16, 8, 1.0, "full", 32, True,
                              rewards=("videoalign",)),
}
ALGORITHMS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paper_table.toml")


def algorithm_workloads(path: str = ALGORITHMS_FILE) -> dict[str, Workload]:
    """The algorithms' workloads of the settings file (planner/workload.py for_algorithm): each row's
    workload (a row of WORKLOADS changed by `with`, or its own) as its algorithm prices it."""
    with open(path, "rb") as f:
        rows = tomllib.load(f)
    out = {}
    for name, row in rows.items():
        own = {k: tuple(v) if isinstance(v, list) else v for k, v in row.get("workload", {}).items()}
        wl = (WORKLOADS[row["base"]] if "base" in row else Workload(**own)).with_(**row.get("with", {}))
        out[name] = for_algorithm(wl, row["algorithm"], window=row.get("window", 2), fraction=row.get("fraction"))
    return out


ALGORITHM_WORKLOADS = algorithm_workloads()
TESTBEDS = ("h100", "h800", "mixed")
PEERS = ("verl-omni", "dance-grpo", "genrl", "flow-grpo")
BEGIN, END = "<!-- paper-table:begin -->", "<!-- paper-table:end -->"
LINK_GBPS = 25.0
CODECS = ("none", "delta-topk:0.01")
STREAMRL = ("StreamRL (LLM RL, arXiv 2504.15930) reports up to 1.33x cost-effectiveness in a heterogeneous, "
            "cross-datacenter setting")


def pools_of(testbed: str, n: int) -> list[Pool]:
    if testbed == "mixed":
        return [Pool(gpu("h20"), n // 2), Pool(gpu("h100"), n // 2)]
    return [Pool(gpu(testbed), n)]


def train_rollout_ratio(wl: Workload, g) -> float:
    """GPU-seconds of training over those of rollout for one step on one GPU (micro-batches of the
    workload's sizes): below 1 the step is rollout-bound."""
    return (ph.train_s(wl, g, wl.transitions, wl.train_micro_batch, with_reference=True)
            / ph.denoise_s(wl, g, wl.samples, wl.rollout_micro_batch))


def algorithm_cell(name: str, testbed: str, n: int, top_k: int) -> dict:
    """One algorithm workload on one testbed: our recommended plan, the best colocated and the best
    disaggregated plan (no peer column: the peers' models run GRPO as they publish it)."""
    wl = ALGORITHM_WORKLOADS[name]
    preds, _ = enumerate_plans(wl, pools_of(testbed, n), top_k=top_k)
    ours, col = recommend(preds), best_colocated(preds)
    best_disagg = next((p for p in preds if p.system == "digenrl" and not p.knobs.get("stale")), None)
    return {"workload": name, "testbed": testbed, "gpus": n, "description": wl.describe(),
            "train_rollout": train_rollout_ratio(wl, gpu("h100")), "plan": ours.label, "step_s": ours.step_s,
            "bubble": ours.bubble, "colocated": {"label": col.label, "step_s": col.step_s},
            "best_disagg": None if best_disagg is None else {"label": best_disagg.label,
                                                             "step_s": best_disagg.step_s}}


def algorithm_markdown(cells: list[dict]) -> str:
    lines = ["| workload | train : rollout work | testbed | GPUs | recommended plan | step s | vs best colocated "
             "| best disagg vs colocated (plan) |", "|" + "---|" * 8]
    for c in cells:
        d, col = c["best_disagg"], c["colocated"]
        dvc = f"{col['step_s'] / d['step_s']:.2f}x ({d['label']})" if d else "-"
        lines.append(f"| {c['workload']} | {c['train_rollout']:.2f} | {c['testbed']} | {c['gpus']} | {c['plan']} | "
                     f"{c['step_s']:.0f} | {col['step_s'] / c['step_s']:.2f}x ({col['label']}) | {dvc} |")
    return "\n".join(lines)


def cell(model: str, testbed: str, n: int, top_k: int) -> dict:
    wl = WORKLOADS[model]
    preds, _ = enumerate_plans(wl, pools_of(testbed, n), top_k=top_k)
    ours = recommend(preds)
    col = best_colocated(preds)
    best_disagg = next((p for p in preds if p.system == "digenrl" and not p.knobs.get("stale")), None)
    slow = gpu("h20") if testbed == "mixed" else gpu(testbed)
    peers = {s: predict_system(s, wl, slow, n) for s in PEERS if s != "verl-omni"}
    peers["verl-omni"] = verl_omni_best(wl, gpu("h100"), n, rollout_gpu=slow) if testbed == "mixed" else \
        verl_omni_best(wl, slow, n)
    return {"model": model, "testbed": testbed, "gpus": n, "workload": wl.describe(), "plan": ours.label,
            "plan_gpus": ours.gpu_label(), "step_s": ours.step_s, "bubble": ours.bubble, "mfu": ours.mfu,
            "samples_per_dollar": ours.samples_per_dollar,
            "best_disagg": None if best_disagg is None else {"label": best_disagg.label, "step_s": best_disagg.step_s,
                                                           "bubble": best_disagg.bubble, "mfu": best_disagg.mfu},
            "colocated": {"label": col.label, "step_s": col.step_s, "bubble": col.bubble, "mfu": col.mfu},
            "peers": {s: {"step_s": p.step_s, "bubble": p.bubble, "mfu": p.mfu, "fits": p.feasible, "label": p.label}
                      for s, p in peers.items()},
            "_preds": (ours, col, best_disagg, peers)}


def ratio(peer: dict, ours: float) -> str:
    return (f"{peer['step_s'] / ours:.2f}x" + ("" if peer.get("fits", True) else "*")
            + (" (sep)" if "separate-async" in peer.get("label", "") else ""))


def markdown(cells: list[dict]) -> str:
    head = ("| model | testbed | GPUs | recommended plan | step s | bubble | MFU | vs VeRL-Omni | vs DanceGRPO "
            "| vs GenRL | vs best colocated (ours) | best disagg vs colocated |")
    lines = [head, "|" + "---|" * 12]
    for c in cells:
        p, d = c["peers"], c["best_disagg"]
        dvc = f"{c['colocated']['step_s'] / d['step_s']:.2f}x" if d else "-"
        lines.append(f"| {c['model']} | {c['testbed']} | {c['gpus']} | {c['plan']} | {c['step_s']:.0f} | "
                     f"{c['bubble']:.2f} | {100 * c['mfu']:.0f}% | {ratio(p['verl-omni'], c['step_s'])} | "
                     f"{ratio(p['dance-grpo'], c['step_s'])} | {ratio(p['genrl'], c['step_s'])} | "
                     f"{c['colocated']['step_s'] / c['step_s']:.2f}x ({c['colocated']['label']}) | {dvc} |")
    return "\n".join(lines)


def _row(placement: str, codec: str, p: Prediction, ref: Prediction) -> dict:
    return {"placement": placement, "publication": codec, "plan": p.label, "gpus": p.gpu_label(), "step_s": p.step_s,
            "samples_per_s": p.samples_per_s, "usd_per_1k_samples": 1000 / p.samples_per_dollar,
            "cost_effectiveness": p.samples_per_dollar / ref.samples_per_dollar}


def cross_site(n: int, top_k: int) -> list[dict]:
    """FLUX full fine-tuning on n/2 H20 (generators, one site) + n/2 H100 (trainers, another site)
    over a LINK_GBPS link, per publication codec, against the best colocated plan of the same GPUs
    in one site (cost-effectiveness: samples per dollar over that plan's) and, for context, the
    best plan of the same GPUs in one site and the best plan of n H100 in one site."""
    pools = pools_of("mixed", n)
    wl = WORKLOADS["flux"]
    preds, _ = enumerate_plans(wl, pools, top_k=top_k)
    ref = best_colocated(preds)
    rows = [_row("one site", wl.publish_compression, ref, ref),
            _row("one site", wl.publish_compression, recommend(preds), ref)]
    h100, _ = enumerate_plans(wl, [Pool(gpu("h100"), n)], top_k=top_k)
    rows.append(_row("one site, H100 only", wl.publish_compression, recommend(h100), ref))
    for codec in CODECS:
        w = wl.with_(publish_compression=codec)
        preds, _ = enumerate_plans(w, pools, top_k=top_k, link_bytes_s=LINK_GBPS * 1e9 / 8)
        rows.append(_row(f"two sites, {LINK_GBPS:g} Gb/s", codec, recommend(preds), ref))
    return rows


def cross_site_markdown(rows: list[dict]) -> str:
    lines = ["| placement | publication | plan | GPUs | step s | samples/s | $ per 1k samples "
             "| samples/$ vs one-site colocated H20+H100 |", "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['placement']} | {r['publication']} | {r['plan']} | {r['gpus']} | {r['step_s']:.0f} | "
                     f"{r['samples_per_s']:.2f} | {r['usd_per_1k_samples']:.2f} | {r['cost_effectiveness']:.2f}x |")
    return "\n".join(lines)


def timelines(c: dict, out: str) -> list[str]:
    ours, col, best_disagg, peers = c["_preds"]
    wl = WORKLOADS[c["model"]]
    preds, _ = enumerate_plans(wl, pools_of(c["testbed"], c["gpus"]), top_k=2)
    by_mode = {}
    for p in preds:
        mode = p.knobs.get("mode") or p.knobs.get("variant")
        key = f"colocated-{mode}" if p.system == "colocated" else mode
        by_mode.setdefault(key, p)
    for s, p in peers.items():
        by_mode[s] = p
    paths = []
    for mode, p in by_mode.items():
        paths.append(plot_timeline.draw([p], os.path.join(out, f"timeline-{mode}.png"),
                                        f"{mode}: {wl.describe()}, {c['gpus']} GPUs ({c['testbed']})"))
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "planner"))
    ap.add_argument("--page", default=None, help="a markdown page (docs/planner.md) whose section between the "
                    "paper-table markers is replaced")
    ap.add_argument("--quick", action="store_true", help="one model and one size (a smoke test)")
    ap.add_argument("--tag-candidates", type=int, default=8,
                    help="gap plans per GPU split that TAG and TCSS are tried on (fewer: faster, may miss the best)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    models = ["flux"] if a.quick else list(WORKLOADS)
    sizes = [16] if a.quick else [16, 32]
    cells = []
    for model in models:
        for testbed in TESTBEDS:
            for n in sizes:
                c = cell(model, testbed, n, a.tag_candidates)
                cells.append(c)
                print(f"{model:14s} {testbed:6s} {n:3d}: {c['plan']:36s} {c['step_s']:8.1f} s  "
                      f"colocated {c['colocated']['step_s']:8.1f}  VeRL-Omni {c['peers']['verl-omni']['step_s']:8.1f}  "
                      f"DanceGRPO {c['peers']['dance-grpo']['step_s']:8.1f}  GenRL {c['peers']['genrl']['step_s']:8.1f}",
                      flush=True)
    algo_cells = []
    for name in ([] if a.quick else ALGORITHM_WORKLOADS):
        for testbed in TESTBEDS:
            for n in sizes:
                c = algorithm_cell(name, testbed, n, a.tag_candidates)
                algo_cells.append(c)
                print(f"{name:20s} {testbed:6s} {n:3d}: {c['plan']:36s} {c['step_s']:8.1f} s  colocated "
                      f"{c['colocated']['step_s']:8.1f}  train:rollout {c['train_rollout']:.2f}", flush=True)
    rows = [dict(r, total_gpus=n) for n in sizes for r in cross_site(n, a.tag_candidates)]
    for r in rows:
        print(f"cross-site {r['total_gpus']:3d}: {r['placement']:22s} {r['publication']:16s} {r['plan']:36s} "
              f"{r['step_s']:8.1f} s  ${r['usd_per_1k_samples']:.2f} per 1k samples  {r['cost_effectiveness']:.2f}x",
              flush=True)
    table = (markdown(cells) + "\n\nCross-site: FLUX 720^2 full fine-tuning, generators on H20 in one site, trainers "
             f"on H100 in another, {LINK_GBPS:g} Gb/s between (the planner's GPU prices). {STREAMRL}.\n\n"
             + cross_site_markdown(rows))
    if algo_cells:
        table += ("\n\nBy algorithm (planner/workload.py `for_algorithm`): train : rollout is training's GPU-seconds "
                  "over rollout's on one H100 at the workload's micro-batches (below 1: rollout-bound).\n\n"
                  + algorithm_markdown(algo_cells))
    with open(os.path.join(a.out, "paper-table.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(a.out, "paper-table.json"), "w") as f:
        json.dump([{k: v for k, v in c.items() if k != "_preds"} for c in cells], f, indent=1)
    with open(os.path.join(a.out, "cross-site.json"), "w") as f:
        json.dump(rows, f, indent=1)
    if algo_cells:
        with open(os.path.join(a.out, "algorithms.json"), "w") as f:
            json.dump(algo_cells, f, indent=1)
    ref = next(c for c in cells if c["model"] == "flux" and c["testbed"] == "h100" and c["gpus"] == 16)
    for path in timelines(ref, a.out):
        print(f"wrote {path}")
    if a.page:
        with open(a.page) as f:
            text = f.read()
        if BEGIN not in text or END not in text:
            raise ValueError(f"{a.page} has no {BEGIN} ... {END} section")
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        with open(a.page, "w") as f:
            f.write(head + BEGIN + "\n" + table + "\n" + END + tail)
        print(f"updated {a.page}")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
