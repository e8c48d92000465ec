"""One step of each role, as a rank runs it (runtime/build.py's `Rank.generate` and `Rank.train`):
a generator rank generates, scores and streams its fragments and installs new versions between
them (`generator_step`); a trainer rank trains what lands in plan order, updates once and publishes
the next version (`trainer_step`). The roles' objects (rollout.py, trainer.py) and the mechanisms
(parallel/) do the work; these functions put it in order.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from parallel import p2p, tail_assist
from parallel import forward_rows, fragment_records
from parallel.publish import WeightPublisher
from parallel.stepplan import StepPlan
from parallel.tag import FragmentBoard, claimed_rounds, publish_replica_cost
from parallel import store_keys as keys
from rollout import FragmentResult, Generator, VersionSync
from trainer import Trainer


def generator_step(ctx, generator: Generator, versions: VersionSync | None, plan: StepPlan,
                   get_reward_std: Callable[[], float | None], replica=None, store=None,
                   deferred: list | None = None, helper: Trainer | None = None) -> tuple[list[FragmentResult], dict]:
    """One step of a generator rank: generate, decode and score this replica's fragments
    depth-first, streaming every chunk to its trainer as soon as its fragment is scored; new
    versions are installed only between fragments. Colocated ranks keep their chunks (returned).
    With TAG the replica's fragments are the ones it claims as it gets to them (a GAP replica: a
    round at a time, parallel.tag.claimed_rounds). `get_reward_std` gives the advantage std; it is
    called once this step's weights are installed, since the trainer publishes the std after them.
    `helper` (tail assist): trains this rank's share of the step's last fragment if it generated it,
    after its last fragment is on the way, and sends what it trained to the first trainer."""
    tracer, topo, facts, step = ctx.tracer, ctx.topo, ctx.facts, plan.step
    version = versions.at_step_start(step) if versions is not None else step
    reward_std = get_reward_std()
    me = topo.replica_of(ctx.rank)
    results, local, handles = [], {}, []
    board = FragmentBoard(store, step, len(plan.fragments)) if facts.tag else None
    cost, last_emit, helped = None, time.time(), None

    def emit(result: FragmentResult) -> None:
        nonlocal cost, last_emit, helped
        if facts.disagg:
            payloads, share = ctx.intake.route_keeping(plan, result.chunks)
            if helper is not None and result.fragment == ctx.intake.helped(plan):  # a share of it is trained here
                helped = [share]  # [None]: too small to share; the first trainer still waits for the send
            for dst, tensors, meta in payloads:
                handles.append(p2p.isend_payload(tensors, meta, dst=dst, group=ctx.intake.group_to(dst)))
            result = dataclasses.replace(result, chunks=[])  # the trajectories leave the device with their sends
        else:
            local.update({chunk.chunk: chunk for chunk in result.chunks})
        results.append(result)
        if board is not None:  # TAG: share this replica's time per fragment, then mark the fragment landed
            now = time.time()
            cost = now - last_emit if cost is None else 0.7 * cost + 0.3 * (now - last_emit)
            last_emit = now
            publish_replica_cost(store, me, cost)  # first: a trainer that sees the step's last fragment
            board.land(result.fragment)  # landed finds the replica's cost there when it begins the next step

    planned = [f for f in plan.fragments if f.replica == me]
    if replica is not None:  # a GAP replica of several stages; its last stage emits the fragments
        rounds = [planned] if board is None else claimed_rounds(board, store, plan, replica.layout, me)
        for fragments in rounds:
            replica.run_step(plan, fragments, version, generator.stream(plan, reward_std, emit, tracer), tracer)
    else:
        if board is not None:
            planned = (plan.fragments[f] for f in iter(lambda: board.claim(ctx.rank, me), None))
        stream = generator.stream(plan, reward_std, emit, tracer)
        for fragment in planned:
            if versions is not None:
                version = versions.at_fragment_boundary(step)
            with tracer.span("generate", "generate", step, fragment.index, version=version):
                stream.submit(generator.denoise(plan, fragment), version)
            stream.collect()
        stream.close()
    if helped is not None:  # the first trainer waits for what it trained (a share too small to split: nothing)
        helper.begin_step()
        helper.current_step = step
        if helped[0] is not None:
            with tracer.span("assist_train", "train", step, helped[0].fragment):
                helper.train(helped[0])
        first = topo.trainer_ranks[0]
        handles.append(tail_assist.send(helper, first, ctx.intake.group_to(first)))
    due = [(step, handles)]
    if deferred is not None:
        # TCSS: step k's sends complete while step k+1 is generated; the caller drains them later.
        deferred.append((step, handles))
        due = [(s, hs) for s, hs in deferred if s < step]
        deferred[:] = [(s, hs) for s, hs in deferred if s >= step]
    with tracer.span("send_wait", "comm", step):
        drain_sends(store, due)  # this step's, or with TCSS the previous step's
    return results, local


def drain_sends(store, due: list) -> None:
    """Wait for the fragment sends of each (step, handles) in `due`. A trainer receives a step's
    data only once it has begun that step, after its evaluation or checkpoint of the step before,
    which may take longer than any timeout: so first wait, with no time limit (the run guard's
    heartbeats name a dead or silent trainer), until every receiver has begun the step
    (`begin/{step}/{rank}`, runtime/build.py), then wait for the sends, each bounded from there."""
    for step, handles in due:
        for dst in sorted({h.dst for h in handles}):
            while store is not None and not store.ready(keys.trainer_began(step, dst)):
                time.sleep(0.01)  # rank wait: the trainer's evaluation or checkpoint
        for h in handles:
            h.wait()  # rank wait: the trainer takes the fragment


def trainer_step(ctx, trainer: Trainer, plan, local: dict, publish_names: dict[int, list[str]],
                 publisher: WeightPublisher, assistant=None, store=None,
                 reward_std: float | None = None) -> dict[str, float]:
    """One step of a trainer rank: train its work (chunks, or with --tsp its packed transitions of
    every fragment) in plan order as it lands (colocated: from `local`), one optimizer update per
    part of the step's samples (--updates-per-rollout, rl/updates.py; the work of part p trains
    after update p - 1), then publish version k+1 to every generator. With TAG, the `assistant`
    may generate fragments while this rank waits for one (under FSDP: the whole group, between
    forwards)."""
    tracer, topo, facts, intake, step = ctx.tracer, ctx.topo, ctx.facts, ctx.intake, plan.step
    pad_to = forward_rows.fsdp_pad_targets(plan, facts, intake)
    streamed_end = trainer.rule.needs_step_end and len(plan.fragments) > 1  # else its fragment decided it all
    trainer.begin_step(keep_items=streamed_end, scale_later=streamed_end and trainer.rule.std_mode == "global")
    trainer.current_step = step
    intake.inbox.update(local)
    if not facts.disagg:
        intake.exchange(plan, ctx.rank)  # colocated TSP: the packed shares move between ranks first
    if assistant is not None:
        assistant.begin_step(plan, reward_std, trainer, intake)
    work = _Work(intake.needs(plan))
    end, update_s, tail = None, 0.0, {}
    for part, (upto, mine) in enumerate(intake.passes(plan, padded=any(pad_to))):
        _train_part(ctx, trainer, plan, work, upto, mine, part, assistant)
        if facts.tail_assist:  # one update a step: its share of the last fragment joins it
            tail = _join_tail(ctx, trainer, plan, assistant)
        if pad_to[part]:
            with tracer.span("pad", "train", step):
                trainer.pad_forwards(pad_to[part], work.template)
        if trainer.rule.needs_step_end:  # the step's end, read once: before the first update it waits for every reward
            end = end or fragment_records.read_end(trainer, plan, store, seed=ctx.cfg.seed, tracer=tracer)
            fragment_records.train_end(trainer, plan, end, work.template, part, tracer=tracer)
        t0 = time.perf_counter()
        with tracer.span("optimizer", "optimizer", step, part=part):
            trainer.update(end.scale if end is not None else 1.0)  # sync point: all trainers
        update_s += time.perf_counter() - t0
    stats = {**trainer.end_step(), **tail}
    if end is not None:
        stats.update(end.metrics)
        if ctx.rank == topo.trainer_ranks[0]:  # every trainer has read the facts before the first update's all-reduce
            fragment_records.clear(store, step, len(plan.fragments))
    t0 = time.perf_counter()
    if facts.disagg:
        sent = []
        with tracer.span("publish", "publish", step):
            names = sorted({n for names in publish_names.values() for n in names})
            out = trainer.make_version(names)  # sync point under FSDP: the version's checksums, from shards
            # Each generator (stage) gets only the weights it holds, encoded once for all of them.
            by_dst = {g: publish_names[g] for g in topo.generator_ranks}
            if ctx.rank == topo.trainer_ranks[0]:
                if store is not None:
                    store.put(keys.version_published(step + 1), 1)  # generators may install it at their next fragment boundary
                # On a communicator apart from the fragments' (docs/communication.md).
                sent = publisher.publish_all(out, by_dst, step + 1, group=ctx.comms.publish)
            else:
                publisher.follow_all(out, by_dst)  # FSDP: the same bucket all-gathers as trainer 0's sends
            publisher.keep_version(out, names, step + 1)  # TCSS: the generators' version at a checkpoint
        stats["publish/bytes"] = float(sum(s.num_bytes for s in sent))
        stats["publish/seconds"] = time.perf_counter() - t0
    elif trainer.codec is not None:
        with tracer.span("publish", "publish", step):  # colocated: the codec's update, nothing sent
            trainer.make_version(list(trainer.codec.held))
    if assistant is not None:
        assistant.observe_training(work.seconds)
        assistant.observe_transfers(work.transfers)
        assistant.observe_step_end(update_s, time.perf_counter() - t0)
        stats.update(assistant.end_step())
    return stats


def _join_tail(ctx, trainer: Trainer, plan, assistant) -> dict[str, float]:
    """Tail assist: the helper's share of the last fragment joins the update. If this trainer
    generated that fragment (TAG) it trains the share itself; else the first trainer adds what the
    generator that generated it trained (parallel/tail_assist.py). Returns the step's statistics of
    it: the share's transitions and whether a trainer generated the fragment and trained the share."""
    last = ctx.intake.helped(plan)
    if assistant is not None and assistant.helper_share is not None:
        with ctx.tracer.span("assist_train", "train", plan.step, last):
            trainer.train(assistant.helper_share)
        assistant.helper_share = None
    src = assistant.board.wait_owner(last)["rank"] if assistant is not None else ctx.intake.static_source(plan, last)
    if ctx.rank == ctx.topo.trainer_ranks[0] and not ctx.topo.is_trainer(src):
        with ctx.tracer.span("recv_assist", "comm", plan.step, last):
            tail_assist.receive(trainer, src, ctx.intake.group_to(ctx.rank))
    return {"train/assist_transitions": float(ctx.intake.packing(plan).num_transitions()[-1]),
            "train/assist_by_trainer": float(ctx.topo.is_trainer(src))}


