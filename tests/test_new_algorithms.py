"""DiffusionNFT, MixGRPO's sliding window, Flow-DPPO and the DPM-Solver++ ODE steps
(docs/ALGORITHMS.md): the formulas against the peers' recorded outputs (tests/fixtures/peers,
produced by the peers' own code) and diffusers, and the trainer's paths (the forward process, the
rollout's means) against its own per-timestep loop. The placement-invariance runs through torchrun
are in tests/test_new_algorithms_runs.py."""
import json
import os

import pytest
import torch

from rl import algorithms, sampler
from rl.advantages import group_advantages
from rl.algorithms.mixgrpo import WindowSchedule
from rl.algorithms.nft import NFTLoss, optimality
from rl.algorithms.old_policy import SCHEDULES, OldPolicy, schedule

PEERS = os.path.join(os.path.dirname(__file__), "fixtures", "peers")


def _peer(name: str) -> dict:
    with open(os.path.join(PEERS, name)) as f:
        return json.load(f)


# ----- DiffusionNFT: the loss, the optimality probability, the old policy ---------------------------
def _nft_cases():
    d = _peer("diffusion_nft_loss.json")
    return [("sd3_beta1", d["inputs"], d["outputs"])] + [(c["name"], c["inputs"], c["outputs"]) for c in d["extra_cases"]]


@pytest.mark.parametrize("name,inputs,outputs", _nft_cases(), ids=[c[0] for c in _nft_cases()])
def test_nft_loss_and_gradient_match_the_peer(name, inputs, outputs):
    """NVlabs/DiffusionNFT's loss block run verbatim on these tensors (the fixture): per-sample
    positive and negative losses, the batch loss (policy + lambda KL; the peer's `loss += ...`
    works in place, so its recorded policy_loss already holds the KL term) and d loss / d v."""
    t32 = {k: torch.tensor(inputs[k], dtype=torch.float32) for k in ("x0", "xt", "t", "v_old", "v_theta", "v_ref")}
    assert torch.allclose((1 - t32["t"][:, None, None, None]) * t32["x0"]
                          + t32["t"][:, None, None, None] * torch.tensor(inputs["noise"]), t32["xt"], atol=1e-6)
    v = t32["v_theta"].clone().requires_grad_(True)
    loss_fn = NFTLoss(inputs["nft_beta"], inputs["kl_beta"], inputs["adv_clip_max"])
    adv = torch.tensor(outputs["advantages"], dtype=torch.float32)
    total, stats = loss_fn(t32["x0"], t32["xt"], t32["t"], v, t32["v_old"], adv, t32["v_ref"])
    n = len(adv)
    assert total.dtype == torch.float64  # the peer's adaptive weights are float64, and so is its loss
    assert (total / n).item() == pytest.approx(outputs["loss"], rel=1e-6)
    (total / n).backward()
    grad = torch.tensor(outputs["grad_v_theta"])
    assert (v.grad - grad).abs().max().item() < 1e-6 * grad.abs().max().item() + 1e-9
    names = dict(zip(NFTLoss.STATS, stats.tolist()))
    assert names["kl"] / n == pytest.approx(outputs["kl_div_loss"], rel=1e-5)
    assert names["positive_loss"] == pytest.approx(sum(outputs["positive_loss"]), rel=1e-5)
    assert names["negative_loss"] == pytest.approx(sum(outputs["negative_loss"]), rel=1e-5)
    assert names["policy_loss"] / n == pytest.approx(outputs["policy_loss"] - inputs["kl_beta"] * outputs["kl_div_loss"],
                                                     rel=1e-6)


def test_optimality_probability_matches_the_peer():
    """r = 1/2 + 1/2 clip(A/5, -1, 1), with NFT's global-std advantages (the std given to
    group_advantages): every case of the fixture, a zero-std group and a clipped outlier included."""
    for case in _peer("diffusion_nft_loss.json")["reward_to_r_cases"]:
        rewards = torch.tensor(case["rewards"], dtype=torch.float64)
        groups = torch.tensor([sorted(set(case["prompts"])).index(p) for p in case["prompts"]])
        adv = group_advantages(rewards, groups, adv_clip=5.0, std=rewards.std(unbiased=False).item())
        want = torch.tensor(case["advantages"], dtype=torch.float64).clamp(-5, 5)
        assert torch.allclose(adv.double(), want, atol=1e-6), case["name"]
        assert torch.allclose(optimality(adv, 5.0), torch.tensor(case["r"], dtype=torch.float64), atol=1e-7), case["name"]


