"""lab/rl_probe.py: the policy gradient it probes is keyed by the batch's noise alone, and an
update of size 0 leaves the evaluation unchanged."""
import os

import pytest
import torch

from lab import rl_probe

from rl import sampler
from models import load_model
from models.lora import apply_lora
from prompts.sets import load_prompts
from rewards import RewardSet


@pytest.mark.integration  # in process, but tens of seconds
def test_gradient_depends_on_the_noise_key_only():
    adapter = load_model("flux", os.path.join(rl_probe.ROOT, "assets", "shapes-flux"), preset="auto", seed=0, device=torch.device("cpu"))
    apply_lora(adapter.transformer, 4, None, "attn", 0)
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    sampling = sampler.SamplingConfig.for_adapter(adapter, sde_window=(0, 2))
    records = load_prompts(os.path.join(rl_probe.ROOT, "data", "shapes_train.txt"))[:2]
    rewards = RewardSet(["shapes"])

    def grad(step):
        return rl_probe.policy_gradient(adapter, params, sampling, records, rewards, group_size=4, step=step,
                                        same_group_noise=True, timesteps=range(2))

    g0, g0_again, g1 = grad(0), grad(0), grad(1)
    assert g0.norm() > 0
    cos = rl_probe.gradient_cosines([g0, g0_again, g1])  # pairs (0, 0'), (0, 1), (0', 1)
    assert abs(cos[0] - 1.0) < 1e-6
    assert abs(cos[1]) < 0.9 and cos[1] == cos[2]


@pytest.mark.integration  # in process, but tens of seconds
def test_a_step_of_size_zero_changes_nothing(capsys):
    assert rl_probe.main(["step", "--prompts-per-batch", "2", "--group-size", "2", "--batches", "1",
                          "--lora-rank", "4", "--sde-window", "0:1", "--eval-num-prompts", "4",
                          "--etas", "0,0.01"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "paired change +0.0000 +- 0.0000" in lines[1]
    assert lines[2].startswith("eta 0.01 (norm ")


def test_rendered_latents_are_the_prompts_ground_truth():
    """The `train --loss sft` data: decoded, the latents of rendered scenes score ~1 for their prompts."""
    adapter = load_model("flux", os.path.join(rl_probe.ROOT, "assets", "shapes-flux"), preset="auto", seed=0, device=torch.device("cpu"))
    prompts = [r.prompt for r in load_prompts(os.path.join(rl_probe.ROOT, "data", "shapes_train.txt"))[:8]]
    scores = RewardSet(["shapes"]).score(adapter.decode(rl_probe.rendered_latents(adapter, prompts, 0)), prompts,
                                         [{}] * len(prompts))["shapes"]
    assert scores.mean() > 0.9, scores


def _train_curve(capsys, *args) -> list[float]:
    assert rl_probe.main(["train", "--steps", "1", "--eval-every", "1", "--fixed", "2", "--eval-repeats", "2",
                          "--prompts-per-batch", "2", "--group-size", "2", "--lora-rank", "4", *args]) == 0
    out = capsys.readouterr().out
    assert "(4 samples)" in out  # 2 prompts x 2 seeds
    return [float(x) for x in out.splitlines()[-1].split()[2:]]


@pytest.mark.integration  # in process, but tens of seconds
def test_train_probe_updates_only_with_a_learning_rate(capsys):
    before, after = _train_curve(capsys, "--loss", "grpo", "--lr", "0")
    assert before == after
    before, after = _train_curve(capsys, "--loss", "sft", "--lr", "0.05")
    assert before != after
