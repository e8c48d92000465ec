"""lab/simulate.py and lab/planning/costs.py: costs measured from a synthetic run folder, the mode a
run's config maps to, and properties the planner has by construction (simulate.py --cluster)."""
import functools
import json
import os

import pytest

from config.schema import RunConfig
from lab.planning import costs as cm
from lab.planning import placements as plans
from planner.hardware import gpu
from planner.workload import Workload
from telemetry.tracing import Tracer

from lab import simulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def _config(**topology) -> dict:
    cfg = RunConfig()
    cfg.rl.prompts_per_step, cfg.rl.group_size, cfg.rl.micro_batch = 4, 2, 2
    for k, v in topology.items():
        setattr(cfg.topology, k, v)
    return cfg.to_dict()


# ---------------------------------------------------------------------------------------------
# Measured costs from a synthetic trace folder
# ---------------------------------------------------------------------------------------------

T0 = 1000.0  # seconds since the epoch of the synthetic run
STEP = 3.8  # every step starts 3.8 s after the previous one


def _write_run(path, num_steps: int = 3) -> None:
    """A gap-streaming run, 1 generator (rank 0) and 1 trainer (rank 1), 2 fragments of one group
    per step. Per step, from its start t (seconds):
      rank 0: generate f0 [t, t+1.0], generate f1 [t+1.2, t+2.2]   (step 0: f1 ends at t+3.2, warm-up)
      rank 1: recv f0 [t+0.5, t+1.3] (posted before f0 was generated: it waits)
              train f0 [t+1.3, t+2.3]
              recv f1 [t+2.3, t+2.4] (posted after f1 was generated: 0.1 s of receiving)
              train f1 [t+2.4, t+3.4], optimizer [t+3.4, t+3.6], publish [t+3.6, t+3.7]
    and the next step's generation starts at t+3.8."""
    cfg = _config(fragment_groups=1)
    cfg["rl"]["prompts_per_step"] = 2
    cfg["rl"]["steps"] = num_steps
    cfg["output"]["output_dir"] = str(path)
    os.makedirs(path / "trace")
    (path / "config.json").write_text(json.dumps(cfg))
    gen, trn = Tracer(0, "generator"), Tracer(1, "trainer")

    def span(tracer, name, cat, k, a, b, fragment=None):
        t = T0 + k * STEP
        tracer.record(name, cat, k, (t + a) * 1e6, (b - a) * 1e6, fragment)

    for k in range(num_steps):
        span(gen, "generate", "generate", k, 0.0, 1.0, 0)
        span(gen, "generate", "generate", k, 1.2, 3.2 if k == 0 else 2.2, 1)
        span(trn, "recv", "comm", k, 0.5, 1.3, 0)
        span(trn, "train", "train", k, 1.3, 2.3, 0)
        span(trn, "recv", "comm", k, 2.3, 2.4, 1)
        span(trn, "train", "train", k, 2.4, 3.4, 1)
        span(trn, "optimizer", "optimizer", k, 3.4, 3.6)
        span(trn, "publish", "publish", k, 3.6, 3.7)
    span(gen, "install", "publish", num_steps, 0.0, 0.1)  # the last version, installed after the last step
    gen.save(path / "trace" / "rank0.json")
    trn.save(path / "trace" / "rank1.json")
    with open(path / "metrics.jsonl", "w") as f:
        for k, (step_s, bubble) in enumerate([(9.0, 0.9), (4.0, 0.3), (4.2, 0.5)][:num_steps]):
            f.write(json.dumps({"step": k, "perf/step_s": step_s, "perf/bubble_fraction": bubble}) + "\n")


def test_costs_from_synthetic_trace(tmp_path):
    _write_run(tmp_path / "run")
    run = cm.load_run(str(tmp_path / "run"))
    assert run.world_size == 2 and run.steps == [0, 1, 2]  # the install under step 3 is no step
    setup = cm.sim_setup(run.config, run.world_size)
    assert (setup.mode, setup.num_fragments, setup.num_trainers, setup.chunks_per_fragment) == ("gap", 2, 1, 1)
    c = cm.measure_costs(run, setup)
    assert c.replica_fragment_s == [pytest.approx(1.1)]  # window 2.2 s / 2 fragments; step 0 left out
    assert c.trainer_fragment_s == pytest.approx(1.1)  # no TAG span: as fast as the replicas
    assert c.train_fragment_s == pytest.approx(1.1)  # 1.0 s of training + 0.1 s of receiving
    assert c.transfer_s == pytest.approx(0.1)  # f0: 1.3 - 1.0 - 0.1 = 0.2; f1: 0.0 (posted late)
    assert c.update_s == pytest.approx(0.2)
    assert c.publish_s == pytest.approx(0.2)  # optimizer end 3.6 -> next generation at 3.8
    assert c.chunks_per_fragment == 1

    with_warmup = cm.measure_costs(run, setup, skip=0)
    assert with_warmup.replica_fragment_s == [pytest.approx((1.6 + 1.1 + 1.1) / 3)]

    measured = cm.measured_step_metrics(run)
    assert measured == {"step_s": pytest.approx(4.1), "bubble_fraction": pytest.approx(0.4),
                        "period_s": pytest.approx(STEP)}


