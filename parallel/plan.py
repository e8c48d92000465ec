"""The step plan: which prompts, how they split into fragments and micro-batch chunks, which replica
generates each fragment and which trainer trains each chunk. Pure functions of plain data, shared by
the runtime, the tests and the simulator (docs/DESIGN.md section 9)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seeding import derive_seed


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


def plan_step(step: int, *, seed: int, num_prompts: int, prompts_per_step: int, group_size: int,
              micro_batch: int, num_replicas: int, num_trainers: int, fragment_groups: int | None = None,
              replica_speeds: list[float] | None = None, colocated: bool = False) -> StepPlan:
    """Colocated: replica r is rank r and also trains its own chunks. Disagg: chunks go round-robin
    over the trainers in step order."""
    b, g = prompts_per_step, group_size
    if fragment_groups is None:
        fragment_groups = -(-b // num_replicas)  # naive: one fragment per replica
    if not 1 <= fragment_groups <= b:
        raise ValueError(f"--fragment-groups {fragment_groups} must be between 1 and --prompts-per-step {b}")
    groups = [tuple(range(s, min(s + fragment_groups, b))) for s in range(0, b, fragment_groups)]
    owners = assign_fragments(len(groups), replica_speeds or [1.0] * num_replicas)
    fragments, n_chunks = [], 0
    for f, (fgroups, replica) in enumerate(zip(groups, owners)):
        ids = [i for grp in fgroups for i in range(grp * g, (grp + 1) * g)]
        chunks = []
        for s in range(0, len(ids), micro_batch):
            trainer = replica if colocated else n_chunks % num_trainers
            chunks.append(Chunk(n_chunks, f, tuple(ids[s:s + micro_batch]), trainer))
            n_chunks += 1
        fragments.append(Fragment(f, fgroups, replica, tuple(chunks)))
    return StepPlan(step, choose_prompts(seed, step, num_prompts, b), g, tuple(fragments))


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