class _Work:
    """A trainer's pieces of one step: what it needs in plan order, what it has taken so far (held
    until the step's last update that trains them), the last piece taken (FSDP padding's
    template), its seconds of training per fragment and of the transfers of fragments that landed
    before their receive began (TAG's cost model)."""

    def __init__(self, needs: list):
        self.needs, self.taken, self.num_taken, self.template = needs, {}, 0, None
        self.seconds: dict[int, float] = {}
        self.transfers: dict[int, float] = {}


def _train_part(ctx, trainer: Trainer, plan, work: _Work, upto: int, mine: list[int], part: int, assistant) -> None:
    """Update `part`'s training: take the pieces up to `upto` in plan order as they land, and train
    the transitions of part `part` of the pieces in `mine`."""
    tracer, intake = ctx.tracer, ctx.intake
    for i in range(upto):
        need = work.needs[i]
        if i == work.num_taken:
            src = None
            if need.key not in intake.inbox:  # with TAG, this rank may generate fragments while it waits
                src = assistant.source_of(need.fragment) if assistant is not None else \
                    intake.static_source(plan, need.fragment)
            t0 = time.perf_counter()
            work.taken[i] = work.template = intake.take(plan, need, src)
            if assistant is not None and src not in (None, ctx.rank):  # landed before the receive began: a transfer
                work.transfers[need.fragment] = work.transfers.get(need.fragment, 0.0) + time.perf_counter() - t0
            work.num_taken += 1
            trainer.admit(work.template)
        if i not in mine:
            continue
        item = work.taken[i]
        with tracer.span("train", "train", plan.step, item.fragment, part=part, **intake.span_args(item)):
            t0, helped = time.perf_counter(), assistant.window_s if assistant is not None else 0.0
            trainer.train(item, part=part)
            took = time.perf_counter() - t0 - ((assistant.window_s if assistant is not None else 0.0) - helped)
            work.seconds[item.fragment] = work.seconds.get(item.fragment, 0.0) + took
        if not any(need.forwards[part + 1:]):  # its last update: the trainer keeps it only for the step's end
            del work.taken[i]