def test_old_policy_decay_schedules_match_the_peer():
    d = _peer("diffusion_nft_old_policy.json")
    names = {0: "copy", 1: "linear_to_0_5", 2: "delayed_linear_to_0_999"}
    for kind, name in names.items():
        got = [SCHEDULES[name].decay(u) for u in d["inputs"]["steps"]]
        assert got == pytest.approx(d["outputs"][f"decay_type_{kind}"], abs=1e-12), name
    assert schedule("0:0.001:0.5") == SCHEDULES["linear_to_0_5"]
    with pytest.raises(ValueError, match="FLAT:UPRATE:UPHOLD"):
        schedule("linear")
    with pytest.raises(ValueError, match="UPHOLD in"):
        schedule("0:0.1:1.5")


def test_old_policy_soft_update_and_swap():
    """old <- d old + (1 - d) theta after the due updates only; `swapped` puts the old weights in the
    parameters and gives back the trained ones bit for bit."""
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    old = OldPolicy([p], schedule("0:0.25:0.5"), interval=2)
    with torch.no_grad():
        p.add_(1.0)  # the optimizer moved theta to [2, 3]
    assert old.after_update(1) is None and old.tensors[0].tolist() == [1.0, 2.0]  # not due
    assert old.after_update(2) == 0.5 and old.tensors[0].tolist() == [1.5, 2.5]
    with old.swapped():
        assert p.tolist() == [1.5, 2.5]
    assert p.tolist() == [2.0, 3.0] and old.tensors[0].tolist() == [1.5, 2.5]


# ----- which steps are trained: NFT's subset, MixGRPO's window --------------------------------------
def test_nft_trains_a_seeded_subset_of_every_sigma():
    """int(K x fraction) distinct sigma indices of all K (the first, sigma = 1, included), per sample,
    a function of (seed, step, sample) alone."""
    nft = algorithms.algorithm("nft")
    picks = [nft.timesteps(10, 0.99, seed=0, step=3, sample_id=i) for i in range(40)]
    assert all(len(p) == 9 and len(set(p)) == 9 and set(p) <= set(range(10)) for p in picks)
    assert len(set(picks)) > 1 and any(0 in p for p in picks) and any(9 in p for p in picks)
    assert picks[5] == nft.timesteps(10, 0.99, seed=0, step=3, sample_id=5)
    assert picks[5] != nft.timesteps(10, 0.99, seed=0, step=4, sample_id=5) or \
        picks[6] != nft.timesteps(10, 0.99, seed=0, step=4, sample_id=6)


@pytest.mark.parametrize("key,interval,stride", [("mixgrpo_default_windows", 25, 1), ("mixgrpo_flash_windows", 20, 1),
                                                 ("mixgrpo_flash_star_windows", 20, 0)])
def test_sliding_window_matches_mixgrpo(key, interval, stride):
    """MixGRPO's GRPOTrainingStates over 650 steps (the fixture): windows of 4 moving by the stride
    every interval, shrinking before K - 2 = 23, empty at 23, rolled back to 0 after it."""
    d = _peer("mixgrpo_window.json")
    w = WindowSchedule(4, stride, interval, d["inputs"]["sampling_steps"])
    assert [list(range(*w.window(s))) for s in d["inputs"]["steps"]] == d["outputs"][key]
    if stride:
        assert w.first_empty(range(650)) == 23 * interval
        assert w.first_empty(range(300)) is None  # MixGRPO's 300-step run never reaches it


def test_window_schedules_clamp_and_random():
    clamp = WindowSchedule(2, 1, 1, 6, "progressive-clamp")
    assert [clamp.window(s) for s in range(6)] == [(0, 2), (1, 3), (2, 4), (3, 4), (4, 4), (4, 4)]
    rand = WindowSchedule(2, 1, 1, 10, "random", seed=3)
    starts = [rand.start(s) for s in range(50)]
    assert set(starts) == set(range(7)) and starts == [WindowSchedule(2, 1, 1, 10, "random", seed=3).start(s)
                                                      for s in range(50)]
    with pytest.raises(ValueError, match="at least 3 sampling steps"):
        WindowSchedule(1, 1, 1, 2)


