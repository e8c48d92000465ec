"""--placement auto's planner (planner/candidates.py): the placements a world size allows, and the
ranking of the probe's costs, against hand computations and the regimes the bench measures.
Pure: no process, no model."""
import dataclasses

import pytest

from config.cli import parse_config
from planner.candidates import Machine, Placement, Workload, candidates, predict, rank

# 4 prompts x 4 samples in fragments of one group, micro-batch 4: one chunk per fragment
WL = Workload(prompts_per_step=4, group_size=4, micro_batch=4, num_prompts=64, seed=0, fragment_groups=1,
              sample_steps=8, trained_per_sample=8, sample_bytes=1e4, version_bytes=1e5, grad_bytes=4e5,
              weight_bytes=7e6, tsp=True, train_micro_batch=16, blocks=4, units=8)
FAST_LINK = dict(link_bytes_s=1e9, latency_s=1e-4)


def _best(machine, stale=False, world=2):
    return rank(candidates(world, machine, allow_stale=stale, blocks=4), WL, machine)[0].placement


def test_the_candidates_of_a_world():
    """Colocated (replicated, FSDP2; by speed only when the ranks differ), then every split with
    TAG on and off, GAP stages where the generators divide, FSDP2 trainers where there are several;
    TCSS only when staleness is allowed."""
    labels = [p.label() for p in candidates(2)]
    assert labels == ["colocated", "colocated FSDP2", "1 generator + 1 trainer", "1 generator + 1 trainer, TAG"]
    assert [p.label() for p in candidates(1)] == ["colocated"]
    three = candidates(3, blocks=4)
    assert Placement("disagg", 2, 1, 2, tag=True) in three and Placement("disagg", 1, 2, 1, "fsdp") in three
    assert not any(p.tcss for p in three) and not any(p.gap_stages > 1 and p.generators == 1 for p in three)
    stale = candidates(3, blocks=4, allow_stale=True)
    assert len(stale) == 2 + 2 * (len(three) - 2) and sum(p.tcss for p in stale) == len(three) - 2
    uneven = Machine([0.2, 0.1], [0.01, 0.01], **FAST_LINK)
    assert Placement("colocated", fragment_split="speed") in candidates(2, uneven)
    assert candidates(2, blocks=1) == candidates(2, blocks=4)  # 1 generator: one stage only
    assert Placement("colocated").flags() == ["--mode", "colocated", "--colocated-sharding", "replicate"]
    assert Placement("disagg", 1, 2, 1, "fsdp", tag=True).flags() == [
        "--mode", "disagg", "--generators", "1", "--trainers", "2", "--gap-stages", "1", "--train-sharding", "fsdp",
        "--tag"]


def test_colocated_step_by_hand():
    """Two equal ranks, 4 fragments of one chunk: each generates 2 (2 x 0.1 s), then the packed
    transitions move (16 samples x 1e4 bytes, half of them, over 1e9 B/s, plus the latency) and
    each trains half of 4 x 32 transitions at 0.001 s, then the LoRA gradient all-reduce."""
    m = Machine([0.1, 0.1], [0.001, 0.001], **FAST_LINK)
    exchange = 16 * 1e4 * 0.5 / 1e9 + 1e-4
    allreduce = 2 * 4e5 * 0.5 / 1e9 + 1e-4
    assert predict(Placement("colocated"), WL, m).step_s == pytest.approx(0.2 + 4 * 16 * 0.001 + allreduce + exchange)


def test_colocated_split_by_speed_by_hand():
    """Rank 0 2x slower at everything, 4 fragments: by speed it generates 1 (0.3 s) while rank 1
    generates 3 (0.45 s); then each fragment's 32 transitions train in shares by speed (rank 0 a
    third, rank 1 two thirds: 0.064 s each at once), not in halves at the slow rank's pace."""
    m = Machine([0.3, 0.15], [0.006, 0.003], **FAST_LINK)
    exchange = 16 * 1e4 * 0.5 / 1e9 + 1e-4
    allreduce = 2 * 4e5 * 0.5 / 1e9 + 1e-4
    by_speed = predict(Placement("colocated", fragment_split="speed"), WL, m)
    assert by_speed.shares == (4, 12)
    assert by_speed.step_s == pytest.approx(0.45 + 4 * 32 / 3 * 0.006 + allreduce + exchange)
    even = predict(Placement("colocated"), WL, m)
    assert even.step_s == pytest.approx(2 * 0.3 + 4 * 16 * 0.006 + allreduce + exchange)


