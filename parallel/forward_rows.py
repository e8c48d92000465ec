"""Which rows each of a trainer's forwards trains (trainer.py): a chunk needs one forward per trained
timestep of its samples, a TSP share one per packed micro-batch. A forward trains the kept rows, or
at the end of a step (rl/advantages.py `step_end`) the rows of the samples trained again, each row
with the weight of its policy term and whether it counts (carries its KL term and statistics).
Pure functions of the plan's data: an FSDP rank counts its forwards before it runs them, and every
FSDP trainer pads to the same count (`fsdp_pad_target`)."""
from __future__ import annotations

import torch
from torch import Tensor

from parallel.trainer_intake import TrainChunk, TrainingSpec, TransitionBatch
from rl.advantages import StepEnd

Row = tuple[int, float, bool]
"""(row of the item, weight of its policy term, counted)"""


def rows(sample_ids: list[int], keep: Tensor, end: StepEnd | None) -> list[Row]:
    """The rows trained now: the kept ones, or at the step's end those of its samples trained again."""
    if end is None:
        return [(j, 1.0, True) for j in range(len(sample_ids)) if keep[j]]
    return [(j, *end.rows[i]) for j, i in enumerate(sample_ids) if i in end.rows]


def forwards(item: TrainChunk | TransitionBatch, spec: TrainingSpec, end: StepEnd | None) -> list[tuple[int, list[Row]]]:
    """(timestep of a chunk, or first row of a micro-batch; its rows) of every forward `item` needs,
    in order; rows are empty where nothing of the forward is trained now."""
    ids = item.sample_ids.tolist()
    if isinstance(item, TransitionBatch):
        return [(lo, [(lo + j, w, c) for j, w, c in rows(ids[lo:hi], item.keep[lo:hi], end)])
                for lo, hi in item.bounds()]
    chosen = rows(ids, item.keep, end)
    return [(t, [r for r in chosen if t in spec.timesteps(item.step, ids[r[0]])])
            for t in spec.forward_timesteps(item.step, tuple(ids))]


def weights(chosen: list[Row], device) -> tuple[Tensor, Tensor]:
    """(policy weights (n,) float32, counted (n,) bool) of the rows."""
    return (torch.tensor([w for _, w, _ in chosen], dtype=torch.float32, device=device),
            torch.tensor([c for _, _, c in chosen], dtype=torch.bool, device=device))


def fsdp_pad_target(plan, facts, intake) -> int:
    """FSDP ranks run collectives inside every forward, so they must run equally many: the forward
    count every trainer pads to (0 without FSDP). Colocated FSDP generation needs equal chunk counts."""
    if facts.train_sharding != "fsdp":
        return 0
    counts = [len(f) for f in intake.forward_fragments(plan)]
    if not facts.disagg:
        gen = [sum(len(f.chunks) for f in plan.fragments if f.replica == r) for r in range(facts.topology.num_replicas)]
        if len(set(gen)) > 1:
            raise ValueError(f"--colocated-sharding fsdp needs every rank to generate equally many chunks, got {gen} "
                             f"(choose --prompts-per-step, --group-size and --micro-batch so they divide evenly)")
    if min(counts) == 0:
        what = "transition (TSP)" if facts.tsp else "chunk"
        raise ValueError(f"--train-sharding fsdp: trainer(s) {[i for i, c in enumerate(counts) if c == 0]} get no "
                         f"{what}; use more samples per step or a smaller --micro-batch")
    return max(counts)
