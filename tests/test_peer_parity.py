"""Parity with the peers' own code (docs/ALGORITHMS.md): the reference vectors in tests/fixtures/peers
were computed by yifan123/flow_grpo and XueZeyue/DanceGRPO from the exact source text at the commits
each file names; here the project's functions take the same inputs. float32 results agree to a few
units in the last place (most bit for bit); where the project keeps a deliberate difference, the
test says which and checks the difference is the one docs/ALGORITHMS.md describes."""
import json
import math
import os

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from config.cli import load_config_files
from rl import advantages, algorithms, sampler
from rl.algorithms import flow_dppo
from rl.loss import ClippedPolicyLoss, clipped_policy_loss, kl_to_reference

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "peers")
F32 = dict(rtol=4 * torch.finfo(torch.float32).eps, atol=1e-7)  # a few ulp of float32: reductions
EXACT = dict(rtol=0, atol=0)  # element-wise float32 arithmetic in the peer's order
F64 = dict(rtol=1e-12, atol=1e-15)


def fixture(name: str) -> dict:
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


def T(d) -> torch.Tensor:
    """A fixture tensor {shape, dtype, data}."""
    return torch.tensor(d["data"], dtype=getattr(torch, d["dtype"])).reshape(d["shape"])


# ----- schedules, timesteps, the quantised model timestep ------------------------------------------------
def test_flow_grpo_sigmas_are_the_diffusers_schedule():
    fx = fixture("flow_grpo_sde_step.json")["inputs"]["scheduler"]
    sched = FlowMatchEulerDiscreteScheduler(**fx["config"])
    assert torch.equal(sampler.make_sigmas(sched, fx["K"], "static", shift=fx["config"]["shift"]), T(fx["sigmas"]))


@pytest.mark.parametrize("case", ["K16_shift3", "K10_shift3", "K50_shift3", "K16_shift5"])
def test_dance_grpo_schedule_timesteps_and_trained_count(case):
    """DanceGRPO's own float32 shift of linspace(1, 0, K+1) bit for bit; the model's timestep
    int(sigma*1000)/1000 bit for bit (FLUX gets timesteps/1000); int((K-1) x fraction) trained steps,
    never the last (train_grpo_flux.py:127-128, 231, 506-512, 570)."""
    s = fixture("dance_grpo_schedule.json")["outputs"]["schedules"][case]
    sigmas = sampler.make_sigmas(FlowMatchEulerDiscreteScheduler(), s["K"], "dance", shift=s["shift"])
    assert torch.equal(sigmas, T(s["sigma_schedule"]))
    cfg = sampler.SamplingConfig(16, 16, s["K"], quantize_timestep=True)
    assert torch.equal(cfg.model_sigma(sigmas[:-1]), T(s["flux_model_timestep_input"]))
    # HunyuanVideo takes the integer; its adapter's 1000 x sigma is that integer exactly on these schedules
    assert (cfg.model_sigma(sigmas[:-1]) * 1000).tolist() == [float(i) for i in s["hunyuan_model_timestep_input"]]
    assert torch.equal(sampler.SamplingConfig(16, 16, s["K"]).model_sigma(sigmas), sigmas)  # off: exact sigma
    dance = algorithms.algorithm("dance_grpo")
    for fraction, count in s["train_timesteps_line570"].items():
        for sample in range(6):
            ts = dance.timesteps(s["K"], float(fraction), seed=0, step=3, sample_id=sample)
            assert len(ts) == count and len(set(ts)) == count
            assert set(ts) <= set(range(s["candidate_train_steps_after_drop_last_line512"]))


def test_dance_grpo_subsets_are_keyed_by_the_sample_not_a_global_rng():
    """Deliberate difference: DanceGRPO draws each sample's subset from torch's global RNG
    (train_grpo_flux.py:551-556, fixture `random_step_selection_example`), so which steps a
    sample trains depends on the process and the order of draws; ours come from (seed, step,
    sample), so every placement trains the same transitions. The counts agree."""
    example = fixture("dance_grpo_schedule.json")["outputs"]["random_step_selection_example"]
    dance = algorithms.algorithm("dance_grpo")
    ours = [dance.timesteps(16, 0.6, seed=0, step=0, sample_id=i) for i in range(4)]
    assert [len(t) for t in ours] == [len(t) for t in example["trained_step_indices_per_sample"]] == [9] * 4
    assert ours == [dance.timesteps(16, 0.6, seed=0, step=0, sample_id=i) for i in range(4)]
    assert len(set(ours)) > 1


