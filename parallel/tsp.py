"""TSP, timestep parallelism (docs/DESIGN.md 5.3): the trainer treats a fragment as a bag of
(sample, timestep) transitions, packs transitions of different samples *and* timesteps into
micro-batches and spreads them over all M trainer ranks, so every trainer works on every fragment
as soon as it lands.

Pure functions of plain data: the runtime (the generator that routes a fragment, every trainer that
receives its share) and the simulator call the same code, and since the inputs are functions of
(seed, step, config), every rank computes the whole packing itself without a message.

The packing of one fragment with T transitions, M trainers and micro-batch size b:

  - transitions are ordered sample-major (sample 0 at its trained timesteps, then sample 1, ...),
    so a trainer's share covers few samples and needs little conditioning;
  - the T transitions are split into M contiguous shares whose sizes differ by at most one; which
    trainers take the larger shares rotates across the fragments of a step, so per-step totals also
    differ by at most one;
  - with trainers of different speeds (`weights`, relative speeds), the shares follow the speeds
    instead: each trainer's share is T w_m / sum(w) rounded (largest remainders, ties in the
    rotation's order), so that every trainer finishes its share at the same time;
  - every trainer with a non-empty share cuts it into the same number k of micro-batches (fewer
    only when its share is smaller than k), with sizes differing by at most one and never above b:
    k = ceil(largest share / b), which for equal shares is ceil(T / (M b)). Equal counts keep FSDP
    ranks, whose forwards are collectives, in step;
  - with tail assist (`helped`, docs/DESIGN.md 5.9) one fragment, the step's last, is shared by
    M + 1: share M goes to the rank that generated the fragment, which trains it beside the
    trainers (its weight in a split by speed: `helper_weight`, by default the trainers' mean).

Which trainer trains a transition never changes what it contributes: the trainers' gradients are
summed, so every packing trains the same weights to float32 reassociation.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Transition = tuple[int, int]  # (sample_id, t): sample `sample_id` of the step at denoising step t


@dataclass(frozen=True)
class MicroBatch:
    """The transitions of one training forward pass."""

    index: int  # position in the step (fragment by fragment, update by update, trainer by trainer)
    fragment: int
    trainer: int  # index into the trainer ranks
    transitions: tuple[Transition, ...]
    part: int = 0  # the step's optimizer update that trains it (rl.updates)


@dataclass(frozen=True)
class Packing:
    """A step's micro-batches, fragment by fragment."""

    micro_batches: tuple[MicroBatch, ...]
    num_trainers: int
    num_helpers: int = 0  # 1 with tail assist: micro-batches of trainer index num_trainers are the helper's

    def of(self, fragment: int, trainer: int) -> tuple[MicroBatch, ...]:
        return tuple(m for m in self.micro_batches if m.fragment == fragment and m.trainer == trainer)

    def trainers_of(self, fragment: int) -> tuple[int, ...]:
        """The trainers that receive a share of `fragment`, in trainer order."""
        return tuple(sorted({m.trainer for m in self.micro_batches if m.fragment == fragment}))

    def num_forwards(self) -> list[int]:
        """Micro-batches (forward passes) per trainer."""
        counts = [0] * (self.num_trainers + self.num_helpers)
        for m in self.micro_batches:
            counts[m.trainer] += 1
        return counts

    def num_transitions(self) -> list[int]:
        counts = [0] * (self.num_trainers + self.num_helpers)
        for m in self.micro_batches:
            counts[m.trainer] += len(m.transitions)
        return counts


def fragment_transitions(sample_ids: Sequence[int], timesteps: Mapping[int, Sequence[int]]) -> list[Transition]:
    """A fragment's transitions, sample-major: every trained timestep of its first sample, then the next."""
    return [(i, int(t)) for i in sample_ids for t in sorted(timesteps[i])]


def _split(n: int, parts: int, first_larger: int = 0) -> list[int]:
    """n split into `parts` sizes differing by at most one; the n % parts larger ones start at
    position `first_larger` (cyclically)."""
    q, r = divmod(n, parts)
    return [q + (1 if (j - first_larger) % parts < r else 0) for j in range(parts)]


