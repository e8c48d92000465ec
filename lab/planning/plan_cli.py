"""The planner from the command line (docs/calibration.md). Three uses:

    python -m scripts.plan --model flux --gpus h100:16 [--gpus h20:16] [workload flags]
    python -m scripts.plan --model sd3 --variant large --gpus a800:8
    python -m scripts.plan --model wan --variant 1.3b --gpus b200:8
        Every feasible plan of the cluster (colocated replicate / fsdp / sleepwake; disaggregated
        generators x trainers x GAP stages x fragment size with TSP, TAG and TCSS), ranked by
        predicted step time, with samples/s, samples per dollar, bubble, end-to-end MFU and peak
        memory per role, and one recommendation. The best colocated plan is always listed.

    python -m scripts.plan --model flux --gpus h100:16 --shape-mix 512x512:1,1024x1024:1
        The same for prompts of several shapes (one shape per group): fragments are dispatched by the
        runtime's policy (--dispatch lpt | round-robin) and the recommended plan is also predicted
        with the other one.

    python -m scripts.plan --model flux --finetune full --gpus h20:8 --gpus h100:8 --link-gbps 25 \
            --publish-compression delta-topk:0.01
        Generators in one site, trainers in the other, joined by a 25 Gb/s link that trajectories
        and compressed publications cross.

    python -m scripts.plan --fit-run RUN --profile PROFILE --predict RUN2 [RUN3 ...] [--out OUT.json]
        Fit per-unit costs on one measured run folder (traces of lab/bench.py or of any run) and
        predict the step time of other runs from their config alone (lab/planning/fit.py).

These are predictions of a model (assumptions and validation in docs/calibration.md).
"""
from __future__ import annotations

import argparse
import json
import os

from lab.planning import fit
from planner.hardware import GPUS, Kernels, gpu, with_price
from lab.planning.placements import Pool, best_colocated, enumerate_plans, recommend, repredict
from lab.planning import timeline as plot_timeline
from lab.planning.profile import DeviceProfile, with_profile
from planner.released_specs import MODELS, model_names, resolve
from lab.planning.peer_systems import SYSTEMS, predict_system
from parallel.stepplan import DISPATCHES
from planner.workload import ALGORITHMS, REWARDS, Workload, for_algorithm, parse_shape_mix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def parse_gpus(specs: list[str], prices: list[str], profile: DeviceProfile | None) -> list[Pool]:
    price = {}
    for p in prices or []:
        key, _, usd = p.partition("=")
        try:
            price[key] = float(usd)
        except ValueError:
            raise ValueError(f"--price {p!r}: expected KEY=USD_PER_GPU_HOUR, e.g. h100=2.5") from None
    pools = []
    for spec in specs or ["h100:16"]:
        key, _, count = spec.partition(":")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--gpus {spec!r}: expected TYPE:COUNT, e.g. h100:16")
        g = with_price(gpu(key), price.get(key))
        if profile is not None and profile.gpu_key == key:
            g = with_profile(g, profile)
        pools.append(Pool(g, int(count)))
    if len(pools) > 2:
        raise ValueError("at most two --gpus pools (generators on one, trainers on the other)")
    if len(pools) == 2 and pools[0].gpu.key == pools[1].gpu.key:
        raise ValueError("two --gpus pools of the same type: give one pool with their total")
    if sum(p.count for p in pools) < 2:
        raise ValueError("a plan needs at least 2 GPUs")
    return pools


def workload_from_args(a) -> Workload:
    model = resolve(a.model, a.variant)
    k = a.sampling_steps or MODELS[model].default_steps
    wl = Workload(model, a.height, a.width, a.frames, k, max(1, int(k * 0.99)), a.prompts_per_step, a.group_size,
                  a.cfg_scale, a.finetune, a.lora_rank, a.gradient_checkpointing, a.kl, a.text_tokens,
                  tuple(a.reward or ["pickscore"]), Kernels(a.compile, a.attention), a.rollout_micro_batch,
                  a.train_micro_batch, a.optimizer_steps, parse_shape_mix(a.shape_mix) if a.shape_mix else (),
                  a.publish_compression, reward_gpus=a.reward_gpus)
    wl = for_algorithm(wl, a.algorithm, window=a.window)
    return wl.with_(trained_timesteps=a.trained_timesteps) if a.trained_timesteps else wl


