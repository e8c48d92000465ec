"""Parity with NVlabs/DiffusionNFT (24af555), quantity by quantity: its epoch-global advantages, streamed
through fragments and the step's end exactly; its loss under every adv_mode and its gradient; its
rollout solvers (flow, ddim, dpm1, dpm2). The peer's functions ran on fixed inputs outside the project
(tests/fixtures/peers/diffusion_nft_*.json, with repo, commit, file and lines)."""
import json
import os

import pytest
import torch

from rl import advantages, algorithms, sampler
from rl.algorithms.nft import NFTLoss

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "peers")


def fixture(name: str) -> dict:
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


def _nft_rl(**kw):
    fields = {"std_mode": "global", "adv_clip": 5.0, "reward_combine": "rewards", "drop_zero_std": False,
              "readmit_multiple": 1, "best_of_n": 0, "nft_beta": 1.0, "beta": 1e-4, "adv_mode": "all"}
    fields.update(kw)
    return type("RL", (), fields)


# ----- the epoch-global advantages ------------------------------------------------------------------
@pytest.mark.parametrize("case", range(5))
def test_nft_global_advantages_streamed_equal_the_peer(case):
    """stat_tracking.py:27-31 with global_std (every NFT config): (r - mean_prompt) / (np.std of all the
    epoch's rewards + 1e-4), the record's default (--std-mode global). Streamed, one group per fragment
    in another order: each fragment's u, scaled at the step's end, gives the peer's advantages."""
    c = fixture("diffusion_nft_loss.json")["reward_to_r_cases"][case]
    nft = algorithms.algorithm("nft")
    assert nft.std_mode == "global"
    rule = nft.advantages(_nft_rl())
    rewards = torch.tensor(c["rewards"], dtype=torch.float64)
    groups = torch.tensor([sorted(set(c["prompts"])).index(p) for p in c["prompts"]])
    facts, us = [], {}
    for g in reversed(groups.unique().tolist()):
        rows = torch.nonzero(groups == g).flatten()
        out = advantages.fragment_advantages(rule, {"combined": rewards[rows]}, groups[rows], rows.tolist())
        facts.append(out.facts)
        us.update(zip(rows.tolist(), out.advantages.tolist()))
    end = advantages.step_end(rule, facts, whole_step=False, seed=0, step=0)
    got = torch.tensor([us[i] * end.scale for i in range(len(rewards))], dtype=torch.float64)
    want = torch.tensor(c["advantages"], dtype=torch.float64)
    clamped = want.abs() > 5
    torch.testing.assert_close(got[~clamped], want[~clamped], rtol=2e-7, atol=1e-9)
    binding = {i for i in end.rows}
    assert binding == set(torch.nonzero(clamped).flatten().tolist())  # trained again to reach the clamp
    for i in binding:
        w, counted = end.rows[i]
        assert not counted and got[i] * (1 + w) == pytest.approx(5.0 * torch.sign(want[i]).item(), rel=1e-6)


def test_nft_streamed_global_std_trains_the_whole_steps_gradient():
    """The NFT loss is affine in the advantage, so the gradient of the u-advantages' linear term scaled
    by 1 / (std + eps), plus the rest, plus the corrections of the binding clamp, is the gradient of the
    loss with the final advantages (the peer's loss on them: test_new_algorithms.py)."""
    torch.manual_seed(0)
    n = 30
    x0, xt, v_old, v_ref = (torch.randn(n, 2, 3, 3) for _ in range(4))
    t = torch.rand(n) * 0.9 + 0.05
    rewards = torch.zeros(n, dtype=torch.float64)
    rewards[[2, 7]], rewards[19] = 0.05, 1.0  # sample 19's advantage, 5.2, is clamped to 5
    groups = torch.arange(n) // 15
    loss = NFTLoss(0.5, 1e-3, 5.0)
    rule = algorithms.algorithm("nft").advantages(_nft_rl())
    ids = list(range(n))
    final = advantages.fragment_advantages(rule, {"combined": rewards}, groups, ids, whole_step=True).advantages

    def grad(adv, weight=None, counted=None, scale=1.0, apart=True):
        v = (v_old + 0.1 * torch.randn(n, 2, 3, 3, generator=torch.Generator().manual_seed(1))).requires_grad_(True)
        linear, rest, _ = loss(x0, xt, t, v, v_old, adv, v_ref, weight=weight, counted=counted)
        (scale * linear + rest).backward()
        return v.grad

    whole = grad(final)
    facts, us = [], torch.zeros(n)
    for rows in (list(range(15, 30)), list(range(15))):
        out = advantages.fragment_advantages(rule, {"combined": rewards[rows]}, groups[rows], rows)
        facts.append(out.facts)
        us[rows] = out.advantages
    end = advantages.step_end(rule, facts, whole_step=False, seed=0, step=0)
    assert set(end.rows) == {19}
    streamed = grad(us, scale=end.scale)
    w = torch.tensor([end.rows.get(i, (0.0, False))[0] for i in ids])
    again = grad(us, weight=w, counted=torch.zeros(n, dtype=torch.bool), scale=end.scale)
    torch.testing.assert_close(streamed + again, whole, rtol=1e-5, atol=1e-7)


