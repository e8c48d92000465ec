"""Mixed-cost prompts and the skew-aware dispatch (docs/DESIGN.md 5.8): prompt shape fields and their
checks, shape-homogeneous fragments, LPT against round-robin and the optimum, gradients of mixed
shapes against the per-sample loop, evaluation shares, grids, and placement invariance through
torchrun."""
import itertools
import json
import random

import pytest
import torch

from prompts import resolutions
from lab.launch import TINY, torchrun, trained_weights
from traced import assert_nccl_ok, traced
from weights import assert_same_weights
from telemetry.metrics import image_grid, pad_to_largest, read_metrics
from parallel.stepplan import (ShapeTable, assign_fragments, assign_lpt, choose_prompts, plan_step, replica_finish,
                           sample_cost)
from prompts.sets import load_prompts

S16, S24, S32, S48 = (16, 16, None), (24, 24, None), (32, 32, None), (48, 48, None)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ----- prompt files and shape checks ---------------------------------------------------------------
@pytest.mark.parametrize("value", ["32", 0, -16, 2.5, True])
def test_shape_fields_must_be_positive_integers(tmp_path, value):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a red circle"}, {"prompt": "a blue square", "width": value}])
    with pytest.raises(ValueError, match=rf"p.jsonl:2: 'width' must be a positive integer, got {value!r}"):
        load_prompts(path)


def test_shapes_are_checked_against_the_model_naming_file_and_line(tmp_path):
    from rl import sampler
    from models import load_model

    adapter = load_model("flux", preset="tiny", seed=0)  # VAE factor 2 x 2x2 packing: multiples of 4
    sampling = sampler.SamplingConfig.for_adapter(adapter, height=16, width=16, num_steps=3)
    good = _jsonl(tmp_path / "good.jsonl", [{"prompt": "a", "height": 24}, {"prompt": "b"},
                                            {"prompt": "c", "height": 32, "width": 48}])
    records = load_prompts(good)
    tokens = resolutions.check_shapes(adapter, records, sampling, good)
    assert tokens == {(24, 16, None): 24, S16: 16, (32, 48, None): 96}
    table = resolutions.shape_table(adapter, records, sampling, good)
    assert table.keys == ((24, 16, None), S16, (32, 48, None))
    assert table.costs[(32, 48, None)] > table.costs[(24, 16, None)] > table.costs[S16]
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"prompt": "b", "height": 32}, {"prompt": "c", "height": 18}])
    with pytest.raises(ValueError, match=r"bad.jsonl:3: prompt shape 18x16: height 18 must be a positive multiple of 4"):
        resolutions.check_shapes(adapter, load_prompts(bad), sampling, bad)
    video = _jsonl(tmp_path / "video.jsonl", [{"prompt": "a", "frames": 9}])
    with pytest.raises(ValueError, match=r"video.jsonl:1: 'frames' 9 given for 'flux', an image model"):
        resolutions.check_shapes(adapter, load_prompts(video), sampling, video)
    plain = _jsonl(tmp_path / "plain.jsonl", [{"prompt": "a", "height": 16}, {"prompt": "b"}])
    assert resolutions.shape_table(adapter, load_prompts(plain), sampling, plain) is None  # one shape: plans as before


def test_measured_costs_calibrate_the_model():
    table = ShapeTable((S16, S48, S16, S32), {S16: 17.0, S32: 70.0, S48: 252.0})  # FLOPs: 48x48 costs 15x 16x16
    seconds = [{"16x16": 0.04, "32x32": 0.05, "48x48": 0.06}, {"16x16": 0.06, "32x32": 0.06, "48x48": 0.06}]
    got = resolutions.measured_table(table, seconds)  # measured: 1.2x, a fixed cost per forward dominates
    assert got.keys == table.keys
    assert got.costs[S48] == 1.0 and 0.8 < got.costs[S16] < got.costs[S32] < 0.9  # the model's order, measured scale
    noisy = [{"16x16": 0.05, "32x32": 0.045, "48x48": 0.06}]  # noise inverts two shapes: the order stays the model's
    assert sorted(table.costs, key=resolutions.measured_table(table, noisy).costs.get) == [S16, S32, S48]
    falling = [{"16x16": 0.06, "32x32": 0.05, "48x48": 0.04}]  # no positive slope: about equal, in the model's order
    flat = resolutions.measured_table(table, falling).costs
    assert flat[S48] == 1.0 and 1 - 1e-5 < flat[S16] < flat[S32] < 1.0
    assert resolutions.measured_table(None, []) is None
    with pytest.raises(ValueError, match=r"must measure the shapes \['16x16', '32x32', '48x48'\]"):
        resolutions.measured_table(table, [{"16x16": 0.04}])