def test_sampling_follows_the_window_of_the_step():
    cfg = sampler.SamplingConfig(16, 16, 6, noise_level=0.7, window_schedule=WindowSchedule(2, 1, 3, 6))
    assert [cfg.noise_level_at(t, 0) for t in range(6)] == [0.7, 0.7, 0, 0, 0, 0]
    assert [cfg.noise_level_at(t, 3) for t in range(6)] == [0, 0.7, 0.7, 0, 0, 0]
    with pytest.raises(ValueError, match="needs the training step"):
        cfg.noise_level_at(0)


# ----- the second-order ODE steps ---------------------------------------------------------------------
def _velocity(x, sigma):
    return 0.7 * x + torch.sin(3 * x) * sigma + 0.2


def _run(cfg, sigmas, x, step=0):
    prev, trace = None, []
    for t in range(cfg.num_steps):
        out = sampler.sample_step(x, _velocity(x, sigmas[t]), sigmas, t, [0, 1], step, cfg, prev)
        x, prev = out.x_next, out.x0
        trace.append(x)
    return trace


def test_dpm2_matches_diffusers_dpm_solver_pp():
    """--ode-solver dpm2 is diffusers' DPMSolverMultistepScheduler (dpmsolver++, order 2, midpoint,
    flow prediction, first-order first and last steps) on the same sigmas. K = 20: below 15 steps
    diffusers also takes the second-to-last step first order, where NVlabs/DiffusionNFT does not."""
    from diffusers import DPMSolverMultistepScheduler

    k = 20
    sigmas = torch.linspace(1, 0, k + 1)
    sigmas = 3 * sigmas / (1 + 2 * sigmas)
    x0 = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    ours = _run(sampler.SamplingConfig(16, 16, k, noise_level=0.0, ode_solver="dpm2"), sigmas, x0)[-1]
    sched = DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint",
                                        prediction_type="flow_prediction", use_flow_sigmas=True,
                                        lower_order_final=True, final_sigmas_type="zero")
    sched.set_timesteps(k)
    sched.sigmas, sched.timesteps = sigmas.clone(), sigmas[:-1] * 1000
    y = x0.clone()
    for i, t in enumerate(sched.timesteps):
        y = sched.step(_velocity(y, sigmas[i]), t, y).prev_sample
    assert (ours - y).abs().max().item() < 1e-5
    euler = _run(sampler.SamplingConfig(16, 16, k, noise_level=0.0), sigmas, x0)[-1]
    assert (euler - y).abs().max().item() > 1e-3  # a different solver, not Euler again


def test_dpm2_runs_after_the_window_only():
    """MixGRPO-Flash: Euler before and SDE inside the window, DPM-Solver++ after it (the data
    prediction of every earlier step feeds the first post-window step)."""
    k = 8
    sigmas = torch.linspace(1, 0, k + 1)
    window = WindowSchedule(2, 1, 1, k)  # step 2: the SDE at steps 2 and 3
    flash = sampler.SamplingConfig(16, 16, k, noise_level=0.7, window_schedule=window, ode_solver="dpm2")
    plain = sampler.SamplingConfig(16, 16, k, noise_level=0.7, window_schedule=window)
    assert [flash.second_order_at(t, 2) for t in range(k)] == [False] * 4 + [True] * 3 + [False]
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    a, b = _run(flash, sigmas, x, step=2), _run(plain, sigmas, x, step=2)
    assert all(torch.equal(a[t], b[t]) for t in range(4)) and not torch.equal(a[4], b[4])


