"""The planner on mixed-shape workloads and across two sites: per-fragment costs follow each
fragment's shape, fragments are dispatched by the runtime's own policy (parallel/stepplan.py), LPT beats
round-robin where generation decides the step, publication bytes are the runtime codecs' bytes
(parallel/compress.py), and a slow cross-site link rewards compressed publication."""
import os
from dataclasses import replace

import pytest
import torch

from parallel import compress
from parallel.stepplan import ShapeTable, plan_step
from planner import phases as ph
from parallel.event_engine import Costs
from planner.hardware import gpu
from lab.planning.mixed_shapes import PLAN_SEED, step_plan
from lab.planning.placements import Pool, colocated, disagg_plan, replica_fragment_s, repredict
from planner.simulator import simulate_run
from planner.specs import forward_flops
from planner.workload import Workload, parse_shape_mix

from lab.planning import plan_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# data/shapes_mixed.jsonl's 16x16 / 32x32 / 48x48 at 1:1:2, at FLUX scale (x32: the same side ratios)
MIX = "512x512:1,1024x1024:1,1536x1536:2"


def _mix(**kw) -> Workload:
    base = dict(model="flux", height=512, width=512, sampling_steps=8, trained_timesteps=7, prompts_per_step=8,
                group_size=8, rewards=("ocr_cpu",), shapes=parse_shape_mix(MIX))
    return Workload(**{**base, **kw})


class _ConstantEfficiency:
    """A device profile whose kernels run at one efficiency whatever the shape: time = FLOPs / rate."""

    def efficiency(self, g, tokens, phase):
        return 0.4

    def busbw(self, group):
        return None


def test_shape_mix_parses_and_apportions_groups():
    assert parse_shape_mix("512x512:1,1024x768x33:2.5,256x256") == (
        (512, 512, 1, 1.0), (1024, 768, 33, 2.5), (256, 256, 1, 1.0))
    for bad in ("512:1", "512xabc:1", "512x512:x", "1x2x3x4:1"):
        with pytest.raises(ValueError, match="HxW"):
            parse_shape_mix(bad)
    keys = _mix(prompts_per_step=24).group_keys()
    assert [keys.count((s, s, 1)) for s in (512, 1024, 1536)] == [6, 6, 12]
    assert _mix(prompts_per_step=5).group_keys().count((1536, 1536, 1)) == 3  # 1.25, 1.25, 2.5: remainders
    with pytest.raises(ValueError, match="multiples of 16"):
        _mix(shapes=((500, 512, 1, 1.0),))
    with pytest.raises(ValueError, match="weight > 0"):
        _mix(shapes=((512, 512, 1, 0.0),))


def test_fragment_costs_follow_the_shape_in_the_flops_ratio():
    g = replace(gpu("h100"), measured=_ConstantEfficiency())
    pool = Pool(g, 8)
    wl = _mix()
    p = disagg_plan(wl, pool, pool, 4, 1, 1, 1, "gap", True)
    c, plan = p.knobs["costs"], p.knobs["owners"]
    assert plan is not None and len(c["gen_scale"]) == len(plan) == 8
    shapes = [f.shape for f in step_plan(wl, _sample_s(wl, g, 1, 8), num_replicas=4, num_trainers=1, micro=8,
                                         fragment_groups=1).fragments]
    flops = {k: forward_flops(wl.spec, wl.at(k).n_img, wl.at(k).n_txt) for k in set(shapes)}
    ref = shapes[0]
    for f, key in enumerate(shapes):
        # training: one trainer, no collectives, constant efficiency -> exactly the FLOPs ratio
        assert c["train_scale"][f] == pytest.approx(flops[key] / flops[ref], rel=1e-9)
        # generation: the DiT's share in the FLOPs ratio, plus the VAE decode (pixels) and text (fixed)
        w, r = wl.at(key), wl.at(ref)
        rest = lambda x: ph.decode_s(x, g, 8) + ph.text_s(x, g, 1)
        dit = ph.denoise_s(w, g, 8, p.knobs["rollout_micro"]) / ph.denoise_s(r, g, 8, p.knobs["rollout_micro"])
        assert dit == pytest.approx(flops[key] / flops[ref], rel=1e-9)
        assert c["gen_scale"][f] == pytest.approx((ph.denoise_s(w, g, 8, p.knobs["rollout_micro"]) + rest(w))
                                                  / (ph.denoise_s(r, g, 8, p.knobs["rollout_micro"]) + rest(r)))
    big, small = (1536, 1536, 1), (512, 512, 1)
    assert 8 < flops[big] / flops[small] < 10  # 9x the image tokens; the 512 text tokens are common to both
    assert c["gen_scale"][shapes.index(big)] / c["gen_scale"][shapes.index(small)] > 8
    assert c["transfer_scale"][shapes.index(big)] > c["transfer_scale"][shapes.index(small)]


