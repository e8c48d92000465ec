"""Tail assist (docs/DESIGN.md 5.9), the pure parts: the packing of the helped fragment, the
placements that refuse it, and the helper's gradient added into the first trainer's. The runs
(placement invariance, the recorded communication) are in tests/test_tail_assist_runs.py."""
import pytest
import torch

from config.cli import parse_config
from config.validate import tail_assist_refusal, validate
from parallel import p2p, tail_assist, tsp
from parallel.topology import Topology


def _fragments(sizes, num_steps=2):
    out, start = [], 0
    for n in sizes:
        out.append([(i, t) for i in range(start, start + n) for t in range(num_steps)])
        start += n
    return out


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
    (["--dtype", "bfloat16"], (), "needs float32 compute (got torch.bfloat16)"),
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
