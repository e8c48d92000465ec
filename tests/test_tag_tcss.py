"""TAG with BTS and TCSS through torchrun: placement invariance, fragment accounting, staleness; and
the pure pieces of TAG."""
import json
from types import SimpleNamespace

import pytest

from lab.launch import TINY, torchrun, torchrun_module, trained_weights
from traced import ALL_GATHER, assert_nccl_ok, merged, traced
from weights import assert_same_weights
from telemetry.metrics import read_metrics
from parallel.stepplan import plan_step
from parallel.trainer_intake import TrainingSpec, make_intake
from rl import algorithms
from parallel.tag import Assistant, group_windows

ARGS = [a if a != "2" or TINY[i - 1] != "--prompts-per-step" else "4" for i, a in enumerate(TINY)]
ARGS += ["--lora-rank", "4", "--fragment-groups", "1"]  # 4 fragments of one group each




def test_group_windows_are_the_slots_where_fragments_are_first_needed():
    """An FSDP group waits (and may generate) only before a slot where some trainer first takes a
    piece of a fragment; trainers of different forward counts still share every window."""
    assert group_windows([[(0, 0), (2, 2)], [(0, 1), (2, 3)]]) == [(0, (0, 1)), (2, (2, 3))]
    assert group_windows([[(0, 0), (1, 2)], [(0, 0), (1, 1), (3, 3)]]) == [(0, (0,)), (1, (1, 2)), (3, (3,))]
    assert group_windows([[], [(0, 0)]]) == [(0, (0,))]


@pytest.mark.parametrize("tsp", [False, True])
def test_receive_slots_with_one_update_are_the_first_forwards(tsp):
    """With one update per rollout a trainer takes each piece just before its first forward, the
    windows of the forward lists the group used to wait at."""
    plan = plan_step(0, seed=0, num_prompts=8, prompts_per_step=4, group_size=2, micro_batch=2, num_replicas=2,
                     num_trainers=2, fragment_groups=1)
    intake = make_intake(tsp, TrainingSpec(algorithms.algorithm("flow_grpo"), 4, 0.99, 0, None), (0, 1),
                         lambda r: r, micro_batch=4, me=0)
    for r, slots in enumerate(intake.receive_slots(plan)):
        fragments = intake.forward_fragments(plan)[r]
        assert slots == [(fragments.index(f), f) for f in dict.fromkeys(fragments)]


def test_training_seconds_are_observed_in_the_simulators_unit():
    """BTS's cost model counts a fragment's training as the group's wall time with every trainer
    taking an equal share (Costs.train_fragment_s). Without TSP a trainer trains whole chunks."""
    # one fragment of 3 chunks of 2 samples: trainer 0 trains chunks 0 and 2, trainer 1 chunk 1
    plan = plan_step(0, seed=0, num_prompts=8, prompts_per_step=3, group_size=2, micro_batch=2, num_replicas=1,
                     num_trainers=2, fragment_groups=3)
    assert [c.trainer for c in plan.fragments[0].chunks] == [0, 1, 0]
    spec = TrainingSpec(algorithms.algorithm("flow_grpo"), 4, 0.99, 0, None)
    for tsp, expected in ((False, 1.2 / 2 * 3 / 2), (True, 1.2)):
        ctx = SimpleNamespace(topo=SimpleNamespace(num_replicas=1))
        helper = Assistant(ctx, None, None, 2, 0)
        helper.plan, helper.intake = plan, make_intake(tsp, spec, (0, 1), lambda r: 0, micro_batch=2, me=0)
        helper.observe_training({0: 1.2})  # trainer 0's seconds on its share of fragment 0
        # per trained transition: 6 samples x 3 trained timesteps of 4 (a window may change the count)
        assert helper.intake.fragment_transitions(plan, 0) == 18
        assert helper.tracker.values["train_fragment_s"] == pytest.approx(expected / 18)


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    """The reference: the colocated run of ARGS, with the weights of every step saved."""
    out = tmp_path_factory.mktemp("colocated")
    torchrun(2, [*ARGS, "--steps", "3", "--mode", "colocated", "--save-every", "1", "--output-dir", str(out)])
    return out


