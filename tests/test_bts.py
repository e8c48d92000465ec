"""The step simulator (docs/DESIGN.md 9) and BTS (5.4): hand-computed makespans, the ordering of the
modes, fragment accounting, and BTS decisions against the simulator they predict. Pure: no
processes, no torch."""
import itertools
import json
import random

import pytest

from parallel import bts
from planner.simulator import MODES, Costs, StepState, predict_makespan, simulate_run, simulate_step
from telemetry.tracing import CATEGORIES


def _costs(gen=(1.0,), train=0.5, trainer_gen=None, **kw):
    return Costs(list(gen), trainer_gen if trainer_gen is not None else max(gen), train, **kw)


def _spans(result, cat=None):
    return [e for e in result.events if e["ph"] == "X" and (cat is None or e["cat"] == cat)]


# ----- hand computations ---------------------------------------------------------------------------
def test_naive_and_streaming_match_hand_computation():
    c = _costs(update_s=0.1, publish_s=0.1)
    # naive: the whole batch (4 s) lands, then 4 x 0.5 s of training, update, publication
    assert simulate_step("disagg", 4, c, 1).makespan_s == pytest.approx(4 + 2 + 0.2)
    # streaming: only the last fragment's training is left after generation
    assert simulate_step("gap", 4, c, 1).makespan_s == pytest.approx(4 + 0.5 + 0.2)
    c = _costs(update_s=0.1, publish_s=0.1, transfer_s=0.3)
    assert simulate_step("disagg", 4, c, 1).makespan_s == pytest.approx(4 + 0.3 + 2 + 0.2)
    assert simulate_step("gap", 4, c, 1).makespan_s == pytest.approx(4 + 0.3 + 0.5 + 0.2)
    # two replicas: naive lands 2 fragments each at t=2; streaming lands two at t=1 and two at t=2
    c = _costs(gen=(1.0, 1.0), update_s=0.1, publish_s=0.1)
    assert simulate_step("disagg", 4, c, 1).makespan_s == pytest.approx(2 + 2 + 0.2)
    assert simulate_step("gap", 4, c, 1).makespan_s == pytest.approx(3 + 0.2)
    # without TSP, one chunk per fragment: trainer f % 2 trains fragment f alone in 0.5 x 2 s
    c = _costs(update_s=0.1, publish_s=0.1, chunks_per_fragment=1)
    assert simulate_step("gap", 4, c, 2).makespan_s == pytest.approx(5 + 0.2)
    # colocated: 4 fragments then their training on the one rank, update, no publication
    assert simulate_step("colocated", 4, _costs(update_s=0.1, publish_s=0.1), 1).makespan_s == pytest.approx(6.1)


def test_waves_of_a_staged_replica_land_together():
    """A replica of 2 stages whose fragments have one micro-batch pipelines them two at a time
    (the runtime keeps S micro-batches in flight): fragments 0 and 1 land at 2 s, 2 and 3 at 4 s."""
    c = _costs(update_s=0.1, publish_s=0.1)
    assert simulate_step("gap", 4, c, 1, stages_per_replica=2).makespan_s == pytest.approx(4 + 0.5 + 0.2)
    waves = simulate_run("gap", 1, 4, c, 1, stages_per_replica=2, wave=2)
    assert waves.makespan_s == pytest.approx(4 + 2 * 0.5 + 0.2)
    starts = sorted((e["ts"] / 1e6, e["args"]["fragment"]) for e in _spans(waves, "train"))
    assert [f for _, f in starts] == [0, 1, 2, 3] and [t for t, _ in starts] == pytest.approx([2.0, 2.5, 4.0, 4.5])
    gen = [e for e in _spans(waves, "generate") if e["pid"] == 1]  # the last stage: back-to-back spans
    assert sum(e["dur"] for e in gen) / 1e6 == pytest.approx(4.0) and len(gen) == 4
    # an odd count: the last wave holds what is left
    assert simulate_run("gap", 1, 3, c, 1, stages_per_replica=2, wave=2).makespan_s == pytest.approx(3 + 0.5 + 0.2)