# ----- the trainer's forward-process path ---------------------------------------------------------------
def _nft_rollout(cfg_scale=1.0, lora=True):
    """A tiny FLUX (or SD3 with CFG) NFT trainer and the clean chunks of one fragment of 2 groups."""
    from config.schema import RunConfig
    from models import load_model
    from models.lora import apply_lora
    from parallel.trainer_intake import TrainChunk
    from parallel.stepplan import plan_step
    from rollout import encode_batch
    from trainer import Trainer

    torch.manual_seed(0)
    adapter = load_model("sd3" if cfg_scale > 1 else "flux", preset="tiny", seed=0)
    cfg = RunConfig()
    cfg.rl.algorithm, cfg.rl.timestep_fraction, cfg.rl.micro_batch, cfg.rl.beta = "nft", 0.6, 2, 1e-3
    cfg.rl.nft_beta, cfg.rl.old_policy_decay = 0.5, "0:0.5:0.5"
    cfg.optim.lora_rank = 4 if lora else 0
    if lora:
        apply_lora(adapter.transformer, 4, None, "attn", 0)
    sampling = sampler.SamplingConfig.for_adapter(adapter, height=16, width=16, num_steps=5, noise_level=0.0,
                                                  ode_solver="dpm2", cfg_scale=cfg_scale)
    trainer = Trainer(cfg, adapter, sampling)
    plan = plan_step(0, seed=0, num_prompts=4, prompts_per_step=2, group_size=2, micro_batch=2, num_replicas=1,
                     num_trainers=1)
    chunks, adv = [], torch.tensor([1.0, -0.5, 0.3, -0.8])
    for c in plan.fragments[0].chunks:
        cond, neg = encode_batch(adapter, ["a red circle", "a blue square"], "blurry", sampling)
        traj = sampler.denoise(adapter, cond, neg, list(c.sample_ids), 0, sampling)
        ids = torch.tensor(c.sample_ids)
        chunks.append(TrainChunk(0, 0, c.index, 0, ids, traj.latents[:, -1:], traj.log_probs[:, :0], adv[ids].clone(),
                                 torch.ones(2, dtype=torch.bool), traj.sigmas, cond, neg))
    return trainer, plan, chunks


def _grads(trainer):
    g = torch.cat([p.grad.reshape(-1) for p in trainer.params if p.grad is not None])
    trainer.optimizer.zero_grad(set_to_none=True)
    return g


@pytest.mark.parametrize("lora,cfg_scale", [(True, 1.0), (False, 1.0), (True, 2.0)], ids=["lora", "full", "lora-cfg"])
def test_nft_packed_gradients_equal_the_per_timestep_loop(lora, cfg_scale):
    """Clean records through the wire format and TSP's packing over 1 and 2 trainers give the
    per-timestep loop's gradient and statistics; the records carry one latent per sample."""
    from parallel.trainer_intake import TransitionBatch, TransitionIntake

    trainer, plan, chunks = _nft_rollout(cfg_scale, lora)
    assert chunks[0].clean and chunks[0].latents.shape[1] == 1
    chunks[1].keep[0] = False
    for chunk in chunks:
        trainer.train_chunk(chunk)
    ref, ref_sums, ref_n = _grads(trainer), dict(trainer.sums), trainer.num_transitions
    assert ref.norm() > 0 and ref_n == 3 * 3  # 3 kept samples x int(5 x 0.6) sigmas
    for num_trainers in (1, 2):
        trainer.reset_stats()
        intake = TransitionIntake(trainer.spec, tuple(range(num_trainers)), lambda r: 0, 4)
        for _, batch in intake.batches(plan, chunks):
            assert batch.x_next.shape == (len(batch.keep), 0)  # nothing but the clean sample travels
            trainer.train_transitions(TransitionBatch.from_payload(*batch.to_payload()))
        got = _grads(trainer)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5, num_trainers
        assert trainer.num_transitions == ref_n
        for k in ref_sums:
            assert trainer.sums[k] == pytest.approx(ref_sums[k], rel=1e-5, abs=1e-9), k