def test_flow_grpo_trains_the_first_int_k_fraction_steps():
    flow = algorithms.algorithm("flow_grpo")
    assert flow.timesteps(10, 0.99, seed=0, step=0, sample_id=0) == tuple(range(9))  # train_sd3.py:345
    assert flow.timesteps(10, 1.0, seed=0, step=0, sample_id=0) == tuple(range(10))  # base.py's 1.0


# ----- the steps and their log-probabilities ---------------------------------------------------------
def _step_cases(name):
    fx = fixture(name)
    inputs = fx["inputs"]
    x = T(inputs.get("x_sample") or inputs["x_latents"])
    v = T(inputs["model_output_v"])
    return fx, x, v


@pytest.mark.parametrize("sde_type,name", [("sde", "flow_grpo_sde_step.json"), ("cps", "flow_grpo_cps_step.json")])
def test_flow_grpo_steps(sde_type, name):
    """sd3_sde_with_logprob.py:11-70 (sde, @ac4c86e) and its cps branch (@54809b5:70-89): scoring a
    given x', and sampling with the generator's noise, at t = 0, 4, 8 and the last step t = 9."""
    fx, x, v = _step_cases(name)
    noise = T(fx["inputs"]["generator_noise"])
    for case in fx["outputs"]["cases"]:
        sc = case["scoring"]
        out = sampler.sde_step(x, v, case["sigma"], case["sigma_next"], sde_type=sde_type,
                               noise_level=case["noise_level"], x_next=T(sc["prev_sample_input"]))
        torch.testing.assert_close(out.mean, T(sc["prev_sample_mean"]), **EXACT)
        torch.testing.assert_close(out.std_dev_t, T(sc["std_dev_t"]).flatten(), **EXACT)
        torch.testing.assert_close(out.log_prob, T(sc["log_prob"]), **F32)
        drawn = sampler.sde_step(x, v, case["sigma"], case["sigma_next"], sde_type=sde_type,
                                 noise_level=case["noise_level"], noise=noise)
        torch.testing.assert_close(drawn.x_next, T(case["internal_noise"]["prev_sample"]), **EXACT)
        torch.testing.assert_close(drawn.log_prob, T(case["internal_noise"]["log_prob"]), **F32)


def test_cps_last_step_is_scored_like_every_other_row():
    """At sigma' = 0 CPS's std is 0; Flow-GRPO still scores x' against the mean (-(x' - mu)^2). The
    value of a row does not depend on whether its batch holds rows of other timesteps (it used to be
    0 when every row of a batch was at the last step)."""
    fx, x, v = _step_cases("flow_grpo_cps_step.json")
    last = next(c for c in fx["outputs"]["cases"] if c["sigma_next"] == 0.0)
    x_next = T(last["scoring"]["prev_sample_input"])
    alone = sampler.sde_step(x, v, last["sigma"], 0.0, sde_type="cps", noise_level=last["noise_level"], x_next=x_next)
    assert (alone.std == 0).all() and (alone.log_prob < 0).all()
    torch.testing.assert_close(alone.log_prob, T(last["scoring"]["log_prob"]), **F32)
    sigma = torch.tensor([last["sigma"], 0.5, last["sigma"]])
    sigma_next = torch.tensor([0.0, 0.4, 0.0])
    mixed = sampler.sde_step(x, v, sigma, sigma_next, sde_type="cps", noise_level=last["noise_level"], x_next=x_next)
    torch.testing.assert_close(mixed.log_prob[[0, 2]], alone.log_prob[[0, 2]], rtol=0, atol=0)