def test_trainer_tail_delays_the_trainers_not_the_generators():
    """After a publication the trainers spend `trainer_tail_s` (checkpoint, logging); the next
    step's generation starts at once, so a tail shorter than the first fragment is hidden."""
    c = _costs(update_s=0.1, publish_s=0.1)
    base = simulate_run("gap", 2, 4, c, 1).step_end_s
    assert simulate_run("gap", 2, 4, _costs(update_s=0.1, publish_s=0.1, trainer_tail_s=0.9), 1).step_end_s == \
        pytest.approx(base)
    tail = simulate_run("gap", 2, 4, _costs(update_s=0.1, publish_s=0.1, trainer_tail_s=4.0), 1)
    # step 1: generation from 4.7, the trainer free at 8.7, four fragments of 0.5 s, update, publish
    assert tail.step_end_s == pytest.approx([4.7, 8.7 + 2.0 + 0.2])
    assert min(e["ts"] for e in _spans(tail, "generate") if e["args"]["step"] == 1) / 1e6 == pytest.approx(4.7)


def test_gap_multi_step_waits_for_publication_and_tcss_overlaps_it():
    c = _costs(train=0.6, update_s=0.3, publish_s=0.3)
    gap = simulate_run("gap", 5, 8, c, 1)
    assert gap.step_s == pytest.approx([8 + 0.6 + 0.6] * 5)
    tcss = simulate_run("tcss", 5, 8, c, 1)
    assert tcss.steady_step_s == pytest.approx(8.0)  # the generator never waits
    assert tcss.step_end_s[0] == pytest.approx(gap.step_end_s[0])


def test_trace_has_the_runtime_shape():
    c = _costs(gen=(1.0, 2.0), update_s=0.1, publish_s=0.1, transfer_s=0.2)
    result = simulate_step("tag", 6, c, 2, "always", stages_per_replica=2)
    for e in _spans(result):
        assert e["cat"] in CATEGORIES and e["dur"] >= 0 and e["args"]["step"] == 0
        assert 0 <= e["pid"] < 2 * 2 + 2
        if e["cat"] in ("generate", "train", "comm"):
            assert e["args"]["fragment"] is not None
        if e["cat"] == "comm":
            assert e["tid"] == "comm"
    roles = {e["pid"]: e["args"]["name"] for e in result.events if e["name"] == "process_name"}
    assert [roles[r].split("(")[1][:-1] for r in range(6)] == ["generator"] * 4 + ["trainer"] * 2
    # a 2-stage replica draws each fragment on both of its ranks
    gen0 = sorted((e["ts"], e["args"]["fragment"]) for e in _spans(result, "generate") if e["pid"] == 0)
    gen1 = sorted((e["ts"], e["args"]["fragment"]) for e in _spans(result, "generate") if e["pid"] == 1)
    assert gen0 == gen1 and gen0
    json.dumps(result.events)


# ----- fragment accounting -------------------------------------------------------------------------
def _check_accounting(result, num_steps, num_fragments, costs, num_trainers, stages=1):
    gens = _spans(result, "generate")
    trains = _spans(result, "train")
    for k in range(num_steps):
        generated = [e["args"]["fragment"] for e in gens if e["args"]["step"] == k]
        ids = sorted(set(generated))
        assert all(result.generated_by[k][f] >= 0 for f in ids)
        for f in ids:  # generated exactly once (a replica's span on each of its stages)
            n = generated.count(f)
            assert n == (stages if result.generated_by[k][f] < costs.num_replicas * stages else 1), (k, f, n)
        shares = [(e["args"]["fragment"], e["pid"]) for e in trains if e["args"]["step"] == k]
        assert len(shares) == len(set(shares)), "a trainer trained a share twice"
        assert sorted({f for f, _ in shares}) == ids, "a generated fragment was not trained, or the reverse"
        work = sum(e["dur"] for e in trains if e["args"]["step"] == k) / 1e6
        assert work == pytest.approx(num_fragments * costs.train_fragment_s * num_trainers)
        assert len([e for e in _spans(result, "optimizer") if e["args"]["step"] == k]) == (
            costs.num_replicas if result.events[0]["args"]["name"].endswith("(colocated)") else num_trainers)


