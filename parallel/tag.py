"""TAG: trainer-assisted generation with BTS (docs/DESIGN.md), the runtime side.

With --tag the fragments of a step are claimed, not assigned: every generator replica and every
idle trainer takes the next unclaimed fragment with an atomic `add` on the TCP store, so no
fragment is generated twice and none is lost. Whoever generates a fragment records itself as its
owner and marks the fragment landed once its data is on the way; trainers receive each fragment
from its owner. A trainer claims only at an idle window (the next fragment it needs has not
landed) and only when BTS (parallel/bts.py) predicts a shorter step. Trainer weights during a
step are exactly the step's version, generation runs without grad, and accumulated gradients are
never touched, so a fragment is the same whoever generates it.

What a trainer generates travels to each other trainer on that trainer's own communicator
(parallel/topology.py): two trainers that both generate send to each other before each receives,
which on one NCCL communicator would wait for each other (docs/communication.md).

Replicated trainers each decide on their own (`Assistant`). FSDP2 trainers cannot: every forward
all-gathers over the whole group, so they generate together, and one of them decides for all
(`GroupAssistant`). A GAP replica claims a round of fragments at a time (`claimed_rounds`). A
trainer scores the fragments it generates itself; scorer ranks score the replicas' fragments.
"""
from __future__ import annotations

import dataclasses
import itertools
import time

import torch

from parallel import p2p
from parallel.bts import CostTracker, decide
from parallel.event_engine import StepState
from parallel import store_keys as keys
from rl.updates import held_fraction

POLL_S = 0.003


class FragmentBoard:
    """Claims, owners and landings of one step's fragments, on the TCP store."""

    def __init__(self, store, step: int, num_fragments: int):
        self.store, self.step, self.n = store, step, num_fragments

    def claim(self, rank: int, replica: int | None = None) -> int | None:
        f = self.store.add(keys.claims(self.step)) - 1  # atomic: each value is handed out once
        if f >= self.n:
            return None
        now = time.time()
        self.store.put(keys.fragment_owner(self.step, f), {"rank": rank, "start": now, "replica": replica})
        if replica is not None:
            self.store.put(keys.replica_busy(self.step, replica), {"fragment": f, "start": now})
        return f

    def num_claimed(self) -> int:
        return min(self.n, self.store.add(keys.claims(self.step), 0))

    def owner(self, f: int) -> dict | None:
        key = keys.fragment_owner(self.step, f)
        return self.store.get(key) if self.store.ready(key) else None

    def wait_owner(self, f: int) -> dict:
        return self.store.get(keys.fragment_owner(self.step, f))  # rank wait: until someone claims f

    def land(self, f: int) -> None:
        self.store.put(keys.fragment_landed(self.step, f), time.time())

    def landed(self, f: int) -> bool:
        return self.store.ready(keys.fragment_landed(self.step, f))

    def replica_busy(self, replica: int) -> dict | None:
        key = keys.replica_busy(self.step, replica)
        return self.store.get(key) if self.store.ready(key) else None


def publish_replica_cost(store, replica: int, seconds: float) -> None:
    store.put(keys.replica_cost(replica), seconds)


def claimed_rounds(board: FragmentBoard, store, plan, layout, replica: int):
    """The fragments of a GAP replica of S stages (pipeline.StageLayout) under TAG: stage 0 claims
    them a round at a time, enough for S micro-batches in flight (at least S chunks, or what is
    left), and announces each round to the other stages on the store; an empty round ends the
    step. Each round runs as one pipelined schedule. The claims name the last stage as the
    owner: the trainers and the scorers receive the fragment from it."""
    for n in itertools.count():
        key = keys.gap_round(plan.step, replica, n)
        if layout.first:
            got, num_chunks = [], 0
            while num_chunks < layout.num_stages and (f := board.claim(layout.ranks[-1], replica)) is not None:
                got.append(f)
                num_chunks += len(plan.fragments[f].chunks)
            store.put(key, got)
        else:
            got = store.get(key)  # rank wait: stage 0's claims
        if not got:
            return
        yield [plan.fragments[f] for f in got]