def _spans(run, ranks, names):
    """(step, fragment) of every span named in `names`, per rank of `ranks`."""
    out = {}
    for r in ranks:
        events = json.loads((run / "trace" / f"rank{r}.json").read_text())["traceEvents"]
        out[r] = [(e["args"]["step"], e["args"]["fragment"]) for e in events if e.get("name") in names]
    return out


def _check_tag_run(run, reference, steps, generators, trainers):
    """A TAG run trained exactly the colocated data: the same weights after `steps` steps, the same
    transitions and rewards every step, trainers did generate, and every fragment of every step
    was generated exactly once (by a replica or by one trainer) and trained."""
    assert_same_weights(trained_weights(str(reference), steps), trained_weights(str(run), steps), run.name)
    rows = [r for r in read_metrics(str(run / "metrics.jsonl")) if "train/loss" in r]
    col = [r for r in read_metrics(str(reference / "metrics.jsonl")) if "train/loss" in r][:steps]
    assert len(rows) == steps
    for r, c in zip(rows, col):
        assert r["train/num_transitions"] == c["train/num_transitions"]  # nothing lost, nothing twice
        assert r["reward/mean"] == pytest.approx(c["reward/mean"], rel=1e-6)
    by_trainers = [x for spans in _spans(run, trainers, {"tag_generate"}).values() for x in spans]
    bts = [{k: v for k, v in r.items() if k.startswith(("bts/", "tag/"))} for r in rows]
    assert len(by_trainers) == sum(r["tag/fragments"] for r in rows) > 0, bts  # the trainers did generate
    assert len(by_trainers) == len(set(by_trainers))  # none twice, by one trainer or by two
    # a replica's fragments: its "generate" spans, or with GAP stages the micro-batch actions "F"
    by_replicas = {x for spans in _spans(run, generators, {"generate", "F"}).values() for x in spans}
    assert not by_replicas & set(by_trainers)
    everything = [(s, f) for s in range(steps) for f in range(4)]
    assert sorted(by_replicas | set(by_trainers)) == everything
    trained = {x for spans in _spans(run, trainers, {"train"}).values() for x in spans}
    assert sorted(trained) == everything


def test_tag_trains_the_colocated_data(tmp_path, colocated):
    """A slowed generator makes idle trainers claim fragments; the weights stay the colocated ones
    and every fragment of every step is trained exactly once."""
    run = tmp_path / "tag"
    torchrun(3, [*ARGS, "--steps", "3", "--generators", "1", "--trainers", "2", "--tag", "--debug-slow-rank", "0:5",
                 "--output-dir", str(run)], env=traced(run))
    _check_tag_run(run, colocated, 3, [0], [1, 2])
    assert_nccl_ok(run, ["data.to", "publish"])
    _check_recorded_costs(run, logging_rank=1)


def _check_recorded_costs(run, logging_rank):
    """BTS decides with every cost measured in the run: the step log's bts/* (the logging trainer's
    costs after each step) hold transfers, the update and publication. After step 0 each is that
    step's own measurement: the update and publication agree with the trainer's trace spans."""
    rows = [r for r in read_metrics(str(run / "metrics.jsonl")) if "train/loss" in r]
    events = json.loads((run / "trace" / f"rank{logging_rank}.json").read_text())["traceEvents"]

    def span_s(name, step):
        return sum(e["dur"] for e in events if e.get("name") == name and e["args"]["step"] == step) / 1e6

    for r in rows:
        assert {"bts/transfer_s", "bts/update_s", "bts/publish_s", "bts/train_fragment_s"} <= set(r), sorted(r)
        assert 0 < r["bts/transfer_s"] < r["perf/step_s"] and 0 < r["bts/publish_s"] < r["perf/step_s"]
    first = rows[0]
    for key, name in (("bts/update_s", "optimizer"), ("bts/publish_s", "publish")):
        assert first[key] == pytest.approx(span_s(name, 0), rel=0.2, abs=2e-3), key