def test_dance_grpo_step():
    """flux_step with sde_solver (train_grpo_flux.py:131-170; hunyuan:57-96 is identical): mean,
    std and log-prob of a given x', and sampling with the given noise, float32."""
    fx, x, v = _step_cases("dance_grpo_step.json")
    noise = T(fx["inputs"]["internal_noise"])
    for case in fx["outputs"]["cases"]:
        out = sampler.sde_step(x, v, case["sigma"], case["sigma_next"], sde_type="dance", noise_level=case["eta"],
                               x_next=T(case["scoring"]["prev_sample_input"]))
        torch.testing.assert_close(out.mean, T(case["prev_sample_mean_sde_solver"]), **EXACT)
        assert out.std_dev_t.double().sub(case["std_dev_t_python_float"]).abs().max() < 1e-7  # theirs a float64
        torch.testing.assert_close(out.log_prob, T(case["scoring"]["log_prob"]), **F32)
        drawn = sampler.sde_step(x, v, case["sigma"], case["sigma_next"], sde_type="dance", noise_level=case["eta"],
                                 noise=noise)
        ref = case["internal_noise_torch_manual_seed_1234"]
        torch.testing.assert_close(drawn.x_next, T(ref["prev_sample"]), **F32)
        torch.testing.assert_close(drawn.log_prob, T(ref["log_prob"]), **F32)


def test_dance_grpo_bf16_velocity_is_stepped_in_float32():
    """Deliberate difference: with a bf16 model output DanceGRPO multiplies dsigma x v and sigma x v
    in bf16 before adding them to the float32 latents; every step here runs in float32 (a bf16 v is
    cast first), so its log-probs stay the float32 ones, 1e-3 relative from DanceGRPO's bf16 values."""
    fx, x, v = _step_cases("dance_grpo_step.json")
    for case in fx["outputs"]["cases"]:
        x_next = T(case["scoring"]["prev_sample_input"])
        ours = sampler.sde_step(x, v.bfloat16(), case["sigma"], case["sigma_next"], sde_type="dance",
                                noise_level=case["eta"], x_next=x_next).log_prob
        exact = sampler.sde_step(x, v.bfloat16().float(), case["sigma"], case["sigma_next"], sde_type="dance",
                                 noise_level=case["eta"], x_next=x_next).log_prob
        assert torch.equal(ours, exact)
        theirs = T(case["bf16_model_output_scoring"]["log_prob"])
        assert ((ours - theirs).abs() / theirs.abs().clamp_min(1e-2)).max() < 1e-2


# ----- the KL term ---------------------------------------------------------------------------------
def test_kl_is_flow_grpos():
    """train_sd3.py:895-896 divides by 2 std_dev_t^2 without sqrt(-dt); --kl-form transition keeps
    the exact KL of the two Gaussian steps, which is Flow-GRPO's divided by sigma - sigma'."""
    fx = fixture("flow_grpo_kl.json")
    x, v, v_ref = (T(fx["inputs"][k]) for k in ("x_sample", "model_output_v", "model_output_v_ref"))
    for case in fx["outputs"]["cases"]:
        args = dict(sde_type="sde", noise_level=case["noise_level"], x_next=x)
        out = sampler.sde_step(x, v, case["sigma"], case["sigma_next"], **args)
        ref = sampler.sde_step(x, v_ref, case["sigma"], case["sigma_next"], **args)
        torch.testing.assert_close(out.mean, T(case["prev_sample_mean"]), **EXACT)
        torch.testing.assert_close(ref.mean, T(case["prev_sample_mean_ref"]), **EXACT)
        kl = kl_to_reference(out.mean, ref.mean, out.std_dev_t)
        torch.testing.assert_close(kl, T(case["kl_loss_per_sample_line895"]).flatten(), **F32)
        torch.testing.assert_close(kl.mean(), T(case["kl_loss_line896"]), **F32)
        transition = kl_to_reference(out.mean, ref.mean, out.std)
        torch.testing.assert_close(transition, kl / (case["sigma"] - case["sigma_next"]), rtol=1e-5, atol=0)
        for form, want in (("flow_grpo", kl), ("transition", transition)):
            _, term, _ = ClippedPolicyLoss(1e-4, 0.04, form)(out.log_prob, out.log_prob, torch.zeros(3), mean=out.mean,
                                                             mean_ref=ref.mean, std=out.std, std_dev_t=out.std_dev_t)
            torch.testing.assert_close(term, 0.04 * want.sum(), rtol=1e-6, atol=0)


# ----- advantages ------------------------------------------------------------------------------------
def _flow_rewards():
    fx = fixture("flow_grpo_advantages.json")
    prompts = fx["inputs"]["prompts"]
    group_ids = torch.tensor([ord(p) - ord("a") for p in prompts])
    return fx, T(fx["inputs"]["rewards"]), group_ids