# ----- the plan --------------------------------------------------------------------------------------
def _table(num_prompts, seed=0, weights=(1, 1, 2)):
    rng = random.Random(seed)
    keys = tuple(rng.choices([S16, S32, S48], weights=weights)[0] for _ in range(num_prompts))
    return ShapeTable(keys, {k: sample_cost(k[0] * k[1] // 16, 10, 768) for k in (S16, S32, S48)})


def _plan(step, table, dispatch="lpt", fragment_groups=1, speeds=None, prompts_per_step=8, replicas=2, **kw):
    return plan_step(step, seed=0, num_prompts=len(table.keys) if table else 20, prompts_per_step=prompts_per_step,
                     group_size=2, micro_batch=2, num_replicas=replicas, num_trainers=2,
                     fragment_groups=fragment_groups, replica_speeds=speeds, shapes=table, dispatch=dispatch, **kw)


def _makespan(plan, speeds):
    return max(replica_finish([f.cost for f in plan.fragments], [f.replica for f in plan.fragments], speeds))


def test_one_shape_plans_are_unchanged():
    one = ShapeTable((S32,) * 20, {S32: 5.0})
    for fg, speeds in itertools.product((1, 3, None), (None, [0.5, 1.0])):
        ref = _plan(3, None, "round-robin", fg, speeds)
        for plan in (_plan(3, None, "lpt", fg, speeds), _plan(3, one, "lpt", fg, speeds)):
            assert [(f.groups, f.replica, f.chunks) for f in plan.fragments] == \
                   [(f.groups, f.replica, f.chunks) for f in ref.fragments]


@pytest.mark.parametrize("fragment_groups", [1, 2, 3])
def test_fragments_never_mix_shapes_and_lpt_orders_longest_first(fragment_groups):
    table = _table(40)
    for step in range(6):
        lpt, rr = _plan(step, table, "lpt", fragment_groups), _plan(step, table, "round-robin", fragment_groups)
        for plan in (lpt, rr):
            prompts = plan.prompt_indices
            assert sorted(g for f in plan.fragments for g in f.groups) == list(range(8))  # every group once
            for f in plan.fragments:
                assert {table.keys[prompts[g]] for g in f.groups} == {f.shape}  # one shape per fragment
                assert len(f.groups) <= fragment_groups
                assert f.cost == pytest.approx(len(f.groups) * 2 * table.costs[f.shape])
            assert [c.index for c in plan.chunks] == list(range(len(plan.chunks)))
            assert [i for c in plan.chunks for i in c.sample_ids] == [i for f in plan.fragments for i in f.sample_ids]
        costs = [f.cost for f in lpt.fragments]
        assert costs == sorted(costs, reverse=True)  # TAG claims in index order: longest first
        assert [f.groups[0] for f in rr.fragments] == sorted(f.groups[0] for f in rr.fragments)  # step order
        assert sorted(f.groups for f in lpt.fragments) == sorted(f.groups for f in rr.fragments)  # same data
        assert lpt.prompt_indices == rr.prompt_indices == choose_prompts(0, step, 40, 8)


@pytest.mark.parametrize("speeds", [[1.0, 1.0], [0.5, 1.0], [1.0, 1.0, 1.0]])
def test_lpt_makespan_beats_round_robin(speeds):
    table = _table(60, seed=1)
    lpt, rr = [], []
    for step in range(30):
        a = _plan(step, table, "lpt", speeds=speeds, replicas=len(speeds))
        b = _plan(step, table, "round-robin", speeds=speeds, replicas=len(speeds))
        lpt.append(_makespan(a, speeds))
        rr.append(_makespan(b, speeds))
        assert lpt[-1] <= rr[-1] * (1 + 1e-9), step
        assert a == _plan(step, table, "lpt", speeds=speeds, replicas=len(speeds))  # deterministic
    assert sum(lpt) < 0.9 * sum(rr)  # the skew costs round-robin >10% here


def test_assign_lpt_is_near_the_optimum():
    rng = random.Random(0)
    ratios = []
    for _ in range(300):
        n, m = rng.randint(2, 8), rng.randint(2, 3)
        costs = sorted((rng.choice([1.0, 4.3, 10.5]) for _ in range(n)), reverse=True)
        speeds = [rng.choice([1.0, 0.5]) for _ in range(m)]
        got = max(replica_finish(costs, assign_lpt(costs, speeds), speeds))
        best = min(max(replica_finish(costs, o, speeds)) for o in itertools.product(range(m), repeat=n))
        ratios.append(got / best)
        if len(set(speeds)) == 1:
            assert got / best <= 4 / 3 - 1 / (3 * m) + 1e-9  # Graham's bound for LPT
    assert max(ratios) < 1.25 and sum(r < 1 + 1e-9 for r in ratios) >= 0.9 * len(ratios)
    assert assign_lpt([1.0] * 7, [0.33, 0.75, 1.0]) == assign_fragments(7, [0.33, 0.75, 1.0])  # equal costs
    assert assign_lpt([10.5, 10.5, 4.3, 4.3, 1.0, 1.0], [1.0, 1.0]) == [0, 1, 0, 1, 0, 1]
    with pytest.raises(ValueError, match="speeds must be positive"):
        assign_lpt([1.0], [0.0])
    with pytest.raises(ValueError, match="unknown --dispatch 'fifo'"):
        _plan(0, None, "fifo")


def test_dispatch_flag_is_validated_and_reaches_the_plan():
    from config.cli import parse_config
    from config.validate import validate

    cfg = parse_config(["--dispatch", "fifo"])
    cfg.resolve_defaults()
    with pytest.raises(ValueError, match=r"unknown --dispatch 'fifo'; choose one of \('lpt', 'round-robin'\)"):
        validate(cfg, 2)
    table = _table(1500)
    for dispatch in ("lpt", "round-robin"):
        cfg = parse_config(["--dispatch", dispatch, "--generators", "1", "--trainers", "1"])
        cfg.resolve_defaults()
        plan = validate(cfg, 2).step_plan(cfg, 0, None, table)
        assert plan == plan_step(0, seed=0, num_prompts=1500, prompts_per_step=8, group_size=8, micro_batch=8,
                                 num_replicas=1, num_trainers=1, fragment_groups=1, shapes=table, dispatch=dispatch)


def test_evaluation_shares_every_shape_evenly():
    keys = ["16x16", "32x32", "16x16", "48x48", "16x16", "32x32", "16x16"]
    shares = [resolutions.evaluation_share(keys, 3, me) for me in range(3)]
    assert sorted(j for s in shares for j, real in s if real) == list(range(len(keys)))
    for name in set(keys):
        counts = [sum(keys[j] == name for j, _ in s) for s in shares]
        assert len(set(counts)) == 1, (name, counts)  # equal forwards of every shape on every evaluator
    one = ["a"] * 5
    assert resolutions.evaluation_share(one, 2, 1) == [(3, True), (4, True), (4, False)]


def test_grid_pads_mixed_sizes_to_the_largest():
    images = [torch.ones(3, 4, 4), torch.full((3, 8, 6), 0.5)]
    batch = pad_to_largest(images)
    assert batch.shape == (2, 3, 8, 6)
    assert batch[0, :, 2:6, 1:5].eq(1).all() and batch[0].sum() == 3 * 16  # centred, black around
    assert image_grid(images, nrow=2, padding=1).size == (2 * 7 + 1, 9 + 1)


# ----- gradients: mixed shapes, chunks and TSP against the per-sample loop ---------------------------
def test_mixed_shape_gradients_equal_the_per_sample_loop():
    from rl import sampler
    from config.schema import RunConfig
    from models import load_model
    from parallel.trainer_intake import TrainChunk, TransitionBatch, TransitionIntake
    from prompts.sets import PromptRecord
    from rewards import RewardSet
    from rollout import Generator
    from trainer import Trainer

    torch.manual_seed(0)
    adapter = load_model("flux", preset="tiny", seed=0)
    cfg = RunConfig()
    cfg.optim.lora_rank = 0
    cfg.rl.algorithm, cfg.rl.timestep_fraction = "dance_grpo", 0.6
    sampling = sampler.SamplingConfig.for_adapter(adapter, height=16, width=16, num_steps=4)
    records = [PromptRecord("a red circle", {"height": 24}), PromptRecord("two blue squares"),
               PromptRecord("a green triangle", {"height": 24, "width": 32})]
    table = resolutions.shape_table(adapter, records, sampling, "mem")
    plan = plan_step(0, seed=0, num_prompts=3, prompts_per_step=3, group_size=2, micro_batch=2, num_replicas=1,
                     num_trainers=1, fragment_groups=2, shapes=table)
    assert len({f.shape for f in plan.fragments}) == 3
    gen = Generator(adapter, sampling, RewardSet(["jpeg_compressibility"]), records, seed=0)
    chunks = {}
    for f in plan.fragments:
        result = gen.complete(plan, gen.submit(plan, gen.denoise(plan, f), 0), None)
        h, w, _ = f.shape
        assert all(c.latents.shape[-2:] == (h // 2, w // 2) for c in result.chunks)  # denoised at its shape
        assert torch.equal(result.chunks[0].sigmas, sampler.sigmas_for(adapter, resolutions.sampling_for(sampling, f.shape)))
        chunks[f.index] = result.chunks
    sigmas = [chunks[f.index][0].sigmas for f in plan.fragments]
    assert not torch.equal(sigmas[0], sigmas[-1])  # the dynamic shift follows the sequence length
    trainer = Trainer(cfg, adapter, sampling)

    def grads():
        g = torch.cat([p.grad.reshape(-1) for p in trainer.params if p.grad is not None])
        trainer.optimizer.zero_grad(set_to_none=True)
        n = trainer.num_transitions
        trainer.reset_stats()
        return g, n

    for c in (c for f in plan.fragments for c in chunks[f.index]):  # the reference: one sample per forward
        for j in range(len(c.sample_ids)):
            one = TrainChunk(c.step, c.fragment, c.chunk, c.version, c.sample_ids[j:j + 1], c.latents[j:j + 1],
                             c.log_probs[j:j + 1], c.advantages[j:j + 1], c.keep[j:j + 1], c.sigmas,
                             c.cond.select([j]), None)
            trainer.train_chunk(one)
    ref, ref_n = grads()
    assert ref.norm() > 0
    for f in plan.fragments:
        for c in chunks[f.index]:
            trainer.train_chunk(c)
    got, n = grads()
    assert n == ref_n and ((got - ref).norm() / ref.norm()).item() < 1e-5
    for num_trainers in (1, 2):  # TSP: every micro-batch is of one fragment, hence of one shape
        intake = TransitionIntake(trainer.spec, tuple(range(num_trainers)), lambda r: 0, 3)
        for f in plan.fragments:
            for _, batch in intake.batches(plan, chunks[f.index]):
                trainer.train_transitions(TransitionBatch.from_payload(*batch.to_payload()))
        got, n = grads()
        assert n == ref_n and ((got - ref).norm() / ref.norm()).item() < 1e-5, num_trainers


# ----- through torchrun: mixed shapes train the colocated run's weights ------------------------------
def test_mixed_shapes_placement_invariance(tmp_path):
    """Prompts of three sizes: colocated (2 ranks, lpt), 2 generator replicas + 1 TSP trainer (lpt,
    evaluating every shape) and a 2-stage GAP replica + 1 trainer with round-robin dispatch (micro-
    batches of different shapes in flight) end with the same weights."""
    sizes = [8, 16, 24, 24]
    prompts = _jsonl(tmp_path / "mixed.jsonl", [{"prompt": f"prompt {i}", "height": sizes[i % 4], "width": sizes[i % 4]}
                                                for i in range(8)])
    args = [*TINY, "--prompts", prompts, "--prompts-per-step", "4", "--lora-rank", "4", "--steps", "2"]
    runs = {"colocated": (2, ["--mode", "colocated"]),
            "2g1t-lpt-tsp": (3, ["--generators", "2", "--trainers", "1", "--tsp", "--train-micro-batch", "3",
                                 "--eval-every", "2", "--eval-prompts", prompts, "--eval-num-prompts", "5"]),
            "gap2stage-rr": (3, ["--generators", "2", "--gap-stages", "2", "--trainers", "1",
                                 "--dispatch", "round-robin"])}
    checked = {"colocated": ([], []), "2g1t-lpt-tsp": (["data.to"], ["trainers:all_gather_object"]),  # evaluation
               "gap2stage-rr": (["gap.r0.s0->s1"], [])}
    weights, metrics = {}, {}
    for name, (nproc, placement) in runs.items():
        torchrun(nproc, [*args, *placement, "--output-dir", str(tmp_path / name)], env=traced(tmp_path / name))
        assert_nccl_ok(tmp_path / name, *checked[name])
        weights[name] = trained_weights(str(tmp_path / name), 2)
        metrics[name] = [r for r in read_metrics(str(tmp_path / name)) if "reward/mean" in r]
    for name in runs:
        assert_same_weights(weights[name], weights["colocated"], name)
        assert [r["reward/mean"] for r in metrics[name]] == \
               pytest.approx([r["reward/mean"] for r in metrics["colocated"]], rel=1e-6), name
        assert all(r["train/ratio"] == 1.0 and r["train/num_transitions"] == 16 for r in metrics[name]), name
    evals = [r for r in read_metrics(str(tmp_path / "2g1t-lpt-tsp")) if "eval/reward" in r]
    assert {k for k in evals[-1] if k.startswith("eval/reward/")} == {"eval/reward/8x8", "eval/reward/16x16",
                                                                     "eval/reward/24x24"}
    assert (tmp_path / "2g1t-lpt-tsp" / "eval" / "step-000002.png").is_file()