def test_run_report_reproduces_synthetic_run(tmp_path, capsys):
    _write_run(tmp_path / "run")
    trace_out = tmp_path / "sim.json"
    out = simulate.simulate_measured_run(str(tmp_path / "run"), trace_out=str(trace_out))
    # The synthetic run is exactly what the simulator models: its period is reproduced.
    assert out["predicted"]["period_s"] == pytest.approx(STEP)
    assert out["error"]["period_s"] == pytest.approx(0.0, abs=1e-9)
    assert json.loads(trace_out.read_text())["traceEvents"]
    assert simulate.main(["--run", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    assert "gap streaming" in text and "step period" in text and "bubble fraction" in text


def test_missing_traces_is_a_user_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_config()))
    with pytest.raises(ValueError, match="trace/rank0.json"):
        cm.load_run(str(tmp_path))
    with pytest.raises(ValueError, match="no config.json"):
        cm.load_run(str(tmp_path / "nothing"))


# ---------------------------------------------------------------------------------------------
# Config -> simulator mode
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world, topology, expected", [
    (2, dict(mode="colocated", fragment_groups=0), ("colocated", None, 2, 2, 1, 2)),
    (2, dict(fragment_groups=0), ("disagg", None, 1, 1, 1, 4)),  # naive: one fragment per replica
    (2, dict(fragment_groups=1), ("gap", None, 4, 1, 1, 1)),
    (4, dict(fragment_groups=2, generators=2, trainers=2), ("disagg", None, 2, 2, 1, 2)),  # one per replica
    (2, dict(fragment_groups=1, tsp=True), ("gap", None, 4, 1, 1, None)),
    (2, dict(fragment_groups=1, tag=True), ("tag", "bts", 4, 1, 1, 1)),
    (2, dict(fragment_groups=1, tcss=True), ("tcss", None, 4, 1, 1, 1)),
    (2, dict(fragment_groups=1, tcss=True, tag=True), ("tcss", "bts", 4, 1, 1, 1)),
    (3, dict(fragment_groups=1, generators=2, trainers=1, gap_stages=2), ("gap", None, 4, 1, 2, 1)),
])
def test_mode_mapping(world, topology, expected):
    s = cm.sim_setup(_config(**topology), world)
    assert (s.mode, s.tag_policy, s.num_fragments, s.num_trainers, s.stages_per_replica,
            s.chunks_per_fragment) == expected


# ---------------------------------------------------------------------------------------------
# --cluster: the planner on one pool (lab/planning/placements.py; more in tests/test_planner.py)
# ---------------------------------------------------------------------------------------------

FLUX_FULL = Workload("flux", 512, 512, sampling_steps=10, trained_timesteps=9, prompts_per_step=8, group_size=16,
                     finetune="full", gradient_checkpointing=True)


@functools.lru_cache(maxsize=None)
def _plans(num_gpus: int):
    preds, _ = plans.enumerate_plans(FLUX_FULL, [plans.Pool(gpu("h100"), num_gpus)], top_k=2)
    return preds


def test_more_gpus_shorter_predicted_step():
    assert plans.best_colocated(_plans(32)).step_s < plans.best_colocated(_plans(16)).step_s
    # Doubling generators and trainers shortens the streaming step with the same fragments.
    small = plans.disagg_plan(FLUX_FULL, plans.Pool(gpu("h100"), 16), plans.Pool(gpu("h100"), 16), 4, 12, 1, 1,
                              "gap", True)
    large = plans.disagg_plan(FLUX_FULL, plans.Pool(gpu("h100"), 32), plans.Pool(gpu("h100"), 32), 8, 24, 1, 1,
                              "gap", True)
    assert small.feasible and large.feasible and large.step_s < small.step_s


def test_gap_never_slower_than_naive_with_the_same_costs():
    """By construction: streaming the same fragments only lets trainers start earlier."""
    pool = plans.Pool(gpu("h100"), 16)
    for g in (2, 4, 8):
        gap = plans.disagg_plan(FLUX_FULL, pool, pool, g, 16 - g, 1, 1, "gap", True)
        naive = plans.disagg_plan(FLUX_FULL, pool, pool, g, 16 - g, 1, 1, "gap", True, naive=True)
        assert gap.step_s <= naive.step_s + 1e-9


def test_plans_add_up_and_fit():
    preds = _plans(16)
    disagg = [p for p in preds if p.system == "digenrl"]
    assert {p.knobs["mode"] for p in disagg} >= {"gap", "tcss", "naive"}
    for p in disagg:
        k = p.knobs
        assert k["generators"] + k["trainers"] == 16 and k["generators"] % k["stages"] == 0
        assert all(m.fits for m in p.memory.values())
        assert len(p.knobs["costs"]["replica_fragment_s"]) == k["generators"] // k["stages"]


def test_recommendation_is_the_fastest_and_never_slower_than_colocated():
    preds = _plans(16)
    best = plans.recommend(preds)
    on_policy = [p for p in preds if not p.knobs.get("stale")]
    assert best.step_s == min(p.step_s for p in on_policy)
    assert best.step_s <= plans.best_colocated(preds).step_s
    assert best.samples_per_s == pytest.approx(8 * 16 / best.step_s)
    with pytest.raises(ValueError):
        plans.recommend([])


def test_cluster_cli_prints_table_and_recommendation(capsys):
    assert simulate.main(["--cluster", "qwen-image-20b", "--gpus", "8", "--gpu", "h200",
                          "--finetune", "lora", "--prompts-per-step", "4", "--group-size", "8"]) == 0
    text = capsys.readouterr().out
    assert "PREDICTIONS" in text and "recommended:" in text and "colocated replicate" in text
    assert "samples/$" in text and "peak GB per role" in text
