"""Splitting one torchrun world into generator, trainer and scorer ranks (docs/DESIGN.md section 3).

Ranks [0, N) are generators (N / S replicas of S pipeline stages), the next M ranks trainers, the
rest scorers. In colocated mode every rank is both a generator (a replica of one stage) and a trainer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from parallel import commhooks

MODES = ("disagg", "colocated")
SHARDINGS = ("replicate", "fsdp")


@dataclass(frozen=True)
class Topology:
    world_size: int
    mode: str
    generator_ranks: tuple[int, ...]
    trainer_ranks: tuple[int, ...]
    scorer_ranks: tuple[int, ...]
    gap_stages: int

    @classmethod
    def build(cls, world_size: int, mode: str = "disagg", generators: int | None = None,
              trainers: int | None = None, scorers: int = 0, gap_stages: int = 1) -> "Topology":
        """Validate before any collective: every error names the numbers that do not add up."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
        if gap_stages < 1:
            raise ValueError(f"--gap-stages must be >= 1, got {gap_stages}")
        if scorers < 0:
            raise ValueError(f"--scorers must be >= 0, got {scorers}")
        if mode == "colocated":
            if generators is not None or trainers is not None or scorers:
                raise ValueError(f"--mode colocated gives every rank both roles: drop --generators ({generators}), "
                                 f"--trainers ({trainers}) and --scorers ({scorers})")
            if gap_stages != 1:
                raise ValueError(f"--gap-stages {gap_stages} needs --mode disagg")
            ranks = tuple(range(world_size))
            return cls(world_size, mode, ranks, ranks, (), 1)
        if world_size < 2:
            raise ValueError(f"--mode disagg needs at least 2 ranks (a generator and a trainer), world size is "
                             f"{world_size}; use --mode colocated on one rank")
        if generators is None and trainers is None:
            generators = (world_size - scorers) // 2
        if generators is None:
            generators = world_size - scorers - trainers
        if trainers is None:
            trainers = world_size - scorers - generators
        if generators < 1 or trainers < 1:
            raise ValueError(f"need at least one generator and one trainer: --generators {generators} "
                             f"--trainers {trainers} --scorers {scorers} in a world of {world_size}")
        if generators + trainers + scorers != world_size:
            raise ValueError(f"--generators {generators} + --trainers {trainers} + --scorers {scorers} = "
                             f"{generators + trainers + scorers}, but the world size is {world_size}")
        if generators % gap_stages:
            raise ValueError(f"--generators {generators} is not a multiple of --gap-stages {gap_stages}")
        return cls(world_size, mode, tuple(range(generators)), tuple(range(generators, generators + trainers)),
                   tuple(range(generators + trainers, world_size)), gap_stages)

    @property
    def num_replicas(self) -> int:
        return len(self.generator_ranks) // self.gap_stages

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        """The S ranks of a replica, stage 0 first."""
        s = self.gap_stages
        return self.generator_ranks[replica * s:(replica + 1) * s]

    @property
    def num_trainers(self) -> int:
        return len(self.trainer_ranks)

    def replica_of(self, rank: int) -> int | None:
        if rank not in self.generator_ranks:
            return None
        return self.generator_ranks.index(rank) // self.gap_stages

    def is_generator(self, rank: int) -> bool:
        return rank in self.generator_ranks

    def is_trainer(self, rank: int) -> bool:
        return rank in self.trainer_ranks

    def is_scorer(self, rank: int) -> bool:
        return rank in self.scorer_ranks

    def role(self, rank: int) -> str:
        if self.mode == "colocated":
            return "colocated"
        return "generator" if self.is_generator(rank) else "trainer" if self.is_trainer(rank) else "scorer"

    def describe(self, rank: int) -> str:
        """A rank in words, for messages that name a peer: 'generator rank 0 (replica 0)'."""
        if self.mode == "colocated":
            return f"rank {rank} (colocated generator and trainer)"
        if self.is_generator(rank):
            replica = self.replica_of(rank)
            stage = f", stage {self.replica_ranks(replica).index(rank)}" if self.gap_stages > 1 else ""
            return f"generator rank {rank} (replica {replica}{stage})"
        return f"{self.role(rank)} rank {rank}"


