"""Tail assist (docs/DESIGN.md 5.9), the pure parts: the packing of the helped fragment, the
placements that refuse it, and the helper's gradient added into the first trainer's. The runs
(placement invariance, the recorded communication) are in tests/test_tail_assist_runs.py."""
import dataclasses

import pytest
import torch

from config.cli import parse_config
from config.validate import tail_assist_refusal, validate
from parallel import p2p, stepplan, tail_assist, tsp
from parallel.topology import Topology


def _fragments(sizes, num_steps=2):
    """Fragments of consecutive samples, each trained at `num_steps` timesteps."""
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    return [tsp.fragment_transitions(range(a, b), {i: range(num_steps) for i in range(a, b)})
            for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("num_trainers,weights", [(1, None), (2, None), (3, None), (2, [1.0, 3.0])])
def test_the_helped_fragment_is_shared_by_one_more_and_the_others_are_unchanged(num_trainers, weights):
    fragments = _fragments([4, 4, 4, 4])
    plain = tsp.pack(fragments, micro_batch=4, num_trainers=num_trainers, weights=weights)
    helped = tsp.pack(fragments, micro_batch=4, num_trainers=num_trainers, weights=weights, helped=3)
    assert helped.num_helpers == 1 and len(helped.num_forwards()) == num_trainers + 1
    for f in range(3):  # every other fragment packs exactly as without the helper
        assert [(m.trainer, m.transitions) for m in plain.micro_batches if m.fragment == f] == \
            [(m.trainer, m.transitions) for m in helped.micro_batches if m.fragment == f]
    last = [m for m in helped.micro_batches if m.fragment == 3]
    assert sorted(tr for m in last for tr in m.transitions) == sorted(fragments[3])  # each transition once
    shares = [sum(len(m.transitions) for m in last if m.trainer == r) for r in range(num_trainers + 1)]
    if weights is None:
        assert max(shares) - min(shares) <= 1, shares
    else:  # the helper weighs the trainers' mean: 8 x (1, 3, 2) / 6
        assert shares == [1, 4, 3], shares
    assert helped.trainers_of(3)[-1] == num_trainers
    with pytest.raises(ValueError, match="helped fragment 4"):
        tsp.pack(fragments, micro_batch=4, num_trainers=1, helped=4)


def test_the_helpers_weight_follows_the_generators_probed_speed():
    fragments = _fragments([6])  # 12 transitions
    # a generator 2x slower than the trainer: a third of the share a trainer takes as much
    assert stepplan.helper_weight([2.0], [1.0], None) == 0.5
    half = tsp.pack(fragments, micro_batch=16, num_trainers=1, helped=0, helper_weight=0.5)
    assert half.num_transitions() == [8, 4]
    # within 15% of the trainers: their mean weight (even shares without weights)
    assert stepplan.helper_weight([1.1], [1.0], (1.0, 0.5)) is None
    assert stepplan.helper_weight([1.0], [1.0, 2.0], (1.0, 0.5)) == pytest.approx(round(0.75 * (1 / 0.75), 2))
    assert tsp.pack(fragments, micro_batch=16, num_trainers=1, helped=0).num_transitions() == [6, 6]


def _cfg(*argv):
    cfg = parse_config(["--preset", "tiny", "--tsp", "--tail-assist", *argv])
    cfg.resolve_defaults()
    return cfg


@pytest.mark.parametrize("argv,topo,why", [
    ([], ("colocated",), "needs --mode disagg"),
    (["--no-tsp"], (), "needs --tsp"),
    (["--train-sharding", "fsdp"], (), "--train-sharding fsdp"),
    ([], ("disagg", 2, 1, 0, 2), "--gap-stages 2"),
    (["--tcss"], (), "is on-policy"),
    (["--publish-compression", "bf16"], (), "--publish-compression bf16"),
    (["--updates-per-rollout", "2"], (), "--updates-per-rollout 2"),
    (["--std-mode", "global"], (), "the global std"),
    (["--algorithm", "nft"], (), "cannot run nft"),
    (["--lora-rank", "0", "--beta", "0.01"], (), "reference copy"),
])
def test_placements_that_cannot_assist_are_named(argv, topo, why):
    cfg = _cfg(*argv)
    mode, *rest = topo or ("disagg",)
    assert why in tail_assist_refusal(cfg, Topology.build(3 if rest else 2, mode, *rest))


def test_a_fixed_placement_that_cannot_assist_fails_validation_and_one_that_can_assists():
    with pytest.raises(ValueError, match="--tail-assist needs replicated trainers"):
        validate(_cfg("--generators", "1", "--trainers", "1", "--train-sharding", "fsdp"), 2)
    assert tail_assist_refusal(_cfg("--lora-rank", "0"), Topology.build(2)) is None  # beta 0: no reference
    assert validate(_cfg("--generators", "1", "--trainers", "1"), 2).tail_assist


class _Side:
    """The attributes of trainer.Trainer that tail assist reads and writes."""

    def __init__(self, params, names, step=3):
        self.params, self.names, self.current_step, self.device = params, names, step, torch.device("cpu")
        self.reset_stats()

    def reset_stats(self):
        self.loss_sums = torch.zeros(2, dtype=torch.float64)
        self.counts = {"staleness_mean": 0.0, "staleness_frac_1": 0.0}
        self.num_transitions = 0
        self.nonfinite_advantages = torch.zeros((), dtype=torch.int64)


def test_the_helpers_gradient_and_sums_join_the_first_trainers():
    torch.manual_seed(0)
    shapes, names = [(3, 2), (4,)], ["a.weight", "b.bias"]
    helper = _Side([torch.randn(s, requires_grad=True) for s in shapes], names)
    trainer = _Side([torch.randn(s, requires_grad=True) for s in shapes], names)
    x = torch.randn(5, 3)
    (x @ helper.params[0]).sum().backward()  # the second weight gets no gradient: sent as zeros
    trainer.params[1].grad = torch.ones(4)
    want = [helper.params[0].grad.clone(), torch.ones(4)]
    helper.loss_sums += torch.tensor([1.5, 2.0], dtype=torch.float64)
    helper.num_transitions, helper.counts["staleness_mean"] = 6, 0.0
    helper.nonfinite_advantages += 1
    trainer.num_transitions = 10
    tensors, meta = tail_assist.payload(helper)
    assert all(p.grad is None for p in helper.params) and helper.num_transitions == 0  # handed over, cleared
    tail_assist.add(trainer, tensors, meta)
    for p, w in zip(trainer.params, want):
        assert torch.equal(p.grad, w)
    assert trainer.num_transitions == 16 and trainer.loss_sums.tolist() == [1.5, 2.0]
    assert int(trainer.nonfinite_advantages) == 1
    with pytest.raises(p2p.ProtocolError, match="weights"):
        tail_assist.add(_Side(trainer.params, ["other"]), tensors, meta)
    with pytest.raises(p2p.ProtocolError, match="step 3's gradient in step 4"):
        tail_assist.add(_Side(trainer.params, names, step=4), tensors, meta)


def test_the_planner_offers_tail_assist_where_the_config_allows_and_predicts_a_shorter_tail():
    from planner.candidates import Machine, Placement, Workload, candidates, predict
    plain = candidates(2)
    assert not any(p.tail_assist for p in plain)
    offered = [p for p in candidates(3, blocks=4, allow_stale=True, tail_assist=True) if p.tail_assist]
    # whole replicas, replicated trainers, on-policy: TAG on and off for 1 + 2 and 2 + 1
    assert [p.label() for p in offered] == ["1 generator + 2 trainers, tail assist",
                                           "1 generator + 2 trainers, TAG, tail assist",
                                           "2 generators + 1 trainer, tail assist",
                                           "2 generators + 1 trainer, TAG, tail assist"]
    assert offered[0].flags()[-1] == "--tail-assist"
    wl = Workload(prompts_per_step=4, group_size=4, micro_batch=4, num_prompts=64, seed=0, fragment_groups=1,
                  sample_steps=8, trained_per_sample=8, sample_bytes=1e4, version_bytes=1e5, grad_bytes=4e5,
                  weight_bytes=7e6, tsp=True, train_micro_batch=16, blocks=4, units=8)
    machine = Machine([0.1, 0.1], [0.004, 0.004], link_bytes_s=1e9, latency_s=1e-4)
    split = predict(Placement("disagg", 1, 1, tag=True), wl, machine).step_s
    assisted = predict(Placement("disagg", 1, 1, tag=True, tail_assist=True), wl, machine).step_s
    # the last fragment (4 samples x 8 transitions x 4 ms = 0.128 s) trains in half, the gradient's
    # 4e5 bytes cross the link: 0.064 - 0.0005 s shorter
    assert split - assisted == pytest.approx(0.064 - 4e5 / 1e9 - 1e-4, abs=0.01), (split, assisted)


def test_the_memory_model_counts_the_generators_share_of_training():
    from planner import memory
    shape = memory.RunShape(family="flux", dit=1e9, text=1e8, vae=1e7, rewards=0, hidden=3072, blocks=8,
                            largest_unit=1e8, largest_tensor=1e7, tokens=1024, latent=4096, pixels=512 * 512, steps=8,
                            branches=1, gen_micro=4, train_micro=16, fragment=4, lora=1e7, compute_bytes=4)
    plain = memory.generator_phases(shape, float("inf"))
    assert "tail assist" not in plain
    assisted = memory.generator_phases(dataclasses.replace(shape, tail_assist=True), float("inf"))
    phase = assisted["tail assist"]
    assert phase.items["gradients"] == 4e7  # the adapters' float32 gradient
    assert phase.items["activations"] == memory.ACTIVATIONS[("flux", 4)].train * 16 * 1024 * 3072
    assert phase.items["DiT weights"] == plain["fragment"].items["DiT weights"]  # beside what a generator holds


class _Recorder:
    def __init__(self):
        self.trained = []

    def train(self, item):
        self.trained.append(item)


@pytest.mark.parametrize("owner,me,received,by_trainer", [
    (0, 1, True, 0.0),   # a generator generated the last fragment: the first trainer adds what it trained
    (0, 2, False, 0.0),  # the second trainer does not wait for it
    (2, 1, False, 1.0),  # the second trainer generated it (TAG): it trains the share, nothing is sent
    (1, 1, False, 1.0),  # the first trainer generated it
])
def test_the_share_joins_the_update_where_the_fragment_was_generated(monkeypatch, owner, me, received, by_trainer):
    from types import SimpleNamespace
    import contextlib
    from runtime import steps
    packing = tsp.pack(_fragments([2, 2]), micro_batch=4, num_trainers=2, helped=1)
    topo = Topology.build(3, "disagg", 1, 2)
    intake = SimpleNamespace(helped=lambda plan: 1, packing=lambda plan: packing, group_to=lambda dst: f"data.to{dst}")
    ctx = SimpleNamespace(intake=intake, topo=topo, rank=me, tracer=SimpleNamespace(span=lambda *a, **k:
                                                                                    contextlib.nullcontext()))
    share = object()
    board = SimpleNamespace(wait_owner=lambda f: {"rank": owner})
    assistant = SimpleNamespace(board=board, helper_share=share if owner == me else None)
    got = []
    monkeypatch.setattr(tail_assist, "receive", lambda trainer, src, group: got.append((src, group)))
    trainer = _Recorder()
    stats = steps._join_tail(ctx, trainer, SimpleNamespace(step=0), assistant)
    assert trainer.trained == ([share] if owner == me else []) and assistant.helper_share is None
    assert got == ([(0, "data.to1")] if received else [])
    assert stats == {"train/assist_transitions": 1.0, "train/assist_by_trainer": by_trainer}


def test_a_half_precision_helper_accumulates_its_gradient_in_float32():
    """A generator holds bf16 weights: each backward's bf16 gradient is added into a float32 sum (as a
    mixed-precision trainer's FSDP2 reduces and accumulates it), not summed in bf16."""
    torch.manual_seed(0)
    w = torch.randn(8, 4).to(torch.bfloat16).requires_grad_(True)
    helper = _Side([w], ["w"])
    tail_assist.float32_gradients(helper)
    xs = [torch.randn(3, 8).to(torch.bfloat16) for _ in range(3)]
    for x in xs:
        (x @ w).float().pow(2).sum().backward()
        assert w.grad is None  # moved into the float32 sum
    ref = torch.zeros(8, 4)
    for x in xs:
        v = w.detach().clone().requires_grad_(True)
        (x @ v).float().pow(2).sum().backward()
        ref += v.grad.float()  # each bf16 gradient, summed in float32
    assert helper.float_grads[0].dtype == torch.float32 and torch.equal(helper.float_grads[0], ref)
    tensors, _ = tail_assist.payload(helper)
    assert torch.equal(tensors["grads"], ref.reshape(-1)) and helper.float_grads == [None]
