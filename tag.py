"""TAG: trainer-assisted generation with BTS (DESIGN.md 5.4), the runtime side.

With --tag the fragments of a step are claimed, not assigned: every generator replica and every
idle trainer takes the next unclaimed fragment with an atomic `add` on the TCP store, so no
fragment is generated twice and none is lost. Whoever generates a fragment records itself as its
owner and marks the fragment landed once its data is on the way; trainers receive each fragment
from its owner. A trainer claims only at an idle window (the next fragment it needs has not
landed) and only when BTS (parallel/bts.py) predicts a shorter step. Trainer weights during a
step are exactly the step's version, generation runs without grad, and accumulated gradients are
never touched, so a fragment is the same whoever generates it.
"""
from __future__ import annotations

import time

import torch

from parallel import p2p
from parallel.bts import CostTracker, decide
from parallel.simulator import StepState

POLL_S = 0.003


class FragmentBoard:
    """Claims, owners and landings of one step's fragments, on the TCP store."""

    def __init__(self, store, step: int, num_fragments: int):
        self.store, self.step, self.n = store, step, num_fragments

    def claim(self, rank: int, replica: int | None = None) -> int | None:
        f = self.store.add(f"claim/{self.step}") - 1  # atomic: each value is handed out once
        if f >= self.n:
            return None
        now = time.time()
        self.store.put(f"owner/{self.step}/{f}", {"rank": rank, "start": now, "replica": replica})
        if replica is not None:
            self.store.put(f"busy/{self.step}/{replica}", {"fragment": f, "start": now})
        return f

    def num_claimed(self) -> int:
        return min(self.n, self.store.add(f"claim/{self.step}", 0))

    def owner(self, f: int) -> dict | None:
        key = f"owner/{self.step}/{f}"
        return self.store.get(key) if self.store.ready(key) else None

    def land(self, f: int) -> None:
        self.store.put(f"landed/{self.step}/{f}", time.time())

    def landed(self, f: int) -> bool:
        return self.store.ready(f"landed/{self.step}/{f}")

    def replica_busy(self, replica: int) -> dict | None:
        key = f"busy/{self.step}/{replica}"
        return self.store.get(key) if self.store.ready(key) else None


def publish_replica_cost(store, replica: int, seconds: float) -> None:
    store.put(f"cost/replica/{replica}", seconds)


class Assistant:
    """The generation helper of one trainer rank."""

    def __init__(self, ctx, generator, store, num_trainers: int, me: int, decision_interval_s: float = 0.02):
        self.ctx, self.gen, self.store = ctx, generator, store
        self.num_trainers, self.me = num_trainers, me
        self.tracker = CostTracker(ctx.topo.num_replicas)
        self.interval = decision_interval_s
        self.board = None

    def begin_step(self, plan, reward_std: float | None) -> None:
        self.plan, self.reward_std = plan, reward_std
        self.board = FragmentBoard(self.store, plan.step, len(plan.fragments))
        self.step_start = time.time()
        self.generated, self.predicted_s, self.sends, self.results = 0, None, [], []
        for r in range(self.ctx.topo.num_replicas):
            if self.store.ready(f"cost/replica/{r}"):
                self.tracker.replica_fragment_s[r] = self.store.get(f"cost/replica/{r}")

    def source_of(self, f: int, local: dict, untrained_landed: int = 0) -> int:
        """The rank that generated fragment f, once it has landed. Until then this trainer is idle:
        at every idle window BTS decides whether it generates an unclaimed fragment itself."""
        last = 0.0
        while not self.board.landed(f):
            if time.monotonic() - last >= self.interval:
                last = time.monotonic()
                if self._idle_window(local, untrained_landed):
                    continue
            time.sleep(POLL_S)
        return self.board.owner(f)["rank"]

    def _state(self, costs, untrained_landed: int) -> StepState:
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
        backlog = untrained_landed * costs.train_fragment_s
        return StepState(now_s=now, unclaimed=list(range(claimed, board.n)), replica_free_s=free,
                         arrivals_s=arrivals, trainer_free_s=[now] * self.num_trainers,
                         trainer_backlog_s=[backlog] * self.num_trainers, trainer=self.me)

    def _idle_window(self, local: dict, untrained_landed: int) -> bool:
        if not self.tracker.ready or self.board.num_claimed() >= self.board.n:
            return False
        costs = self.tracker.costs()
        decision = decide(self._state(costs, untrained_landed), costs, self.num_trainers)
        if self.predicted_s is None:
            self.predicted_s = decision.predicted_s
        if not decision.claim:
            return False
        f = self.board.claim(self.ctx.rank)
        if f is None:
            return False
        self._generate(f, local)
        return True

    def _generate(self, f: int, local: dict) -> None:
        from intake import TrainChunk, TransitionBatch, route_chunks

        ctx, plan = self.ctx, self.plan
        with ctx.tracer.span("tag_generate", "generate", plan.step, f), torch.no_grad():
            t0 = time.perf_counter()
            result = self.gen.generate_fragment(plan, plan.fragments[f], version=plan.step, reward_std=self.reward_std)
            self.tracker.observe_trainer_fragment(time.perf_counter() - t0)
        for dst, tensors, meta in route_chunks(ctx, plan, result.chunks):
            if dst == ctx.rank:  # this trainer's own share stays here
                if meta["kind"] == "chunk":
                    local[meta["chunk"]] = TrainChunk.from_payload(tensors, meta)
                else:
                    local[("tsp", f)] = TransitionBatch.from_payload(tensors, meta)
            else:
                self.sends.append(p2p.isend_payload(tensors, meta, dst=dst))
        self.board.land(f)
        self.generated += 1
        self.results.append(result)  # its rewards belong to the step's metrics

    def end_step(self) -> dict:
        for h in self.sends:
            h.wait()  # drain this step's sends
        self.sends = []
        return {"tag_fragments": self.generated, "tag_predicted_s": self.predicted_s}
