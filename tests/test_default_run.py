"""The README's main command, shortened: the embedded default (shipped model, shapes prompts and
reward, disaggregated with fragment streaming) for 2 steps with evaluation."""
from lab.launch import torchrun
from telemetry.metrics import read_metrics


def test_default_configuration_runs(tmp_path):
    out = tmp_path / "run"
    torchrun(2, ["--steps", "2", "--eval-num-prompts", "8", "--eval-every", "2", "--output-dir", str(out)])
    rows = read_metrics(str(out / "metrics.jsonl"))
    steps = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/reward" in r]
    assert len(steps) == 2 and [r["step"] for r in evals] == [0, 2]
    assert all(0.0 <= r["reward/shapes/mean"] <= 1.0 for r in steps)
    assert all(0.0 <= r["eval/shapes"] <= 1.0 for r in evals)
    # the independent scorer, on by default for the shapes reward: a fraction of 8 images, outside eval/reward
    assert all(r["eval/shapes_detector"] * 8 == round(r["eval/shapes_detector"] * 8) for r in evals)
    assert all(r["eval/reward"] == r["eval/shapes"] for r in evals)
    assert steps[0]["train/approx_kl"] == 0.0
    assert (out / "eval" / "step-000000.png").is_file() and (out / "checkpoints" / "step-2").is_dir()
