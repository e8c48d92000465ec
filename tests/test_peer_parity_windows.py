"""Parity with MixGRPO (-Flash, -Flash*) and Flow-GRPO-Fast, quantity by quantity (docs/ALGORITHMS.md):
the peers' own functions were run on fixed inputs outside the project (tests/fixtures/peers/mixgrpo_*.json,
flow_grpo_fast_window.json: repo, commit, file and lines in each); here the project's take the same
inputs. MixGRPO's advantages, its quantised model timesteps, Flash's compressed schedules and model-call
counts, its rollout step by step, and Flow-GRPO-Fast's window frequencies."""
import json
import os

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from rl import advantages, algorithms, sampler, solvers
from rl.algorithms.flow_grpo_fast import GroupWindow
from rl.algorithms.mixgrpo import MixGRPOLoss, WindowSchedule, training_order

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "peers")


def fixture(name: str) -> dict:
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


# ----- MixGRPO's advantages ----------------------------------------------------------------------------
def _mix_rule(case, names):
    mix = algorithms.algorithm("mixgrpo")
    rl = type("RL", (), {"std_mode": "group", "adv_clip": 1e9, "drop_zero_std": False, "readmit_multiple": 1,
                         "best_of_n": 0, "trimmed_ratio": case["trimmed_ratio"], "advantage_rerange": "none",
                         "reward_combine": "advantages" if case["multi_reward_mix"] == "advantage_aggr" else "rewards"})
    return mix.advantages(rl, tuple((n, case["weights"][n]) for n in names))