class Assistant:
    """The generation helper of one trainer rank. `generator` is the rank's rollout.Generator: a
    fragment generated here is the same as one a replica generates."""

    def __init__(self, ctx, generator, store, num_trainers: int, me: int, decision_interval_s: float = 0.02,
                 trainer_ratio: float = 1.0):
        """`trainer_ratio`: this trainer's generation time over a replica's, from the start-up speed
        probe; BTS uses it until the trainer has generated a fragment of its own."""
        self.ctx, self.gen, self.store = ctx, generator, store
        self.num_trainers, self.me = num_trainers, me
        self.tracker = CostTracker(ctx.topo.num_replicas, trainer_ratio=trainer_ratio)
        self.interval = decision_interval_s
        self.board = None

    def begin_step(self, plan, reward_std: float | None, trainer, intake) -> None:
        """`intake`: this trainer's parallel.trainer_intake; fragments generated here leave its own share there."""
        self.plan, self.reward_std, self.trainer, self.intake = plan, reward_std, trainer, intake
        self.board = FragmentBoard(self.store, plan.step, len(plan.fragments))
        self.step_start = time.time()
        self.generated, self.predicted_s, self.sends, self.results = 0, None, [], []
        self.helper_share = None  # tail assist: this trainer generated the last fragment and trains this share too
        self.window_s = 0.0  # seconds of windows run inside training (GroupAssistant)
        for r in range(self.ctx.topo.num_replicas):
            if self.store.ready(keys.replica_cost(r)):
                self.tracker.replica_fragment_s[r] = self.store.get(keys.replica_cost(r))

    def source_of(self, f: int) -> int:
        """The rank that generated fragment f, once it has landed. Until then this trainer is idle:
        at every idle window BTS decides whether it generates an unclaimed fragment itself."""
        last = 0.0
        while not self.board.landed(f):
            if time.monotonic() - last >= self.interval:
                last = time.monotonic()
                if self._idle_window():
                    continue
            time.sleep(POLL_S)
        return self.board.owner(f)["rank"]

    def _state(self, costs) -> StepState:
        board, start = self.board, self.step_start
        now = time.time() - start
        claimed = board.num_claimed()
        free = []
        for r in range(self.ctx.topo.num_replicas):
            busy = board.replica_busy(r)
            if busy is None or board.landed(busy["fragment"]):
                free.append(now)
            else:
                free.append(max(now, busy["start"] - start + costs.replica_fragment_s[r]))
        arrivals = {}
        for f in range(claimed):
            if board.landed(f):
                continue
            owner = board.owner(f)
            if owner is None:  # claimed a moment ago, owner not written yet
                arrivals[f] = now + min(costs.replica_fragment_s)
                continue
            took = (costs.replica_fragment_s[owner["replica"]] if owner["replica"] is not None
                    else costs.trainer_fragment_s)
            arrivals[f] = max(now, owner["start"] - start + took) + costs.transfer_s
        return StepState(now_s=now, unclaimed=list(range(claimed, board.n)), replica_free_s=free,
                         arrivals_s=arrivals, trainer_free_s=[now] * self.num_trainers,
                         trainer_backlog_s=[0.0] * self.num_trainers, trainer=self.me, num_fragments=board.n)

    def _decide(self, claims_per_window: int = 1):
        """BTS at an idle window (None until the costs are known or when nothing is left to claim)."""
        # Tail assist: the last fragment is left to the generators, which train a share of it.
        if not self.tracker.ready or self.board.num_claimed() >= self.board.n - self.ctx.facts.tail_assist:
            return None
        costs = self.tracker.costs(chunks_per_fragment=self.intake.chunks_per_fragment(self.plan))
        # The tracker learns seconds per trained transition: this step's fragments train their own
        # counts (a sliding window, MixGRPO, trains fewer steps near the end of the schedule).
        counts = [self.intake.fragment_transitions(self.plan, f) for f in range(len(self.plan.fragments))]
        # Several updates per rollout over parts that span the step: the later ones' training waits.
        updates = self.intake.spec.updates
        held = held_fraction(updates.num_updates, updates.split, self.trainer.rule.needs_step_end)
        costs = dataclasses.replace(costs, train_fragment_s=costs.train_fragment_s * counts[0],
                                    train_scale=[n / counts[0] for n in counts], held_fraction=held)
        decision = decide(self._state(costs), costs, self.num_trainers, claims_per_window=claims_per_window,
                          tcss=self.ctx.facts.tcss)
        if self.predicted_s is None:
            self.predicted_s = decision.predicted_s
        return decision

    def _idle_window(self) -> bool:
        decision = self._decide()
        if decision is None or not decision.claim:
            return False
        f = self.board.claim(self.ctx.rank)
        if f is None:
            return False
        with self.ctx.tracer.span("tag_generate", "generate", self.plan.step, f):
            t0 = time.perf_counter()
            result = self._generate(f)
            self.tracker.observe_trainer_fragment(time.perf_counter() - t0)
        self._deliver(f, result)
        return True

    def _generate(self, f: int):
        """Fragment f with the step's version (the trainer's weights are exactly that version)."""
        plan, out = self.plan, []
        with torch.no_grad():
            self.gen.generate(plan, [plan.fragments[f]], plan.step, self.reward_std, out.append)
        return out[0]

    def _deliver(self, f: int, result) -> None:
        """Routed as a generator routes a fragment: this trainer's share into its own intake, the
        others' sent; then the fragment is marked landed."""
        payloads, share = self.intake.route_keeping(self.plan, result.chunks)
        if share is not None:  # tail assist: the last fragment's helper share, trained here too
            self.helper_share = share
        for dst, tensors, meta in payloads:
            if dst == self.ctx.rank:
                self.intake.accept(tensors, meta)
            else:
                self.sends.append(p2p.isend_payload(tensors, meta, dst=dst, group=self.intake.group_to(dst)))
        self.board.land(f)
        self.generated += 1
        self.results.append(result)  # its rewards belong to the step's metrics

    def observe_transfers(self, seconds: dict[int, float]) -> None:
        """This trainer's seconds receiving each fragment generated elsewhere, every piece of it,
        timed from when the fragment had landed (the sender's data on the way): `Costs.transfer_s`."""
        for s in seconds.values():
            self.tracker.observe_transfer(s)

    def observe_step_end(self, update_s: float, publish_s: float) -> None:
        """The optimizer update's seconds and the publication's (the new version sent to every
        generator; colocated ranks and TCSS trainers do not wait for it the same way, and BTS's
        engine models both)."""
        self.tracker.observe_update(update_s)
        self.tracker.observe_publish(publish_s)

    def observe_training(self, seconds: dict[int, float]) -> None:
        """This trainer's seconds of training on each fragment it had a share of, in the unit of
        `Costs.train_fragment_s` (the trainer group's wall time per fragment, as if every trainer
        took an equal share; the intake converts) per trained transition of the fragment."""
        for f, s in seconds.items():
            self.tracker.observe_train_fragment(self.intake.fragment_seconds(self.plan, f, s)
                                                / self.intake.fragment_transitions(self.plan, f))

    def end_step(self) -> dict:
        for h in self.sends:
            h.wait()  # drain this step's sends
        self.sends = []
        return {"tag_fragments": self.generated, "tag_predicted_s": self.predicted_s, "tag_costs": self.costs_now()}

    def costs_now(self) -> dict[str, float]:
        """The costs BTS decides with, as learned so far (seconds; a quantity not yet measured is
        absent): what the step log records as bts/*."""
        values = {k: v for k, v in self.tracker.values.items() if v is not None}
        replicas = [x for x in self.tracker.replica_fragment_s if x is not None]
        if replicas:
            values["replica_fragment_s"] = sum(replicas) / len(replicas)
        return values