def _sample_s(wl, g, stages, micro):
    return {k: replica_fragment_s(wl.at(k), g, stages, wl.group_size, micro, 1) / wl.group_size
            for k in set(wl.group_keys())}


def test_the_planner_dispatches_with_the_runtimes_plan_and_the_simulator_runs_it():
    wl, g = _mix(prompts_per_step=12), gpu("h100")
    pool = Pool(g, 8)
    owners = {}
    for dispatch in ("lpt", "round-robin"):
        p = disagg_plan(wl, pool, pool, 4, 4, 2, 1, "gap", True, dispatch=dispatch)
        micro = p.knobs["rollout_micro"]
        keys = wl.group_keys()
        table = ShapeTable(tuple(keys), _sample_s(wl, g, 2, micro))
        runtime = plan_step(0, seed=PLAN_SEED, num_prompts=len(keys), prompts_per_step=len(keys),
                            group_size=wl.group_size, micro_batch=micro, num_replicas=2, num_trainers=4,
                            fragment_groups=1, shapes=table, dispatch=dispatch)
        assert p.knobs["owners"] == [f.replica for f in runtime.fragments]
        owners[dispatch] = p.knobs["owners"]
        res = simulate_run("gap", 1, len(runtime.fragments), Costs.from_dict(p.knobs["costs"]), 4,
                           stages_per_replica=2, owners=p.knobs["owners"])
        assert res.generated_by[0] == [2 * f.replica for f in runtime.fragments]  # replica r's first rank
    assert owners["lpt"] != owners["round-robin"]


def _generation_bound(wl, g, replicas, dispatch):
    """Predicted makespan of a step whose training is negligible: the generators decide it."""
    plan = step_plan(wl, _sample_s(wl, g, 1, 8), num_replicas=replicas, num_trainers=1, micro=8,
                     fragment_groups=1, dispatch=dispatch)
    gen = [replica_fragment_s(wl.at(f.shape), g, 1, len(f.sample_ids), 8, len(f.groups)) for f in plan.fragments]
    costs = Costs([gen[0]] * replicas, gen[0], 1e-6, gen_scale=[x / gen[0] for x in gen])
    return simulate_run("gap", 1, len(gen), costs, 1, owners=[f.replica for f in plan.fragments]).makespan_s


@pytest.mark.parametrize("mix", [MIX, "512x512:3,1536x1536:1", "512x512:1,1024x1024:1"])
def test_lpt_never_predicts_a_longer_generation_than_round_robin(mix):
    g = gpu("h100")
    wl = _mix(prompts_per_step=16, shapes=parse_shape_mix(mix))
    for replicas in (2, 3, 4, 5, 6):
        lpt, rr = (_generation_bound(wl, g, replicas, d) for d in ("lpt", "round-robin"))
        assert lpt <= rr * (1 + 1e-9), (mix, replicas, lpt, rr)


def test_lpt_is_strictly_shorter_on_a_skewed_mix():
    g = gpu("h100")
    wl = _mix(prompts_per_step=16, shapes=parse_shape_mix("512x512:3,1536x1536:1"))
    assert _generation_bound(wl, g, 3, "lpt") < 0.9 * _generation_bound(wl, g, 3, "round-robin")
    # the whole planner: a colocated step of FLUX 512^2 / 1024^2 on 16 x H100
    big = Workload("flux", 512, 512, 1, 16, 9, 24, 16, 1.0, "lora", 32, True,
                   shapes=parse_shape_mix("512x512:1,1024x1024:1"))
    pools = [Pool(g, 16)]
    lpt = colocated(big, pools, "replicate", "lpt")
    rr = repredict(lpt, pools, dispatch="round-robin")
    assert lpt.step_s < 0.85 * rr.step_s


