"""Heterogeneous ranks and sharded training state: the pure pieces (replica speeds, the slow-down,
the memory budget) and, through torchrun, that the bench's `hetero` and `sharded` DigenRL modes
train the weights of their colocated baselines."""
import json
import time
from types import SimpleNamespace

import pytest
import torch

from runtime.probe import check_memory_budget, state_bytes
from runtime.launch import TINY, torchrun, trained_weights
from traced import assert_nccl_ok, traced
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


def _facts(sharding, trainers=1, disagg=True, stages=1):
    return SimpleNamespace(train_sharding=sharding, num_trainers=trainers, disagg=disagg,
                           topology=SimpleNamespace(gap_stages=stages))


def test_memory_budget_refuses_replicated_training_state_that_does_not_fit():
    model = torch.nn.Linear(1000, 1000)  # 1.001M float32 parameters: 4.004 MB of weights
    b = state_bytes(model)
    assert b == {"weights": 4.004e6, "gradients": 4.004e6, "optimizer": 8.008e6, "inference": 4.004e6}
    assert state_bytes(model, compute_bytes=2)["inference"] == 2.002e6  # generators hold bf16 weights
    budget = 10e6 / 1e9  # 10 MB: the 16 MB of replicated training state does not fit
    with pytest.raises(ValueError, match=r"--memory-budget-gb 0.01: training state needs 0.016 GB per trainer rank "
                                         r"\(weights 0.004 \+ gradients 0.004 \+ AdamW 0.00801 GB, over 1 rank\(s\)\); "
                                         r"shard it"):
        check_memory_budget(budget, model, _facts("replicate"))
    check_memory_budget(budget, model, _facts("fsdp", trainers=2))  # 8 MB per trainer: fits
    with pytest.raises(ValueError, match="a generator holds 0.004 GB"):
        check_memory_budget(3e6 / 1e9, model, _facts("fsdp", trainers=8))
    check_memory_budget(3e6 / 1e9, model, _facts("fsdp", trainers=8, stages=2))  # half the weights per stage
    model.requires_grad_(False)  # LoRA-like: nothing trainable but what is added
    assert state_bytes(model)["optimizer"] == 0
    check_memory_budget(budget, model, _facts("replicate"))




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


def test_sharded_modes_train_the_colocated_data(tmp_path):
    """Full fine-tuning under a memory budget that forbids replicated training state: colocated
    FSDP2 over 3 ranks and 1 generator + 2 FSDP2 trainers reach the same weights; replicated
    training is refused, naming the numbers."""
    budget = ["--lora-rank", "0", "--memory-budget-gb", "0.0015", "--prompts-per-step", "3"]
    runs = {"colocated-fsdp3": ["--mode", "colocated", "--colocated-sharding", "fsdp"],
            "gap-fsdp": ["--generators", "1", "--trainers", "2", "--train-sharding", "fsdp"]}
    weights = {}
    for name, placement in runs.items():
        out = tmp_path / name
        torchrun(3, [*ARGS, *budget, *placement, "--output-dir", str(out)], env=traced(out))
        assert_nccl_ok(out, collectives=["world:reduce_scatter_single" if "colocated" in name
                                         else "trainers:reduce_scatter_single"])
        weights[name] = trained_weights(str(out), 2)
        assert read_metrics(str(out / "metrics.jsonl"))[-1]["train/num_allgathers"] > 0
    assert_same_weights(weights["colocated-fsdp3"], weights["gap-fsdp"], "gap-fsdp")
    refused = torchrun(2, [*ARGS, *budget, "--mode", "colocated", "--output-dir", str(tmp_path / "r")], check=False)
    assert refused.returncode != 0 and "--memory-budget-gb 0.0015: training state needs" in refused.stderr