@pytest.mark.parametrize("mode,policy", [("colocated", None), ("disagg", None), ("gap", None), ("tag", "never"),
                                         ("tag", "always"), ("tag", "bts"), ("tcss", None), ("tcss", "bts")])
@pytest.mark.parametrize("chunks", [None, 1, 3])
@pytest.mark.parametrize("wave", [1, 2])
def test_every_fragment_is_generated_and_trained_exactly_once(mode, policy, chunks, wave):
    c = _costs(gen=(1.0, 2.5), train=0.3, trainer_gen=1.5, update_s=0.2, publish_s=0.1, transfer_s=0.05,
               chunks_per_fragment=chunks, trainer_tail_s=0.15)
    stages = 1 if mode == "colocated" else 2
    result = simulate_run(mode, 3, 7, c, 2, policy, stages_per_replica=stages, wave=wave)
    _check_accounting(result, 3, 7, c, 2, stages)
    assert len(result.step_end_s) == 3 and result.step_end_s == sorted(result.step_end_s)
    if policy in ("always",):
        assert result.fragments_by_trainers > 0


# ----- ordering of the modes -----------------------------------------------------------------------
def _random_costs(rng, num_replicas):
    return Costs([rng.uniform(0.2, 3.0) for _ in range(num_replicas)], rng.uniform(0.2, 3.0), rng.uniform(0.0, 1.5),
                 transfer_s=rng.uniform(0, 0.3), update_s=rng.uniform(0, 0.5), publish_s=rng.uniform(0, 0.5),
                 chunks_per_fragment=rng.choice([None, 1, 2, 4]))


def test_streaming_is_never_slower_than_naive():
    """With every trainer taking the same share of every fragment (TSP, or chunks that spread evenly),
    streaming only lands work earlier. Uneven chunk placement is left out: naive and streaming place
    chunks on different trainers, so either can be luckier."""
    rng = random.Random(0)
    for _ in range(200):
        num_replicas, num_trainers = rng.randint(1, 4), rng.randint(1, 4)
        c = _random_costs(rng, num_replicas)
        c.chunks_per_fragment = rng.choice([None, num_trainers, 2 * num_trainers])
        num_fragments = rng.randint(1, 12)
        naive = simulate_step("disagg", num_fragments, c, num_trainers).makespan_s
        gap = simulate_step("gap", num_fragments, c, num_trainers).makespan_s
        assert gap <= naive + 1e-9, (c, num_fragments, num_trainers, gap, naive)


def test_tcss_steady_state_is_never_slower_than_gap():
    rng = random.Random(1)
    for _ in range(60):
        num_replicas, num_trainers = rng.randint(1, 3), rng.randint(1, 3)
        c = _random_costs(rng, num_replicas)
        num_fragments = rng.randint(1, 8)
        gap = simulate_run("gap", 4, num_fragments, c, num_trainers)
        tcss = simulate_run("tcss", 4, num_fragments, c, num_trainers)
        assert tcss.steady_step_s <= gap.steady_step_s + 1e-9, (c, num_fragments, num_trainers)
        assert tcss.makespan_s <= gap.makespan_s + 1e-9


def test_balanced_colocated_step_has_no_bubble():
    for chunks in (None, 1):
        c = _costs(gen=(1.0, 1.0), train=0.5, update_s=0.2, chunks_per_fragment=chunks)
        result = simulate_step("colocated", 4, c, 2)
        assert result.bubble_fraction == pytest.approx(0.0, abs=1e-12)
        assert result.makespan_s == pytest.approx(2 + 4 * 0.5 * 2 / 2 + 0.2)
    unbalanced = simulate_step("colocated", 4, _costs(gen=(1.0, 2.0), train=0.5), 2)
    assert unbalanced.bubble_fraction > 0.1
    assert simulate_step("disagg", 4, _costs(), 1).bubble_fraction > 0.3  # naive disagg idles both sides