@dataclass
class ProcessGroups:
    """The run's communicators, created by every rank in the same order (a torch.distributed rule;
    the creations are recorded, so the NCCL check compares the order).

    On NCCL a communicator runs a rank's sends and receives in posting order, and a send completes
    only when its receive runs: two ranks that each send before they receive on one communicator
    wait for each other forever (docs/communication.md). So traffic goes to each receiver on a
    communicator of its own, on which the receiver only receives and the others only send; a rank's
    sends to different receivers then never queue behind each other either:
      trainers       the trainers' all-reduces and FSDP2 collectives (colocated: the world)
      data[t]        training data to trainer t: from generators, TAG trainers, colocated ranks
      publish        versions: the first trainer -> generators (one at a time)
      images[s]      decoded fragments to scorer s;  scores[g]: scores to generator g
      gap[r, s]      a GAP replica r's link from stage s to the next (the last stage -> stage 0)
      own[t]         trainer t alone, with `own`: FSDP2 as the mixed-precision engine of a
                     replicated trainer (parallel/fsdp.py); with one trainer, the trainers' group
    The point-to-point communicators get `pending_s` as their NCCL watchdog timeout, which counts
    from posting: an op may stay posted through a long evaluation or checkpoint, and waits on it
    are bounded from when they start (parallel/p2p.py). The collective groups get `timeout_s`,
    which the run guard adapts to the step time."""

    trainers: object
    data: dict = field(default_factory=dict)  # trainer rank -> its communicator
    publish: object = None
    images: dict = field(default_factory=dict)  # scorer rank -> its communicator
    scores: dict = field(default_factory=dict)  # generator rank -> its communicator
    gap: dict = field(default_factory=dict)  # (replica, stage) -> its link to the next stage
    own: dict = field(default_factory=dict)  # trainer rank -> a group of it alone (`create(own=True)`)

    @classmethod
    def create(cls, topo: Topology, timeout_s: float, pending_s: float, exchange: bool = False,
               own: bool = False) -> "ProcessGroups":
        """`exchange`: colocated ranks exchange TSP shares (else nothing moves between them).
        `own`: each trainer gets a group of its own (replicated trainers in mixed precision)."""
        pending, timeout = timedelta(seconds=pending_s), timedelta(seconds=timeout_s)
        generators, trainers = list(topo.generator_ranks), list(topo.trainer_ranks)
        if topo.mode == "colocated":
            every = list(range(topo.world_size))
            data = {t: commhooks.new_group(f"data.to{t}", every, pending) for t in trainers} if exchange else {}
            out = cls(trainers=dist.group.WORLD, data=data)
            out.own = cls._own(trainers, out.trainers, timeout) if own else {}
            return out
        out = cls(trainers=commhooks.new_group("trainers", trainers, timeout))
        out.own = cls._own(trainers, out.trainers, timeout) if own else {}
        out.data = {t: commhooks.new_group(f"data.to{t}", generators + trainers, pending) for t in trainers}
        out.publish = commhooks.new_group("publish", [trainers[0]] + generators, pending)
        scorers = list(topo.scorer_ranks)
        out.images = {s: commhooks.new_group(f"images.to{s}", generators + [s], pending) for s in scorers}
        if scorers:
            out.scores = {g: commhooks.new_group(f"scores.to{g}", [g] + scorers, pending) for g in generators}
        for r in range(topo.num_replicas if topo.gap_stages > 1 else 0):
            ranks = topo.replica_ranks(r)
            for s in range(len(ranks)):
                nxt = (s + 1) % len(ranks)
                out.gap[r, s] = commhooks.new_group(f"gap.r{r}.s{s}->s{nxt}", [ranks[s], ranks[nxt]], pending)
        return out

    @staticmethod
    def _own(trainers: list[int], group, timeout) -> dict:
        """A group of each trainer alone, created like every other group: by every rank, in one
        order (`commhooks.new_group`). Not one `dist.split_group` for all of them, which would be a
        single ncclCommSplit: torch documents it as experimental, and it refuses gloo (it needs a
        device bound to the world), so the CPU tests could not run the path GPUs take. One trainer:
        the trainers' group is its own already."""
        if len(trainers) == 1:
            return {trainers[0]: group}
        return {t: commhooks.new_group(f"own.t{t}", [t], timeout) for t in trainers}

    def destroy(self) -> None:
        """Destroy every communicator of this set but the world's (a placement switching inside a
        run: the next set is created by every rank in its own order). Every rank calls it after its
        last operation on them; destroying is local to each rank."""
        seen = {id(dist.group.WORLD)}
        for group in [self.trainers, self.publish, *self.data.values(), *self.images.values(),
                      *self.scores.values(), *self.gap.values(), *self.own.values()]:
            if group is None or id(group) in seen:
                continue
            seen.add(id(group))
            dist.destroy_process_group(group)

    def stage_links(self, replica: int, stage: int, num_stages: int) -> tuple:
        """(the link a GAP stage receives on, the link it sends on)."""
        return self.gap.get((replica, (stage - 1) % num_stages)), self.gap.get((replica, stage))
