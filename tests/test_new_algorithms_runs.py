"""DiffusionNFT, MixGRPO and Flow-DPPO through torchrun: every placement trains the colocated run's
weights (disaggregated, TSP, TAG, GAP stages, FSDP2, LoRA and full fine-tuning), a resumed NFT run
repeats the uninterrupted one bitwise (the old policy is in the checkpoint), TCSS stays within
staleness 1, MixGRPO's window moves with the step in every placement, and Flow-DPPO's mask drops
updates once the policy has moved from the rollout's (TCSS)."""
import shutil

import pytest
import torch

from checkpointing.checkpoint import SAMPLED, checkpoint_dir, read_state
from lab.launch import TINY, torchrun, trained_weights
from telemetry.metrics import read_metrics
from weights import assert_same_weights

BASE = [a if a != "2" or TINY[i - 1] != "--prompts-per-step" else "4" for i, a in enumerate(TINY)]
BASE += ["--fragment-groups", "1"]  # 4 fragments of one group of 2 samples
# The old policy moves halfway to the trained weights after every update (d = 0.5 from the first):
# a placement that sampled with the trained weights, or lost the old policy, trains other data.
NFT = [*BASE, "--algorithm", "nft", "--old-policy-decay", "0:0.5:0.5", "--ode-solver", "dpm2",
       "--timestep-fraction", "0.67", "--nft-beta", "0.5", "--beta", "1e-3"]
# K = 5: windows of 2 moving every step: [0, 1], [1, 2], then [2] (MixGRPO trains before K - 2 = 3)
MIX = [*BASE, "--algorithm", "mixgrpo", "--sample-steps", "5", "--window-size", "2", "--window-interval", "1",
       "--same-group-noise", "--ode-solver", "dpm2"]
# Flow-DPPO: Flow-GRPO's rollout, whose fragments carry every step's transition mean; a threshold
# below any divergence of a moved policy, so every update that moves away from the rollout is dropped.
DPPO = [*BASE, "--algorithm", "flow_dppo", "--kl-mask-threshold", "1e-12"]
SLOW_GENERATOR = ["--debug-slow-rank", "0:5"]  # idle trainers claim fragments (TAG)


def _old(run, step):
    return read_state(checkpoint_dir(str(run), step), SAMPLED)


def _rows(run):
    return [r for r in read_metrics(str(run / "metrics.jsonl")) if "train/loss" in r]


@pytest.fixture(scope="module")
def nft_colocated(tmp_path_factory):
    out = tmp_path_factory.mktemp("nft-colocated")
    torchrun(2, [*NFT, "--lora-rank", "4", "--steps", "3", "--mode", "colocated", "--output-dir", str(out)])
    return out


@pytest.mark.parametrize("nproc,placement", [
    (3, ["--generators", "1", "--trainers", "2", "--tsp", "--train-micro-batch", "3", "--tag", *SLOW_GENERATOR]),
    (3, ["--generators", "2", "--gap-stages", "2", "--trainers", "1"]),
], ids=["tsp-tag", "gap-stages"])
def test_nft_placements_train_the_colocated_weights(tmp_path, nft_colocated, nproc, placement):
    """The trained weights and the old policy (which the generators sample with) of every placement
    are the colocated run's after 3 steps; every step trained the same transitions."""
    out = tmp_path / "run"
    torchrun(nproc, [*NFT, "--lora-rank", "4", "--steps", "3", "--output-dir", str(out), *placement])
    assert_same_weights(trained_weights(str(nft_colocated), 3), trained_weights(str(out), 3), "theta")
    assert_same_weights(_old(nft_colocated, 3), _old(out, 3), "old policy")
    ref, rows = _rows(nft_colocated), _rows(out)
    for r, c in zip(rows, ref):
        assert r["train/num_transitions"] == c["train/num_transitions"] == 8 * 2
        assert r["reward/mean"] == pytest.approx(c["reward/mean"], rel=1e-6)
    assert rows[0]["train/old_deviation"] == 0.0 < rows[1]["train/old_deviation"]
    if "--tag" in placement:
        assert sum(r["tag/fragments"] for r in rows) > 0


