"""Several optimizer updates per rollout (rl/updates.py, docs/ALGORITHMS.md "Optimizer and update"):
the split of a step's samples into parts, against the peers' own batch cuts; what TSP, the intakes
and FSDP padding make of it; the trainer's N updates against N one-update steps on the parts; the
simulator's held training. The placements through torchrun: tests/test_runtime.py,
test_global_std.py, test_new_algorithms_runs.py, test_tag_tcss.py."""
import dataclasses

import pytest
import torch

from config.cli import parse_config
from config.validate import validate
from parallel.event_engine import Costs
from parallel.stepplan import plan_step
from parallel.trainer_intake import TrainChunk, TrainingSpec, make_intake
from parallel import tsp
from rl import algorithms
from rl.updates import UpdateSplit, UpdateSums, held_fraction, step_stats


# ----- the split --------------------------------------------------------------------------------------
@pytest.mark.parametrize("split", ["samples", "members", "groups"])
def test_parts_cover_the_step_in_near_equal_sizes_from_seed_and_step_alone(split):
    group = 4 if split == "groups" else 6  # 6 groups or 6 members: 2 of them per part
    s = UpdateSplit(3, split, seed=5, num_samples=24, group_size=group)
    parts = s.parts(7)
    assert len(parts) == 24 and set(parts) == {0, 1, 2}
    assert sorted(parts.count(p) for p in range(3)) == [8, 8, 8]
    assert parts == UpdateSplit(3, split, seed=5, num_samples=24, group_size=group).parts(7)  # no state, no rank
    if split == "samples":  # a permutation per step: other steps, other seeds cut elsewhere
        assert parts != s.parts(8) and parts != dataclasses.replace(s, seed=6).parts(7)
    else:
        assert parts == s.parts(8)
    odd = UpdateSplit(4, "samples", num_samples=10).parts(0)
    assert sorted(odd.count(p) for p in range(4)) == [2, 2, 3, 3]


