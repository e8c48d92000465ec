"""The step simulator from the command line (docs/DESIGN.md 9), in three uses:

    python -m lab.simulate --run DIR
        Read a training run's config.json and trace/rank*.json, measure the per-action costs,
        simulate the run's mode with them and print predicted vs measured step time and bubble
        fraction (medians over the steps after the first) with their relative errors.

    python -m lab.simulate --cluster flux-12b --gpus 16 [--gpu h100]
        The planner of scripts/plan.py on one pool of N GPUs (`plan.py --model flux --gpus h100:16`):
        every feasible colocated and disaggregated plan, ranked, with a recommendation. Predictions
        of the calibrated cost model of docs/calibration.md, not measurements.

    python -m lab.simulate --anchors data/anchors.jsonl [--json OUT]
        Predict the published runs of a JSON-lines file (one run per line, schema in
        lab/planning/published.py) and print predicted vs published step time per row; OUT gets a JSON
        list of {name, predicted_step_s, published_step_s, rel_error}. Exits 1 when a row is off by
        more than its tolerance (default 0.25).

--run replays a run from the costs measured in that same run (in sample: a check of the
simulator's structure). Out-of-sample prediction of other runs: scripts/plan.py --fit-run.
"""
from __future__ import annotations

import argparse
import json
import os

from config import cli
from lab.planning import plan_cli as plan
from lab.planning import costs as cm
from lab.planning import published
from planner.hardware import GPUS
from planner.simulator import simulate_run
from planner.released_specs import model_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




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
                          setup.tag_policy, stages_per_replica=setup.stages_per_replica, wave=setup.gen_wave)
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
# --cluster: the planner (scripts/plan.py) on one pool of N GPUs
# ---------------------------------------------------------------------------------------------

CLUSTER_MODELS = {"flux-12b": "flux", "wan2.1-14b": "wan", "qwen-image-20b": "qwen_image",
                  "hunyuanvideo-13b": "hunyuan_video", **{m: m for m in model_names()}}


def cluster_argv(args) -> list[str]:
    """scripts/plan.py arguments for `--cluster MODEL --gpus N --gpu TYPE` and the workload flags."""
    argv = ["--model", CLUSTER_MODELS[args.cluster], "--gpus", f"{args.gpu}:{args.gpus}",
            "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
            "--finetune", args.finetune, "--lora-rank", str(args.lora_rank)]
    if args.sample_steps:
        argv += ["--sampling-steps", str(args.sample_steps)]
    if args.kl:
        argv.append("--kl")
    return argv


def run_anchors(path: str, out: str | None) -> int:
    """Predicted vs published step time per row; 1 when a row is outside its tolerance."""
    results = published.validate(published.load_rows(path))
    print(published.summary(results))
    if out:
        with open(out, "w") as f:
            json.dump([r.record() for r in results], f, indent=1)
        print(f"wrote {out}")
    outside = [r.name for r in results if not r.within_tolerance]
    if outside:
        print(f"outside their tolerance: {', '.join(outside)}")
    return 1 if outside else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--run", help="a training run folder (config.json, trace/rank*.json, metrics.jsonl)")
    what.add_argument("--cluster", choices=sorted(CLUSTER_MODELS),
                      help="predict plans for this model (the planner of scripts/plan.py, one GPU pool)")
    what.add_argument("--anchors", metavar="FILE", help="published runs to predict, JSON lines (data/anchors.jsonl)")
    p.add_argument("--json", metavar="OUT", help="--anchors: write the predictions here (JSON)")
    p.add_argument("--skip-steps", type=int, default=1, help="--run: leading (warm-up) steps left out")
    p.add_argument("--trace-out", help="--run: write the simulated Chrome trace here")
    p.add_argument("--gpus", type=int, default=16, help="--cluster: number of GPUs N")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="--cluster: GPU type")
    p.add_argument("--prompts-per-step", type=int, default=24, help="B")
    p.add_argument("--group-size", type=int, default=24, help="G, samples per prompt")
    p.add_argument("--sample-steps", type=int, default=None, help="K (default: the model's)")
    p.add_argument("--finetune", choices=("full", "lora"), default="full")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--kl", action="store_true", help="a KL term (one reference forward per transition)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.anchors:
        return run_anchors(args.anchors, args.json)
    if args.run:
        print_run_report(simulate_measured_run(args.run, args.skip_steps, args.trace_out), args.skip_steps)
        return 0
    if args.gpus < 2:
        raise ValueError(f"--gpus must be >= 2 (a generator and a trainer), got {args.gpus}")
    return plan.main(cluster_argv(args))


if __name__ == "__main__":
    cli.run(main)