def test_streaming_step_by_hand():
    """1 generator + 1 trainer, GAP streaming: 4 fragments of 0.1 s back to back; each lands after
    its transfer; the last trains (32 transitions at 0.001 s) and the version goes to the
    generator (1e5 bytes). The steady step: generation, then the last fragment's tail."""
    m = Machine([0.1, 0.1], [0.001, 0.001], **FAST_LINK)
    transfer = 4 * 1e4 / 1e9 + 1e-4
    publish = 1e5 / 1e9 + 1e-4
    step = predict(Placement("disagg", 1, 1), WL, m).step_s
    assert step == pytest.approx(4 * 0.1 + transfer + 32 * 0.001 + publish)


def test_the_ranking_follows_the_regime():
    """Identical ranks with training half the generation: colocated. Rank 0 generating 2x slower:
    it generates and the fast rank trains and helps (TAG). Training that dwarfs generation: both
    ranks should train (colocated). TCSS only wins where it is allowed."""
    even = Machine([0.15, 0.15], [0.003, 0.003], **FAST_LINK)
    assert _best(even) == Placement("colocated")
    slow0 = Machine([0.3, 0.15], [0.006, 0.003], **FAST_LINK)
    assert _best(slow0) == Placement("disagg", 1, 1, tag=True)
    assert _best(slow0, stale=True).tcss
    heavy = Machine([0.05, 0.05], [0.02, 0.02], **FAST_LINK)
    assert _best(heavy).mode == "colocated"
    by_speed = rank(candidates(2, slow0, blocks=4), WL, slow0)
    assert Placement("colocated", fragment_split="speed") in [x.placement for x in by_speed]  # 3 fragments to rank 1
    slightly = Machine([0.12, 0.1], [0.003, 0.003], **FAST_LINK)  # 4 fragments split 2 and 2 either way: one run
    assert Placement("colocated", fragment_split="speed") in candidates(2, slightly)
    assert Placement("colocated", fragment_split="speed") not in [x.placement for x in rank(
        candidates(2, slightly), WL, slightly)]
    preds = rank(candidates(2, slow0, blocks=4), WL, slow0)
    assert [p.step_s for p in preds] == sorted(p.step_s for p in preds)
    tag = next(p for p in preds if p.placement.tag)
    assert tag.trainer_fragments >= 1  # the fast trainer generates


def test_fsdp_pays_its_gathers():
    """FSDP2 gathers every unit's weights at every forward: on a slow link it loses to replicas, on
    a free one it ties."""
    free = Machine([0.1, 0.1], [0.001, 0.001], link_bytes_s=1e15, latency_s=0.0)
    slow = Machine([0.1, 0.1], [0.001, 0.001], link_bytes_s=1e8, latency_s=1e-3)
    col, fsdp = Placement("colocated"), Placement("colocated", sharding="fsdp")
    assert predict(fsdp, WL, free).step_s == pytest.approx(predict(col, WL, free).step_s)
    assert predict(fsdp, WL, slow).step_s > 1.5 * predict(col, WL, slow).step_s


def test_a_measured_sharding_cost_replaces_the_links_price():
    """What the probe measured FSDP2 to add to a forward is what the prediction charges, whatever
    the link: measured free on a slow link, sharding saves the replicas' gradient all-reduce (its
    reduce-scatters are in what the probe measured); measured dear on a free link, every denoising
    forward of a rank's chunks pays it, and every training forward its own."""
    col, fsdp = Placement("colocated"), Placement("colocated", sharding="fsdp")
    free_on_slow = Machine([0.1, 0.1], [0.001, 0.001], link_bytes_s=1e8, latency_s=1e-3, gather_s=0.0,
                           train_gather_s=0.0)
    allreduce = 2 * WL.grad_bytes / 2 / 1e8 + 1e-3
    assert predict(fsdp, WL, free_on_slow).step_s == pytest.approx(predict(col, WL, free_on_slow).step_s - allreduce)
    dear = dict(link_bytes_s=1e15, latency_s=0.0, gather_s=0.01)
    gen_only = Machine([0.1, 0.1], [0.001, 0.001], train_gather_s=0.0, **dear)
    both = Machine([0.1, 0.1], [0.001, 0.001], train_gather_s=0.05, **dear)
    base = predict(col, WL, gen_only).step_s
    chunks = WL.prompts_per_step * WL.group_size // WL.micro_batch // 2  # each rank's chunks of the step
    assert predict(fsdp, WL, gen_only).step_s == pytest.approx(base + chunks * WL.sample_steps * 0.01, rel=1e-6)
    assert predict(fsdp, WL, both).step_s > predict(fsdp, WL, gen_only).step_s + 0.05


