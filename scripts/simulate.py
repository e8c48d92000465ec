"""The step simulator from the command line (docs/DESIGN.md 9), in two uses:

    python scripts/simulate.py --run DIR
        Read a training run's config.json and trace/rank*.json, measure the per-action costs,
        simulate the run's mode with them and print predicted vs measured step time and bubble
        fraction (medians over the steps after the first) with their relative errors.

    python scripts/simulate.py --cluster flux-12b --gpus 16 [--gpu h100]
        A FLOP and bandwidth model of a GPU cluster: the costs of every colocated and
        disaggregated topology of N GPUs, each simulated in the simulator's modes; prints the
        predicted step times, the throughput ratio to colocated and the recommended topology.
        These are predictions of a model whose assumptions are printed with them, not measurements.

Models: flux-12b, wan2.1-14b, qwen-image-20b, hunyuanvideo-13b. GPUs: h100, h200, a100.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from planner import cluster  # noqa: E402
from planner import costs as cm  # noqa: E402
from planner.simulator import simulate_run  # noqa: E402

CLUSTER_MODES = (("naive disagg", "disagg"), ("gap", "gap"), ("gap+tag", "tag"), ("tcss", "tcss"))


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


# ---------------------------------------------------------------------------------------------
# --run
# ---------------------------------------------------------------------------------------------

def simulate_measured_run(run_dir: str, skip: int = 1, trace_out: str | None = None) -> dict:
    """Costs measured in the run, its mode simulated with them, and both sides' step metrics."""
    run = cm.load_run(run_dir)
    setup = cm.sim_setup(run.config, run.world_size)
    costs = cm.measure_costs(run, setup, skip)
    result = simulate_run(setup.mode, len(run.steps), setup.num_fragments, costs, setup.num_trainers,
                          setup.tag_policy, stages_per_replica=setup.stages_per_replica)
    if trace_out:
        os.makedirs(os.path.dirname(os.path.abspath(trace_out)), exist_ok=True)
        with open(trace_out, "w") as f:
            json.dump({"traceEvents": result.events, "displayTimeUnit": "ms"}, f)
    measured = cm.measured_step_metrics(run, skip)
    predicted = cm.predicted_step_metrics(result, setup, costs, skip)
    return {"run": run, "setup": setup, "costs": costs, "result": result, "measured": measured,
            "predicted": predicted,
            "error": {k: cm.relative_error(predicted[k], measured[k]) for k in ("step_s", "period_s")},
            "bubble_difference": (None if measured["bubble_fraction"] is None
                                  else predicted["bubble_fraction"] - measured["bubble_fraction"])}


def print_run_report(out: dict, skip: int) -> None:
    run, setup, c = out["run"], out["setup"], out["costs"]
    steps = cm.used_steps(run, skip)
    topo = setup.topology
    print(f"run {os.path.abspath(run.config['output']['output_dir'])}")
    print(f"  simulated as: {setup.label}  ({topo.num_replicas} replica(s) x {setup.stages_per_replica} stage(s), "
          f"{setup.num_trainers} trainer(s), {setup.num_fragments} fragment(s) per step, "
          f"{'TSP' if setup.chunks_per_fragment is None else f'{setup.chunks_per_fragment} chunk(s) per fragment'})")
    print(f"  {len(run.steps)} step(s); costs and medians over steps {steps[0]}..{steps[-1]}")
    print(f"  {run.world_size} rank(s) on a machine with {os.cpu_count()} CPU core(s): on CPU, ranks share cores "
          f"with each other and with other work, so times carry contention noise")
    if topo.scorer_ranks:
        print(f"  note: scorer ranks {list(topo.scorer_ranks)} are not simulated (their scoring is not on the "
              f"generators' path in the model)")
    print("measured costs (mean per action, seconds):")
    print(f"  replica_fragment_s {[round(x, 4) for x in c.replica_fragment_s]}  trainer_fragment_s "
          f"{c.trainer_fragment_s:.4f}  train_fragment_s {c.train_fragment_s:.4f}")
    print(f"  transfer_s {c.transfer_s:.4f}  update_s {c.update_s:.4f}  publish_s {c.publish_s:.4f}  "
          f"chunks_per_fragment {c.chunks_per_fragment}")
    m, p, e = out["measured"], out["predicted"], out["error"]
    print(f"{'':34s}{'measured':>10s}{'predicted':>11s}{'error':>12s}")
    for name, key in (("step time, s (perf/step_s)", "step_s"), ("step period, s (end to end)", "period_s")):
        print(f"{name:34s}{_fmt(m[key]):>10s}{_fmt(p[key]):>11s}{_pct(e[key]):>12s}")
    diff = out["bubble_difference"]
    print(f"{'bubble fraction':34s}{_fmt(m['bubble_fraction']):>10s}{_fmt(p['bubble_fraction']):>11s}"
          f"{'-' if diff is None else f'{diff:+.3f}':>12s}  (absolute)")
    print("  step time: as the runtime logs it, the last end of a step over all ranks minus the previous "
          "step's; period: end of a step's last trainer span minus the previous step's")


# ---------------------------------------------------------------------------------------------
# --cluster
# ---------------------------------------------------------------------------------------------