def _split_weighted(n: int, weights: Sequence[float], first_larger: int = 0) -> list[int]:
    """n split in proportion to `weights`: each part the floor of its exact share, the rest one
    each to the largest remainders (ties: cyclically from `first_larger`). Equal weights: `_split`."""
    parts, total = len(weights), sum(weights)
    exact = [n * w / total for w in weights]
    out = [int(x) for x in exact]
    order = sorted(range(parts), key=lambda j: (-(exact[j] - out[j]), (j - first_larger) % parts))
    for j in order[:n - sum(out)]:
        out[j] += 1
    return out


def pack(fragments: Sequence[Sequence[Transition]], *, micro_batch: int, num_trainers: int,
         parts: Mapping[int, int] | None = None, weights: Sequence[float] | None = None,
         helped: int | None = None, helper_weight: float | None = None) -> Packing:
    """Pack each fragment's transitions (in the given order) into micro-batches of at most
    `micro_batch` transitions, balanced over `num_trainers` trainers (see the module docstring).
    `parts`: sample id -> the step's optimizer update that trains it (rl.updates; None: one
    update): a micro-batch never mixes updates, each update's transitions of a fragment are packed
    as the module docstring packs a fragment's, update after update. `weights`: the trainers'
    relative speeds (None or all equal: even shares). `helped`: the fragment whose transitions a
    helper (trainer index `num_trainers`) shares too (None: none), `helper_weight` its speed in the
    unit of `weights` (None: the trainers' mean)."""
    if micro_batch < 1:
        raise ValueError(f"--train-micro-batch must be >= 1, got {micro_batch}")
    if num_trainers < 1:
        raise ValueError(f"TSP needs at least one trainer, got {num_trainers}")
    if weights is not None and (len(weights) != num_trainers or not all(w > 0 for w in weights)):
        raise ValueError(f"TSP needs one positive speed per trainer ({num_trainers}), got {list(weights)}")
    if weights is not None and len(set(weights)) == 1:
        weights = None
    if helped is not None and not 0 <= helped < len(fragments):
        raise ValueError(f"the helped fragment {helped} is not one of the step's {len(fragments)}")
    units = []
    for f, transitions in enumerate(fragments):
        if len(set(transitions)) != len(transitions):
            raise ValueError(f"fragment {f} lists a (sample, timestep) transition twice")
        of = [0 if parts is None else parts[i] for i, _ in transitions]
        units += [(f, p, [tr for tr, q in zip(transitions, of) if q == p]) for p in sorted(set(of))]
    out, rotate = [], 0
    for f, part, transitions in units:
        total = len(transitions)
        if f == helped:  # one more share, the helper's last: the trainers' rotation goes on unchanged
            own = list(weights or [1.0] * num_trainers)
            own.append(helper_weight if helper_weight is not None else sum(own) / num_trainers)
            shares = _split(total, num_trainers + 1) if len(set(own)) == 1 else _split_weighted(total, own)
        else:
            shares = _split(total, num_trainers, first_larger=rotate) if weights is None else \
                _split_weighted(total, weights, first_larger=rotate)
            rotate = (rotate + total % num_trainers) % num_trainers
        per_trainer = -(-max(shares) // micro_batch)  # k: micro-batches of the largest share
        start = 0
        for trainer, share in enumerate(shares):
            own = transitions[start:start + share]
            start += share
            if not own:
                continue
            sizes = _split(share, min(per_trainer, share))
            offset = 0
            for size in sizes:
                out.append(MicroBatch(len(out), f, trainer, tuple(own[offset:offset + size]), part))
                offset += size
    return Packing(tuple(out), num_trainers, 0 if helped is None else 1)


def pack_step(fragment_sample_ids: Sequence[Sequence[int]], timesteps: Mapping[int, Sequence[int]], *,
              micro_batch: int, num_trainers: int, parts: Mapping[int, int] | None = None,
              weights: Sequence[float] | None = None, helped: int | None = None,
              helper_weight: float | None = None) -> Packing:
    """The packing of a step: `fragment_sample_ids[f]` are fragment f's samples, `timesteps[i]`
    sample i's trained timesteps (Flow-GRPO in order, a DanceGRPO subset, a window), `parts[i]`
    the optimizer update that trains sample i (None: one update), `weights` the trainers'
    relative speeds (None: equal), `helped` the fragment a helper shares too (None: none) at
    `helper_weight` (None: the trainers' mean)."""
    return pack([fragment_transitions(ids, timesteps) for ids in fragment_sample_ids],
                micro_batch=micro_batch, num_trainers=num_trainers, parts=parts, weights=weights, helped=helped,
                helper_weight=helper_weight)