@pytest.mark.parametrize("flags,expected", [
    ([], "auto"), (["--mode", "colocated"], "fixed"), (["--generators", "1", "--trainers", "1"], "fixed"),
    (["--tag"], "fixed"), (["--tcss"], "fixed"), (["--train-sharding", "fsdp"], "fixed"),
    (["--tsp", "--fragment-groups", "2"], "auto"), (["--placement", "auto", "--tag"], "auto"),
    (["--placement", "fixed"], "fixed"),
])
def test_placement_is_auto_unless_a_placement_flag_is_given(flags, expected):
    cfg = parse_config(flags)
    cfg.resolve_defaults()
    assert cfg.topology.placement == expected


def test_a_placement_flag_at_its_default_still_names_a_placement():
    """`--mode disagg` (the default's value) on the command line: the run takes 1 + 1, as asked."""
    cfg = parse_config(["--mode", "disagg"])
    cfg.resolve_defaults()
    assert cfg.topology.placement == "fixed"


def test_a_forwards_fixed_cost_weighs_on_colocated_training_in_smaller_forwards():
    """A training forward of n transitions costs forward_s + n row_s. A 2-timestep window trains 8
    transitions per fragment: colocated, every rank trains its half of each of the 4 fragments in a
    forward of its own (4 fixed costs on the step's path, after generation); a 1 + 1 split trains
    each fragment in one forward as it lands, and only the last one's is on the path."""
    window = dataclasses.replace(WL, trained_per_sample=2)
    plain = Machine([0.25, 0.25], [0.011, 0.011], **FAST_LINK)
    fixed = dataclasses.replace(plain, forward_s=[0.02, 0.02])
    step = lambda p, m: predict(p, window, m).step_s  # noqa: E731
    assert step(Placement("colocated"), fixed) - step(Placement("colocated"), plain) == pytest.approx(4 * 0.02)
    split = Placement("disagg", 1, 1)
    assert step(split, fixed) - step(split, plain) == pytest.approx(0.02)


def test_a_forwards_fixed_cost_is_fitted_from_two_sizes():
    """Two probe forwards (16 and 4 transitions) fit a line; timings that fit no positive line
    (noise, or one size alone) count per transition alone."""
    from runtime.probe import forward_and_row_s
    assert forward_and_row_s(16, 0.02 + 16 * 0.011, 4, 0.02 + 4 * 0.011) == pytest.approx((0.02, 0.011))
    assert forward_and_row_s(16, 0.2, 4, 0.21) == pytest.approx((0.0, 0.2 / 16))  # the smaller slower
    assert forward_and_row_s(16, 0.2, 4, 0.04) == pytest.approx((0.0, 0.2 / 16))  # a negative fixed cost
    assert forward_and_row_s(1, 0.2, 1, None) == pytest.approx((0.0, 0.2))


def _ranked(*modes_and_steps):
    return [{"label": f"{m} {s}", "predicted_step_s": s, "placement": {"mode": m}} for m, s in modes_and_steps]


def test_the_trials_are_the_placements_predicted_near_the_best():
    """The runner-ups within the margin first, the predicted best last; none when no other is near,
    when --placement-trials is 1, or when there is no prediction."""
    from runtime.autoplace import trial_order
    ranked = _ranked(("colocated", 1.0), ("disagg", 1.05), ("colocated", 1.08), ("disagg", 1.5))
    assert trial_order(ranked, 2, 0.1) == [1, 0]
    assert trial_order(ranked, 3, 0.1) == [2, 1, 0]
    assert trial_order(ranked, 4, 0.1) == [2, 1, 0]  # the fourth is predicted 50% slower
    assert trial_order(ranked, 3, 0.01) == []
    assert trial_order(ranked, 1, 0.1) == []
    assert trial_order(_ranked(("colocated", None)), 2, 0.1) == []


