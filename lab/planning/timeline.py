"""One predicted step per plan as a timeline figure (matplotlib): a row per role lane, coloured by
what the lane does. Used by scripts/plan.py --timeline and lab/paper_table.py."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

COLORS = {"generate": "#4c78a8", "score": "#72b7b2", "train": "#f58518", "optimizer": "#e45756",
          "switch": "#9d755d", "comm": "#bab0ac", "other": "#d3d3d3"}
LABELS = {"generate": "generate", "score": "decode / reward / text", "train": "train (fwd+bwd, recompute)",
          "optimizer": "optimizer", "switch": "switch / sync / publish", "comm": "transfer", "other": "other"}


def _lanes(pred, max_lanes: int) -> list[str]:
    lanes = []
    for s in pred.segments:
        if s.lane not in lanes:
            lanes.append(s.lane)
    gens = [x for x in lanes if x.startswith("generator")]
    rest = [x for x in lanes if not x.startswith("generator")]
    keep = gens[:max(1, max_lanes // 2)] + rest[:max(1, max_lanes - min(len(gens), max_lanes // 2))]
    return keep


def draw(preds, path: str, title: str = "", max_lanes: int = 6) -> str:
    """One panel per prediction, on a shared time axis (seconds of one step)."""
    fig, axes = plt.subplots(len(preds), 1, figsize=(11, 1.1 + 0.9 * sum(min(max_lanes, len(_lanes(p, max_lanes)))
                                                                         for p in preds) / max(1, len(preds))
                                                  * len(preds)), squeeze=False)
    t_max = max(p.step_s for p in preds)
    start0 = {id(p): (min(s.start_s for s in p.segments) if p.segments else 0.0) for p in preds}
    for ax, p in zip(axes[:, 0], preds):
        lanes = _lanes(p, max_lanes)
        for y, lane in enumerate(lanes):
            for s in p.segments:
                if s.lane == lane and s.end_s > s.start_s:
                    ax.broken_barh([(s.start_s - start0[id(p)], s.end_s - s.start_s)], (y - 0.4, 0.8),
                                   facecolors=COLORS.get(s.kind, COLORS["other"]), edgecolor="white", linewidth=0.3)
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels(lanes, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, t_max * 1.02)
        ax.set_title(f"{p.label} [{p.gpu_label()}]: {p.step_s:.1f} s/step, bubble {p.bubble:.2f}, "
                     f"MFU {100 * p.mfu:.1f}%", fontsize=8, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel("seconds into the step", fontsize=8)
    used = sorted({s.kind for p in preds for s in p.segments}, key=list(COLORS).index)
    fig.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in used], loc="lower center",
               ncol=len(used), fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97 if title else 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["draw"]