def group_windows(receives: list[list[tuple[int, int]]]) -> list[tuple[int, tuple[int, ...]]]:
    """Where an FSDP trainer group may wait: (slot, fragments) for every slot before which some
    trainer first takes a piece of fragments no earlier slot's took. Slot i is the i-th planned
    forward of every trainer: the group runs them together, since their all-gathers pair up.
    `receives[r]` lists (slot, fragment) where trainer r takes each piece (the intake's
    `receive_slots`: just before the piece's first forward, or with several updates per rollout
    before a forward of an earlier update, when the piece comes first in plan order)."""
    first: dict[int, int] = {}
    for per in receives:
        for slot, f in per:
            first[f] = min(first.get(f, slot), slot)
    by_slot: dict[int, list[int]] = {}
    for f, slot in first.items():
        by_slot.setdefault(slot, []).append(f)
    return [(slot, tuple(sorted(fs))) for slot, fs in sorted(by_slot.items())]


class GroupAssistant(Assistant):
    """TAG for an FSDP2 trainer group. Every forward, training or generation, all-gathers over the
    whole group, so the trainers must run the same forwards in the same order: they generate
    together, and only where every one of them stands between the same two forwards.

    Those places are the windows of `group_windows`, known to every trainer from the plan: before
    slot i, where the group first needs some fragments. Trainer 0, the leader, alone looks at the
    board there and writes a sequence of decisions `tagdec/{step}/{slot}/{n}`: either "generate"
    the fragments it just claimed (at most one per trainer, as BTS with `claims_per_window` = the
    group size says), which the group generates in one round, or "proceed" once the window's
    fragments have landed. The others read that sequence from the store and never look at the
    board, so no race can split the group. A trainer whose fragment in a round has fewer chunks
    than another's, or that has none, denoises throw-away chunks: every chunk runs the same
    transformer forwards, so the all-gathers pair up. Between windows every fragment a slot needs
    has landed, so no trainer waits inside a collective for data."""

    def __init__(self, ctx, generator, store, num_trainers: int, me: int, decision_interval_s: float = 0.02,
                 trainer_ratio: float = 1.0):
        super().__init__(ctx, generator, store, num_trainers, me, decision_interval_s, trainer_ratio)
        self.leader = me == 0
        self.written: list[str] = []  # the leader's decision keys of the previous step

    def begin_step(self, plan, reward_std: float | None, trainer, intake) -> None:
        super().begin_step(plan, reward_std, trainer, intake)
        if self.leader:  # every trainer read them before the previous step's update (a sync point)
            for key in self.written:
                self.store.delete(key)
            self.written = []
        self.windows = group_windows(intake.receive_slots(plan))
        self.next_window = 0
        trainer.before_forward = self.before_forward

    def before_forward(self, slot: int) -> None:
        """Run the windows up to `slot`: the trainer is about to start that forward."""
        while self.next_window < len(self.windows) and self.windows[self.next_window][0] <= slot:
            t0 = time.perf_counter()
            self._window(*self.windows[self.next_window])
            self.next_window += 1
            self.window_s += time.perf_counter() - t0

    def source_of(self, f: int) -> int:
        """Called before this trainer receives its first piece of fragment f, before its next
        planned forward: the windows up to that forward have made sure f landed."""
        self.before_forward(self.trainer.slot)
        if not self.board.landed(f):
            raise p2p.ProtocolError(f"TAG: fragment {f} of step {self.plan.step} has not landed at forward "
                                    f"{self.trainer.slot}")
        return self.board.owner(f)["rank"]

    def _window(self, slot: int, fragments: tuple[int, ...]) -> None:
        for n in itertools.count():
            key = keys.tag_decision(self.plan.step, slot, n)
            if self.leader:
                decision = self._lead(fragments)
                self.store.put(key, decision)
                self.written.append(key)
            else:
                decision = self.store.get(key)  # rank wait: the leader's decision
            if decision["generate"] is None:
                return
            self._round(decision["generate"])

    def _lead(self, fragments: tuple[int, ...]) -> dict:
        """The leader's next decision at a window: poll until the window's fragments have landed
        ("generate": None, proceed) or BTS has the group generate the fragments it claims."""
        last = 0.0
        while not all(self.board.landed(f) for f in fragments):
            if time.monotonic() - last >= self.interval:
                last = time.monotonic()
                decision = self._decide(claims_per_window=self.num_trainers)
                if decision is not None and decision.claim:
                    claims = []
                    for j in range(decision.claims_now):
                        f = self.board.claim(self.ctx.topo.trainer_ranks[j])  # trainer j generates f
                        if f is None:
                            break
                        claims.append(f)
                    if claims:
                        return {"generate": claims + [None] * (self.num_trainers - len(claims))}
            time.sleep(POLL_S)
        return {"generate": None}

    def _round(self, fragments: list[int | None]) -> None:
        """Every trainer generates its fragment of `fragments` (None: none), all with the same
        number of chunks: the most chunks of any, the missing ones thrown away."""
        plan, trainer = self.plan, self.trainer
        mine = fragments[self.me]
        num_chunks = max(len(plan.fragments[f].chunks) for f in fragments if f is not None)
        gathers = trainer.num_allgathers
        with self.ctx.tracer.span("tag_generate" if mine is not None else "tag_pad", "generate", plan.step, mine):
            t0 = time.perf_counter()
            result = self._generate(mine) if mine is not None else None
            for _ in range(num_chunks - (len(plan.fragments[mine].chunks) if mine is not None else 0)):
                self.gen.denoise_padding(plan.step)  # the forwards of a chunk, so the all-gathers pair up
            self.tracker.observe_trainer_fragment(time.perf_counter() - t0)
        trainer.num_allgathers = gathers  # generation's all-gathers are not the training's
        if result is not None:
            self._deliver(mine, result)

    def end_step(self) -> dict:
        if self.next_window != len(self.windows):
            raise p2p.ProtocolError(f"TAG: the step ended after {self.next_window} of {len(self.windows)} windows")
        self.trainer.before_forward = None
        return super().end_step()