def test_the_trials_take_the_other_familys_best_within_the_margin():
    """Within the margin the best placement of the other family (colocated against disaggregated)
    is tried ahead of a nearer runner-up of the best's own family; outside it, it is not."""
    from runtime.autoplace import trial_order
    ranked = _ranked(("disagg", 0.834), ("disagg", 0.876), ("colocated", 0.896), ("disagg", 0.9))
    assert trial_order(ranked, 2, 0.1) == [2, 0]
    assert trial_order(ranked, 3, 0.1) == [2, 1, 0]
    assert trial_order(ranked, 2, 0.06) == [1, 0]  # colocated predicted 7.4% slower: outside the margin
    assert trial_order(_ranked(("colocated", 1.0), ("colocated", 1.02), ("disagg", 1.05)), 2, 0.1) == [2, 0]
    # where ranks share cores a colocated placement runs as predicted or slower: not promoted
    assert trial_order(ranked, 2, 0.1, families=True) == [1, 0]


def test_ranks_sharing_cores_try_the_best_of_the_other_family():
    """Where ranks time-share a CPU's cores (which the simulator does not model), the best
    disaggregated placement is tried against a colocated best however far its prediction, ahead of
    nearer colocated runner-ups, and last (there a split runs faster than predicted: tried last, it
    is kept without a switch back). Against a disaggregated best, a colocated placement (which runs
    as predicted or slower there) is tried only within the margin, as any runner-up."""
    from runtime.autoplace import trial_order
    ranked = _ranked(("colocated", 1.74), ("colocated", 1.8), ("disagg", 2.22), ("disagg", 2.5))
    assert trial_order(ranked, 2, 0.1) == [1, 0]
    assert trial_order(ranked, 2, 0.1, families=True) == [0, 2]
    assert trial_order(ranked, 3, 0.1, families=True) == [1, 0, 2]
    flipped = _ranked(("disagg", 1.0), ("disagg", 1.02), ("colocated", 3.0))
    assert trial_order(flipped, 2, 0.1, families=True) == [1, 0]
    assert trial_order(flipped, 3, 0.1, families=True) == [1, 0]
    near = _ranked(("disagg", 1.0), ("colocated", 1.05), ("disagg", 1.5))
    assert trial_order(near, 2, 0.1, families=True) == [1, 0]
    assert trial_order(_ranked(("colocated", 1.0), ("colocated", 2.0)), 2, 0.1, families=True) == []


def test_the_run_keeps_the_fastest_trial_unless_a_switch_costs_more_than_it_saves():
    """After the trials: the placement of the fastest median step, where its gain over the steps
    left pays for a switch (the mean of the run's switches' measured costs); otherwise the one
    running (tried last)."""
    from runtime.autoplace import decide
    measured = {1: [0.9, 3.0, 0.95], 0: [1.1, 1.0]}  # one disturbed step does not move a median
    keep, why = decide(measured, 0, 10, [0.4, 0.6])
    assert keep == 1 and why["fastest"] == 1 and why["remaining_steps"] == 10
    assert why["gain_s"] == pytest.approx((1.05 - 0.95) * 10) and why["switch_s"] == pytest.approx(0.5)
    keep, why = decide(measured, 0, 4, [0.4, 0.6])  # saves 0.4 s, a switch costs 0.5 s
    assert keep == 0 and why["fastest"] == 1 and why["gain_s"] == pytest.approx(0.4)
    assert decide(measured, 1, 1, [5.0])[0] == 1  # the fastest is already running
    assert decide({0: [1.2], 1: [1.0]}, 0, 1, [])[0] == 1  # no switch measured yet: nothing to pay


def test_shared_cores_are_found_on_a_cpu_only(monkeypatch):
    import torch
    from runtime import autoplace
    monkeypatch.setattr(autoplace.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(autoplace.torch, "get_num_threads", lambda: 1)
    assert autoplace.shared_cores(torch.device("cpu"), 2) is None
    assert autoplace.shared_cores(torch.device("cpu"), 3) == "3 ranks of 1 thread time-share 2 cores"
    assert autoplace.shared_cores(torch.device("cuda", 0), 3) is None
    monkeypatch.setattr(autoplace.torch, "get_num_threads", lambda: 2)
    assert autoplace.shared_cores(torch.device("cpu"), 2) == "2 ranks of 2 threads time-share 2 cores"