def test_nft_update_moves_the_old_policy_and_generation_uses_it():
    """After an update the old policy is d old + (1 - d) theta; a generator that shares the
    trainer's model (colocated, TAG) samples with it, and the trained weights come back after."""
    from parallel.scoring import LocalScorer
    from rollout import Generator

    trainer, plan, chunks = _nft_rollout()
    before = [p.detach().clone() for p in trainer.params]
    for chunk in chunks:
        trainer.train_chunk(chunk)
    trainer.current_step = 0
    stats = trainer.finish_step()
    assert stats["train/old_deviation"] == 0.0  # step 0: the old policy is the initial weights
    for o, b, p in zip(trainer.state.tensors, before, trainer.params):
        torch.testing.assert_close(o, 0.5 * b + 0.5 * p.detach(), rtol=0, atol=1e-7)
    theta, old = [p.detach().clone() for p in trainer.params], [o.clone() for o in trainer.state.tensors]
    gen = Generator(trainer.adapter, trainer.sampling, LocalScorer(None), [], seed=0,
                    policy=trainer.sampling_policy)  # a scorer stand-in: nothing is scored here
    cond = trainer.adapter.encode_prompts(["a red circle"])
    live = sampler.denoise(trainer.adapter, cond, None, [0], 1, trainer.sampling).latents
    with gen.policy():
        sampled_old = sampler.denoise(trainer.adapter, cond, None, [0], 1, trainer.sampling).latents
        assert all(torch.equal(p.detach(), o) for p, o in zip(trainer.params, old))
    assert not torch.equal(live, sampled_old)
    assert all(torch.equal(p.detach(), q) for p, q in zip(trainer.params, theta))
    assert all(torch.equal(o, q) for o, q in zip(trainer.state.tensors, old))
    held = trainer.sampling_tensors(trainer.names)  # what a publication sends the generators
    assert all(torch.equal(held[n].detach(), o) for n, o in zip(trainer.names, old))


# ----- Flow-DPPO: the rollout's means travel with the fragment, the mask in the trainer -------------------
def _dppo_rollout(threshold=1e-12):
    """A tiny FLUX Flow-DPPO trainer and the chunks of one fragment of 2 groups, sampled with the
    algorithm's sampler (it records every step's transition mean)."""
    from config.schema import RunConfig
    from models import load_model
    from models.lora import apply_lora
    from parallel.trainer_intake import TrainChunk
    from parallel.stepplan import plan_step
    from rollout import encode_batch
    from trainer import Trainer

    torch.manual_seed(0)
    adapter = load_model("flux", preset="tiny", seed=0)
    cfg = RunConfig()
    cfg.rl.algorithm, cfg.rl.micro_batch, cfg.rl.kl_mask_threshold, cfg.optim.lora_rank = "flow_dppo", 2, threshold, 4
    apply_lora(adapter.transformer, 4, None, "attn", 0)
    algorithm = algorithms.algorithm("flow_dppo")
    sampling = algorithm.sampling(cfg, sampler.SamplingConfig.for_adapter(adapter, height=16, width=16, num_steps=4))
    trainer = Trainer(cfg, adapter, sampling)
    plan = plan_step(0, seed=0, num_prompts=4, prompts_per_step=2, group_size=2, micro_batch=2, num_replicas=1,
                     num_trainers=1)
    chunks, adv = [], torch.tensor([1.0, -0.5, 0.3, -0.8])
    for c in plan.fragments[0].chunks:
        cond, neg = encode_batch(adapter, ["a red circle", "a blue square"], "", sampling)
        traj = sampler.denoise(adapter, cond, neg, list(c.sample_ids), 0, sampling)
        ids = torch.tensor(c.sample_ids)
        kept = algorithm.carried(traj)
        chunks.append(TrainChunk(0, 0, c.index, 0, ids, kept.latents, kept.log_probs, adv[ids].clone(),
                                 torch.ones(2, dtype=torch.bool), traj.sigmas, cond, neg, kept.steps))
    return trainer, plan, chunks


