"""TSP, timestep parallelism (docs/DESIGN.md 5.3): the pure packing, gradients of packed micro-batches
against the sequential per-timestep loop, and placement invariance through torchrun."""
import itertools

import pytest
import torch

from rl import algorithms
from lab.launch import TINY, torchrun, trained_weights
from traced import assert_nccl_ok, traced
from weights import assert_same_weights
from telemetry.metrics import read_metrics
from parallel import tsp


# ----- the packing (pure) ---------------------------------------------------------------------------
def _fragments(sizes, num_steps=4):
    """Fragments of consecutive samples, each sample trained at every step (Flow-GRPO-like)."""
    out, start = [], 0
    for n in sizes:
        out.append([(i, t) for i in range(start, start + n) for t in range(num_steps)])
        start += n
    return out


def _check(packing, fragments, micro_batch, num_trainers):
    mbs = packing.micro_batches
    assert [m.index for m in mbs] == list(range(len(mbs)))
    for f, transitions in enumerate(fragments):
        mine = [m for m in mbs if m.fragment == f]
        packed = [tr for m in mine for tr in m.transitions]
        assert sorted(packed) == sorted(transitions) and len(packed) == len(set(packed)), f  # each exactly once
        shares = [sum(len(m.transitions) for m in mine if m.trainer == r) for r in range(num_trainers)]
        assert max(shares) - min(shares) <= 1, (f, shares)  # balanced within one transition
        counts = [sum(1 for m in mine if m.trainer == r) for r in range(num_trainers)]
        k = -(-len(transitions) // (num_trainers * micro_batch))
        assert all(c == min(k, s) for c, s in zip(counts, shares)), (f, counts, shares)
        for r in range(num_trainers):
            sizes = [len(m.transitions) for m in mine if m.trainer == r]
            assert all(1 <= n <= micro_batch for n in sizes) and (not sizes or max(sizes) - min(sizes) <= 1)
    totals = packing.num_transitions()
    assert max(totals) - min(totals) <= 1, totals  # the rotation balances the whole step too


@pytest.mark.parametrize("sizes,micro_batch,num_trainers", [
    ([4], 4, 1), ([4], 4, 2), ([4, 4], 4, 2), ([3, 5, 2], 3, 3), ([1], 4, 3), ([2, 2, 2], 5, 4), ([6], 1, 4),
])
def test_packing_covers_every_transition_once_balanced(sizes, micro_batch, num_trainers):
    fragments = _fragments(sizes)
    packing = tsp.pack(fragments, micro_batch=micro_batch, num_trainers=num_trainers)
    _check(packing, fragments, micro_batch, num_trainers)


def test_packing_full_micro_batches_mix_samples_and_timesteps():
    fragments = _fragments([4], num_steps=2)  # 8 transitions, 2 trainers x 1 micro-batch of 4
    packing = tsp.pack(fragments, micro_batch=4, num_trainers=2)
    assert [len(m.transitions) for m in packing.micro_batches] == [4, 4]
    assert packing.num_forwards() == [1, 1]
    for m in packing.micro_batches:
        assert len({i for i, _ in m.transitions}) == 2 and len({t for _, t in m.transitions}) == 2


def test_packing_is_deterministic_and_validates():
    fragments = _fragments([3, 5])
    a = tsp.pack(fragments, micro_batch=3, num_trainers=2)
    b = tsp.pack([list(f) for f in fragments], micro_batch=3, num_trainers=2)
    assert a == b
    with pytest.raises(ValueError, match="--train-micro-batch"):
        tsp.pack(fragments, micro_batch=0, num_trainers=2)
    with pytest.raises(ValueError, match="twice"):
        tsp.pack([[(0, 1), (0, 1)]], micro_batch=2, num_trainers=1)


@pytest.mark.parametrize("sizes,micro_batch,weights", [
    ([4, 4, 4, 4], 16, (0.5, 1.0)), ([4, 4], 4, (0.25, 1.0, 1.0)), ([3, 5, 2], 3, (1.0, 0.33)), ([1], 4, (0.5, 1.0)),
])
def test_trainers_of_different_speeds_take_shares_in_proportion(sizes, micro_batch, weights):
    """With the trainers' relative speeds, every transition is still packed once; each trainer's share
    of a fragment is its exact share rounded (within one), the whole step's too (within one per
    fragment); every trainer cuts its share into as many micro-batches as the largest share needs."""
    fragments, m = _fragments(sizes), len(weights)
    packing = tsp.pack(fragments, micro_batch=micro_batch, num_trainers=m, weights=weights)
    for f, transitions in enumerate(fragments):
        mine = [x for x in packing.micro_batches if x.fragment == f]
        assert sorted(tr for x in mine for tr in x.transitions) == sorted(transitions)
        shares = [sum(len(x.transitions) for x in mine if x.trainer == r) for r in range(m)]
        exact = [len(transitions) * w / sum(weights) for w in weights]
        assert all(abs(s - e) < 1 for s, e in zip(shares, exact)), (shares, exact)
        k = -(-max(shares) // micro_batch)
        counts = [sum(1 for x in mine if x.trainer == r) for r in range(m)]
        assert counts == [min(k, s) for s in shares], (counts, shares)
        assert all(1 <= len(x.transitions) <= micro_batch for x in mine)
    exact = [sum(len(t) for t in fragments) * w / sum(weights) for w in weights]
    assert all(abs(s - e) < len(fragments) for s, e in zip(packing.num_transitions(), exact))
    totals = packing.num_transitions()
    slow = weights.index(min(weights))
    assert all(totals[slow] < n for r, n in enumerate(totals) if r != slow), totals  # the slow trainer takes less
    # Equal speeds pack as no speeds do; bad speeds are refused, naming them.
    assert tsp.pack(fragments, micro_batch=micro_batch, num_trainers=m, weights=(2.0,) * m) == \
        tsp.pack(fragments, micro_batch=micro_batch, num_trainers=m)
    with pytest.raises(ValueError, match=r"one positive speed per trainer \(2\), got \[1.0, 0.0\]"):
        tsp.pack(fragments, micro_batch=micro_batch, num_trainers=2, weights=(1.0, 0.0))


def test_trainer_speeds_round_as_replica_speeds_do():
    from parallel.stepplan import trainer_speeds
    assert trainer_speeds({1: 1.0, 2: 1.1}) is None  # noise on identical trainers: even shares
    assert trainer_speeds({0: 4.0, 1: 1.0}) == (0.25, 1.0)
    assert trainer_speeds({3: 1.0, 2: 3.0}) == (0.33, 1.0)  # rank order


@pytest.mark.parametrize("name,window", [("flow_grpo", None), ("dance_grpo", None), ("flow_grpo_fast", (1, 3))])
def test_packing_of_trained_timestep_selections(name, window):
    num_steps, ids = 6, [list(range(0, 4)), list(range(4, 8)), list(range(8, 12))]
    timesteps = {i: algorithms.algorithm(name).timesteps(num_steps, 0.6, seed=3, step=1, sample_id=i, window=window)
                 for f in ids for i in f}
    packing = tsp.pack_step(ids, timesteps, micro_batch=8, num_trainers=2)
    fragments = [tsp.fragment_transitions(f, timesteps) for f in ids]
    _check(packing, fragments, 8, 2)
    if name == "dance_grpo":  # random per-sample subsets: samples differ, the packing still mixes them
        assert len({timesteps[i] for i in timesteps}) > 1
        assert any(len({t for _, t in m.transitions}) > 1 and len({i for i, _ in m.transitions}) > 1
                   for m in packing.micro_batches)
    if name == "flow_grpo_fast":
        assert {t for m in packing.micro_batches for _, t in m.transitions} == {1, 2}
    assert packing == tsp.pack_step(ids, timesteps, micro_batch=8, num_trainers=2)


# ----- gradients: packed micro-batches == the per-timestep loop -------------------------------------
def _rollout(algorithm_name, cfg_scale, window, beta):
    """A tiny FLUX trainer and the two chunks of one fragment from a real SDE rollout."""
    from rl import sampler
    from config.schema import RunConfig
    from models import load_model
    from parallel.stepplan import plan_step
    from rollout import encode_batch
    from parallel.trainer_intake import TrainChunk
    from trainer import Trainer

    torch.manual_seed(0)
    adapter = load_model("flux", preset="tiny", seed=0)
    cfg = RunConfig()
    cfg.optim.lora_rank, cfg.rl.beta = 0, beta
    cfg.rl.algorithm, cfg.rl.timestep_fraction, cfg.rl.micro_batch = algorithm_name, 0.6, 2
    cfg.topology.tsp, cfg.topology.train_micro_batch = True, 3
    sampling = sampler.SamplingConfig.for_adapter(adapter, height=16, width=16, num_steps=5, cfg_scale=cfg_scale,
                                                  sde_window=window)
    trainer = Trainer(cfg, adapter, sampling)
    plan = plan_step(0, seed=0, num_prompts=4, prompts_per_step=2, group_size=2, micro_batch=2, num_replicas=1,
                     num_trainers=1)
    chunks, advantages = [], torch.tensor([1.0, -0.5, 0.3, -0.8])
    for c in plan.fragments[0].chunks:
        cond, neg = encode_batch(adapter, ["a red circle", "a blue square"], "a blurry photo", sampling)
        traj = sampler.denoise(adapter, cond, neg, list(c.sample_ids), 0, sampling)
        ids = torch.tensor(c.sample_ids)
        chunks.append(TrainChunk(0, 0, c.index, 0, ids, traj.latents, traj.log_probs, advantages[ids].clone(),
                                 torch.ones(len(ids), dtype=torch.bool), traj.sigmas, cond, neg))
    return trainer, plan, chunks


def _tsp(trainer, num_trainers):
    """The TSP intake of `num_trainers` trainers for the trainer's config."""
    from parallel.trainer_intake import TransitionIntake

    t = trainer.cfg.topology
    return TransitionIntake(trainer.spec, tuple(range(num_trainers)), lambda r: 0,
                            t.train_micro_batch or trainer.cfg.rl.micro_batch)


def _grads(trainer):
    g = torch.cat([p.grad.reshape(-1) for p in trainer.params if p.grad is not None])
    trainer.optimizer.zero_grad(set_to_none=True)
    return g


CASES = {
    "flow_grpo": ("flow_grpo", 1.0, None, 0.0),
    "flow_grpo-cfg": ("flow_grpo", 2.0, None, 0.0),
    "dance_grpo": ("dance_grpo", 1.0, None, 0.0),
    "dance_grpo-cfg": ("dance_grpo", 2.0, None, 0.0),
    "flow_grpo_fast": ("flow_grpo_fast", 1.0, (1, 4), 0.0),
    "flow_grpo-kl": ("flow_grpo", 1.0, None, 0.01),
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_gradients_equal_the_per_timestep_loop(case):
    from parallel.trainer_intake import TransitionBatch

    trainer, plan, chunks = _rollout(*CASES[case])
    chunks[1].keep[1] = False  # a dropped sample is left out alike
    for chunk in chunks:
        trainer.train_chunk(chunk)
    ref, ref_n, ref_sums = _grads(trainer), trainer.num_transitions, dict(trainer.sums)
    ref_forwards = trainer.num_forwards
    assert ref.norm() > 0
    for num_trainers in (1, 2):  # two trainer ranks: their gradients sum (the all-reduce)
        trainer.reset_stats()
        routed = _tsp(trainer, num_trainers).batches(plan, chunks)
        assert [r for r, _ in routed] == list(range(num_trainers))
        for _, batch in routed:
            trainer.train_transitions(TransitionBatch.from_payload(*batch.to_payload()))  # through the wire format
        got = _grads(trainer)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5, (case, num_trainers)
        assert trainer.num_transitions == ref_n
        for k in ref_sums:
            assert trainer.sums[k] == pytest.approx(ref_sums[k], rel=1e-5, abs=1e-6), k
        if num_trainers == 1:  # micro-batches of only dropped transitions are skipped (replicated)
            assert trainer.num_forwards <= len(_tsp(trainer, 1).forward_fragments(plan)[0]) <= ref_forwards


def test_packed_steps_with_mixed_noise_levels_match_per_transition_steps():
    """A windowed sampler is deterministic outside its window: one packed micro-batch may hold
    transitions at different noise levels, each scored as sampler.sde_step scores it alone."""
    from rl import sampler

    trainer, _, chunks = _rollout("flow_grpo", 1.0, (1, 3), 0.0)
    c = chunks[0]
    ts = [0, 1, 2, 3, 1, 0]
    rows = [0, 1, 0, 1, 1, 0]
    x_t = torch.stack([c.latents[j, t] for j, t in zip(rows, ts)])
    x_next = torch.stack([c.latents[j, t + 1] for j, t in zip(rows, ts)])
    v = torch.randn_like(x_t)
    sigma, sigma_next = c.sigmas[ts], c.sigmas[[t + 1 for t in ts]]
    out = sampler.score_rows(trainer.sampling, x_t, v, sigma, sigma_next, ts, x_next)
    for n, t in enumerate(ts):
        one = sampler.sde_step(x_t[n:n + 1], v[n:n + 1], sigma[n].item(), sigma_next[n].item(), sde_type="sde",
                               noise_level=trainer.sampling.noise_level_at(t), x_next=x_next[n:n + 1])
        for k in ("log_prob", "mean", "std"):
            torch.testing.assert_close(getattr(out, k)[n:n + 1], getattr(one, k), rtol=1e-6, atol=1e-6)
    assert (out.std == 0).tolist() == [t not in (1, 2) for t in ts]


def test_forwards_drop_by_the_packing_factor():
    """2 samples x 3 trained timesteps per chunk: the loop runs 3 forwards of 2 transitions per
    chunk, TSP with --train-micro-batch 6 one forward of 6 per chunk's worth."""
    trainer, plan, chunks = _rollout("flow_grpo_fast", 1.0, (1, 4), 0.0)
    for chunk in chunks:
        trainer.train_chunk(chunk)
    loop = trainer.num_forwards
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.reset_stats()
    trainer.cfg.topology.train_micro_batch = 6
    for _, batch in _tsp(trainer, 1).batches(plan, chunks):
        trainer.train_transitions(batch)
    assert (loop, trainer.num_forwards) == (6, 2) and trainer.num_transitions == 12


# ----- through torchrun: placement invariance, forwards and all-gathers in metrics.jsonl ------------


def test_placement_invariance_with_tsp(tmp_path):
    """Disagg 1 generator + 2 trainers with --tsp (replicated and FSDP2) and colocated 2 ranks with
    --tsp end with the weights of colocated 2 ranks without TSP. Per fragment (2 groups x 2 samples x
    2 trained timesteps = 8 transitions, --train-micro-batch 4) each trainer runs one forward of 4
    transitions where the per-timestep loop runs 2 forwards of 2 samples. Colocated, each rank's
    fragment (4 transitions) is split over both ranks: 2 forwards of 2 transitions per trainer."""
    tsp_flags = ["--tsp", "--train-micro-batch", "4"]
    naive = ["--fragment-groups", "0"]  # one fragment per replica, as counted above
    runs = {"colocated-2": (2, ["--mode", "colocated"]),
            # --fragment-split even: the replicated trainers share each fragment evenly, whatever their
            # start-up probes say (3 ranks time-share 2 cores here, and probes of equal ranks can differ
            # by more than the 15% that counts as equal: shares by speed then need a second forward)
            "disagg-1g2t-tsp": (3, ["--generators", "1", "--trainers", "2", *tsp_flags, "--fragment-split", "even"]),
            "disagg-1g2t-tsp-fsdp": (3, ["--generators", "1", "--trainers", "2", *tsp_flags,
                                         "--train-sharding", "fsdp"]),
            "colocated-2-tsp": (2, ["--mode", "colocated", *tsp_flags])}
    traffic = {"colocated-2": [], "disagg-1g2t-tsp": ["data.to"], "disagg-1g2t-tsp-fsdp": ["data.to"],
               "colocated-2-tsp": ["data.to"]}  # the colocated TSP exchange
    results = {}
    for name, (nproc, placement) in runs.items():
        out = tmp_path / name
        torchrun(nproc, [*TINY, *naive, "--lora-rank", "4", "--steps", "2", "--output-dir", str(out), *placement],
                 env=traced(out))
        assert_nccl_ok(out, traffic[name])
        results[name] = (trained_weights(str(out), 2), read_metrics(str(out / "metrics.jsonl")))
    ref_w, ref_m = results["colocated-2"]
    for name, (w, m) in results.items():
        # After two AdamW steps of lr 3e-4 every lora_B entry is about 7e-4, and a few entries whose
        # second gradient is a small difference of its transitions' gradients move by up to 1.0e-4
        # of that between forwards of 2 and of 4 transitions (float32 reduction order, measured: 4
        # of 128 entries above 1e-9 in disagg-1g2t-tsp, none above 7.6e-8): tests/weights.py's REL.
        assert_same_weights(ref_w, w, name)
        for row, ref_row in zip(m, ref_m):
            assert row["train/num_transitions"] == ref_row["train/num_transitions"] == 8, name
            # Packed forwards differ from the generation batch only by reduction order.
            assert row["train/approx_kl"] < 1e-12 and row["train/clipfrac"] == 0.0, (name, row)
            assert (row["train/num_allgathers"] > 0) == ("fsdp" in name), (name, row)
    expected_forwards = {"colocated-2": 2.0, "disagg-1g2t-tsp": 1.0, "disagg-1g2t-tsp-fsdp": 1.0,
                         "colocated-2-tsp": 2.0}
    for (name, (_, m)), row in itertools.product(results.items(), range(2)):
        forwards = m[row]["train/num_forwards"]  # of the first trainer rank
        assert forwards == expected_forwards[name], (name, forwards)
    fsdp = results["disagg-1g2t-tsp-fsdp"][1]
    # One forward + its backward per step; every FSDP unit is gathered in forward and again in backward.
    assert len({r["train/num_allgathers"] for r in fsdp}) == 1