# ----- the loss under adv_mode ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["all", "positive_only", "negative_only", "one_only", "binary"])
def test_nft_adv_mode_loss_and_gradient(mode):
    """train_nft_sd3.py:908-980 with config.train.adv_mode (915-925): the advantage clipped to 5, then
    its positive or negative part, 1 where positive, or its sign, before the mapping to r."""
    base = fixture("diffusion_nft_loss.json")["inputs"]
    fx = fixture("diffusion_nft_options.json")
    t32 = {k: torch.tensor(base[k], dtype=torch.float32) for k in ("x0", "xt", "t", "v_old", "v_theta", "v_ref")}
    loss = NFTLoss(base["nft_beta"], base["kl_beta"], base["adv_clip_max"], mode)
    for row in fx["outputs"]["losses"][mode]:
        v = t32["v_theta"].clone().requires_grad_(True)
        adv = torch.tensor(row["advantages"]).clamp(-5, 5)  # the fragment's clamp (--adv-clip)
        linear, rest, _ = loss(t32["x0"], t32["xt"], t32["t"], v, t32["v_old"], adv, t32["v_ref"])
        total = (linear + rest) / 3
        assert total.item() == pytest.approx(row["loss"], rel=1e-6)
        total.backward()
        want = torch.tensor(row["grad_v_theta"])
        assert (v.grad - want).abs().max().item() < 1e-6 * want.abs().max().item() + 1e-9


# ----- the rollout solvers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("solver", ["flow", "ddim", "dpm1", "dpm2"])
def test_nft_rollout_solvers(solver):
    """solver.py run_sampling(determistic=True) on SD3's 10 shift-3 sigmas: flow (the Euler step), ddim
    (DDIM with eta 0, its float64 coefficients), dpm1 (DDIM at the first and last steps, DPM-Solver++(1)
    between), dpm2 (DPM-Solver++(2M), midpoint): every latent of the path bit for bit."""
    fx = fixture("diffusion_nft_options.json")
    sigmas = torch.tensor(fx["inputs"]["sigmas"])
    cfg = sampler.SamplingConfig(16, 16, 10, noise_level=0.0, ode_solver="euler" if solver == "flow" else solver)
    x, history, path = torch.tensor(fx["inputs"]["z0"]), (), []
    for t in range(10):
        v = 0.7 * x + torch.sin(3 * x) * sigmas[t] + 0.2
        out = sampler.sample_step(x, v, sigmas, t, [0, 1], 0, cfg, history)
        x, history = out.x_next, out.x0
        path.append(x)
    want = torch.tensor(fx["outputs"]["paths"][solver])
    assert torch.equal(torch.stack(path, 1), want[:, 1:])  # bit for bit (measured on this CPU)
    if solver != "flow":  # a different solver, not Euler again
        euler = torch.tensor(fx["outputs"]["paths"]["flow"])[:, -1]
        assert solver in ("ddim", "dpm1") or (want[:, -1] - euler).abs().max() > 1e-4


# ----- evaluation: the EMA at its own step count --------------------------------------------------------
def test_nft_evaluation_ema_and_step_count(monkeypatch):
    """NFT evaluates its EMA (ema.py: decay min((1 + u) / (10 + u), 0.9), stepped after update u) with
    40 steps (config eval_num_steps): --eval-ema swaps the EMA into the parameters for the block and
    the trained weights back bit for bit; --eval-sample-steps sets evaluation's K."""
    from config.schema import RunConfig
    from models import load_model
    from models.lora import apply_lora
    from prompts.sets import PromptRecord
    from rewards import RewardSet
    from runtime.evaluation import evaluate
    from rl.ema import ema_decay
    from trainer import Trainer

    want = fixture("diffusion_nft_old_policy.json")
    steps, decays = want["inputs"]["steps"], want["outputs"]["eval_ema_decay"]
    assert [ema_decay(0.9, u) for u in steps[1:]] == pytest.approx(decays[1:], abs=1e-15)
    adapter = load_model("flux", preset="tiny", seed=0)
    apply_lora(adapter.transformer, 4, None, "attn", 0)
    cfg = RunConfig()
    cfg.optim.lora_rank, cfg.optim.ema_decay = 4, 0.9
    sampling = sampler.SamplingConfig.for_adapter(adapter, height=16, width=16, num_steps=3)
    trainer = Trainer(cfg, adapter, sampling)
    with torch.no_grad():
        for e in trainer.ema:
            e.add_(1.0)
    live, ema = [p.detach().clone() for p in trainer.params], [e.clone() for e in trainer.ema]
    with trainer.ema_swapped():
        assert all(torch.equal(p, e) for p, e in zip(trainer.params, ema))
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, live))
    assert all(torch.equal(e, q) for e, q in zip(trainer.ema, ema))
    calls = []
    monkeypatch.setattr(adapter, "velocity", lambda x, *a, **k: calls.append(1) or torch.zeros_like(x))
    records = [PromptRecord("a red circle", {})]
    evaluate(adapter, sampling, records, RewardSet(["jpeg_compressibility"]), num_steps=7)
    assert len(calls) == 7
