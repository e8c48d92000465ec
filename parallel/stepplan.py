"""The step plan: which prompts, how they split into fragments and micro-batch chunks, which replica
generates each fragment and which trainer trains each chunk. Pure functions of plain data, shared by
the runtime, the tests and the simulator (docs/DESIGN.md section 9).

Prompts may carry their own shape (resolution, frame count: `ShapeTable`). A fragment never mixes
shapes, so its chunks and its TSP micro-batches are shape-homogeneous; the skew-aware dispatch
(`--dispatch lpt`, docs/DESIGN.md 5.8) predicts each fragment's cost from its shape and gives the
longest fragments out first, to the replica that finishes them first."""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rl.seeding import derive_seed


@dataclass(frozen=True)
class Chunk:
    """A micro-batch of consecutive samples of one fragment: the unit of one forward pass in
    generation and in training. Fixed by sample ids, so every placement batches samples alike."""

    index: int  # position in the step
    fragment: int
    sample_ids: tuple[int, ...]
    trainer: int  # index into the trainer ranks


@dataclass(frozen=True)
class Fragment:
    """A fixed set of whole groups: the unit of generation, scoring, transfer and training intake."""

    index: int
    groups: tuple[int, ...]  # group g = prompt g of the step, samples g*G .. g*G+G-1
    replica: int
    chunks: tuple[Chunk, ...]
    shape: Hashable = None  # the shape key of every sample (ShapeTable.keys); None: the run's one shape
    cost: float = 0.0  # predicted cost (ShapeTable.costs x samples; without shapes, the sample count)

    @property
    def sample_ids(self) -> tuple[int, ...]:
        return tuple(i for c in self.chunks for i in c.sample_ids)


@dataclass(frozen=True)
class StepPlan:
    step: int
    prompt_indices: tuple[int, ...]  # (B,) indices into the prompt set
    group_size: int
    fragments: tuple[Fragment, ...]

    @property
    def num_samples(self) -> int:
        return len(self.prompt_indices) * self.group_size

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return tuple(c for f in self.fragments for c in f.chunks)


DISPATCHES = ("lpt", "round-robin")

ATTENTION_WIDTH = 6 * 3072
"""C of the cost model `sample_cost`: per token and block, a DiT's linear layers take about 24 d^2
FLOPs (QKV and output projections 8 d^2, a 4x MLP 16 d^2) and attention 4 n d (QK^T and AV over n
tokens), so attention adds n / (6 d) to each token's linear work: C = 6 d. The default is FLUX.1's
width d = 3072 (Qwen-Image and HunyuanVideo share it); the runtime passes 6 x its model's width."""


@dataclass(frozen=True)
class ShapeTable:
    """Per-prompt shapes as plain data: `keys[p]` is prompt p's shape key (any hashable, e.g.
    (height, width, frames)); `costs[key]` the predicted cost of one sample of that shape
    (`sample_cost`). Built by the runtime from the prompt file and the model (prompts/resolutions.py)."""

    keys: tuple
    costs: Mapping


def sample_cost(tokens: int, steps: int = 1, attention_width: float = ATTENTION_WIDTH) -> float:
    """Predicted cost of denoising one sample: K x (tokens + tokens^2 / C), in units of one token's
    linear work per step (see ATTENTION_WIDTH). Text tokens, the same for every sample, are left out."""
    if tokens < 1 or steps < 1 or not attention_width > 0:
        raise ValueError(f"sample_cost needs tokens >= 1, steps >= 1 and C > 0, got {tokens}, {steps}, "
                         f"{attention_width}")
    return steps * (tokens + tokens * tokens / attention_width)


def choose_prompts(seed: int, step: int, num_prompts: int, batch: int) -> tuple[int, ...]:
    """Prompts of a step: walk epoch-wise through seeded permutations of the prompt set, so the data
    position is a function of the step alone (resume needs no iterator state)."""
    out = []
    for pos in range(step * batch, (step + 1) * batch):
        epoch, offset = divmod(pos, num_prompts)
        perm = np.random.default_rng(derive_seed(seed, "prompts", epoch)).permutation(num_prompts)
        out.append(int(perm[offset]))
    return tuple(out)


def assign_fragments(num_fragments: int, replica_speeds: list[float]) -> list[int]:
    """Greedy earliest-finish assignment: each fragment goes to the replica that would finish it
    first given its relative speed (fragments per unit time). Ties go to the lower replica."""
    if not replica_speeds or min(replica_speeds) <= 0:
        raise ValueError(f"replica speeds must be positive, got {replica_speeds}")
    finish = [0.0] * len(replica_speeds)
    out = []
    for _ in range(num_fragments):
        r = min(range(len(finish)), key=lambda j: (finish[j] + 1 / replica_speeds[j], j))
        finish[r] += 1 / replica_speeds[r]
        out.append(r)
    return out


