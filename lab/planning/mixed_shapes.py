"""Steps whose prompt groups come in several shapes (`Workload.shapes`; docs/calibration.md, "Mixed
shapes and cross-site links").

The planner does not re-implement the runtime's dispatch: it builds the `ShapeTable` a prompt file
with the mix would give (each shape's predicted seconds per sample, as the runtime's measured table
holds its generators' seconds per sample) and asks `parallel.plan.plan_step` for the step plan.
Fragments never mix shapes, and every fragment's costs follow its own shape: generation, scoring,
transfer and training (TSP micro-batches are shape-homogeneous).
"""
from __future__ import annotations

from parallel.stepplan import ShapeTable, StepPlan, plan_step
from planner import phases as ph
from planner.hardware import GPU, Sharding
from planner.workload import Workload, ceil_div

PLAN_SEED = 0
"""The seed of the planner's step plan: the order in which the step draws the mix's groups."""


def step_plan(wl: Workload, sample_s: dict, *, num_replicas: int, num_trainers: int, micro: int,
              fragment_groups: int | None, speeds: list[float] | None = None, colocated: bool = False,
              dispatch: str = "lpt") -> StepPlan:
    """The runtime's plan of one step of `wl`: `wl.group_keys()` as a prompt set of exactly the
    mix, `sample_s[key]` the predicted cost of one sample of each shape, `speeds` the replicas'
    relative speeds (None: equal)."""
    keys = wl.group_keys()
    table = ShapeTable(tuple(keys), {k: float(sample_s[k]) for k in set(keys)})
    return plan_step(0, seed=PLAN_SEED, num_prompts=len(keys), prompts_per_step=len(keys),
                     group_size=wl.group_size, micro_batch=micro, num_replicas=num_replicas,
                     num_trainers=num_trainers, fragment_groups=fragment_groups, replica_speeds=speeds,
                     colocated=colocated, shapes=table, dispatch=dispatch)


def colocated_phases(wl: Workload, gpus: list[GPU], slow: GPU, *, micro: int, train_micro: int,
                     gen_sharding: Sharding | None, train_sharding: Sharding | None, speed_weighted: bool,
                     dispatch: str, fragment_groups: int | None = None) -> dict:
    """The rollout, scoring, exchange and training phases of a colocated step of a shape mix: the
    runtime's plan gives each rank its fragments (one per rank's share of each shape, as the
    runtime's default fragment size cuts them); a rank generates its chunks one forward each. FSDP
    generation (`gen_sharding`) runs every rank's forwards in lockstep at the slowest GPU (the
    runtime refuses unequal chunk counts: `chunk_counts`). Training is TSP over all ranks, shape
    by shape. `fragment_groups`: the runtime's --fragment-groups (None: its colocated default, one
    fragment per rank's share)."""
    n = len(gpus)
    keys = wl.group_keys()
    ref = [slow if gen_sharding is not None else g for g in gpus]
    chunk_s = {(k, g.key): ph.rollout_forward_s(wl.at(k), g, 1) for k in set(keys) for g in set(ref)}
    speeds = [chunk_s[(keys[0], ref[0].key)] / chunk_s[(keys[0], g.key)] for g in ref] if speed_weighted else None
    plan = step_plan(wl, {k: chunk_s[(k, slow.key)] for k in set(keys)}, num_replicas=n, num_trainers=n, micro=micro,
                     fragment_groups=fragment_groups, speeds=speeds, colocated=True, dispatch=dispatch)
    forwards: list[list[float]] = [[] for _ in range(n)]
    score = [0.0] * n
    for f in plan.fragments:
        w, g = wl.at(f.shape), ref[f.replica]
        kw = {"sharding": gen_sharding} if gen_sharding is not None else {}
        for c in f.chunks:
            forwards[f.replica] += [ph.rollout_forward_s(w, g, len(c.sample_ids), **kw)] * wl.sampling_steps
        score[f.replica] += ph.decode_s(w, g, len(f.sample_ids)) + ph.reward_s(w, g, len(f.sample_ids))
    if gen_sharding is not None:  # lockstep: forward i of every rank together
        depth = max(len(x) for x in forwards)
        gen = sum(max(x[i] if i < len(x) else 0.0 for x in forwards) for i in range(depth))
    else:
        gen = max(sum(x) for x in forwards)
    counts = {k: keys.count(k) * wl.group_size for k in set(keys)}
    share = n if train_sharding is not None or not speed_weighted else n * sum(
        g.peak_flops for g in gpus) / (n * slow.peak_flops)
    train = sum(ph.train_s(wl.at(k), slow, ceil_div(c * wl.trained_timesteps, share), train_micro,
                           sharding=train_sharding, with_reference=True) for k, c in counts.items())
    traj = sum(ph.trajectory_bytes(wl.at(k), c) for k, c in counts.items()) / n
    return {"generate_s": gen, "score_s": max(score),
            "trajectory_bytes": traj, "train_s": train,
            "chunk_counts": [sum(len(f.chunks) for f in plan.fragments if f.replica == r) for r in range(n)],
            "plan": plan, "fragment_groups": fragment_groups}


__all__ = ["PLAN_SEED", "colocated_phases", "step_plan"]