def test_tag_with_fsdp_trainers_trains_the_colocated_data(tmp_path, colocated):
    """FSDP2 trainers generate together, between training forwards, what their leader claims. (The
    generator is slowed 10x, not 5x: a group's shared generation costs it an all-gather per block,
    and with the suite's other processes on the same cores BTS once judged 5x not worth helping.)"""
    run = tmp_path / "tag-fsdp"
    torchrun(3, [*ARGS, "--steps", "2", "--generators", "1", "--trainers", "2", "--tag", "--train-sharding", "fsdp",
                 "--debug-slow-rank", "0:10", "--output-dir", str(run)], env=traced(run))
    _check_tag_run(run, colocated, 2, [0], [1, 2])
    assert_nccl_ok(run, ["data.to", "publish"], [f"trainers:{ALL_GATHER}"])
    rows = [r for r in read_metrics(str(run / "metrics.jsonl")) if "train/loss" in r]
    assert len({r["train/num_allgathers"] for r in rows}) == 1  # generation's gathers are not counted as training's


@pytest.mark.parametrize("placement,generators,trainers,scorers", [
    (["--generators", "2", "--trainers", "1", "--gap-stages", "2"], [0, 1], [2], []),
    (["--generators", "1", "--trainers", "1", "--scorers", "1"], [0], [1], [2]),
], ids=["gap-stages", "scorers"])
def test_tag_with_gap_stages_or_scorers_trains_the_colocated_data(tmp_path, colocated, placement, generators,
                                                                    trainers, scorers):
    """A 2-stage GAP replica claims its fragments a round at a time; with a scorer rank, the scorer
    scores what replicas generate and the trainers score their own fragments. (No checkpoint before
    the last step: a 2-stage replica claims a step's fragments in two rounds, and a trainer still
    writing the step before's checkpoint when the second round is claimed has nothing left to take;
    three steps give BTS two steps with its costs measured.)"""
    run = tmp_path / "tag"
    torchrun(3, [*ARGS, "--steps", "3", *placement, "--tag", "--debug-slow-rank", "0:5", "--save-every", "0",
                 "--output-dir", str(run)], env=traced(run))
    _check_tag_run(run, colocated, 3, generators, trainers)
    assert_nccl_ok(run, ["gap.r0.s0->s1", "gap.r0.s1->s0"] if not scorers else ["images.to", "scores.to"])
    if scorers:
        scored = {x for spans in _spans(run, scorers, {"score"}).values() for x in spans}
        assert scored == {x for spans in _spans(run, generators, {"generate"}).values() for x in spans}


def test_fsdp_helper_generation_leaves_gradients_alone():
    proc = torchrun_module(2, "tests.fsdp_helper_generation", timeout=120)
    assert proc.stdout.count("helper generation left") == 2, proc.stdout[-2000:]


@pytest.mark.parametrize("tcss,updates", [(False, 1), (True, 1), (True, 2)], ids=["on-policy", "tcss", "tcss-2-updates"])
def test_staleness_is_at_most_one_and_zero_without_tcss(tmp_path, tcss, updates):
    """TCSS: a step's transitions are 0 or 1 versions old, with several updates per rollout too (the
    generators get the version after the step's last update)."""
    out = tmp_path / "run"
    torchrun(2, [*ARGS, "--steps", "4", "--output-dir", str(out), "--updates-per-rollout", str(updates),
                 *(["--tcss"] if tcss else [])], env=traced(out))
    assert_nccl_ok(out, ["data.to", "publish"])
    if tcss and updates == 1:  # on one communicator, as before: the generator sends step k+1's fragments
        old = merged(out, ["data.to", "publish"])  # before it receives version k+1, which the trainer sends first
        assert old.deadlock and old.cycles == [[0, 1]], old.message
    rows = [r for r in read_metrics(str(out / "metrics.jsonl")) if "train/loss" in r]
    assert len(rows) == 4
    for r in rows:
        assert r["train/staleness_max"] in (0.0, 1.0)
        assert r["train/staleness_frac_0"] + r["train/staleness_frac_1"] == pytest.approx(1.0)
        assert r["train/num_updates"] == updates
        if not tcss:
            assert r["train/staleness_max"] == 0.0 and r["train/approx_kl"] == 0.0
    assert rows[0]["train/staleness_max"] == 0.0  # step 0 is generated by version 0 either way
    if tcss:
        assert any(r["train/staleness_frac_1"] > 0 for r in rows[1:])
        stale_rows = [r for r in rows if r["train/staleness_frac_1"] > 0]
        assert all(r["train/approx_kl"] > 0 for r in stale_rows)  # pi_old is the older version
