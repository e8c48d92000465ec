"""GAP: the pure stage partition and schedule, and a pipelined replica against one-stage generation."""
import json
import os
import subprocess
import sys

import pytest

from traced import assert_nccl_ok, merged, traced
from parallel.schedule import (Action, ScheduleError, fragments_in_flight, gap_schedule, idle_slots,
                               partition_blocks, render_grid, validate_schedule)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("microbatches", [0, 1, 2, 3, 4, 7, 8, 13])
@pytest.mark.parametrize("steps", [1, 2, 3, 10])
def test_generated_schedules_are_valid(stages, microbatches, steps):
    schedule = gap_schedule(stages, microbatches, steps)
    validate_schedule(schedule, stages, microbatches, steps)
    assert all(len(actions) == microbatches * steps for actions in schedule)


@pytest.mark.parametrize("stages,microbatches,steps", [(2, 4, 10), (3, 6, 8), (4, 4, 5), (3, 9, 3)])
def test_at_least_s_in_flight_leaves_only_fill_and_drain(stages, microbatches, steps):
    """With >= S micro-batches in flight every stage is busy in steady state: the idle time is the
    fill and drain, (S-1) slots per stage, independent of K."""
    assert idle_slots(gap_schedule(stages, microbatches, steps)) == stages * (stages - 1)


def test_fewer_microbatches_than_stages_bubble():
    # One micro-batch cannot overlap with itself: each stage idles (S-1)/S of the time.
    assert idle_slots(gap_schedule(3, 1, 4)) == 3 * 4 * 2


@pytest.mark.parametrize("stages,per_fragment,expected", [(1, 1, 1), (2, 1, 2), (2, 2, 1), (3, 2, 2), (4, 1, 4),
                                                           (4, 8, 1)])
def test_fragments_in_flight_fill_the_stages(stages, per_fragment, expected):
    """The planner's wave: the fewest fragments whose micro-batches fill the S in-flight slots;
    one fragment fewer leaves every stage more idle per micro-batch."""
    wave = fragments_in_flight(stages, per_fragment)
    assert wave == expected
    assert wave * per_fragment >= stages and (wave - 1) * per_fragment < stages
    if wave > 1:
        def idle_per_mb(n):
            return idle_slots(gap_schedule(stages, n, 6)) / n
        assert idle_per_mb(wave * per_fragment) < idle_per_mb((wave - 1) * per_fragment)


def test_validator_rejects_missing_duplicate_and_foreign_actions():
    s = gap_schedule(2, 2, 2)
    with pytest.raises(ScheduleError, match="missing"):
        validate_schedule([s[0][:-1], s[1]], 2, 2, 2)
    with pytest.raises(ScheduleError, match="duplicated"):
        validate_schedule([s[0] + [s[0][0]], s[1]], 2, 2, 2)
    with pytest.raises(ScheduleError, match="other stages"):
        validate_schedule([s[1], s[1]], 2, 2, 2)


def test_validator_finds_deadlock_and_prints_the_grid():
    s = gap_schedule(2, 2, 2)
    stage0 = [s[0][2], s[0][0], s[0][1], s[0][3]]  # stage 0 waits for step 1 before it starts step 0
    with pytest.raises(ScheduleError) as e:
        validate_schedule([stage0, s[1]], 2, 2, 2)
    text = str(e.value)
    assert "0F0.1!" in text and "stage 0" in text and "stage 1" in text


def test_validator_rejects_out_of_order_channels():
    s = gap_schedule(2, 2, 2)
    stage1 = [s[1][1], s[1][0], s[1][2], s[1][3]]
    with pytest.raises(ScheduleError, match="out of order"):
        validate_schedule([s[0], stage1], 2, 2, 2)


def test_render_grid_shape():
    grid = render_grid(gap_schedule(3, 3, 2), {Action(1, 0, 0)})
    lines = grid.splitlines()
    assert len(lines) == 1 + 6 and "1F0.0!" in grid


@pytest.mark.parametrize("costs,speeds,expected", [
    ([1, 1, 1, 1], [1, 1], [(0, 2), (2, 4)]),
    ([1, 1, 1, 1, 2, 2], [1, 1], [(0, 4), (4, 6)]),
    ([1, 1, 1, 1, 1, 1], [2, 1], [(0, 4), (4, 6)]),  # a faster first rank takes more blocks
    ([5, 1, 1, 1], [1, 1, 1], [(0, 1), (1, 2), (2, 4)]),
])
def test_partition_balances_measured_cost_and_speed(costs, speeds, expected):
    assert partition_blocks(costs, speeds) == expected