def test_nft_resume_repeats_the_run_and_matches_colocated(tmp_path, nft_colocated):
    """Disaggregated 1 + 1: the colocated weights; cut back to its step-2 checkpoint and resumed,
    bitwise the uninterrupted run (trained weights and old policy: the generator installs the old
    policy from the checkpoint, the trainer both)."""
    args = [*NFT, "--lora-rank", "4", "--steps", "3", "--save-every", "1"]
    torchrun(2, [*args, "--output-dir", str(tmp_path / "straight")])
    straight = tmp_path / "straight"
    assert_same_weights(trained_weights(str(nft_colocated), 3), trained_weights(str(straight), 3), "disagg")
    shutil.copytree(straight, tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step-3")
    torchrun(2, [*args, "--resume", str(tmp_path / "resumed"), "--output-dir", str(tmp_path / "resumed")])
    for got, want in ((trained_weights(str(tmp_path / "resumed"), 3), trained_weights(str(straight), 3)),
                      (_old(tmp_path / "resumed", 3), _old(straight, 3))):
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_nft_with_tcss_is_at_most_one_version_stale(tmp_path):
    out = tmp_path / "run"
    torchrun(2, [*NFT, "--lora-rank", "4", "--steps", "3", "--tcss", "--output-dir", str(out)])
    rows = _rows(out)
    assert len(rows) == 3 and all(r["train/staleness_max"] <= 1.0 for r in rows)
    assert any(r["train/staleness_frac_1"] > 0 for r in rows[1:])


def test_nft_full_fine_tuning_with_fsdp_trainers(tmp_path):
    """--lora-rank 0: the old policy is a copy of every weight, sharded like them under FSDP2."""
    runs = {"colocated": (2, ["--mode", "colocated"]),
            "fsdp": (3, ["--generators", "1", "--trainers", "2", "--train-sharding", "fsdp"])}
    for name, (nproc, placement) in runs.items():
        torchrun(nproc, [*NFT, "--lora-rank", "0", "--steps", "2", "--output-dir", str(tmp_path / name), *placement])
    assert_same_weights(trained_weights(str(tmp_path / "colocated"), 2), trained_weights(str(tmp_path / "fsdp"), 2),
                        "fsdp")
    assert_same_weights(_old(tmp_path / "colocated", 2), _old(tmp_path / "fsdp", 2), "fsdp old policy")


@pytest.fixture(scope="module")
def mix_colocated(tmp_path_factory):
    out = tmp_path_factory.mktemp("mix-colocated")
    torchrun(2, [*MIX, "--lora-rank", "4", "--steps", "3", "--mode", "colocated", "--output-dir", str(out)])
    return out


@pytest.mark.parametrize("nproc,placement", [
    (3, ["--generators", "1", "--trainers", "2", "--tsp", "--train-micro-batch", "3", "--tag", *SLOW_GENERATOR]),
    (3, ["--generators", "2", "--gap-stages", "2", "--trainers", "1"]),
], ids=["tsp-tag", "gap-stages"])
def test_mixgrpo_placements_train_the_colocated_weights(tmp_path, mix_colocated, nproc, placement):
    """The window moves every step (2, 2, then 1 trained step per sample) in every placement; the
    weights are the colocated run's and every update is on-policy (ratio 1)."""
    out = tmp_path / "run"
    torchrun(nproc, [*MIX, "--lora-rank", "4", "--steps", "3", "--output-dir", str(out), *placement])
    assert_same_weights(trained_weights(str(mix_colocated), 3), trained_weights(str(out), 3), "mixgrpo")
    for rows in (_rows(mix_colocated), _rows(out)):
        assert [r["train/num_transitions"] for r in rows] == [16.0, 16.0, 8.0]
        for r in rows:
            assert r["train/approx_kl"] < 1e-12 and r["train/clipfrac"] == 0.0, r


@pytest.fixture(scope="module")
def dppo_colocated(tmp_path_factory):
    out = tmp_path_factory.mktemp("dppo-colocated")
    torchrun(2, [*DPPO, "--lora-rank", "4", "--steps", "3", "--mode", "colocated", "--output-dir", str(out)])
    return out


@pytest.mark.parametrize("nproc,placement", [
    (3, ["--generators", "1", "--trainers", "2", "--tsp", "--train-micro-batch", "3", "--tag", *SLOW_GENERATOR]),
    (3, ["--generators", "2", "--gap-stages", "2", "--trainers", "1"]),
], ids=["tsp-tag", "gap-stages"])
def test_flow_dppo_placements_train_the_colocated_weights(tmp_path, dppo_colocated, nproc, placement):
    """The rollout's transition means reach the trainers alike in every placement (TSP's packed rows,
    the last GAP stage's record): the weights are the colocated run's, and every on-policy update
    finds the divergence to the rollout 0 and drops nothing."""
    out = tmp_path / "run"
    torchrun(nproc, [*DPPO, "--lora-rank", "4", "--steps", "3", "--output-dir", str(out), *placement])
    assert_same_weights(trained_weights(str(dppo_colocated), 3), trained_weights(str(out), 3), "flow_dppo")
    ref, rows = _rows(dppo_colocated), _rows(out)
    assert len(rows) == len(ref) == 3
    for r, c in zip(rows, ref):
        assert r["train/num_transitions"] == c["train/num_transitions"]
        assert r["train/divergence"] < 1e-12 and r["train/masked"] == 0.0 and r["train/ratio"] == pytest.approx(1.0)


def test_flow_dppo_drops_updates_that_move_away_from_a_stale_rollout(tmp_path):
    """With TCSS a step trains the transitions of the version before (staleness 1): the divergence to
    the rollout's means is positive and the mask drops the updates that move further away."""
    out = tmp_path / "run"
    torchrun(2, [*DPPO, "--lora-rank", "4", "--steps", "3", "--tcss", "--output-dir", str(out)])
    rows = _rows(out)
    assert len(rows) == 3 and rows[0]["train/divergence"] < 1e-12 and rows[0]["train/masked"] == 0.0
    stale = [r for r in rows[1:] if r["train/staleness_frac_1"] > 0]
    assert stale and all(r["train/divergence"] > 0 and r["train/divergence_high"] > 0 for r in stale)
    assert any(0 < r["train/masked"] < 1 for r in stale), stale