@pytest.mark.parametrize("global_std", [True, False])
def test_flow_grpo_advantages(global_std):
    """stat_tracking.py:11-55 (float64, population std + 1e-4, per-prompt mean; global_std: the
    batch's std) and the clamp at 5 (train_sd3.py:881-885). An all-equal group gives exact zeros."""
    fx, rewards, group_ids = _flow_rewards()
    key = f"global_std_{global_std}"
    want = T(fx["outputs"]["advantages_after_clamp_5"][key])
    rule = advantages.AdvantageRule(std_mode="global" if global_std else "group", clip=5.0)
    ids = list(range(len(rewards)))
    whole = advantages.fragment_advantages(rule, {"combined": rewards}, group_ids, ids, whole_step=True)
    torch.testing.assert_close(whole.advantages.double(), want, rtol=2 ** -23, atol=1e-12)  # theirs float64
    exact = advantages.centred(rewards, group_ids) / (
        (advantages.std_of(rewards, 0) if global_std else advantages.group_stds(rewards, group_ids, 0)) + 1e-4)
    torch.testing.assert_close(exact, T(fx["outputs"]["per_prompt_stat_tracker"][key]["advantages_from_1d_rewards"]),
                               **F64)
    assert (whole.advantages[group_ids == 1] == 0).all()  # group 'b': all 0.7


def test_flow_grpo_global_std_from_streamed_fragments():
    """Streamed: each fragment's group-centred u, the step's end scales them by 1/(std + 1e-4) from
    every fragment's facts, in any arrival order: the global-std advantages of stat_tracking.py:27."""
    fx, rewards, group_ids = _flow_rewards()
    want = T(fx["outputs"]["advantages_after_clamp_5"]["global_std_True"])
    rule = advantages.AdvantageRule(std_mode="global")
    facts, us = [], {}
    for g in (2, 0, 3, 1):  # one group per fragment, arriving in another order
        rows = torch.nonzero(group_ids == g).flatten()
        out = advantages.fragment_advantages(rule, {"combined": rewards[rows]}, group_ids[rows], rows.tolist())
        facts.append(out.facts)
        us.update(zip(rows.tolist(), out.advantages.tolist()))
    end = advantages.step_end(rule, facts, whole_step=False, seed=0, step=0)
    assert end.rows == {} and end.metrics["train/adv_clamped"] == 0
    got = torch.tensor([us[i] * end.scale for i in range(len(rewards))], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-12)  # float32 u times the float64 scale


@pytest.mark.parametrize("g", [12, 4])
def test_dance_grpo_group_advantages(g):
    """train_grpo_flux.py:533-548: contiguous groups, Bessel std (torch.std) + 1e-8, float32 there;
    ours in float64, rounded once. The all-equal block is exactly 0."""
    fx = fixture("dance_grpo_advantages.json")
    rewards = T(fx["inputs"]["rewards_vq"])
    group_ids = torch.arange(len(rewards)) // g
    a = algorithms.algorithm("dance_grpo")
    ours = advantages.group_advantages(rewards, group_ids, adv_clip=math.inf, ddof=a.std_ddof, eps=a.std_eps)
    want = T(fx["outputs"]["flux_group_advantages"][f"use_group_G{g}"])
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-6)
    population = advantages.group_advantages(rewards, group_ids, adv_clip=math.inf, eps=1e-8)  # np.std's
    ratio = (want / population)[population.abs() > 1e-3]  # the Bessel factor a population std would miss
    torch.testing.assert_close(ratio, torch.full_like(ratio, math.sqrt((g - 1) / g)), rtol=1e-4, atol=0)
    if g == 4:
        assert (ours[12:16] == 0).all()