def test_tag_with_a_slow_replica_shortens_the_step():
    c = _costs(gen=(1.0, 3.0), trainer_gen=1.0, train=0.2, update_s=0.1, publish_s=0.1)
    off = simulate_step("gap", 16, c, 2).makespan_s
    dynamic_only = simulate_step("tag", 16, c, 2, "never").makespan_s
    with_bts = simulate_step("tag", 16, c, 2, "bts")
    greedy = simulate_step("tag", 16, c, 2, "always").makespan_s
    assert with_bts.fragments_by_trainers > 0
    assert with_bts.makespan_s < dynamic_only < off
    assert with_bts.makespan_s <= greedy + 1e-9
    assert with_bts.bubble_fraction < simulate_step("gap", 16, c, 2).bubble_fraction


# ----- BTS ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_replicas,num_trainers,chunks", [(1, 1, None), (2, 1, None), (2, 2, None),
                                                              (3, 2, None), (2, 2, 2), (4, 3, 3), (3, 3, 6)])
def test_bts_never_claims_when_the_trainers_are_the_bottleneck(num_replicas, num_trainers, chunks):
    """Training per fragment >= generation per fragment / replicas, trainers no faster at generating
    than replicas, and training spread evenly over the trainers (TSP, or a chunk count that is a
    multiple of the trainers): no claim can shorten the step, so BTS never claims."""
    gen = 1.0
    for ratio, trainer_ratio, transfer in itertools.product((1.0, 1.5, 3.0), (1.0, 2.0), (0.0, 0.2)):
        c = Costs([gen] * num_replicas, gen * trainer_ratio, ratio * gen / num_replicas, transfer_s=transfer,
                  update_s=0.2, publish_s=0.1, chunks_per_fragment=chunks)
        result = simulate_step("tag", 12, c, num_trainers, "bts")
        assert result.decisions, "the trainers had idle windows and were asked"
        assert result.fragments_by_trainers == 0, (c, [d for d in result.decisions if d["claim"]])


def test_bts_fills_trainers_that_uneven_chunks_leave_idle():
    """Without TSP, 1 chunk per fragment over 3 trainers leaves two of them idle on each fragment:
    the group is not the bottleneck even though its nominal rate says so, and BTS uses the gap."""
    c = Costs([1.0, 1.0], 1.0, 0.5, update_s=0.2, publish_s=0.1, chunks_per_fragment=1)
    result = simulate_step("tag", 12, c, 3, "bts")
    assert result.fragments_by_trainers > 0
    assert result.makespan_s < simulate_step("tag", 12, c, 3, "never").makespan_s


@pytest.mark.parametrize("num_replicas,num_trainers,num_fragments,train,trainer_gen", [
    (1, 1, 12, 0.1, 1.0), (1, 2, 24, 0.3, 2.0), (2, 1, 24, 0.3, 1.0), (2, 2, 12, 0.1, 2.0), (3, 2, 24, 0.3, 2.0),
])
def test_bts_claims_more_as_the_generators_slow_down(num_replicas, num_trainers, num_fragments, train, trainer_gen):
    claims = []
    for slowdown in (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 10.0):
        c = Costs([slowdown] * num_replicas, trainer_gen, train, transfer_s=0.05, update_s=0.1, publish_s=0.1)
        result = simulate_step("tag", num_fragments, c, num_trainers, "bts")
        claims.append(result.fragments_by_trainers)
        assert result.makespan_s <= simulate_step("tag", num_fragments, c, num_trainers, "never").makespan_s + 1e-9
    assert claims == sorted(claims) and claims[0] < claims[-1], claims


def test_bts_with_one_slow_replica_among_several():
    """Slowing one replica of several: BTS claims and beats no TAG at every slowdown. The claim
    count is not monotone here, and should not be: once the slow replica's fragment in progress
    sets the step's end, no claim can move it and BTS saves them (a 6x replica that starts a
    fragment at t=0 ends it at 6 whatever the trainers do)."""
    for slowdown in (1.5, 2.0, 3.0, 4.0, 6.0, 10.0):
        c = Costs([slowdown, 1.0], 1.0, 0.3, transfer_s=0.05, update_s=0.1, publish_s=0.1)
        with_bts = simulate_step("tag", 24, c, 2, "bts")
        never = simulate_step("tag", 24, c, 2, "never")
        assert with_bts.fragments_by_trainers > 0
        assert with_bts.makespan_s < never.makespan_s < simulate_step("gap", 24, c, 2).makespan_s
        assert with_bts.makespan_s <= simulate_step("tag", 24, c, 2, "always").makespan_s + 1e-9


