"""Heterogeneous ranks and sharded training state: the pure pieces (replica speeds, the slow-down,
the memory budget) and, through torchrun, that the bench's `hetero` and `sharded` DigenRL modes
train the weights of their colocated baselines."""
import json
import time

import pytest

from config.cli import parse_config
from config.validate import validate
from models import load_model
from planner.memory import peak
from runtime.budget import check_budget, predict
from lab.launch import TINY, torchrun, trained_weights
from traced import REDUCE_SCATTER, assert_nccl_ok, traced
from weights import assert_same_weights
from telemetry.metrics import read_metrics
from parallel.stepplan import plan_step, replica_speeds
from telemetry.tracing import Slowdown


def test_replica_speeds_ignore_noise_and_follow_real_differences():
    assert replica_speeds({0: 1.0, 1: 1.08}, [(0,), (1,)]) == [1.0, 1.0]  # noise on identical ranks
    assert replica_speeds({0: 2.0, 1: 1.0}, [(0,), (1,)]) == [0.5, 1.0]  # rank 0 twice as slow
    # A GAP replica of two stages generates at the sum of its ranks' speeds.
    assert replica_speeds({0: 1.0, 1: 1.0, 2: 1.0}, [(0, 1), (2,)]) == [1.0, 0.5]
    with pytest.raises(ValueError, match="positive"):
        replica_speeds({0: 0.0}, [(0,)])


def test_speed_weighted_plans_give_slow_replicas_fewer_fragments():
    even = plan_step(0, seed=0, num_prompts=8, prompts_per_step=6, group_size=2, micro_batch=2, num_replicas=2,
                     num_trainers=1, fragment_groups=1)
    weighted = plan_step(0, seed=0, num_prompts=8, prompts_per_step=6, group_size=2, micro_batch=2,
                         num_replicas=2, num_trainers=1, fragment_groups=1, replica_speeds=[0.5, 1.0])
    count = lambda plan, r: sum(f.replica == r for f in plan.fragments)  # noqa: E731
    assert (count(even, 0), count(even, 1)) == (3, 3)
    assert (count(weighted, 0), count(weighted, 1)) == (2, 4)
    # The data is the plan's, not the replica's: the same samples and chunks either way.
    assert [c.sample_ids for c in even.chunks] == [c.sample_ids for c in weighted.chunks]


def test_slowdown_stretches_the_wrapped_work():
    slow, plain = Slowdown(3.0), Slowdown()
    start = time.perf_counter()
    with slow():
        time.sleep(0.05)
    stretched = time.perf_counter() - start
    start = time.perf_counter()
    with plain():
        time.sleep(0.05)
    assert stretched >= 0.15 and time.perf_counter() - start < 0.1
    with pytest.raises(ValueError, match="factor must be >= 1"):
        Slowdown(0.5)


def _budgeted(*flags: str):
    """A tiny full fine-tuning run's config, facts and model (the memory model's input)."""
    cfg = parse_config(["--preset", "tiny", "--lora-rank", "0", "--prompts-per-step", "2", *flags])
    cfg.resolve_defaults()
    facts = validate(cfg, 3)
    return cfg, facts, load_model(cfg.model.model, preset="tiny", seed=0)


def test_memory_budget_refuses_a_plan_whose_predicted_peak_does_not_fit():
    """--memory-budget-gb compares every role's peak in the one memory model (planner/memory.py) with
    the budget: replicated full fine-tuning over 2 trainers is refused where FSDP2 over them fits."""
    replicated = _budgeted("--generators", "1", "--trainers", "2")
    sharded = _budgeted("--generators", "1", "--trainers", "2", "--train-sharding", "fsdp")
    peaks = {name: {role: peak(phases).total for role, phases in predict(*run).items()}
             for name, run in (("replicated", replicated), ("sharded", sharded))}
    assert peaks["sharded"]["trainer"] < peaks["replicated"]["trainer"]
    assert peaks["sharded"]["generator"] == pytest.approx(peaks["replicated"]["generator"])
    budget = (max(peaks["sharded"].values()) + peaks["replicated"]["trainer"]) / 2 / 1e9
    replicated[0].topology.memory_budget_gb = sharded[0].topology.memory_budget_gb = budget
    check_budget(*sharded)
    with pytest.raises(ValueError, match=rf"--memory-budget-gb {budget:g}: a trainer needs [0-9.]+ GB at its "
                                         r"[a-z -]+ \(.*weights fp32.*\); shard the training state"):
        check_budget(*replicated)
    replicated[0].topology.memory_budget_gb = None
    check_budget(*replicated)  # no budget, no check


ARGS = [a if a != "2" or TINY[i - 1] != "--prompts-per-step" else "4" for i, a in enumerate(TINY)]
ARGS += ["--lora-rank", "4", "--fragment-groups", "1", "--steps", "2", "--log-images-every", "0",
         "--tsp", "--train-micro-batch", "4"]