def test_partition_is_optimal_against_brute_force():
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(50):
        n, s = rng.randint(2, 8), rng.randint(1, 4)
        if s > n:
            continue
        costs = [rng.uniform(0.1, 3) for _ in range(n)]
        speeds = [rng.uniform(0.5, 2) for _ in range(s)]
        got = partition_blocks(costs, speeds)
        assert got[0][0] == 0 and got[-1][1] == n and all(a < b for a, b in got)
        worst = max(sum(costs[a:b]) / v for (a, b), v in zip(got, speeds))
        best = min(max(sum(costs[a:b]) / v for (a, b), v in zip(zip((0, *cut), (*cut, n)), speeds))
                   for cut in itertools.combinations(range(1, n), s - 1))
        assert worst == pytest.approx(best)


def test_partition_errors():
    with pytest.raises(ValueError, match="cannot split 2 blocks into 3"):
        partition_blocks([1, 1], [1, 1, 1])


def test_stage_param_names_cover_every_weight_once_per_role():
    from models import load_model
    from parallel.gap import stage_param_names

    adapter = load_model("flux")
    names = [n for n, _ in adapter.transformer.named_parameters()]
    ranges = partition_blocks([1.0] * len(adapter.blocks), [1.0] * 3)
    per_stage = [stage_param_names(adapter, names, r, i == 0, i == 2) for i, r in enumerate(ranges)]
    block_names = [n for n in names if n.startswith(("transformer_blocks.", "single_transformer_blocks."))]
    assert sorted(n for stage in per_stage for n in stage if n in block_names) == sorted(block_names)
    assert not any(n not in block_names for n in per_stage[1])  # the middle stage holds blocks only
    assert "x_embedder.weight" in per_stage[0] and "proj_out.weight" in per_stage[2]


@pytest.mark.parametrize("stages", [2, 3])
def test_pipelined_replica_equals_one_stage(tmp_path, stages):
    """FLUX (dual + single stream), Wan (single stream, CFG) and HunyuanVideo (reversed return
    order): S stages produce bitwise the trajectories of one stage."""
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(stages),
           "-m", "tests.dist_scripts.gap_equivalence", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **traced(tmp_path)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_nccl_ok(tmp_path, [f"gap.s{s}->s{(s + 1) % stages}" for s in range(stages)])  # every link, S = 2 and 3
    report = json.loads(out.read_text())
    assert set(report) == {"flux", "wan", "hunyuan_video"}
    for family, r in report.items():
        assert r["latents"] == 0.0 and r["log_probs"] == 0.0, (family, r)
        assert r["fragments"] == r["emitted"] == 2, (family, r)


def test_placement_invariance_across_fragments_and_stages(tmp_path):
    """Fragment streaming and block pipelines train on the same data as the colocated baseline."""

    from lab.launch import TINY, torchrun, trained_weights
    from weights import assert_same_weights

    runs = {"colocated": (2, ["--mode", "colocated"]),
            "stream": (2, ["--fragment-groups", "1"]),
            "stages-2": (3, ["--generators", "2", "--trainers", "1", "--gap-stages", "2", "--fragment-groups", "1"])}
    links = {"colocated": [], "stream": ["data.to"], "stages-2": ["gap.r0.s0->s1", "gap.r0.s1->s0"]}
    weights = {}
    for name, (nproc, placement) in runs.items():
        out = tmp_path / name
        torchrun(nproc, [*TINY, "--lora-rank", "4", "--steps", "2", "--output-dir", str(out), *placement],
                 env=traced(out))
        assert_nccl_ok(out, links[name])
        weights[name] = trained_weights(str(out), 2)
    # Both links on one communicator, as before: stage 0's early receive from stage 1 holds back its send.
    old = merged(tmp_path / "stages-2", ["gap."])
    assert old.deadlock and old.cycles == [[0, 1]], old.message
    for name, w in weights.items():
        assert_same_weights(w, weights["colocated"], name)


def test_trainers_start_before_generation_ends(tmp_path):
    """Fragment streaming: in every step the trainer's first train span starts before the
    generator's last generate span of that step ends (8 fragments: 7 fragments' time of slack,
    so a loaded machine does not decide it)."""
    from lab.launch import TINY, torchrun

    out = tmp_path / "run"
    args = [a if a != "2" or i != TINY.index("--prompts-per-step") + 1 else "8" for i, a in enumerate(TINY)]
    torchrun(2, [*args, "--lora-rank", "4", "--steps", "2", "--fragment-groups", "1", "--output-dir", str(out)])
    spans = {r: [e for e in json.loads((out / "trace" / f"rank{r}.json").read_text())["traceEvents"]
                 if e.get("ph") == "X"] for r in (0, 1)}
    for step in (0, 1):
        gen = [e for e in spans[0] if e["cat"] == "generate" and e["args"]["step"] == step]
        train = [e for e in spans[1] if e["cat"] == "train" and e["args"]["step"] == step]
        assert len(gen) == 8 and train, (len(gen), len(train))
        assert min(e["ts"] for e in train) < max(e["ts"] + e["dur"] for e in gen)