def _gb(p) -> str:
    return " ".join(f"{role.split()[0]} {v:.0f}" for role, v in p.peak_memory_gb.items())


def table(preds, top: int, best_col) -> list[str]:
    shown = preds[:top]
    if best_col is not None and best_col not in shown:
        shown.append(best_col)
    lines = [f"{'#':>3s}  {'plan':44s} {'GPUs':12s} {'step s':>8s} {'samples/s':>9s} {'samples/$':>9s} "
             f"{'bubble':>6s} {'MFU':>6s}  peak GB per role"]
    for p in shown:
        rank = preds.index(p) + 1
        lines.append(f"{rank:3d}  {p.label:44s} {p.gpu_label():12s} {p.step_s:8.1f} {p.samples_per_s:9.3f} "
                     f"{p.samples_per_dollar:9.0f} {p.bubble:6.2f} {100 * p.mfu:5.1f}%  {_gb(p)}"
                     + ("  (stale by 1)" if p.knobs.get("stale") else ""))
    return lines


def run_plan(a) -> int:
    profile = DeviceProfile.load(a.profile) if a.profile else None
    pools = parse_gpus(a.gpus, a.price, profile)
    wl = workload_from_args(a)
    if a.peers and wl.shapes:
        raise ValueError("--peers models one shape per run: leave out --shape-mix")
    if a.peers and wl.reward_gpus:
        raise ValueError("--peers models each peer's own reward placement: leave out --reward-gpus")
    if a.link_gbps is not None and (a.link_gbps <= 0 or len(pools) != 2):
        raise ValueError("--link-gbps: a positive bandwidth between two --gpus pools (one site each)")
    link = a.link_gbps * 1e9 / 8 if a.link_gbps else None
    preds, excluded = enumerate_plans(wl, pools, top_k=a.tag_candidates, link_bytes_s=link, dispatch=a.dispatch)
    print(f"PREDICTIONS of the planner's cost model, not measurements: {wl.describe()}")
    print(f"  cluster: {' + '.join(f'{p.count} x {p.gpu.name} (${p.gpu.price_per_hour:.2f}/h)' for p in pools)}"
          + (f"; device profile {a.profile}" if profile else "")
          + (f"; two sites joined by {a.link_gbps:g} Gb/s, publication {wl.publish_compression}" if link else ""))
    best_col = best_colocated(preds)
    for line in table(preds, a.top, best_col):
        print(line)
    if not preds:
        print("no feasible plan:")
        for e in excluded[:10]:
            print(f"  {e}")
        return 1
    rec = recommend(preds, a.allow_stale)
    ratio = f", {best_col.step_s / rec.step_s:.2f}x the best colocated plan ({best_col.label})" if best_col else ""
    print(f"recommended: {rec.label} on {rec.gpu_label()}: {rec.step_s:.1f} s per step, {rec.samples_per_s:.3f} "
          f"samples/s, {rec.samples_per_dollar:.0f} samples per dollar{ratio}")
    for note in rec.notes:
        print(f"  {note}")
    if wl.shapes:
        other = next(d for d in DISPATCHES if d != a.dispatch)
        again = repredict(rec, pools, dispatch=other)
        alt, _ = enumerate_plans(wl, pools, top_k=a.tag_candidates, link_bytes_s=link, dispatch=other)
        best_other = recommend(alt, a.allow_stale) if alt else None
        print(f"dispatch of the shape mix: {rec.label}: {a.dispatch} {rec.step_s:.1f} s, {other} {again.step_s:.1f} s per "
              f"step" + (f"; best plan with {other}: {best_other.label} {best_other.step_s:.1f} s" if best_other else ""))
    if a.peers:
        g, n = pools[0].gpu, pools[0].count
        print(f"modelled peer systems on {n} x {g.key} (as they run):")
        for s in SYSTEMS:
            p = predict_system(s, wl, g, n)
            fits = "" if p.feasible else f"  [does not fit: {p.why_not[0]}]"
            print(f"  {p.label:28s} {p.step_s:8.1f} s  bubble {p.bubble:.2f}  MFU {100 * p.mfu:4.1f}%  "
                  f"DigenRL {p.step_s / rec.step_s:.2f}x{fits}")
    if excluded:
        print(f"excluded ({len(excluded)}): " + "; ".join(excluded[:3]) + (" ..." if len(excluded) > 3 else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"rank": i + 1, "label": p.label, "system": p.system, "gpus": p.gpu_label(), "step_s": p.step_s,
                        "samples_per_s": p.samples_per_s, "samples_per_dollar": p.samples_per_dollar,
                        "bubble": p.bubble, "mfu": p.mfu, "peak_memory_gb": p.peak_memory_gb,
                        "knobs": {k: v for k, v in p.knobs.items() if k != "costs"}, "recommended": p is rec}
                       for i, p in enumerate(preds)], f, indent=1)
        print(f"wrote {a.json}")
    if a.timeline:
        best_disagg = next((p for p in preds if p.system == "digenrl" and not p.knobs.get("stale")), None)
        shown = []
        for p in (rec, best_col, best_disagg):
            if p is not None and all(p is not q for q in shown):
                shown.append(p)
        plot_timeline.draw(shown, a.timeline, wl.describe())
        print(f"wrote {a.timeline}")
    return 0