@pytest.mark.parametrize("spec", ["none", "bf16", "delta", "delta-topk:0.01", "delta-topk:0.3"])
def test_publication_bytes_are_the_runtime_codecs_bytes(spec):
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 48), (300,), (7, 5, 3), (1,)]
    initial = {f"w{i}": torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
    new = {n: t + 1e-2 * torch.randn(t.shape, generator=gen) for n, t in initial.items()}
    wire = compress.Reconstruction(spec, initial).publish(new)[0] if compress.lossy(spec) else new
    runtime = sum(t.numel() * t.element_size() for t in wire.values())
    planner = ph.wire_bytes(spec, [(t.numel(), 1) for t in new.values()], element_size=4)
    assert planner == runtime
    # a workload's publication: bf16 is 2 bytes per trained parameter, none the fp32 tensors
    wl = Workload("flux", 512, 512, finetune="full", publish_compression=spec)
    trained = sum(n * k for n, k in ph.trained_tensors(wl))
    assert trained == int(wl.spec.params)
    expected = {"none": 4, "bf16": 2, "delta": 2}.get(spec)
    if expected:
        assert ph.publish_wire_bytes(wl) == expected * trained
    else:
        fraction = float(spec.split(":")[1])
        assert ph.publish_wire_bytes(wl) == pytest.approx(6 * fraction * trained, rel=1e-3)  # int32 + bf16


def _cross_site(codec, link_bytes_s):
    wl = Workload("flux", 720, 720, 1, 16, 9, 24, 16, 1.0, "full", 32, True, rewards=("hpsv2",),
                  publish_compression=codec)
    return disagg_plan(wl, Pool(gpu("h20"), 8), Pool(gpu("h100"), 8), 8, 8, 1, 1, "gap", False,
                       link_bytes_s=link_bytes_s)


def test_a_slow_link_rewards_compressed_publication_and_a_fast_one_is_irrelevant():
    slow = 25e9 / 8
    none, topk = _cross_site("none", slow), _cross_site("delta-topk:0.01", slow)
    assert none.feasible and topk.feasible
    assert topk.step_s < 0.9 * none.step_s
    assert none.step_s > _cross_site("none", None).step_s  # the link costs something uncompressed
    fast = 10 * gpu("h100").nvlink_busbw
    for codec in ("none", "bf16", "delta-topk:0.01"):
        assert _cross_site(codec, fast).step_s == _cross_site(codec, None).step_s
    with pytest.raises(ValueError, match="two pools"):
        p = Pool(gpu("h100"), 16)
        disagg_plan(none.workload, p, p, 8, 8, 1, 1, "gap", True, link_bytes_s=slow)


def test_plan_cli_reports_both_dispatches_and_the_link(capsys):
    assert plan_cli.main(["--model", "flux", "--gpus", "h100:8", "--prompts-per-step", "8", "--group-size", "4",
                          "--shape-mix", "512x512:1,1024x1024:1", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "shapes 512x512:1,1024x1024:1" in out
    assert "dispatch of the shape mix:" in out and "lpt" in out and "round-robin" in out
    assert plan_cli.main(["--model", "flux", "--finetune", "full", "--gpus", "h20:4", "--gpus", "h100:4",
                          "--prompts-per-step", "8", "--group-size", "4", "--link-gbps", "25",
                          "--publish-compression", "delta-topk:0.01", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "two sites joined by 25 Gb/s, publication delta-topk:0.01" in out
    assert "colocated replicate: a colocated plan does not span two sites" in out
    with pytest.raises(ValueError, match="--link-gbps"):
        plan_cli.main(["--gpus", "h100:8", "--link-gbps", "25"])