def test_hetero_modes_train_the_colocated_data(tmp_path):
    """Rank 0 is 4x slower (a large factor, so that the probe's ratio stands above timing noise on
    shared cores). Colocated with the even split (the baseline), colocated with the
    speed-weighted split, and DigenRL with the slow rank generating and the trainer assisting (TAG)
    reach the same weights; the probe saw the slow rank as slow, and the weighted split moved
    fragments off it."""
    slow = ["--debug-slow-rank", "0:4"]
    runs = {"colocated": ["--mode", "colocated"], "colocated-speed": ["--mode", "colocated", "--fragment-split", "speed"],
            "gap+tag": ["--generators", "1", "--trainers", "1", "--tag"]}
    weights = {}
    for name, placement in runs.items():
        out = tmp_path / name
        torchrun(2, [*ARGS, *slow, *placement, "--output-dir", str(out)], env=traced(out))
        assert_nccl_ok(out)
        weights[name] = trained_weights(str(out), 2)
        speeds = json.loads((out / "speeds.json").read_text())
        assert speeds[0]["generate_s"] > 2 * speeds[1]["generate_s"], speeds
        if name.startswith("colocated"):  # a generator rank runs no training probe
            assert speeds[0]["train_s"] > 2 * speeds[1]["train_s"], speeds
        else:
            assert "train_s" not in speeds[0] and "train_s" in speeds[1], speeds
    for name in runs:
        assert_same_weights(weights["colocated"], weights[name], name)
    trace = json.loads((tmp_path / "colocated-speed" / "trace" / "rank0.json").read_text())["traceEvents"]
    fragments = {e["args"]["fragment"] for e in trace if e.get("name") == "generate" and e["args"]["step"] == 1}
    assert len(fragments) < 2, fragments  # of 4 fragments, the slow rank generated at most one
    # TSP's shares follow the trainers' speeds too: the slow rank trains about a fifth (4x slower),
    # where the even split gives each rank half.
    trained = {name: [_transitions(tmp_path / name, rank, step=1) for rank in (0, 1)]
               for name in ("colocated", "colocated-speed")}
    assert abs(trained["colocated"][0] - trained["colocated"][1]) <= 4, trained  # within one per fragment
    assert sum(trained["colocated-speed"]) == sum(trained["colocated"]), trained
    assert trained["colocated-speed"][0] < 0.4 * trained["colocated-speed"][1], trained


def _transitions(run, rank: int, step: int) -> int:
    """Transitions rank `rank` trained in step `step`, from its trace."""
    events = json.loads((run / "trace" / f"rank{rank}.json").read_text())["traceEvents"]
    return sum(e["args"]["transitions"] for e in events if e.get("ph") == "X" and e.get("name") == "train"
               and e["args"]["step"] == step)


SHARDED_STEPS = 4  # --placement auto: three trials of a step each, then the one kept
# A reward continuous in the pixels: FSDP2 over 2 trainers and over 3 ranks sum the gradients in
# other orders, and the images of the next version differ in their last bits. JPEG compressibility
# counts bytes, so such a difference can move a reward by a whole byte, and a group of 2 samples
# turns it into another advantage (seen: tensors up to 7% of their scale apart after 4 steps).
SMOOTH = [a if a != "jpeg_compressibility" else "rule_aesthetic" for a in ARGS]


def test_sharded_modes_train_the_colocated_data(tmp_path):
    """Full fine-tuning under a memory budget that forbids replicated training state: colocated
    FSDP2 over 3 ranks and 1 generator + 2 FSDP2 trainers reach the same weights; replicated
    training is refused, naming the numbers (a budget between the memory model's peaks for them).
    --placement auto under that budget tries every sharded placement a step each, switching between
    FSDP2 groups inside the run (a new trainers' group of the ranks of a destroyed one among them),
    and trains the same weights."""
    full = ["--lora-rank", "0", "--prompts-per-step", "3", "--steps", str(SHARDED_STEPS)]
    runs = {"colocated-fsdp3": ["--mode", "colocated", "--colocated-sharding", "fsdp"],
            "gap-fsdp": ["--generators", "1", "--trainers", "2", "--train-sharding", "fsdp"]}

    def peaks(placement: list[str], nproc: int) -> list[float]:  # the memory model's, per role
        cfg = parse_config([*SMOOTH, *full, *placement])
        cfg.resolve_defaults()
        return [peak(p).total for p in predict(cfg, validate(cfg, nproc), load_model(cfg.model.model, seed=0)).values()]

    admitted = max(max(peaks(p, 3)) for p in runs.values())
    refused_peak = max(peaks(["--mode", "colocated"], 2))
    assert admitted < refused_peak
    limit = f"{(admitted + refused_peak) / 2 / 1e9:.6g}"
    budget = [*full, "--memory-budget-gb", limit]
    weights = {}
    for name, placement in runs.items():
        out = tmp_path / name
        torchrun(3, [*SMOOTH, *budget, *placement, "--output-dir", str(out)], env=traced(out))
        assert_nccl_ok(out, collectives=[f"world:{REDUCE_SCATTER}" if "colocated" in name
                                         else f"trainers:{REDUCE_SCATTER}"])
        weights[name] = trained_weights(str(out), SHARDED_STEPS)
        assert read_metrics(str(out / "metrics.jsonl"))[-1]["train/num_allgathers"] > 0
    assert_same_weights(weights["colocated-fsdp3"], weights["gap-fsdp"], "gap-fsdp")
    auto = tmp_path / "auto"
    torchrun(3, [*SMOOTH, *budget, "--placement", "auto", "--placement-trials", "3", "--placement-trial-steps", "1",
                 "--placement-margin", "1e9", "--output-dir", str(auto)])
    record = json.loads((auto / "config.json").read_text())["run"]["placement"]
    tried = [x["label"] for x in record["trials"]]
    assert len(tried) == 3 and all("FSDP2" in t for t in tried), tried
    assert [s["after_step"] for s in record["switches"]][:2] == [0, 1], record["switches"]
    assert_same_weights(weights["colocated-fsdp3"], trained_weights(str(auto), SHARDED_STEPS), "auto")
    refused = torchrun(2, [*SMOOTH, *budget, "--mode", "colocated", "--output-dir", str(tmp_path / "r")], check=False)
    assert refused.returncode != 0 and f"--memory-budget-gb {limit}: a colocated needs" in refused.stderr