def run_fit(a) -> int:
    if not a.profile:
        raise ValueError("--fit-run needs --profile (a lab/calibrate.py profile of the same machine)")
    profile = DeviceProfile.load(a.profile)
    units = fit.fit_unit_costs(a.fit_run, profile)
    print(f"fitted on {a.fit_run}: generation x{units.gen_scale:.3f} and training x{units.train_scale:.3f} of the "
          f"profile, transfer {units.transfer_s * 1e3:.1f} ms, update {units.update_s * 1e3:.1f} ms, publish "
          f"{units.send_per_rank_s * 1e3:.1f} ms per generator rank + install {units.install_s * 1e3:.1f} ms, "
          f"trainer tail {units.trainer_tail_s * 1e3:.1f} ms, step overhead "
          f"{units.step_overhead_s * 1e3:.1f} ms, {units.cores:.2f} effective cores")
    out = []
    for d in a.predict:
        r = fit.predict_run(d, units, profile)
        out.append(r)
        print(f"  {r['run']:24s} {r['world_size']} ranks {r['mode']:28s} predicted {r['predicted_step_s']:.3f} s, "
              f"measured {r['measured_step_s']:.3f} s, {100 * r['rel_error']:+.1f}%"
              + ("  (more ranks than cores: contention)" if r["contention"] else "")
              + ("  (in sample)" if r["in_sample"] else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", metavar="OUT", help="--fit-run: write the results here (JSON)")
    p.add_argument("--fit-run", metavar="DIR", help="a measured run folder to fit per-unit costs on")
    p.add_argument("--predict", metavar="DIR", nargs="+", default=[], help="run folders to predict (--fit-run)")
    p.add_argument("--profile", metavar="FILE", help="a lab/calibrate.py device profile")
    p.add_argument("--model", choices=model_names(), default="flux",
                   help="a model family (its first variant unless --variant) or a released config name "
                        "(models/configs/)")
    p.add_argument("--variant", default=None,
                   help="the family's size or release: sd3 medium|large, wan 14b|1.3b, flux dev|schnell")
    p.add_argument("--gpus", action="append", metavar="TYPE:COUNT",
                   help=f"a GPU pool, repeatable (two pools: generators on one, trainers on the other); "
                        f"types: {', '.join(GPUS)}; default h100:16")
    p.add_argument("--price", action="append", metavar="TYPE=USD", help="price per GPU-hour, e.g. h20=1.1")
    w = p.add_argument_group("workload")
    w.add_argument("--height", type=int, default=512)
    w.add_argument("--width", type=int, default=512)
    w.add_argument("--frames", type=int, default=1)
    w.add_argument("--sampling-steps", type=int, default=None, help="K (default: the model's)")
    w.add_argument("--algorithm", choices=ALGORITHMS, default=ALGORITHMS[0],
                   help="what each trained (sample, t) pair costs and how many a sample has (its `cost`, "
                        "rl/algorithms/; planner/workload.py for_algorithm)")
    w.add_argument("--window", type=int, default=2, help="an algorithm that trains an SDE window: its steps")
    w.add_argument("--trained-timesteps", type=int, default=None,
                   help="override the algorithm's count (its authors' fraction of K, or its window)")
    w.add_argument("--prompts-per-step", type=int, default=24)
    w.add_argument("--group-size", type=int, default=24)
    w.add_argument("--cfg-scale", type=float, default=1.0, help="> 1: classifier-free guidance (two branches)")
    w.add_argument("--finetune", choices=("lora", "full"), default="lora")
    w.add_argument("--lora-rank", type=int, default=32)
    w.add_argument("--gradient-checkpointing", action="store_true")
    w.add_argument("--kl", action="store_true", help="a KL term (a reference forward per transition)")
    w.add_argument("--text-tokens", type=int, default=None)
    w.add_argument("--reward", action="append", choices=sorted(REWARDS), help="reward model(s), repeatable")
    w.add_argument("--reward-gpus", type=int, default=0,
                   help="GPUs of a reward service (--reward http://HOST:PORT/NAME in the run): the reward models "
                        "run there, overlapped with denoising, and the plans pay for them (of the first pool's type)")
    w.add_argument("--compile", action="store_true", help="torch.compile'd kernels")
    w.add_argument("--attention", choices=("sdpa", "fa2", "fa3"), default="sdpa")
    w.add_argument("--rollout-micro-batch", type=int, default=8)
    w.add_argument("--train-micro-batch", type=int, default=16)
    w.add_argument("--optimizer-steps", type=int, default=1)
    w.add_argument("--shape-mix", metavar="HxW[xF]:WEIGHT,...",
                   help="prompts of several shapes, one per group, in proportion to the weights, e.g. "
                        "512x512:1,1024x1024:1 (replaces --height/--width/--frames in the costs)")
    w.add_argument("--dispatch", choices=DISPATCHES, default="lpt",
                   help="the runtime's fragment dispatch for a shape mix (the other one is reported too)")
    w.add_argument("--publish-compression", default="bf16", metavar="CODEC",
                   help="publication codec as the runtime's flag: none (the trained fp32 tensors), bf16, delta, "
                        "delta-topk:F")
    w.add_argument("--link-gbps", type=float, default=None,
                   help="two --gpus pools in two sites joined by a link of this many Gb/s (generators in one, "
                        "trainers in the other)")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=12, help="rows of the table")
    o.add_argument("--tag-candidates", type=int, default=4, help="fastest streaming plans also tried with TAG/TCSS")
    o.add_argument("--allow-stale", action="store_true", help="may recommend TCSS (one step stale)")
    o.add_argument("--peers", action="store_true", help="also print the modelled peer systems")
    o.add_argument("--json", metavar="OUT", help="every plan as JSON")
    o.add_argument("--timeline", metavar="PNG", help="timelines of the recommended and best colocated plans")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.fit_run:
        return run_fit(a)
    return run_plan(a)