def test_flow_dppo_records_the_means_and_packs_them_like_the_path():
    """The rollout records each step's transition mean (what the SDE step drew around); TSP's wire
    format carries it with each transition. On-policy the divergence is 0 and nothing is dropped;
    once the weights moved, the mask drops some updates, alike in the per-timestep loop and packed."""
    from parallel.trainer_intake import TransitionBatch, TransitionIntake

    trainer, plan, chunks = _dppo_rollout()
    mean = chunks[0].steps["mean"]
    assert mean.shape == (2, 4, *chunks[0].latents.shape[2:])
    x, t = chunks[0].latents[:, 1], 1
    v = sampler.guided_velocity(trainer.adapter, x, chunks[0].sigmas[t].expand(2), chunks[0].cond, None,
                                trainer.sampling)
    step = sampler.sde_step(x, v, chunks[0].sigmas[t], chunks[0].sigmas[t + 1], sde_type="sde",
                            noise_level=trainer.sampling.noise_level, x_next=chunks[0].latents[:, 2])
    torch.testing.assert_close(mean[:, t], step.mean, rtol=1e-5, atol=1e-6)
    for moved in (False, True):
        if moved:
            with torch.no_grad():
                for p in trainer.params:
                    p.add_(0.05 * torch.randn_like(p))
        trainer.reset_stats()
        for chunk in chunks:
            trainer.train_chunk(chunk)
        ref, sums = _grads(trainer), dict(trainer.sums)
        n = trainer.num_transitions
        if moved:
            assert sums["divergence"] > 0 and 0 < sums["masked"] < n and sums["divergence_high"] == n
        else:
            assert sums["divergence"] < 1e-12 and sums["masked"] == 0 and sums["ratio"] == pytest.approx(n)
        trainer.reset_stats()
        intake = TransitionIntake(trainer.spec, (0, 1), lambda r: 0, 3)
        for _, batch in intake.batches(plan, chunks):
            assert batch.steps["mean"].shape == batch.x_t.shape
            trainer.train_transitions(TransitionBatch.from_payload(*batch.to_payload()))
        got = _grads(trainer)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5, moved
        for k in sums:
            assert trainer.sums[k] == pytest.approx(sums[k], rel=1e-5, abs=1e-6), k


# ----- CFG-free training ------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["flow_grpo", "nft"])
def test_cfg_scale_one_runs_the_conditional_branch_only(algorithm):
    """--cfg-scale 1 on a CFG family (SD3): one transformer forward per denoising step and per trained
    transition (and the old policy's for NFT), no negative prompt encoded or sent; CFG 4.5 runs two."""
    from config.schema import RunConfig
    from models import load_model
    from rollout import encode_batch
    from trainer import Transitions, Trainer

    adapter = load_model("sd3", preset="tiny", seed=0)
    calls = []
    velocity = adapter.velocity
    adapter.velocity = lambda *a, **kw: calls.append(1) or velocity(*a, **kw)
    for scale, branches in ((1.0, 1), (4.5, 2)):
        cfg = RunConfig()
        cfg.rl.algorithm, cfg.optim.lora_rank = algorithm, 0
        sampling = sampler.SamplingConfig.for_adapter(adapter, height=16, width=16, num_steps=3, cfg_scale=scale)
        trainer = Trainer(cfg, adapter, sampling)
        cond, neg = encode_batch(adapter, ["a red circle"], "", sampling)
        assert (neg is None) == (scale == 1.0)
        calls.clear()
        traj = sampler.denoise(adapter, cond, neg, [0], 0, sampling)
        assert len(calls) == 3 * branches
        calls.clear()
        x = traj.latents[:, -1] if algorithm == "nft" else traj.latents[:, 0]
        tr = Transitions(x, traj.latents[:, 1] if algorithm != "nft" else x.new_empty(1, 0), traj.sigmas[:1],
                         traj.sigmas[1:2], [0], cond, neg, traj.log_probs[:, 0], torch.ones(1), [0], 0)
        trainer._forward(tr)
        assert len(calls) == branches * (2 if algorithm == "nft" else 1)


# ----- recipes ------------------------------------------------------------------------------------------
NEW_RECIPES = {  # algorithm, K, CFG scale (None: the family's guidance embedding), solver, LoRA rank, lr, KL
    "diffusion_nft/sd35_medium.toml": ("nft", 10, 1.0, "dpm2", 32, 3e-4, 1e-4),
    "diffusion_nft/flux_dev.toml": ("nft", 10, None, "dpm2", 32, 3e-4, 1e-4),
    "diffusion_nft/qwen_image.toml": ("nft", 10, 1.0, "euler", 64, 3e-4, 1e-4),
    "mixgrpo/flux_dev.toml": ("mixgrpo", 25, None, "euler", 0, 1e-5, 0.0),
    "mixgrpo/flux_dev_flash.toml": ("mixgrpo", 25, None, "dpm2", 0, 1e-5, 0.0),
    "flow_dppo/qwen_image.toml": ("flow_dppo", 10, 4.0, "euler", 64, 3e-4, 0.0),
}


