"""The prepared GPU check (python -m scripts.gpu_check) runs on a CPU at the tiny size, so it still
works on the day a GPU comes: one run writes every section, and each section's figures are checked
for what they must be (runs that exit 0 with a clean NCCL replay, memory at least the bytes the
state must hold, FLOPs that scale with the batch, log-probabilities that bf16 moves more than
float32's batch shape does)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from scripts.gpu_check import model as M
from scripts.gpu_check import mfu, numerics

GiB = 1024 ** 3


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "cpu.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--device", "cpu", "--json", str(out)],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    got = json.loads(out.read_text())
    got["exit_code"], got["stderr"] = proc.returncode, proc.stderr[-6000:]
    return got


def section(report, name: str) -> dict:
    """A section's figures; a section that failed records its error, shown here."""
    got = report["sections"][name]
    assert "error" not in got, got.get("traceback", got.get("error"))
    return got


def test_every_section_is_written(report):
    assert list(report["sections"]) == ["env", "memory", "mfu", "numerics", "runtime"]
    assert report["exit_code"] == 0, {k: v.get("error") for k, v in report["sections"].items()}
    assert report["device"] == "cpu" and report["size"] == "tiny"
    env = section(report, "env")
    assert env["versions"]["torch"].startswith(torch.__version__.split("+")[0]) and env["device"] == "cpu"


def test_runtime_runs_exit_0_with_clean_traces_and_the_resume_matches(report):
    """Colocated LoRA, colocated FSDP2 full fine-tuning and a resume on one rank: each exits 0 and
    its recorded communication replays under NCCL's rules; on a CPU the resumed weights are the
    uninterrupted run's, bit for bit."""
    runtime = section(report, "runtime")
    assert [r["run"] for r in runtime["runs"]] == ["lora", "full fsdp", "resume"]
    for row in runtime["runs"]:
        assert row["exit_code"] == 0 and row["comm_ok"] and row["comm_ops"] > 0, row
    assert runtime["runs"][2]["weights_equal"] and runtime["runs"][2]["max_abs_weight_difference"] == 0.0
    assert runtime["ok"]


def test_memory_holds_at_least_the_state_of_each_phase(report):
    """The FakeTensorMode measurement of each phase holds at least what its state needs (bf16
    weights; float32 weights, gradients and two AdamW moments for a full fine-tune), and the model
    counts the same weights."""
    memory = section(report, "memory")
    n = memory["parameters"]
    phases = memory["phases"]
    assert n == sum(p.numel() for p in M.adapter(M.TINY, "meta", torch.float32).transformer.parameters())
    assert phases["generator step"]["fake_gib"] * GiB > 2 * n
    assert phases["full fine-tune step"]["fake_gib"] * GiB >= 16 * n
    assert phases["LoRA forward + backward"]["fake_gib"] < phases["full fine-tune step"]["fake_gib"]
    assert phases["generator step"]["model_items"]["DiT weights"] * GiB == pytest.approx(2 * n)
    assert phases["full fine-tune step"]["model_items"]["optimizer"] * GiB == pytest.approx(8 * n)
    for row in phases.values():
        assert row["model_gib"] > 0 and "peak_allocated_gib" not in row  # a CPU has no allocator statistics


def test_mfu_counts_flops_linear_in_the_batch_and_times_every_phase(report):
    rows = section(report, "mfu")["rows"]
    assert len(rows) == 3 * 2 * 3  # phases x token counts x batch sizes
    by = {(r["phase"], r["side"], r["batch"]): r for r in rows}
    for (phase, side, b), r in by.items():
        assert r["seconds"] > 0 and 0 < r["planner_efficiency"] < 1
        assert r["forward_flops"] == pytest.approx(b * by[(phase, side, 1)]["forward_flops"], rel=1e-9)
        assert r["physical_flops"] == r["forward_flops"] * {"generator forward": 1, "LoRA forward + backward": 3,
                                                            "full fine-tune forward + backward": 4}[phase]
    sides = sorted({s for _, s, _ in by})
    assert by[("generator forward", sides[1], 1)]["forward_flops"] > by[("generator forward", sides[0], 1)]["forward_flops"]


def test_numerics_deltas_are_finite_and_bf16_moves_log_p_more_than_float32(report):
    """The rollout's own shape reproduces its log-probabilities exactly; bf16 moves them further
    from the float32 reference than float32's batch shape does."""
    num = section(report, "numerics")
    assert num["clip_range"] == 1e-4
    for table in ("against_rollout", "against_float32_cpu"):
        for row in num[table].values():
            assert all(v == v and abs(v) != float("inf") for v in row.values()), row
    assert num["against_rollout"]["bf16 batch 4"]["max_abs_delta_logp"] == 0.0
    bf16 = num["against_float32_cpu"]["rollout"]["max_abs_delta_logp"]
    assert bf16 > 0 and bf16 > 10 * num["against_float32_cpu"]["float32 batch 1"]["max_abs_delta_logp"]
    assert num["against_rollout"]["bf16 TSP packed"]["transitions"] == num["samples"] * num["steps"]


def test_tsp_packing_of_the_numerics_mixes_samples_and_timesteps():
    """The packed micro-batches cover every transition once, at most 5 a batch, some mixing samples and steps."""
    batches = numerics.packed(6)
    flat = [tr for b in batches for tr in b]
    assert sorted(flat) == [(i, t) for i in range(numerics.NUM_SAMPLES) for t in range(6)]
    assert max(len(b) for b in batches) <= numerics.TSP_MICRO_BATCH
    assert any(len({t for _, t in b}) > 1 for b in batches) and any(len({i for i, _ in b}) > 1 for b in batches)


@pytest.mark.parametrize("side", [512, 1024])
def test_the_planner_counts_the_flops_torch_counts_at_flux_width(side):
    """The mfu section divides torch's FLOP count by the planner's efficiency: at FLUX.1-dev width
    (on the meta device, nothing computed) the planner's formula for the same blocks
    (planner/specs.block_flops) is torch's count within 1% (the embedding and head are outside it)."""
    size = M.with_side(M.FLUX, side)
    counted, _ = mfu.forward_flops(M.adapter(size, "meta", torch.bfloat16), size, 1, "meta", "float32")
    assert mfu.planner_forward_flops(size) == pytest.approx(counted, rel=0.01)
    assert mfu.planner_forward_flops(size) < counted