def print_cluster_report(model_name: str, gpu_name: str, num_gpus: int, wl: cluster.Workload,
                         predictions: list[cluster.Prediction], skipped: list[str]) -> cluster.Prediction:
    model, gpu = cluster.MODELS[model_name], cluster.GPUS[gpu_name]
    print(f"PREDICTIONS of a cost model (not measurements): {model.name} on {num_gpus} x {gpu.name}")
    print(f"  workload: {wl.prompts_per_step} prompts x {wl.group_size} samples per step, K={wl.steps_of(model)} "
          f"({wl.trained_steps(model)} trained), {model.setting}")
    print(f"  {wl.finetune} fine-tuning{f' (LoRA rank {wl.lora_rank})' if wl.finetune == 'lora' else ''}, "
          f"MFU {wl.mfu:.2f}, micro-batch {model.micro_batch}, fragment = {wl.fragment_groups} group(s), "
          f"KL {'on' if wl.kl else 'off'}")
    frag = wl.fragment_groups * wl.group_size
    print(f"  one GPU, one fragment ({frag} samples): generation {cluster.generation_s(model, gpu, wl, frag):.1f} s, "
          f"training {cluster.training_s(model, gpu, wl, frag, 1):.1f} GPU-s (compute only); publication "
          f"{cluster.published_bytes(model, wl) / 1e9:.2f} GB")
    colocated = [p for p in predictions if p.candidate.mode == "colocated"]
    base = min(p.step_s for p in colocated) if colocated else None
    for p in colocated:
        ratio = f"{base / p.step_s:.2f}x" if base else "-"
        print(f"  {p.candidate.label:30s} step {p.step_s:8.1f} s  bubble {p.bubble_fraction:.2f}  {ratio}"
              + (f"  ({p.candidate.note})" if p.candidate.note else ""))
    rows: dict[tuple[int, int, int], dict[str, cluster.Prediction]] = {}
    for p in predictions:
        c = p.candidate
        if c.mode != "colocated":
            rows.setdefault((c.generators, c.trainers, c.stages), {})[c.mode] = p
    header = f"  {'topology':16s}" + "".join(f"{name:>14s}" for name, _ in CLUSTER_MODES) + "   best vs colocated"
    print("predicted step time, s (throughput ratio vs the faster colocated variant: colocated step / step)")
    print(header)
    for (g, t, s), by_mode in rows.items():
        cells = "".join(f"{by_mode[mode].step_s:14.1f}" if mode in by_mode else f"{'n/a':>14s}"
                        for _, mode in CLUSTER_MODES)
        best = min(by_mode.values(), key=lambda p: p.step_s)
        ratio = f"{base / best.step_s:.2f}x" if base else "-"
        name = dict((m, n) for n, m in CLUSTER_MODES)[best.candidate.mode]
        print(f"  {f'G={g} T={t}' + (f' S={s}' if s > 1 else ''):16s}{cells}   {ratio} ({name})")
    best = cluster.recommend(predictions)
    ratio = f", {base / best.step_s:.2f}x the colocated throughput" if base else ""
    print(f"recommended: {best.candidate.label}: predicted {best.step_s:.1f} s per step, "
          f"{best.samples_per_s:.2f} samples/s{ratio}")
    for p in predictions:
        if p.candidate.mode == "tag" and p.candidate.note:
            print(f"  gap+tag: {p.candidate.note}")
            break
    if skipped:
        print(f"left out: {'; '.join(skipped)}")
    print("assumptions:")
    for a in cluster.CLUSTER_ASSUMPTIONS:
        print(f"  - {a}")
    return best


def workload_from_args(args) -> cluster.Workload:
    return cluster.Workload(prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                       sample_steps=args.sample_steps, mfu=args.mfu, finetune=args.finetune, lora_rank=args.lora_rank,
                       kl=args.kl, score_overhead=args.score_overhead, fragment_groups=args.fragment_groups,
                       state_fraction=args.state_fraction)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--run", help="a training run folder (config.json, trace/rank*.json, metrics.jsonl)")
    what.add_argument("--cluster", choices=sorted(cluster.MODELS), help="predict topologies for this model")
    p.add_argument("--skip-steps", type=int, default=1, help="--run: leading (warm-up) steps left out")
    p.add_argument("--trace-out", help="--run: write the simulated Chrome trace here")
    p.add_argument("--gpus", type=int, default=16, help="--cluster: number of GPUs N")
    p.add_argument("--gpu", choices=sorted(cluster.GPUS), default="h100", help="--cluster: GPU type")
    d = cluster.Workload()
    p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step, help="B")
    p.add_argument("--group-size", type=int, default=d.group_size, help="G, samples per prompt")
    p.add_argument("--sample-steps", type=int, default=None, help="K (default: the model's)")
    p.add_argument("--mfu", type=float, default=d.mfu, help="assumed model FLOP utilisation")
    p.add_argument("--finetune", choices=("full", "lora"), default=d.finetune)
    p.add_argument("--lora-rank", type=int, default=d.lora_rank)
    p.add_argument("--kl", action="store_true", help="a KL term (one reference forward per transition)")
    p.add_argument("--score-overhead", type=float, default=d.score_overhead,
                   help="decode + rewards as a fraction of denoising time")
    p.add_argument("--fragment-groups", type=int, default=d.fragment_groups, help="groups per fragment (disagg)")
    p.add_argument("--state-fraction", type=float, default=d.state_fraction,
                   help="fraction of GPU memory for weights and optimizer state")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.run:
        print_run_report(simulate_measured_run(args.run, args.skip_steps, args.trace_out), args.skip_steps)
        return 0
    if args.gpus < 2:
        raise ValueError(f"--gpus must be >= 2 (a generator and a trainer), got {args.gpus}")
    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {args.mfu}")
    wl = workload_from_args(args)
    model, gpu = cluster.MODELS[args.cluster], cluster.GPUS[args.gpu]
    candidates, skipped = cluster.cluster_candidates(model, gpu, args.gpus, wl)
    print_cluster_report(args.cluster, args.gpu, args.gpus, wl, cluster.predict(candidates, wl), skipped)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