def test_new_recipes_carry_the_published_settings_and_fit():
    """Each recipe: its published settings, valid on the GPUs it names (its released config stands
    for the model folder this machine does not have), CFG-free, and within the memory of its GPUs."""
    from config.cli import load_config_files
    from config.validate import validate
    from models.released import meta_adapter
    from planner import hardware
    from planner.memory import peak
    from runtime.budget import GiB, predict

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
    prompts = os.path.join(os.path.dirname(root), "data", "shapes_train.txt")
    adapters = {}
    for rel, (algorithm, k, cfg_scale, solver, rank, lr, kl) in NEW_RECIPES.items():
        cfg, recipe = load_config_files([os.path.join(root, rel)])
        s, rl = cfg.sampling, cfg.rl
        assert (rl.algorithm, s.sample_steps, s.cfg_scale, s.ode_solver, cfg.optim.lora_rank, cfg.optim.lr,
                rl.beta) == (algorithm, k, cfg_scale, solver, rank, lr, kl), rel
        assert recipe["source"] and "CFG" in recipe["notes"], rel  # each says which published runs were CFG-free
        if algorithm == "mixgrpo":
            assert (s.window_size, s.window_stride, s.same_group_noise) == (4, 1, True)
            assert s.window_interval == (20 if "flash" in rel else 25)
        if algorithm == "flow_dppo":  # VeRL-Omni's run: threshold 1e-5, add_kl_coefficient, a window of 2
            assert (rl.kl_mask_threshold, rl.add_kl_coefficient) == (1e-5, True)
            assert (s.sde_window, s.noise_level) == ((0, 2), 1.2)
        cfg.rl.reward_model = [f"{spec.split(':')[0]}=/weights/reward" for spec in rl.reward]
        cfg.rl.prompts = cfg.output.eval_prompts = prompts
        cfg.resolve_defaults()
        name = recipe["model_config"]
        facts = validate(cfg, recipe["gpus"], released=name)
        adapter = adapters.setdefault(name, meta_adapter(name))
        peaks = {role: peak(phases) for role, phases in
                 predict(cfg, facts, adapter, hardware.gpu(recipe["gpu"]).memory_bytes).items()}
        assert all(p.fits for p in peaks.values()), (rel, [p.why() for p in peaks.values()])
        assert 10 * GiB < min(p.tensors for p in peaks.values()), rel


# ----- bad inputs: each a ValueError naming the value, before anything loads -------------------------
@pytest.mark.parametrize("argv,message", [
    (["--algorithm", "mixgrpo", "--sde-window", "0:2"], "--sde-window 0:2 is read by --algorithm flow_grpo_fast"),
    (["--window-size", "3"], "--window-size 3 is read by --algorithm mixgrpo only: use --algorithm mixgrpo (got "),
    (["--nft-beta", "0.5"], "--nft-beta 0.5 is read by --algorithm nft only"),
    (["--algorithm", "mixgrpo", "--sample-steps", "5", "--window-interval", "2", "--steps", "10"],
     "the MixGRPO window is empty at step 6"),
    (["--algorithm", "mixgrpo", "--sample-steps", "2"], "at least 3 sampling steps"),
    (["--window-size", "0"], "--window-size must be >= 1, got 0"),
    (["--window-stride", "-1"], "--window-stride must be >= 0"),
    (["--window-schedule", "decay"], "unknown --window-schedule 'decay'"),
    (["--ode-solver", "heun"], "unknown --ode-solver 'heun'"),
    (["--nft-beta", "0"], "--nft-beta must be a finite number > 0, got 0.0"),
    (["--old-policy-decay", "ema"], "unknown --old-policy-decay 'ema'"),
    (["--old-policy-interval", "0"], "--old-policy-interval must be >= 1, got 0"),
    (["--kl-mask-threshold", "0"], "--kl-mask-threshold must be a finite number > 0, got 0.0"),
    (["--kl-mask-threshold", "1e-3"], "--kl-mask-threshold 0.001 is read by --algorithm flow_dppo only"),
    (["--no-add-kl-coefficient"], "--add-kl-coefficient False is read by --algorithm flow_dppo only"),
])
def test_new_flags_name_their_bad_values(argv, message):
    from config.cli import parse_config
    from config.validate import validate

    cfg = parse_config(["--preset", "tiny", *argv])
    cfg.resolve_defaults()
    with pytest.raises(ValueError) as e:
        validate(cfg, 2)
    assert message in str(e.value)