@pytest.mark.parametrize("index", range(11))
def test_mixgrpo_advantages(index):
    """train_grpo_flux.py:428-495: per group, (r - mean) / (torch.std + 1e-8), float32 there, float64 here
    rounded once; advantage_aggr (each reward's advantage, weighted and summed: its scripts' default and
    its record's) and reward_aggr (one advantage of the weighted sum), with and without trimmed_ratio.
    Flow-GRPO's population std + 1e-4 is 1.044x smaller at G = 12: the difference issue 40 found."""
    fx = fixture("mixgrpo_advantages.json")
    case = fx["outputs"]["cases"][index]
    rewards = case.get("rewards", fx["inputs"]["rewards"])
    g = case.get("group_size", fx["inputs"]["group_size"])
    names = list(rewards)
    scores = {n: torch.tensor(rewards[n], dtype=torch.float32) for n in names}
    scores["combined"] = torch.tensor(case.get("combined", rewards[names[0]]), dtype=torch.float32)  # its sum
    ids = list(range(len(scores["combined"])))
    group_ids = torch.tensor([i // g for i in ids])
    rule = _mix_rule(case, names)
    assert (rule.ddof, rule.eps) == (1, 1e-8)
    got = advantages.fragment_advantages(rule, scores, group_ids, ids).advantages.double()
    exact = torch.tensor(case["advantages_float64"], dtype=torch.float64)  # their block on float64 rewards
    torch.testing.assert_close(got, exact, rtol=2 ** -23, atol=1e-12)  # ours in float64, rounded once
    want = torch.tensor(case["advantages"], dtype=torch.float64)  # their float32 arithmetic: a few ulp of 21 / std
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    if index == 0:  # the old convention (population std + 1e-4) is not theirs
        old = advantages.group_advantages(scores["PickScoreRewardModel"], group_ids, adv_clip=1e9)
        ratio = (got.new_tensor(0) + advantages.group_advantages(scores["PickScoreRewardModel"], group_ids,
                                                                 adv_clip=1e9, ddof=1, eps=1e-8))[0] / old[0]
        assert ratio.item() == pytest.approx((11 / 12) ** 0.5, rel=1e-3)


def test_mixgrpo_refuses_a_trim_that_leaves_one_reward():
    """trimmed_ratio leaving one reward gives the peer a NaN std (torch.std of one value); here a
    ValueError names the flag."""
    from config.cli import parse_config
    from config.validate import validate

    cfg = parse_config(["--preset", "tiny", "--algorithm", "mixgrpo", "--sample-steps", "6", "--steps", "2",
                        "--group-size", "4", "--trimmed-ratio", "0.75"])
    cfg.resolve_defaults()
    with pytest.raises(ValueError, match="--trimmed-ratio 0.75 leaves fewer than 2 of the 4 rewards"):
        validate(cfg, 2)


# ----- MixGRPO's rollout: the schedule, the model's timestep, every step --------------------------------
class Fixed:
    per_sample = False

    def __init__(self, window):
        self.w = (window[0], window[-1] + 1)

    def window(self, step, sample_id=None):
        return self.w


def _velocity(x, ts):
    return 0.7 * x + torch.sin(3 * x) * ts.float().reshape(-1, *([1] * (x.dim() - 1))) + 0.2


def _config(case):
    k = case["dpm_solver_order"]
    everywhere = case["dpm_apply_strategy"] == "all" and case["dpm_algorithm_type"] != "null"
    post = case["dpm_apply_strategy"] == "post" and case["dpm_algorithm_type"] != "null"
    return sampler.SamplingConfig(16, 16, 25, sde_type="dpm" if everywhere else "sde", noise_level=0.7,
                                  schedule="dance", shift=3.0, window_schedule=Fixed(case["window"]),
                                  ode_solver="euler" if case["dpm_algorithm_type"] == "null" else f"dpm{k}",
                                  post_compress=case["dpm_post_compress_ratio"] if post else 0.0,
                                  dpm_everywhere=everywhere, final_prediction=case["drop_last_sample"],
                                  quantize_timestep=True)


def _rollout(case, inputs, monkeypatch):
    """Our rollout of the fixture's case: its sigmas, its velocity of the model's timestep, its noise."""
    cfg = _config(case)
    sigmas = sampler.make_sigmas(FlowMatchEulerDiscreteScheduler(), 25, "dance", shift=3.0)
    assert torch.equal(sigmas, torch.tensor(inputs["sigmas"]))
    noise = [torch.tensor(n) for n in case["noise"]]
    if cfg.dpm_everywhere:  # only the SDE steps draw
        by_step = dict(zip(case["window"], noise))
    else:  # flow_grpo_step draws at every step it takes
        by_step = dict(enumerate(noise))
    monkeypatch.setattr(sampler, "step_noise", lambda seed, step, i, t, shape: by_step[t][i])
    sig = cfg.sigmas_at(sigmas, 0)
    x = torch.randn(inputs["shape"], generator=torch.Generator().manual_seed(inputs["z0_seed"]))
    path, logp, fed, history = [x], [], [], ()
    for t in range(len(sig) - 1):
        ts = cfg.model_sigma(sig[t].expand(len(x)))
        fed.append(ts[0].item())
        out = sampler.sample_step(x, _velocity(x, ts), sig, t, [0, 1], 0, cfg, history)
        x, history = out.x_next, out.x0
        path.append(x)
        logp.append(out.log_prob)
    return cfg, sig, torch.stack(path, 1), torch.stack(logp, 1), fed


POST = [name for name, c in fixture("mixgrpo_sampling.json")["outputs"].items() if c["dpm_apply_strategy"] == "post"]


@pytest.mark.parametrize("name", POST)
def test_mixgrpo_rollout_step_by_step(name, monkeypatch):
    """sampling_utils.py run_sample_step (MixGRPO's own loop) against ours on the same velocity and noise:
    the model calls (Flash's compressed tail: 11 at window [0..3], 20 at [14..17], Flash* 7), the
    timestep the model is fed (int(sigma x 1000) / 1000, bit for bit), every latent of the path, the
    window's log-probabilities and the sample it decodes (drop_last_sample: the last data prediction,
    equal to the last latent where the schedule ends at 0)."""
    fx = fixture("mixgrpo_sampling.json")
    case = fx["outputs"][name]
    cfg, sig, path, logp, fed = _rollout(case, fx["inputs"], monkeypatch)
    assert len(sig) - 1 == cfg.steps_at(0) == case["nfe"]
    assert fed == case["model_timestep_input"]
    want = torch.tensor(case["latents"])
    assert path.shape == want.shape
    if cfg.ode_solver == "euler":  # the SDE and Euler steps in MixGRPO's float32 order: bit for bit
        assert torch.equal(path, want) and torch.equal(path[:, -1], torch.tensor(case["sample"]))
    else:  # its DPM coefficients come from float32 sigmas, ours from float64 (NFT's): within 1e-6
        torch.testing.assert_close(path, want, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(path[:, -1], torch.tensor(case["sample"]), rtol=2e-6, atol=2e-6)
    w = case["window"]
    assert torch.equal(logp[:, w], torch.tensor(case["log_probs"])[:, w])  # the window's SDE steps, bit for bit


def test_mixgrpo_dpm_apply_all(monkeypatch):
    """dpm_apply_strategy all: DPM-Solver++ at every deterministic step (bit for bit before the window)
    and the first-order SDE-DPM step inside it, whose mean and std equal MixGRPO's
    (sampling_utils.py:421-434) on its own path. Deliberate difference: MixGRPO's rollout takes the
    window's SDE steps at second order while its training scores a fresh first-order draw
    (train_grpo_flux.py:157-168); here the rollout and the training both take the first-order step,
    so the first ratio is 1 and the path after the window's first step is not MixGRPO's."""
    fx = fixture("mixgrpo_sampling.json")
    case = fx["outputs"]["all_order2_window_2"]
    cfg, sig, path, _, fed = _rollout(case, fx["inputs"], monkeypatch)
    want = torch.tensor(case["latents"])
    assert fed[:3] == case["model_timestep_input"][:3] and cfg.steps_at(0) == case["nfe"] == 25
    torch.testing.assert_close(path[:, :3], want[:, :3], rtol=2e-6, atol=2e-6)  # steps 0 and 1: before the window
    assert [cfg.solver_at(t, 0) for t in range(6)] == [1, 2, 0, 0, 0, 0] and cfg.solver_at(6, 0) == 2
    for j, t in enumerate(case["window"]):
        x = want[:, t]
        ts = cfg.model_sigma(sig[t].expand(len(x)))
        out = sampler.sde_step(x, _velocity(x, ts), float(sig[t]), float(sig[t + 1]), sde_type="dpm",
                               noise_level=0.7, x_next=want[:, t + 1])
        torch.testing.assert_close(out.mean, torch.tensor(case["first_order_sde_mean"][j]), rtol=2e-6, atol=2e-6)
        assert out.std[0].item() == pytest.approx(case["first_order_sde_std"][j], rel=1e-6)


def test_flash_schedules_and_model_calls_match_every_window():
    """sampling_utils.py:44-54 for every window MixGRPO-Flash (ratio 0.4) and Flash* (0.2) reach:
    the rebuilt sigmas bit for bit and the model calls, as the window moves (mixgrpo_window.json)."""
    d = fixture("mixgrpo_window.json")
    sigmas = torch.tensor(d["inputs"]["sigmas"])
    for key, ratio in (("flash_schedules_by_window", 0.4), ("flash_star_schedules_by_window", 0.2)):
        for window, s in d["outputs"][key].items():
            if s is None:  # the empty window (start K - 2), which a run never reaches (check_steps)
                continue
            last = s["last_sde_index"]
            if solvers.post_points(25, last, ratio) < 2:
                continue  # the tail is one point and ends above sigma 0: refused (below)
            got = solvers.compressed(sigmas, last, ratio, 3.0)
            assert got.tolist() == s["sigmas"] and len(got) - 1 == s["nfe"], (key, window)
    flash = WindowSchedule(4, 1, 20, 25)
    calls = {len(solvers.compressed(sigmas, flash.window(k)[1] - 1, 0.4, 3.0)) - 1 for k in range(300)}
    assert calls == {11, 12, 13, 14, 15, 16, 17, 18, 19, 20}  # Flash's 300 steps: 11 to 20 in place of 25


def test_flash_refuses_a_tail_of_one_point():
    from config.cli import parse_config
    from config.validate import validate

    cfg = parse_config(["--preset", "tiny", "--algorithm", "mixgrpo", "--sample-steps", "25", "--steps", "400",
                        "--window-interval", "20", "--schedule", "dance", "--post-compress", "0.4",
                        "--ode-solver", "dpm2"])
    cfg.resolve_defaults()
    with pytest.raises(ValueError, match="--post-compress 0.4 leaves one point after the window of step 360"):
        validate(cfg, 2)


# ----- MixGRPO's loss options ---------------------------------------------------------------------------
def test_mixgrpo_kl_to_old_is_half_the_squared_log_ratio():
    """train_grpo_flux.py:567-584: loss = clipped surrogate + kl_coeff x 1/2 mean (log p - log p_old)^2;
    the KL-to-old term is outside the advantages' scale (it stays unscaled under the global std)."""
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    old, adv = torch.tensor([-1.1, -1.9, -0.5]), torch.tensor([1.0, -0.5, 2.0])
    loss = MixGRPOLoss(1e-4, 0.0, "flow_grpo", 0.01)
    policy, rest, stats = loss(lp, old, adv)
    ratio = torch.exp(lp - old)
    want_policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 1e-4, 1 + 1e-4)).sum()
    torch.testing.assert_close(policy, want_policy)
    torch.testing.assert_close(rest, 0.01 * 0.5 * ((lp - old) ** 2).sum())
    assert loss.unscaled_term and dict(zip(loss.STATS, stats.tolist()))["kl_old"] == pytest.approx(0.01, rel=1e-5)


def test_mixgrpo_balance_order_alternates_signs_and_drops_zeros():
    """reward_model/utils.py:95-125 (balance_pos_neg): positives and negatives alternate, the smaller
    side first, the larger side's rest after, zero advantages left out; keyed by (seed, step) here."""
    ids, adv = list(range(8)), [0.5, -1.0, 0.0, 2.0, -0.3, -0.2, 0.0, -0.1]
    order = training_order(ids, adv, "balance", seed=0, step=3)
    signs = [adv[i] > 0 for i in order]
    assert sorted(order) == [0, 1, 3, 4, 5, 7] and signs[:4] == [True, False, True, False]
    assert signs[4:] == [False, False] and order == training_order(ids, adv, "balance", seed=0, step=3)
    assert sorted(training_order(ids, adv, "random", seed=0, step=3)) == ids


# ----- Flow-GRPO-Fast's window -------------------------------------------------------------------------
@pytest.mark.parametrize("case", range(3))
def test_flow_grpo_fast_window_frequencies(case):
    """sd3_pipeline_with_logprob_fast.py: start = randint(range[0], range[1] - size), one draw per
    sampling batch; ours per group, keyed by (seed, step, group). The same starts, each as likely:
    with K = 10, size 3, range 0:5 the SDE steps 0..4 run with frequencies 1/3, 2/3, 1, 2/3, 1/3."""
    c = fixture("flow_grpo_fast_window.json")["outputs"]["cases"][case]
    if case == 0:
        assert c["exact_frequencies"][:6] == pytest.approx([1 / 3, 2 / 3, 1, 2 / 3, 1 / 3, 0])
    window = GroupWindow(c["size"], *c["range"], group_size=4, seed=1)
    draws = [window.window(step, 4 * g) for step in range(40) for g in range(50)]
    assert {s for s, _ in draws} == set(c["starts"])
    freq = np.bincount([t for s, e in draws for t in range(s, e)], minlength=c["num_steps"]) / len(draws)
    np.testing.assert_allclose(freq, c["exact_frequencies"], atol=0.04)
    np.testing.assert_allclose(c["peer_frequencies"], c["exact_frequencies"], atol=0.04)
    assert window.window(7, 9) == window.window(7, 11) == GroupWindow(c["size"], *c["range"], 4, 1).window(7, 8)