def replica_finish(costs: Sequence[float], owners: Sequence[int], replica_speeds: Sequence[float]) -> list[float]:
    """Each replica's predicted finish: the cost of its fragments over its speed."""
    loads = [0.0] * len(replica_speeds)
    for c, r in zip(costs, owners):
        loads[r] += c
    return [load / s for load, s in zip(loads, replica_speeds)]


def assign_lpt(costs: Sequence[float], replica_speeds: Sequence[float]) -> list[int]:
    """Skew-aware dispatch of fragments (given longest first) to replicas of relative speeds.

    LPT on machines of different speeds: each fragment goes to the replica that would finish it
    first (ties to the lower replica). Then a local search: while moving one fragment of the
    replica that finishes last to another replica, or swapping it with a shorter fragment of
    another replica, shortens the makespan, or keeps it and leaves fewer replicas finishing at it,
    take the best such change. Deterministic. With equal costs the first pass is already optimal
    (earliest finish is, for equal jobs) and the result is `assign_fragments` exactly."""
    if not replica_speeds or min(replica_speeds) <= 0:
        raise ValueError(f"replica speeds must be positive, got {list(replica_speeds)}")
    if any(not c >= 0 for c in costs):
        raise ValueError(f"fragment costs must be >= 0, got {list(costs)}")
    n, speeds = len(replica_speeds), list(replica_speeds)
    finish, owners = [0.0] * n, []
    for c in costs:
        r = min(range(n), key=lambda j: (finish[j] + c / speeds[j], j))
        finish[r] += c / speeds[r]
        owners.append(r)
    if len(set(costs)) <= 1:
        return owners
    tol = 1e-9 * max((sum(costs) / min(speeds), 1e-300))

    def objective(own) -> tuple[float, int]:  # (makespan, replicas finishing at it)
        finish = replica_finish(costs, own, speeds)
        top = max(finish)
        return top, sum(f >= top - tol for f in finish)

    def smaller(a: tuple[float, int], b: tuple[float, int]) -> bool:  # beyond rounding
        return a[0] < b[0] - tol or (abs(a[0] - b[0]) <= tol and a[1] < b[1])

    best = objective(owners)
    for _ in range(len(costs) * n):  # every accepted change is a strict improvement; this bounds the loop
        finish = replica_finish(costs, owners, speeds)
        slow = min(range(n), key=lambda r: (-finish[r], r))
        changes = []
        for f in (f for f, r in enumerate(owners) if r == slow):
            changes += [((f, r),) for r in range(n) if r != slow]
            changes += [((f, r), (h, slow)) for h, r in enumerate(owners) if r != slow and costs[h] < costs[f]]
        found = None
        for change in changes:
            trial = list(owners)
            for f, r in change:
                trial[f] = r
            got = objective(trial)
            if smaller(got, best if found is None else found[0]):
                found = (got, trial)
        if found is None:
            break
        best, owners = found
    return owners


def shape_pieces(keys: Sequence[Hashable], fragment_groups: int) -> list[tuple[Hashable, tuple[int, ...]]]:
    """The step's groups cut into fragments that never mix shapes: each shape's groups (in step
    order) are cut into fragments of `fragment_groups`, and the fragments are listed in the step
    order of their first group. One shape: the plain cut of the B groups."""
    buckets: dict = {}
    for g, key in enumerate(keys):
        buckets.setdefault(key, []).append(g)
    pieces = [(key, tuple(groups[s:s + fragment_groups])) for key, groups in buckets.items()
              for s in range(0, len(groups), fragment_groups)]
    return sorted(pieces, key=lambda piece: piece[1][0])


