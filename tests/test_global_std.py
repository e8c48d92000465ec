"""Flow-GRPO's batch-global std while streaming, and the advantage options of the published runs
(docs/ALGORITHMS.md, "Global std" and "Which samples are trained"): in process, the gradient a
trainer accumulates from group-centred advantages, scaled and corrected at the step's end, against
the gradient of the advantages computed with the step's std; through torchrun, every placement
against a batch-synchronous run (one replica generating the whole step as one fragment)."""
import pytest
import torch

from config.cli import parse_config
from config.validate import validate
from rl import advantages
from rl.advantages import AdvantageRule, best_of_n, fragment_advantages, readmitted, step_end
from lab.launch import TINY, torchrun, trained_weights
from telemetry.metrics import read_metrics
from weights import assert_same_weights

REWARDS = torch.tensor([0.30, -0.10, 0.80, 0.75, 0.20, 0.20])  # 3 groups of 2; the last all-equal


# ----- pure: the rules -------------------------------------------------------------------------------
def test_best_of_n_keeps_the_top_ceil_and_bottom_floor_of_each_group():
    scores = torch.tensor([3.0, 1.0, 2.0, 5.0, 0.5, 9.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    assert best_of_n(scores, groups, 3).tolist() == [True, True, False, True, True, True, False, True]
    assert best_of_n(scores, groups, 1).tolist() == [False, False, False, True, False, True, False, False]
    assert best_of_n(scores, groups, 0).all() and best_of_n(scores, groups, 4).all()
    ties = best_of_n(torch.ones(4), torch.zeros(4, dtype=torch.long), 2)  # ties: by position, the same on every rank
    assert ties.tolist() == [True, False, False, True]


def test_readmission_is_a_function_of_seed_and_step():
    eligible = [3, 8, 11, 20]
    picks = readmitted(eligible, 5, 4, seed=0, step=7)
    assert len(picks) == 3 and set(picks) <= set(eligible)
    assert picks == readmitted(list(reversed(eligible)), 5, 4, seed=0, step=7)  # not the order they arrived in
    assert readmitted(eligible, 8, 4, seed=0, step=7) == []  # already a multiple
    assert readmitted(eligible[:2], 5, 4, seed=0, step=7) == []  # not enough (Flow-GRPO re-admits none)
    assert {tuple(readmitted(eligible, 5, 4, seed=0, step=s)) for s in range(8)} != {tuple(picks)}


def test_zero_advantage_samples_are_dropped_not_only_all_equal_groups():
    """Flow-GRPO's mask is per sample (advantage exactly 0): a reward at its group's mean goes too."""
    r = torch.tensor([0.0, 0.5, 1.0, 0.2, 0.2, 0.2])
    out = fragment_advantages(AdvantageRule(drop_zero=True), {"combined": r}, torch.tensor([0, 0, 0, 1, 1, 1]),
                              list(range(6)))
    assert out.zero.tolist() == [False, True, False, True, True, True]
    assert out.keep.tolist() == [True, False, True, False, False, False]


def test_reward_combinations():
    """rewards: one advantage of the weighted sum; advantages: the weighted sum of each reward's
    advantage; losses: one column per reward, weight times its clamped advantage."""
    a, b = torch.tensor([1.0, 3.0, 0.0, 2.0]), torch.tensor([2.0, 0.0, 5.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    weights = (("a", 1.0), ("b", 0.5))
    scores = {"a": a, "b": b, "combined": a + 0.5 * b}
    one = lambda r: advantages.group_advantages(r, groups, adv_clip=100.0)  # noqa: E731
    got = {c: fragment_advantages(AdvantageRule(combine=c, weights=weights, clip=0.9), scores, groups,
                                  [0, 1, 2, 3]).advantages for c in advantages.COMBINES}
    torch.testing.assert_close(got["rewards"], one(a + 0.5 * b).clamp(-0.9, 0.9))
    torch.testing.assert_close(got["advantages"], (one(a) + 0.5 * one(b)).clamp(-0.9, 0.9))
    torch.testing.assert_close(got["losses"], torch.stack([one(a).clamp(-0.9, 0.9), 0.5 * one(b).clamp(-0.9, 0.9)], 1))


@pytest.mark.parametrize("combine", advantages.COMBINES)
def test_every_combination_decides_per_group(combine):
    """A fragment's advantages and the samples it trains depend on its own groups only, so the
    fragments of any placement give what the whole step gives (the re-admission aside: step_end)."""
    a, b = REWARDS, torch.tensor([1.0, 0.0, 2.0, 2.0, 0.5, 0.5])
    groups = torch.arange(6) // 2
    rule = AdvantageRule(combine=combine, weights=(("a", 1.0), ("b", 0.5)), best_of_n=1, drop_zero=True, clip=0.7)
    scores = {"a": a, "b": b, "combined": a + 0.5 * b}
    whole = fragment_advantages(rule, scores, groups, list(range(6)))
    for g in range(3):
        rows = slice(2 * g, 2 * g + 2)
        part = fragment_advantages(rule, {k: v[rows] for k, v in scores.items()}, groups[rows], [2 * g, 2 * g + 1])
        assert torch.equal(part.advantages, whole.advantages[rows]) and torch.equal(part.keep, whole.keep[rows])
    assert whole.keep.tolist().count(True) < 3  # best-of-1 keeps one per group, the all-equal one goes


@pytest.mark.parametrize("clip", [5.0, 0.5])
def test_streamed_global_advantages_times_the_scale_are_the_synchronous_ones(clip):
    """Every fragment's u x 1/(std + eps), plus the correction weight of a binding clamp, is the
    advantage a batch-synchronous run computes; the step's end reads the facts in any order."""
    groups = torch.arange(6) // 2
    rule = AdvantageRule(std_mode="global", clip=clip)
    sync = fragment_advantages(rule, {"combined": REWARDS}, groups, list(range(6)), whole_step=True).advantages
    parts = {g: fragment_advantages(rule, {"combined": REWARDS[2 * g:2 * g + 2]}, groups[2 * g:2 * g + 2],
                                    [2 * g, 2 * g + 1]) for g in range(3)}
    end = step_end(rule, [parts[g].facts for g in (1, 2, 0)], whole_step=False, seed=0, step=0)
    u = torch.cat([parts[g].advantages for g in range(3)]).double()
    weight = torch.tensor([1.0 + end.rows.get(i, (0.0, False))[0] for i in range(6)], dtype=torch.float64)
    torch.testing.assert_close((u * end.scale * weight).float(), sync, rtol=1e-6, atol=1e-7)
    assert end.metrics["train/adv_clamped"] == len(end.rows) == (0 if clip == 5.0 else 2)  # group 0: |A| = 0.63
    assert all(not counted for _, counted in end.rows.values())  # corrections carry no KL, count no transition


@pytest.mark.parametrize("argv,message", [
    (["--best-of-n", "9"], "--best-of-n must be between 0 (all) and --group-size 8, got 9"),
    (["--readmit-multiple", "4"], "--readmit-multiple 4 re-admits samples --drop-zero-std dropped"),
    (["--readmit-multiple", "0", "--drop-zero-std"], "--readmit-multiple must be >= 1 (1 = none), got 0"),
    (["--std-mode", "global", "--reward-combine", "losses"], "use --std-mode group"),
    (["--reward-combine", "losses", "--reward", "jpeg_compressibility:-1"], "needs weights >= 0"),
    (["--std-mode", "batch"], "unknown --std-mode 'batch'"),
    (["--kl-form", "exact"], "unknown --kl-form 'exact'"),
    (["--sde-type", "cps", "--beta", "0.01", "--timestep-fraction", "1.0", "--noise-level", "0.5"],
     "trains the last step, whose std is 0"),
])
def test_options_name_the_bad_value(argv, message):
    cfg = parse_config(["--preset", "tiny", *argv])
    cfg.resolve_defaults()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(cfg, 2)


# ----- in process: the trainer's gradient ------------------------------------------------------------
def _trainer(beta: float, clip: float):
    """A tiny full fine-tune trainer whose weights are moved off the reference (KL != 0) and off the
    generating policy (ratios != 1, some clipped), and the chunks of 3 groups of 2 (one per fragment)."""
    from config.schema import RunConfig
    from models import load_model
    from parallel.trainer_intake import TrainChunk
    from rl import sampler
    from rollout import encode_batch
    from trainer import Trainer

    torch.manual_seed(0)
    adapter = load_model("flux", preset="tiny", seed=0)
    cfg = RunConfig()
    cfg.optim.lora_rank, cfg.rl.beta, cfg.rl.adv_clip, cfg.rl.clip_range = 0, beta, clip, 5e-5
    cfg.rl.std_mode, cfg.rl.timestep_fraction = "global", 0.6
    sampling = sampler.SamplingConfig.for_adapter(adapter, height=16, width=16, num_steps=4)
    trainer = Trainer(cfg, adapter, sampling)
    chunks = []
    for g in range(3):
        ids = [2 * g, 2 * g + 1]
        cond, _ = encode_batch(adapter, ["a red circle"] * 2, None, sampling)
        traj = sampler.denoise(adapter, cond, None, ids, 0, sampling)
        chunks.append(TrainChunk(0, g, g, 0, torch.tensor(ids), traj.latents, traj.log_probs, torch.zeros(2),
                                 torch.ones(2, dtype=torch.bool), traj.sigmas, cond, None))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.params:
            p.add_(torch.randn(p.shape, generator=gen) * 0.02 * p.abs().mean())
    return trainer, chunks


def _gradient(trainer, chunks, rule, *, streamed: bool, correct: bool = True, apart: bool = True):
    """The trainer's combined gradient of one step: synchronous (final advantages) or streamed
    (u, then the step's end); `correct`/`apart` False leave out the clamp corrections / the
    separate KL accumulation, to show each is needed."""
    groups = torch.arange(6) // 2
    trainer.begin_step(keep_items=streamed, scale_later=streamed and apart)
    facts = []
    for g, chunk in enumerate(chunks):
        rows = slice(2 * g, 2 * g + 2)
        out = fragment_advantages(rule, {"combined": REWARDS[rows] if streamed else REWARDS}, groups[rows] if streamed
                                  else groups, chunk.sample_ids.tolist() if streamed else list(range(6)),
                                  whole_step=not streamed)
        chunk.advantages = out.advantages if streamed else out.advantages[rows]
        facts.append(out.facts)
        trainer.train(chunk)
    scale = 1.0
    if streamed:
        end = step_end(rule, facts, whole_step=False, seed=0, step=0)
        if correct:
            trainer.train_again(end, chunks[0])
        scale = end.scale
    trainer.grads.combine(scale)
    sums = trainer.loss.rescale(trainer.loss_sums, scale)
    grad = torch.cat([p.grad.reshape(-1) for p in trainer.params if p.grad is not None]).clone()
    n = trainer.num_transitions
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.reset_stats()
    return grad, n, dict(zip(trainer.loss.STATS, sums.tolist()))


@pytest.mark.parametrize("beta,clip", [(0.0, 5.0), (0.0, 0.5), (0.5, 5.0), (0.5, 0.5)])
def test_streamed_gradient_equals_the_synchronous_one(beta, clip):
    trainer, chunks = _trainer(beta, clip)
    rule = trainer.rule
    ref, ref_n, ref_stats = _gradient(trainer, chunks, rule, streamed=False)
    got, n, stats = _gradient(trainer, chunks, rule, streamed=True)
    assert ref.norm() > 0 and n == ref_n
    assert ((got - ref).norm() / ref.norm()).item() < 2e-6, (beta, clip)
    for k in ("loss", "policy_loss", "kl", "ratio", "clipfrac"):
        assert stats[k] == pytest.approx(ref_stats[k], rel=1e-5, abs=1e-6), k  # sums of O(1) terms
    if clip < 1:  # the correction forwards are what makes a binding clamp exact
        wrong, _, _ = _gradient(trainer, chunks, rule, streamed=True, correct=False)
        assert ((wrong - ref).norm() / ref.norm()).item() > 1e-2
    if beta:  # and the KL term kept apart is what keeps it unscaled
        wrong, _, _ = _gradient(trainer, chunks, rule, streamed=True, apart=False)
        assert ((wrong - ref).norm() / ref.norm()).item() > 1e-3


# ----- through torchrun: every placement trains the batch-synchronous weights -------------------------
_NO_REWARD = [a for i, a in enumerate(TINY) if "--reward" not in TINY[max(i - 1, 0):i + 1]]  # each test names its own
ARGS = [*_NO_REWARD, "--prompts-per-step", "4", "--lora-rank", "4", "--steps", "2"]
WHOLE_STEP = (1, ["--mode", "colocated", "--fragment-groups", "0"])  # one fragment: advantages final when scored
GAP_TSP = (4, ["--generators", "2", "--gap-stages", "2", "--trainers", "2", "--tsp", "--train-micro-batch", "3"])


def _runs(tmp_path, flags: list[str], placements: dict) -> dict:
    out = {}
    for name, (nproc, placement) in placements.items():
        run = tmp_path / name
        torchrun(nproc, [*ARGS, *flags, "--output-dir", str(run), *placement])
        out[name] = (trained_weights(str(run), 2), read_metrics(str(run / "metrics.jsonl")))
    return out


def _check_same(results: dict, keys: tuple[str, ...], loose: dict | None = None) -> None:
    """Every placement's weights, transition counts, gradient norms and `keys` are the whole step's;
    `loose`: key -> pytest.approx arguments in place of rel 1e-6."""
    ref_w, ref_m = results["whole-step"]
    for name, (w, m) in results.items():
        # tests/weights.py's tolerance (seen here: 1.1e-4; the gradient norms agree to 1e-6)
        assert_same_weights(ref_w, w, name)
        for row, ref_row in zip(m, ref_m):
            assert row["train/num_transitions"] == ref_row["train/num_transitions"], name
            assert row["train/grad_norm"] == pytest.approx(ref_row["train/grad_norm"], rel=1e-5), name
            for k in keys:
                assert row[k] == pytest.approx(ref_row[k], **(loose or {}).get(k, {"rel": 1e-6})), (name, k)


@pytest.mark.parametrize("binding,updates", [(False, 1), (True, 1), (True, 2)],
                         ids=["no-clamp", "clamp-and-kl", "clamp-and-kl-2-updates"])
def test_streamed_global_std_trains_the_batch_synchronous_weights(tmp_path, binding, updates):
    """--std-mode global: GAP + TSP (with a binding clamp and beta > 0: over FSDP2 trainers, and TAG
    with FSDP2 trainers too) stream fragments and end with the weights of one replica that scores
    the whole step before anything trains. With 2 updates per rollout too: the first waits for the
    step's std, each trains again its own part's clamped samples, FSDP pads each, TAG's windows
    fall where a piece is first taken."""
    flags = ["--reward", "jpeg_compressibility", "--std-mode", "global", "--updates-per-rollout", str(updates)] + (
        ["--adv-clip", "0.8", "--beta", "0.04"] if binding else [])
    placements = {"whole-step": WHOLE_STEP, "gap-tsp": GAP_TSP}
    if binding:
        placements["gap-tsp"] = (4, [*GAP_TSP[1], "--train-sharding", "fsdp"])
        placements["tag-fsdp"] = (3, ["--generators", "1", "--trainers", "2", "--tag", "--train-sharding", "fsdp",
                                      "--debug-slow-rank", "0:5"])
    results = _runs(tmp_path, flags, placements)
    # A second update scores the weights the first moved, which placements reproduce to float32
    # rounding (the gradient norms to 4e-8): its KL agrees to 1e-5 (seen: 3.3e-6), and its loss, a sum
    # of terms of size |A| ~ 1 that cancels to ~1e-6, to that rounding in absolute terms (seen: 3.7e-9).
    loose = {"train/loss": {"abs": 2e-8}, "train/kl": {"rel": 1e-5}} if updates > 1 else None
    _check_same(results, ("train/adv_std", "train/adv_clamped", "train/loss", "train/kl"), loose)
    ref = results["whole-step"][1]
    assert (sum(r["train/adv_clamped"] for r in ref) > 0) == binding
    assert all(r["train/kl"] > 0 for r in ref[1:]) == binding
    late = [r["train/late_forwards"] for name, (_, m) in results.items() if name != "whole-step" for r in m]
    assert (sum(late) > 0) == binding  # the trainer that logs ran correction forwards
    assert all(r["train/num_updates"] == updates for _, m in results.values() for r in m)


def test_published_options_are_placement_invariant(tmp_path):
    """DanceGRPO's per-reward losses (two advantage columns through TSP's wire format) and best-of-n,
    Flow-GRPO's zero-advantage filter with its re-admission: streamed (the re-admission decided at
    the step's end) as batch-synchronously. Seed 0 ties two groups' JPEG sizes at step 0, so one
    sample is re-admitted there. (--reward-combine advantages makes one column like the default:
    test_every_combination_decides_per_group covers what it changes.)"""
    flags = ["--reward", "jpeg_compressibility:1", "--reward", "jpeg_incompressibility:0.5", "--reward-combine",
             "losses", "--best-of-n", "1", "--drop-zero-std", "--readmit-multiple", "3"]
    results = _runs(tmp_path, flags, {"whole-step": WHOLE_STEP, "gap-tsp": GAP_TSP})
    _check_same(results, ("train/readmitted", "train/loss"))
    assert results["whole-step"][1][0]["train/readmitted"] == 1.0