def test_bts_prediction_is_the_simulated_makespan():
    rng = random.Random(2)
    checked = 0
    for _ in range(40):
        num_replicas, num_trainers = rng.randint(1, 3), rng.randint(1, 3)
        c = _random_costs(rng, num_replicas)
        result = simulate_step("tag", rng.randint(2, 12), c, num_trainers, "bts")
        if not result.decisions:
            continue
        # no trainer claims after the last decision: its prediction of the branch it took is exact
        last = result.decisions[-1]
        taken = last["predicted_with_s"] if last["claim"] else last["predicted_without_s"]
        assert taken == pytest.approx(result.makespan_s, rel=1e-9, abs=1e-9), (c, result.decisions)
        # the first window's no-claim prediction is the run without any trainer claim
        first = result.decisions[0]
        never = simulate_step("tag", len(result.generated_by[0]), c, num_trainers, "never").makespan_s
        assert first["predicted_without_s"] == pytest.approx(never, rel=1e-9, abs=1e-9)
        checked += 1
    assert checked > 20


@pytest.mark.parametrize("claim_at", [0, 1, 3])
def test_predict_makespan_continues_the_simulator_from_a_snapshot(claim_at):
    """A policy that claims at exactly one idle window: the prediction made there, with one claim
    now and none later, is the makespan of the whole simulated step."""
    rng = random.Random(3 + claim_at)
    for _ in range(30):
        num_replicas, num_trainers = rng.randint(1, 3), rng.randint(1, 3)
        c = _random_costs(rng, num_replicas)
        seen, predicted = [], []

        def policy(state, costs, m):
            seen.append(state)
            if len(seen) - 1 == claim_at:
                predicted.append(predict_makespan(state, costs, m, 1))
                return True
            return False

        result = simulate_step("tag", 10, c, num_trainers, policy)
        if predicted:
            assert result.fragments_by_trainers == 1
            assert predicted[0] == pytest.approx(result.makespan_s, rel=1e-9, abs=1e-9)


def test_predict_makespan_by_hand():
    # t=1: the replica (1 s/fragment) generates fragment 1 until 2, fragments 2 and 3 are unclaimed,
    # the trainer has trained fragment 0 and is idle
    c = _costs(train=0.5, trainer_gen=1.0, update_s=0.1, publish_s=0.1)
    state = StepState(1.0, [2, 3], [2.0], {1: 2.0}, [1.0], [0.0], 0)
    # no claim: the replica makes 2 (2 -> 3) and 3 (3 -> 4); the last share ends at 4.5
    assert predict_makespan(state, c, 1, 0) == pytest.approx(4.5 + 0.2)
    # the trainer makes 2 now (1 -> 2), trains 1 and 2 (2 -> 3); the replica makes 3 (2 -> 3)
    assert predict_makespan(state, c, 1, 1) == pytest.approx(3.5 + 0.2)
    d = bts.decide(state, c, 1)
    assert d.claim and d.predicted_s == pytest.approx(3.7) and d.predicted_without_s == pytest.approx(4.7)
    # a backlog delays a claim until it is trained: fragment 0 (0.5 s) first, then 2 (1.5 -> 2.5)
    busy = StepState(1.0, [2, 3], [2.0], {1: 2.0}, [1.0], [0.5], 0)
    assert predict_makespan(busy, c, 1, 0) == pytest.approx(4.5 + 0.2)
    assert predict_makespan(busy, c, 1, 1) == pytest.approx(4.0 + 0.2)
    assert not bts.decide(StepState(1.0, [], [2.0], {1: 2.0}, [1.0], [0.0], 0), c, 1).claim