def test_dance_grpo_best_of_n_per_group():
    """train_grpo_hunyuan.py:394-409 ranks the whole local batch; the shipped run holds one prompt's
    group per rank, so its batch is one group: there the selections agree (top ceil(n/2), bottom
    floor(n/2)). Deliberate difference: ours ranks within each group, so several groups on one rank
    each keep n (DanceGRPO would keep n over all of them, as its G=12 rows below show)."""
    fx = fixture("dance_grpo_advantages.json")
    vq, mq = T(fx["inputs"]["rewards_vq"]), T(fx["inputs"]["rewards_mq"])
    for case in fx["outputs"]["hunyuan_bestofn"]:
        g, n = case["num_generations"], case["bestofn"]
        group_ids = torch.arange(len(vq)) // g
        rule = advantages.AdvantageRule(ddof=1, eps=1e-8, combine="advantages", best_of_n=n,
                                        weights=(("vq", case["vq_coef"]), ("mq", case["mq_coef"])))
        out = advantages.fragment_advantages(rule, {"vq": vq, "mq": mq, "combined": vq}, group_ids,
                                             list(range(len(vq))))
        torch.testing.assert_close(out.advantages, T(case["total_scores"]), rtol=1e-5, atol=1e-5)
        kept = set(torch.nonzero(out.keep).flatten().tolist())
        if g == len(vq) or n == g:
            assert kept == set(case["kept_row_ids"]), case
        else:
            per_group = [sum(1 for i in kept if i // g == k) for k in range(len(vq) // g)]
            theirs = [sum(1 for i in case["kept_row_ids"] if i // g == k) for k in range(len(vq) // g)]
            assert per_group == [n] * len(per_group) and theirs != per_group


def test_flow_grpo_zero_advantage_filter_and_readmission():
    """train_sd3.py:797-817: samples whose advantage is exactly 0 are dropped and, when the kept
    count is not a multiple of num_batches_per_epoch, that many of them are re-admitted if there
    are enough. The counts agree; deliberate difference: which ones come from (seed, step), not
    the global torch RNG of each process."""
    fx, rewards, group_ids = _flow_rewards()
    for case in fx["outputs"]["zero_std_filter"]["global_std_False"]:
        rule = advantages.AdvantageRule(drop_zero=True, readmit_multiple=case["num_batches_per_epoch"])
        out = advantages.fragment_advantages(rule, {"combined": rewards}, group_ids, list(range(24)), whole_step=True,
                                             seed=case["torch_manual_seed"], step=0)
        assert torch.nonzero(out.zero).flatten().tolist() == case["zero_adv_rows"]
        assert int(out.keep.sum()) == case["n_kept"]
        assert set(torch.nonzero(out.keep & out.zero).flatten().tolist()) <= set(case["zero_adv_rows"])
        end = advantages.step_end(rule, [out.facts], whole_step=True, seed=case["torch_manual_seed"], step=0)
        assert end.metrics["train/readmitted"] == len(case["readmitted_row_ids"])


# ----- the loss and its gradient ---------------------------------------------------------------------
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_flow_grpo_clipped_loss_gradient_and_statistics(beta):
    """train_sd3.py:881-925: clamp at 5, max(-A r, -A clip(r)), mean over the micro-batch, its
    gradient with respect to the log-prob, approx_kl and clipfrac; with beta the KL of given means."""
    fx = fixture("flow_grpo_advantages.json")
    inp, want = fx["inputs"]["clipped_loss"], fx["outputs"]["clipped_loss"][f"beta_{beta}"]
    adv = T(inp["advantages_raw"]).clamp(-inp["adv_clip_max"], inp["adv_clip_max"])
    old = T(inp["old_log_probs"])
    new = T(inp["new_log_prob"]).requires_grad_(True)
    mean = torch.randn(8, 4, 4, 4, generator=torch.Generator().manual_seed(31)).requires_grad_(True)
    mean_ref = torch.randn(8, 4, 4, 4, generator=torch.Generator().manual_seed(32))
    std_dev_t = torch.full((8,), 0.4344147741794586)
    loss = ClippedPolicyLoss(inp["clip_range"], beta)
    policy, kl, stats = loss(new, old, adv, mean=mean, mean_ref=mean_ref, std=std_dev_t, std_dev_t=std_dev_t)
    n = len(adv)
    total = (policy + (kl if kl is not None else 0)) / n
    total.backward()
    torch.testing.assert_close(new.grad, T(want["grad_wrt_log_prob"]), **F32)
    torch.testing.assert_close(total.detach(), T(want["loss"]), rtol=1e-6, atol=1e-9)
    s = dict(zip(loss.STATS, (stats / n).tolist()))
    assert s["policy_loss"] == pytest.approx(want["policy_loss"]["data"], rel=1e-6)
    assert s["approx_kl"] == pytest.approx(want["approx_kl"]["data"], rel=1e-5)
    for ours, theirs in (("clipfrac", "clipfrac"), ("clipfrac_high", "clipfrac_gt_one"), ("clipfrac_low", "clipfrac_lt_one")):
        assert s[ours] == want[theirs]["data"]
    if beta:
        assert s["kl"] == pytest.approx(want["kl_loss"]["data"], rel=1e-6)
        assert mean.grad.abs().sum().item() == pytest.approx(want["grad_wrt_prev_sample_mean_sum_abs"], rel=1e-5)


@pytest.mark.parametrize("coefs", [None, "vq1.0_mq0.0", "vq0.6_mq0.4"])
def test_dance_grpo_losses_and_their_gradients(coefs):
    """train_grpo_flux.py:589-603 (one advantage) and train_grpo_hunyuan.py:447-477 (one clipped loss
    per reward with the same ratio, weighted and summed: --reward-combine losses), each divided by
    gradient_accumulation_steps x train_timesteps as the trainer divides by its transition count."""
    fx = fixture("dance_grpo_loss.json")
    inp = fx["inputs"]
    vq, mq = T(inp["vq_or_flux_advantages"]), T(inp["mq_advantages"])
    old, new = T(inp["old_log_probs"]), T(inp["new_log_probs"]).requires_grad_(True)
    div = inp["gradient_accumulation_steps"] * inp["train_timesteps"]
    if coefs is None:
        adv, rows = vq.clamp(-5, 5), fx["outputs"]["flux_per_sample"]
    else:
        w = [float(c[2:]) for c in coefs.split("_")]
        adv = torch.stack([w[0] * vq.clamp(-5, 5), w[1] * mq.clamp(-5, 5)], dim=1)  # what the generator sends
        rows = fx["outputs"]["hunyuan_per_sample"][coefs]
    per, ratio = clipped_policy_loss(new, old, adv, 1e-4)
    (per / div).sum().backward()
    torch.testing.assert_close(ratio, torch.tensor([r["ratio"] for r in rows]), rtol=0, atol=0)
    want_loss = torch.tensor([r["loss" if coefs is None else "final_loss"] for r in rows])
    torch.testing.assert_close((per / div).detach(), want_loss, rtol=2e-6, atol=1e-9)
    torch.testing.assert_close(new.grad, torch.tensor([r["grad_wrt_new_log_prob"] for r in rows]), rtol=2e-6,
                               atol=1e-9)


@pytest.mark.parametrize("case", range(4))
def test_flow_dppo_masked_loss_gradient_and_statistics(case):
    """VeRL-Omni's FlowDPPOLoss.compute_loss (diffusion_algos.py:361-443 @ a1139baf, run outside the
    project on the fixture's inputs): the divergence to the rollout's transition mean, the asymmetric
    mask, the mean of the kept -A r over the micro-batch and its gradient with respect to the log-prob,
    and the peer's fractions, for two thresholds with and without add_kl_coefficient."""
    fx = fixture("flow_dppo_loss.json")
    inp, want = fx["inputs"], fx["outputs"]["cases"][case]
    old, adv = T(inp["old_log_prob"]), T(inp["advantages"])
    new = T(inp["log_prob"]).requires_grad_(True)
    mean, rollout_mean = T(inp["prev_sample_mean"]), T(inp["old_prev_sample_mean"])
    std_dev_t, sqrt_dt = T(inp["std_dev_t"]).flatten(), T(inp["sqrt_dt"])
    loss = flow_dppo.MaskedPolicyLoss(want["kl_mask_threshold"], want["add_kl_coefficient"], beta=0.0)
    policy, kl, stats = loss(new, old, adv, mean=mean, std_dev_t=std_dev_t, rollout_mean=rollout_mean,
                             sqrt_dt=sqrt_dt)
    n = len(adv)
    assert kl is None and not loss.needs_reference
    (policy / n).backward()
    torch.testing.assert_close((policy / n).detach(), T(want["loss"]), **F32)
    torch.testing.assert_close(new.grad, T(want["grad_log_prob"]), **F32)
    s, m = dict(zip(loss.STATS, (stats / n).tolist())), want["metrics"]
    for ours, theirs in (("divergence_high", "kl_mask_fraction"), ("masked_positive", "pos_rm_fraction"),
                         ("masked_negative", "neg_rm_fraction"), ("masked", "masked_fraction")):
        assert s[ours] == m[f"actor/{theirs}"], ours  # counts of 8: exact
    assert s["divergence"] == pytest.approx(m["actor/kl_new_old_mean"], rel=1e-6)
    assert s["approx_kl"] == pytest.approx(m["actor/approx_kl"], rel=1e-5)
    assert s["ratio"] == pytest.approx(m["actor/ratio_mean"], rel=1e-6)
    d = flow_dppo.divergence(mean, rollout_mean, std_dev_t, sqrt_dt, want["add_kl_coefficient"])
    assert d.max().item() == pytest.approx(m["actor/kl_new_old_max"], rel=1e-6)


def test_flow_dppo_mask_takes_every_branch_and_scales_with_the_global_std():
    """On the fixture's rows the mask drops a positive and a negative update and keeps the corrective
    ones; the kept terms are linear in A (the mask reads A's sign only), so the global std's scale
    applied at the step's end gives the loss of scaled advantages."""
    inp = fixture("flow_dppo_loss.json")["inputs"]
    old, new, adv = T(inp["old_log_prob"]), T(inp["log_prob"]), T(inp["advantages"])
    kl_old = flow_dppo.divergence(T(inp["prev_sample_mean"]), T(inp["old_prev_sample_mean"]),
                                  T(inp["std_dev_t"]).flatten(), T(inp["sqrt_dt"]))
    per, ratio, positive, negative = flow_dppo.masked_policy_loss(new, old, adv, kl_old, 1e-5)
    high = kl_old >= 1e-5
    assert positive.flatten().tolist() == (high & (ratio > 1) & (adv > 0)).tolist() and positive.any()
    assert negative.flatten().tolist() == (high & (ratio < 1) & (adv < 0)).tolist() and negative.any()
    kept_corrective = high & ~positive.flatten() & ~negative.flatten() & (adv != 0)
    assert kept_corrective.any() and (per[kept_corrective] == -adv[kept_corrective] * ratio[kept_corrective]).all()
    scaled, *_ = flow_dppo.masked_policy_loss(new, old, 0.37 * adv, kl_old, 1e-5)
    torch.testing.assert_close(scaled, 0.37 * per, rtol=1e-6, atol=0)


# ----- the recipes set their algorithm's conventions -------------------------------------------------
PUBLISHED = {  # std mode, zero-advantage re-admission multiple (None: no filter), per-reward losses, best-of-n
    "flow_grpo/flux_dev.toml": ("global", None, "rewards", 0),  # train_flux.py: no filter
    "flow_grpo/sd35_medium.toml": ("global", 4, "rewards", 0),  # train_sd3.py:797-817, num_batches_per_epoch 4
    "flow_grpo/qwen_image.toml": ("global", None, "rewards", 0),
    "flow_grpo/wan2_1_t2v_14b.toml": ("group", 2, "rewards", 0),  # its config: global_std False
    "flow_grpo/wan2_1_t2v_1_3b.toml": ("group", 2, "rewards", 0),
    "flow_grpo/sd35_medium_ocr_http.toml": ("global", 4, "rewards", 0),  # general_ocr_sd3
    "dance_grpo/flux_dev.toml": ("group", None, "rewards", 0),
    "dance_grpo/hunyuan_video.toml": ("group", None, "losses", 8),  # train_grpo_hunyuan.py:394-477
}


def test_every_flow_and_dance_grpo_recipe_is_listed():
    root = os.path.join(os.path.dirname(__file__), "..", "recipes")
    found = {f"{d}/{f}" for d in ("flow_grpo", "dance_grpo") for f in os.listdir(os.path.join(root, d))}
    assert found == set(PUBLISHED)


@pytest.mark.parametrize("recipe", list(PUBLISHED))
def test_recipes_set_the_published_conventions(recipe):
    """Each recipe sets the std its algorithm's authors use (Algorithm.std_mode, unless its config says
    otherwise, as Wan's), the quantised timestep of DanceGRPO, and the filters of its script."""
    cfg, _ = load_config_files([os.path.join(os.path.dirname(__file__), "..", "recipes", recipe)])
    rl, algorithm = cfg.rl, algorithms.algorithm(cfg.rl.algorithm)
    std, readmit, combine, best = PUBLISHED[recipe]
    assert rl.std_mode == std and (std == algorithm.std_mode or "wan" in recipe)
    assert cfg.sampling.quantize_timestep == algorithm.quantize_timestep
    assert (rl.drop_zero_std, rl.readmit_multiple) == ((readmit is not None), readmit or 1)
    assert (rl.reward_combine, rl.best_of_n) == (combine, best)