def test_members_are_mixgrpos_gradient_accumulation():
    """MixGRPO (train_grpo_flux.py:538-610, its shipped script): one prompt's 12 samples per GPU,
    trained sample by sample, `optimizer.step()` after every 3rd (`(i+1) % 3 == 0`): its update j
    trains samples 3j .. 3j+2 of every group."""
    accumulation, group = 3, 12
    peer = []
    update = 0
    for i in range(group):  # the peer's loop over a GPU's samples
        peer.append(update)
        if (i + 1) % accumulation == 0:
            update += 1
    s = UpdateSplit(group // accumulation, "members", num_samples=4 * group, group_size=group)
    assert s.parts(0) == tuple(peer * 4)


def test_samples_cut_a_permutation_as_flow_grpo_rebatches():
    """Flow-GRPO (train_sd3.py:827-836): `perm = randperm(n)`, samples[perm] reshaped into batches:
    batch b holds perm[b n/B .. (b+1) n/B - 1], and an update accumulates consecutive batches. Here
    the permutation is drawn from (seed, step); part j holds exactly the j-th cut of it."""
    import numpy as np
    from rl.seeding import derive_seed

    s = UpdateSplit(2, "samples", seed=3, num_samples=12, group_size=4)
    perm = np.random.default_rng(derive_seed(3, 9, "updates")).permutation(12)
    assert [sorted(i for i in range(12) if s.part_of(9, i) == j) for j in (0, 1)] == \
        [sorted(perm[:6].tolist()), sorted(perm[6:].tolist())]


def test_groups_follow_the_step_order():
    assert UpdateSplit(2, "groups", num_samples=8, group_size=2).parts(0) == (0, 0, 0, 0, 1, 1, 1, 1)


@pytest.mark.parametrize("argv,message", [
    (["--updates-per-rollout", "0"], "--updates-per-rollout must be >= 1, got 0"),
    (["--updates-per-rollout", "5"], "--updates-per-rollout 5 with --update-split samples needs at least that many "
                                     "samples per step (--prompts-per-step x --group-size), got 4"),
    (["--updates-per-rollout", "3", "--update-split", "members"], "needs at least that many samples per group"),
    (["--updates-per-rollout", "3", "--update-split", "groups"], "needs at least that many groups per step"),
    (["--update-split", "halves"], "unknown --update-split 'halves'"),
])
def test_bad_update_flags_name_the_value(argv, message):
    cfg = parse_config(["--preset", "tiny", "--prompts-per-step", "2", "--group-size", "2", *argv])
    cfg.resolve_defaults()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(cfg, 2)


# ----- packing and intake -----------------------------------------------------------------------------
def _spec(n: int, split: str = "samples", samples: int = 8, group: int = 2) -> TrainingSpec:
    return TrainingSpec(algorithms.algorithm("flow_grpo"), 4, 0.99, 0, None,
                        updates=UpdateSplit(n, split, 0, samples, group))


def test_tsp_packs_each_update_apart_and_one_update_as_before():
    fragments = [[0, 1, 2, 3], [4, 5, 6, 7]]
    steps = {i: [0, 1, 2] for i in range(8)}
    parts = dict(enumerate(UpdateSplit(2, "samples", 0, 8, 2).parts(0)))
    packed = tsp.pack_step(fragments, steps, micro_batch=4, num_trainers=2, parts=parts)
    assert {parts[i] for m in packed.micro_batches for i, _ in m.transitions} == {0, 1}
    for m in packed.micro_batches:
        assert {parts[i] for i, _ in m.transitions} == {m.part}  # a micro-batch never mixes updates
    assert sorted(tr for m in packed.micro_batches for tr in m.transitions) == \
        sorted((i, t) for i in range(8) for t in range(3))
    one = tsp.pack_step(fragments, steps, micro_batch=4, num_trainers=2)
    assert one == tsp.pack_step(fragments, steps, micro_batch=4, num_trainers=2, parts=dict.fromkeys(range(8), 0))


@pytest.mark.parametrize("tsp_on", [False, True])
def test_a_trainer_takes_each_piece_by_the_first_update_that_trains_it(tsp_on):
    """With whole groups in step order, update 0 takes only the first fragments; every forward is
    counted once, and FSDP pads each update to the group's most forwards."""
    plan = plan_step(0, seed=0, num_prompts=8, prompts_per_step=4, group_size=2, micro_batch=2, num_replicas=2,
                     num_trainers=2, fragment_groups=1)
    intake = make_intake(tsp_on, _spec(2, "groups"), (0, 1), lambda r: r, micro_batch=2, me=0)
    for r in range(2):
        needs, passes = intake.needs(plan, r), intake.passes(plan, r)
        assert [upto for upto, _ in passes][-1] == len(needs)
        first, _ = passes[0]
        assert {needs[i].fragment for i in range(first)} <= {0, 1}  # groups 0, 1: fragments 0, 1
        assert sum(sum(n.forwards) for n in needs) == len(intake.forward_fragments(plan)[r])
    both = make_intake(tsp_on, _spec(2, "samples"), (0, 1), lambda r: r, micro_batch=2, me=0)
    upto, mine = both.passes(plan)[0]
    needs = both.needs(plan)
    assert mine == [i for i, n in enumerate(needs) if n.forwards[0]] and upto == mine[-1] + 1  # in plan order
    facts = dataclasses.make_dataclass("Facts", ["train_sharding", "disagg", "tsp"])("fsdp", True, tsp_on)
    from parallel.forward_rows import fsdp_pad_targets

    by_update = both.forwards_by_update(plan)
    targets = fsdp_pad_targets(plan, facts, both)
    assert targets[0] == max(len(per[0]) for per in by_update) and targets[1] == sum(
        max(len(per[p]) for per in by_update) for p in range(2))


# ----- the trainer --------------------------------------------------------------------------------------
def _trainer(**rl):
    from config.schema import RunConfig
    from models import load_model
    from rl import sampler
    from rollout import encode_batch
    from trainer import Trainer

    adapter = load_model("flux", preset="tiny", seed=0)
    cfg = RunConfig()
    cfg.optim.lora_rank, cfg.optim.lr, cfg.rl.clip_range = 0, 1e-3, 1e-3
    cfg.rl.prompts_per_step, cfg.rl.group_size = 2, 2
    for name, value in rl.items():
        setattr(cfg.rl, name, value)
    sampling = sampler.SamplingConfig.for_adapter(adapter, height=16, width=16, num_steps=3)
    trainer = Trainer(cfg, adapter, sampling)
    cond, _ = encode_batch(adapter, ["a red circle"] * 2 + ["two blue squares"] * 2, None, sampling)
    traj = sampler.denoise(adapter, cond, None, [0, 1, 2, 3], 0, sampling)
    chunk = TrainChunk(0, 0, 0, 0, torch.arange(4), traj.latents, traj.log_probs, torch.tensor([1.0, -1.0, 0.5, -0.5]),
                       torch.ones(4, dtype=torch.bool), traj.sigmas, cond, None)
    return trainer, chunk


def _rows(chunk: TrainChunk, rows: list[int]) -> TrainChunk:
    idx = torch.tensor(rows)
    return TrainChunk(chunk.step, 0, 0, chunk.version, chunk.sample_ids[idx], chunk.latents[idx],
                      chunk.log_probs[idx], chunk.advantages[idx], chunk.keep[idx], chunk.sigmas,
                      chunk.cond.select(idx), None)


def test_n_updates_are_n_one_update_steps_on_the_parts(monkeypatch):
    """Two updates per rollout train exactly what two one-update steps on the two parts train (the
    loss of each the mean over its transitions, logp_old the rollout's); the second update's ratio
    is off-policy; the algorithm's end of step (NFT's soft update) runs once, after both."""
    trainer, chunk = _trainer(updates_per_rollout=2)
    parts = trainer.spec.updates.parts(0)
    assert sorted(parts) == [0, 0, 1, 1]
    calls = []
    monkeypatch.setattr(trainer.algorithm, "after_update", lambda state, updates: calls.append(updates))
    trainer.begin_step()
    trainer.admit(chunk)
    for p in range(2):
        trainer.train(chunk, part=p)
        trainer.update()
    stats = trainer.end_step()
    assert calls == [2] and trainer.num_updates == 2 and stats["train/num_updates"] == 2.0

    ref, _ = _trainer()
    sums = []
    for p in range(2):
        ref.train(_rows(chunk, [i for i in range(4) if parts[i] == p]))
        sums.append(ref.finish_step())
    for a, b in zip(trainer.params, ref.params):
        assert torch.equal(a, b)
    assert sums[0]["train/ratio"] == 1.0 != sums[1]["train/ratio"]
    n = [s["train/num_transitions"] for s in sums]
    assert stats["train/num_transitions"] == sum(n) == 4 * 2
    for k in ("train/loss", "train/ratio", "train/clipfrac"):
        assert stats[k] == pytest.approx((sums[0][k] * n[0] + sums[1][k] * n[1]) / sum(n), rel=1e-12), k
    assert stats["train/grad_norm"] == pytest.approx((sums[0]["train/grad_norm"] + sums[1]["train/grad_norm"]) / 2)


def test_a_part_with_nothing_trained_makes_no_update():
    """--drop-zero-std may leave a part without a trained transition: its update steps nothing (an
    Adam step on zero gradients would still move the weights), and the step reports one update."""
    trainer, chunk = _trainer(updates_per_rollout=2)
    parts = trainer.spec.updates.parts(0)
    chunk.keep = torch.tensor([p == 0 for p in parts])
    trainer.begin_step()
    trainer.admit(chunk)
    trainer.train(chunk, part=0)
    first = trainer.update()
    before = [p.detach().clone() for p in trainer.params]
    trainer.train(chunk, part=1)
    second = trainer.update()
    assert first.applied and not second.applied and second.num_transitions == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.params))
    stats = trainer.end_step()
    assert stats["train/num_updates"] == 1.0 and stats["train/num_transitions"] == first.num_transitions