def test_bts_margin_blocks_negligible_gains():
    c = _costs(train=0.5, trainer_gen=1.0, update_s=0.1, publish_s=0.1)
    state = StepState(1.0, [2, 3], [2.0], {1: 2.0}, [1.0], [0.0], 0)
    assert bts.decide(state, c, 1).claim
    assert not bts.decide(state, c, 1, margin=0.5).claim  # a 1 s gain, of 3.7 s left without the claim


def test_lockstep_group_claims_for_every_trainer_and_pays_for_the_round():
    """An FSDP trainer group (claims_per_window = M) claims up to one fragment per trainer at a
    shared idle window; a trainer without a claim is held for the round too (its throw-away
    forwards), which the model of trainers on their own does not charge."""
    # a replica of 2 s per fragment and two idle trainers (1 s per fragment) at the step's start
    c = _costs(gen=(2.0,), train=0.5, trainer_gen=1.0)
    state = StepState(0.0, [0, 1, 2], [0.0], {}, [0.0, 0.0], [0.0, 0.0], 0)
    # no claim: the replica makes 0, 1, 2 (until 6), the last shares end at 6.5
    assert predict_makespan(state, c, 2, 0, lockstep=True) == pytest.approx(6.5)
    # both trainers make 0 and 1 (0 -> 1) while the replica makes 2 (0 -> 2): trained by 2.5
    assert predict_makespan(state, c, 2, 2, lockstep=True) == pytest.approx(2.5)
    # one claim now and one later: on its own, trainer 1 claims at once (2.5); in lockstep it is
    # held until 1, both train 0 (1 -> 1.5), then trainer 0 makes 2 (1.5 -> 2.5) and trains last
    assert predict_makespan(state, c, 2, 1, later_claims=1) == pytest.approx(2.5)
    assert predict_makespan(state, c, 2, 1, later_claims=1, lockstep=True) == pytest.approx(3.5)
    alone, group = bts.decide(state, c, 2), bts.decide(state, c, 2, claims_per_window=2)
    assert alone.claim and alone.claims_now == 1
    assert group.claim and group.claims_now == 2 and group.predicted_s == pytest.approx(2.5)
    assert group.predicted_without_s == pytest.approx(6.5)
    # trainers that are the bottleneck claim nothing, together or on their own
    slow = _costs(gen=(1.0,), train=3.0, trainer_gen=4.0)
    busy = StepState(0.0, [1, 2, 3], [1.0], {0: 1.0}, [0.0, 0.0], [0.0, 0.0], 0)
    for per_window in (1, 2):
        d = bts.decide(busy, slow, 2, claims_per_window=per_window)
        assert not d.claim and d.claims_now == 0
    with pytest.raises(ValueError, match="claims_per_window"):
        bts.decide(state, c, 2, claims_per_window=0)


# ----- the cost tracker --------------------------------------------------------------------------
def test_cost_tracker_learns_and_round_trips_through_json():
    tracker = bts.CostTracker(2, alpha=0.5, trainer_ratio=2.0)
    assert not tracker.ready
    with pytest.raises(ValueError, match="replica generation"):
        tracker.costs()
    tracker.observe_replica_fragment(0, 1.0)
    tracker.observe_replica_fragment(0, 3.0)  # EMA: 1 + 0.5 * (3 - 1)
    with pytest.raises(ValueError, match="training"):
        tracker.costs()
    tracker.observe_train_fragment(0.4)
    c = tracker.costs()
    assert c.replica_fragment_s == [2.0, 2.0]  # the unmeasured replica is assumed average
    assert c.trainer_fragment_s == pytest.approx(4.0)  # mean x trainer_ratio until measured
    assert (c.transfer_s, c.update_s, c.publish_s, c.chunks_per_fragment) == (0.0, 0.0, 0.0, None)
    tracker.observe_replica_fragment(1, 6.0)
    tracker.observe_trainer_fragment(1.5)
    tracker.observe_update(0.2)
    tracker.observe_publish(0.3)
    tracker.observe_transfer(0.05)
    again = bts.CostTracker.from_dict(json.loads(json.dumps(tracker.to_dict())))
    assert again.costs(chunks_per_fragment=2) == Costs([2.0, 6.0], 1.5, 0.4, 0.05, 0.2, 0.3, 2)
    assert Costs.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_bad_inputs_are_value_errors():
    with pytest.raises(ValueError, match="unknown mode"):
        simulate_step("pipeline", 4, _costs(), 1)
    with pytest.raises(ValueError, match="tag policy"):
        simulate_step("gap", 4, _costs(), 1, "always")
    with pytest.raises(ValueError, match="unknown tag policy"):
        simulate_step("tag", 4, _costs(), 1, "sometimes")
    with pytest.raises(ValueError, match="replica_fragment_s"):
        Costs([], 1.0, 1.0)
    with pytest.raises(ValueError, match="update_s"):
        Costs([1.0], 1.0, 1.0, update_s=-1)
    with pytest.raises(ValueError):
        bts.CostTracker(0)
    assert set(MODES) == {"colocated", "disagg", "gap", "tag", "tcss"}