def plan_step(step: int, *, seed: int, num_prompts: int, prompts_per_step: int, group_size: int,
              micro_batch: int, num_replicas: int, num_trainers: int, fragment_groups: int | None = None,
              replica_speeds: list[float] | None = None, colocated: bool = False,
              shapes: ShapeTable | None = None, dispatch: str = "lpt") -> StepPlan:
    """Colocated: replica r is rank r and also trains its own chunks. Disagg: chunks go round-robin
    over the trainers in step order. `shapes`: each prompt's shape; fragments never mix shapes.
    `dispatch`: lpt orders fragments by predicted cost, longest first, and assigns them with
    `assign_lpt`; round-robin keeps step order and `assign_fragments`. One shape and equal replica
    speeds (or fragments of equal size): both plans agree."""
    b, g = prompts_per_step, group_size
    if dispatch not in DISPATCHES:
        raise ValueError(f"unknown --dispatch {dispatch!r}; choose one of {DISPATCHES}")
    if fragment_groups is None:
        fragment_groups = -(-b // num_replicas)  # naive: one fragment per replica
    if not 1 <= fragment_groups <= b:
        raise ValueError(f"--fragment-groups {fragment_groups} must be between 1 and --prompts-per-step {b}")
    if shapes is not None and len(shapes.keys) != num_prompts:
        raise ValueError(f"the shape table has {len(shapes.keys)} prompts, the prompt set {num_prompts}")
    prompts = choose_prompts(seed, step, num_prompts, b)
    pieces = shape_pieces([None] * b if shapes is None else [shapes.keys[p] for p in prompts], fragment_groups)
    costs = [len(groups) * g * (1.0 if shapes is None else float(shapes.costs[key])) for key, groups in pieces]
    speeds = replica_speeds or [1.0] * num_replicas
    if dispatch == "lpt":
        order = sorted(range(len(pieces)), key=lambda f: -costs[f])  # stable: step order among equals
        top = max(costs) or 1.0
        owners = assign_lpt([costs[f] / top for f in order], speeds)  # equal costs are exactly 1.0
    else:
        order = list(range(len(pieces)))
        owners = assign_fragments(len(pieces), speeds)
    fragments, n_chunks = [], 0
    for f, (piece, replica) in enumerate(zip(order, owners)):
        key, fgroups = pieces[piece]
        ids = [i for grp in fgroups for i in range(grp * g, (grp + 1) * g)]
        chunks = []
        for s in range(0, len(ids), micro_batch):
            trainer = replica if colocated else n_chunks % num_trainers
            chunks.append(Chunk(n_chunks, f, tuple(ids[s:s + micro_batch]), trainer))
            n_chunks += 1
        fragments.append(Fragment(f, fgroups, replica, tuple(chunks), key, costs[piece]))
    return StepPlan(step, prompts, g, tuple(fragments))


def replica_speeds(seconds_by_rank: dict[int, float], replicas: list[tuple[int, ...]],
                   tolerance: float = 0.15) -> list[float]:
    """Relative speeds of generator replicas from each rank's measured seconds per denoising
    forward. A replica of S stages, partitioned by speed, generates at the sum of its ranks'
    speeds. Speeds within `tolerance` of the fastest count as equal, so that measurement noise
    on identical ranks never changes the plan; others are rounded to two digits."""
    if not replicas or any(not ranks for ranks in replicas):
        raise ValueError(f"every replica needs at least one rank, got {replicas}")
    bad = {r: s for r, s in seconds_by_rank.items() if not s > 0}
    if bad:
        raise ValueError(f"measured seconds must be positive, got {bad}")
    raw = [sum(1.0 / seconds_by_rank[g] for g in ranks) for ranks in replicas]
    fastest = max(raw)
    return [1.0 if v / fastest >= 1 - tolerance else round(v / fastest, 2) for v in raw]


def trainer_speeds(seconds_by_rank: dict[int, float]) -> tuple[float, ...] | None:
    """TSP's shares of trainers of different speeds (parallel/tsp.py `pack`): each trainer rank's
    relative speed from its measured seconds per training forward, rounded as `replica_speeds`
    rounds, in rank order; None when they count as equal (even shares)."""
    out = replica_speeds(seconds_by_rank, [(r,) for r in sorted(seconds_by_rank)])
    return tuple(out) if len(set(out)) > 1 else None


def helper_weight(generator_s: Sequence[float], trainer_s: Sequence[float],
                  trainer_weights: Sequence[float] | None, tolerance: float = 0.15) -> float | None:
    """Tail assist's weight for TSP's split of the last fragment (parallel/tsp.py `pack`, `helped`):
    the generators' mean speed over the trainers', both from the seconds per denoising forward that
    every rank probes (a generator does not probe training; a forward's cost stands for a
    backward's), times the trainers' mean weight (`trainer_speeds`; None: 1). None (the trainers'
    mean) within `tolerance` of equal, as `replica_speeds` rounds."""
    ratio = (sum(1.0 / s for s in generator_s) / len(generator_s)) / (sum(1.0 / s for s in trainer_s) / len(trainer_s))
    if abs(ratio - 1.0) <= tolerance:
        return None
    base = sum(trainer_weights) / len(trainer_weights) if trainer_weights else 1.0
    return round(base * ratio, 2)