def test_step_stats_of_one_update_are_that_updates():
    one = UpdateSums([3.0, 1.5], 6.0, 0.25, True)
    assert step_stats(("loss", "ratio"), [one]) == {"train/loss": 0.5, "train/ratio": 0.25, "train/grad_norm": 0.25,
                                                     "train/num_transitions": 6.0, "train/num_updates": 1.0}


# ----- the simulator -----------------------------------------------------------------------------------
def test_later_updates_training_waits_for_the_last_fragment():
    """One replica streams 4 fragments of 1 s to one trainer (0.5 s of training each): with 2 updates
    over parts that span the step, half of every fragment's training waits for the last one."""
    from planner.simulator import simulate_step

    base = Costs([1.0], 1.0, 0.5, update_s=0.1)
    streamed = simulate_step("gap", 4, base, 1).makespan_s
    held = simulate_step("gap", 4, dataclasses.replace(base, held_fraction=held_fraction(2, "samples")), 1).makespan_s
    assert streamed == pytest.approx(4 + 0.5 + 0.1)
    assert held == pytest.approx(4 + 0.25 + 4 * 0.25 + 0.1)
    assert held_fraction(2, "groups") == 0.0 and held_fraction(2, "groups", waits_for_step=True) == 0.5
    assert held_fraction(1, "samples") == 0.0 and held_fraction(4, "members") == 0.75


def test_the_planner_prices_the_updates_and_the_held_training():
    """FLUX 512 px, 8 x 8 samples, 2 generators and 6 trainers (generation-bound): a second update
    over whole groups in step order costs one more optimizer step; over a cut of the step's samples
    the later update's training follows the last fragment."""
    from lab.planning import placements as plans
    from planner import hardware as hw
    from planner.workload import Workload

    pool = plans.Pool(hw.gpu("h100"), 8)
    step = {}
    for n, split in ((1, "samples"), (2, "groups"), (2, "samples")):
        wl = Workload("flux", 512, 512, sampling_steps=10, trained_timesteps=9, prompts_per_step=8, group_size=8,
                      optimizer_steps=n, update_split=split)
        plan = plans.disagg_plan(wl, pool, pool, 2, 6, 1, 1, "gap", True)
        step[(n, split)] = plan.step_s
        costs = plan.knobs["costs"]
        assert costs["held_fraction"] == held_fraction(n, split)
    one_update = step[(2, "groups")] - step[(1, "samples")]
    assert 0 < one_update < 0.01
    assert step[(2, "samples")] > step[(1, "samples")] + 5  # half of the training after generation