def test_plan_speeds_balance_the_static_plan():
    c = _costs(gen=(1.0, 3.0), train=0.1)
    equal = simulate_step("gap", 8, c, 1)
    by_speed = simulate_step("gap", 8, c, 1, plan_speeds=[3.0, 1.0])
    assert [row.count(0) for row in equal.generated_by] == [4]
    assert [row.count(0) for row in by_speed.generated_by] == [6]
    assert by_speed.makespan_s < equal.makespan_s
    with pytest.raises(ValueError, match="plan_speeds"):
        simulate_step("gap", 8, c, 1, plan_speeds=[1.0])


# ----- TCSS: a claim judged by the end of the next step ---------------------------------------------
def test_tcss_bts_looks_at_the_next_step_and_shortens_the_steady_step():
    """Under TCSS the generator runs a version ahead: a fragment a trainer takes over frees it for
    the next step, which the end of this step alone does not show. Judged by the next step's end,
    BTS claims more and the steady step is shorter than with the one-step judgement (and than
    on-policy TAG); the trainers' own end of this step is what the one-step judgement sees."""
    c = _costs(gen=(1.0,), train=0.3, trainer_gen=1.0, update_s=0.01, publish_s=0.01)
    one_step = simulate_run("tcss", 8, 4, c, 1, lambda s, cc, m: bts.decide(s, cc, m))
    two_step = simulate_run("tcss", 8, 4, c, 1, "bts")  # the policy the runtime runs under TCSS
    never = simulate_run("tcss", 8, 4, c, 1)
    on_policy = simulate_run("tag", 8, 4, c, 1, "bts")
    assert never.steady_step_s == pytest.approx(4.0)  # the generator alone bounds the step
    assert two_step.fragments_by_trainers > one_step.fragments_by_trainers
    assert two_step.steady_step_s < 0.95 * one_step.steady_step_s
    assert two_step.steady_step_s < on_policy.steady_step_s < never.steady_step_s


def test_next_step_prediction_by_hand():
    """From the start of a step of 2 fragments (1 replica of 1 s per fragment, 1 trainer of 0.5 s
    per fragment, nothing else): without claims the replica generates this step's fragments by 2 s
    and the next step's by 4 s; the trainer trains the next step's last fragment at 4 - 4.5 s. With
    one claim now, the trainer generates fragment 1 while the replica generates fragment 0 (0-1);
    the replica, done with this step, starts the next one at once (its version: staleness 1)."""
    c = _costs(gen=(1.0,), train=0.5, trainer_gen=1.0)
    state = StepState(0.0, [0, 1], [0.0], {}, [0.0], [0.0], num_fragments=2)
    assert predict_makespan(state, c, 1, 0, next_claims=0) == pytest.approx(4.5)
    # the trainer trains 0 and 1 (1-2); next step: the replica generated fragment 0 at 1-2 and,
    # free at 2 before the trainer's idle window, claims fragment 1 too (2-3): trained 2-2.5, 3-3.5
    assert predict_makespan(state, c, 1, 1, next_claims=1) == pytest.approx(3.5)
    assert bts.decide(state, c, 1, tcss=True).claim
    with pytest.raises(ValueError, match="num_fragments"):
        bts.decide(StepState(0.0, [0, 1], [0.0], {}, [0.0], [0.0]), c, 1, tcss=True)
