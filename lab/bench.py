"""Side-by-side benchmark: run several modes of train_disagg.py on the same workload and compare
step time, trained samples/s, bubble fraction and busy fraction per role (docs/DESIGN.md section 8).

Each mode is one `torchrun --standalone --nproc_per_node N train_disagg.py ...` subprocess with
its own --output-dir under the bench folder. Its metrics.jsonl gives the per-step numbers; the
first --warmup steps are dropped and the rest summarized by their median. The table is printed,
written as JSON (--json) and as a markdown table (--markdown).

    python -m lab.bench                                    # the default modes and workload
    python -m lab.bench --list                             # known modes and scenarios
    python -m lab.bench --scenarios fits,sharded,hetero,window --json OUT
    python -m lab.bench --scenarios fits,window --modes gap+tag+assist,auto --rounds 4   # baselines + these
    python -m lab.bench --modes disagg,gap --preset mid --steps 6
    python -m lab.bench --modes disagg -- --lora-rank 0    # flags after -- go to every run
    python -m lab.bench --workload "--reward jpeg_compressibility --sample-steps 10"

Every mode trains the same transitions in the same forwards: the workload packs transitions
(TSP, --train-micro-batch) in every mode, colocated ones included, so a ratio isolates placement
(--no-packing runs every mode with one timestep of a chunk per forward instead). Scenarios
(SCENARIOS) run the regimes where placement matters, each against its best colocated
baseline. Adding a mode is one line in MODES (lab/bench_modes.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from config.cli import parse_config
from config.validate import validate
from telemetry.metrics import read_metrics
from models import load_model
from telemetry.tracing import BUSY_CATEGORIES
from lab.planning.bench_report import add_predictions, bubble_check, scenario_report, write_report
from planner.memory import peak
from lab.planning.profile import finetune_flags
from runtime.budget import predict
from lab.bench_modes import AUTO_MODES, BASELINES, DEFAULT_MODES, MODES, SCENARIOS
from lab.bench_summary import auto_notes, compare_auto, median_row, pool_rounds, round_notes, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BUBBLE_DEFINITION = (f"bubble = 1 - ideal / actual; ideal = busy seconds ({', '.join(BUSY_CATEGORIES)}) summed over "
                     f"all ranks / number of ranks; actual = the step's wall time (docs/DESIGN.md, observability)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="Flags after `--` are passed to every train_disagg.py run.")
    p.add_argument("--modes", default=None, help="comma-separated mode names (see --list; default: "
                   f"{','.join(DEFAULT_MODES)}); with --scenarios, only these of each scenario's modes run (its "
                   "baseline always does)")
    p.add_argument("--scenarios", default=None,
                   help=f"comma-separated scenarios ({', '.join(SCENARIOS)}): each runs its modes against its "
                        f"colocated baseline")
    p.add_argument("--list", action="store_true", help="list the known modes and exit")
    p.add_argument("--out", default=None, help="bench folder (default: runs/bench-<date>-<time>)")
    p.add_argument("--json", default=None, help="JSON table path (default: <out>/bench.json)")
    p.add_argument("--markdown", default=None, help="markdown table path (default: <out>/bench.md)")
    w = p.add_argument_group("workload (the same for every mode)")
    w.add_argument("--preset", default="auto", choices=("auto", "tiny", "mid"),
                   help="auto: the shipped model assets/shapes-flux if present, else tiny; "
                        "mid: a random ~42M-parameter FLUX")
    w.add_argument("--steps", type=int, default=5, help="training steps per run")
    w.add_argument("--warmup", type=int, default=1, help="first steps left out of the summary")
    w.add_argument("--prompts-per-step", type=int, default=4, help="B: prompts (groups) per step")
    w.add_argument("--group-size", type=int, default=4, help="G: samples per prompt")
    w.add_argument("--micro-batch", type=int, default=4, help="samples per forward")
    w.add_argument("--sample-steps", type=int, default=8, help="denoising steps K per sample")
    w.add_argument("--height", type=int, default=32, help="image height in pixels")
    w.add_argument("--width", type=int, default=32, help="image width in pixels")
    w.add_argument("--train-micro-batch", type=int, default=16,
                   help="transitions per packed training forward, the same in every mode")
    w.add_argument("--packing", action=argparse.BooleanOptionalAction, default=True,
                   help="pack transitions (TSP) in every mode; --no-packing: one timestep of a chunk per forward")
    w.add_argument("--workload", default="", help="more train_disagg.py flags, as one shell-quoted string")
    r = p.add_argument_group("runs")
    r.add_argument("--timeout", type=float, default=600, help="seconds before a mode's run is killed")
    r.add_argument("--rounds", type=int, default=1,
                   help="scenarios: run every mode this many times, the modes in turn in each round, reversed in every "
                        "second round (a drift of the machine's speed then falls on every mode alike), and pool each "
                        "mode's measured steps")
    r.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS per rank (default: CPU cores // ranks, at least 1)")
    r.add_argument("--profile", default=None, help="scenarios: the lab/calibrate.py profile of the planner's "
                   "predicted ratios (default: measured first into the bench folder; 'none': no prediction)")
    args = p.parse_args(argv)
    args.passthrough = passthrough
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def memory_budget_gb(args: argparse.Namespace, workload: list[str]) -> float:
    """A budget that the memory model (planner/memory.py through runtime/budget.py) admits for the
    sharded scenario's plans (colocated FSDP2 over 3 ranks; 1 generator + 2 FSDP2 trainers) and
    refuses for replicated full fine-tuning: midway between the largest of those peaks and the
    replicated trainer's."""
    base = [*workload, *SCENARIOS["sharded"].flags]
    base[base.index("auto")] = "1e9"

    def peaks(name: str) -> list[float]:
        cfg = parse_config([*base, *MODES[name].flags])
        cfg.resolve_defaults()
        facts = validate(cfg, MODES[name].nproc)
        adapter = load_model(cfg.model.model, cfg.model.model_path, preset=cfg.model.preset, seed=0)
        return [peak(phases).total for phases in predict(cfg, facts, adapter).values()]

    admitted = max(max(peaks("colocated-fsdp3")), max(peaks("gap-fsdp")))
    refused = max(peaks("colocated-replicate"))
    if not admitted < refused:
        raise ValueError(f"the bench's model needs {admitted / 1e9:.3g} GB sharded and {refused / 1e9:.3g} GB "
                         f"replicated: no budget separates them")
    return (admitted + refused) / 2 / 1e9


def run_scenarios(args: argparse.Namespace, workload: list[str]) -> int:
    """Every scenario's modes side by side; rows of {scenario, mode, baseline, samples_per_s, bubble,
    ratio, ...}; each scenario's best DigenRL (non-colocated) mode is marked."""
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        print(f"error: unknown or no scenario(s) {unknown or names}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    try:
        chosen = scenario_modes(names, args.modes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bench_dir = os.path.abspath(args.out or os.path.join(ROOT, "runs", time.strftime("scenarios-%Y%m%d-%H%M%S")))
    os.makedirs(bench_dir, exist_ok=True)
    budget = None
    rows = []
    for sc_name in names:
        sc = SCENARIOS[sc_name]._replace(modes=chosen[sc_name])
        flags = list(sc.flags)
        if "auto" in flags:
            budget = budget or memory_budget_gb(args, workload)
            flags[flags.index("auto")] = f"{budget:.6g}"
        print(f"scenario {sc_name}: {sc.description}; {shlex.join(flags)}", flush=True)
        results = measure_rounds(sc.modes, workload + flags, os.path.join(bench_dir, sc_name), args)
        base = results[0].get("samples_per_s") if results[0]["status"] == "ok" else None
        for name, r in zip(sc.modes, results):
            ok = r["status"] == "ok"
            rows.append({"scenario": sc_name, "mode": name, "baseline": name == sc.baseline, "nproc": r["nproc"],
                         "exceeds_cores": r["exceeds_cores"], "status": r["status"], "flags": [*flags, *MODES[name].flags],
                         "samples_per_s": r.get("samples_per_s") if ok else None,
                         "step_s": r.get("step_s") if ok else None,
                         "steps_total_s": r.get("steps_total_s") if ok else None,
                         "measured_steps": r.get("measured_steps") if ok else None,
                         "bubble": r.get("bubble_fraction") if ok else None,
                         "publish_bytes": r.get("publish_bytes") if ok else None,
                         "busy_fraction": r.get("busy_fraction", {}),
                         "ratio": r["samples_per_s"] / base if ok and base else None,
                         "output_dir": r["output_dir"], "output_dirs": r["output_dirs"],
                         "round_step_s": r.get("round_step_s"), "bubble_check": r.get("bubble_check"),
                         "error": r.get("error")})
        candidates = [row for row in rows[-len(sc.modes):] if not row["mode"].startswith("colocated")
                      and row["mode"] not in AUTO_MODES and row["ratio"] is not None]
        if candidates:
            max(candidates, key=lambda row: row["ratio"])["best"] = True
        compare_auto(rows[-len(sc.modes):])
    rounds = (f", pooled over {args.rounds} rounds of the modes in turn (reversed in every second)"
              if args.rounds > 1 else "")
    notes_lines = [f"workload {shlex.join(workload)}; {os.cpu_count()} CPU cores; medians after {args.warmup} "
                   f"warm-up step(s){rounds}", BUBBLE_DEFINITION,
                   "every mode of a scenario trains the same transitions in the same packed forwards"
                   if args.packing else "no packing: one timestep of a chunk per forward in every mode"]
    if any(r["exceeds_cores"] for r in rows):
        notes_lines.append(f"* more ranks than the {os.cpu_count()} CPU cores: ranks time-share cores (contention)")
    if budget is not None:
        notes_lines.append(f"sharded: --memory-budget-gb {budget:.6g} (the memory model's peaks: between the sharded "
                           f"plans' and a replicated trainer's) forbids replicated full fine-tuning")
    for sc_name in names:
        left_out = [m for m in SCENARIOS[sc_name].modes if m not in chosen[sc_name]]
        if left_out:
            notes_lines.append(f"{sc_name}: --modes left out {', '.join(left_out)}")
    notes_lines += auto_notes(rows) + round_notes(rows)
    if args.profile != "none":
        notes_lines.append(add_predictions(rows, args.profile or calibrate(args, bench_dir, rows)))
    scenario_report(rows, notes_lines, bench_dir, args.json or os.path.join(bench_dir, "scenarios.json"))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def measure_rounds(modes: tuple[str, ...], workload: list[str], sc_dir: str, args: argparse.Namespace) -> list[dict]:
    """Each of `modes` run `args.rounds` times, the modes in turn within a round (round k's runs in
    SC_DIR/roundk when there are several), and each mode's rounds pooled (`pool_rounds`). Every
    second round runs the modes in reverse (`round_order`), so that a steady drift of the machine's
    speed over the rounds falls on every mode alike."""
    rounds = []
    for k in range(args.rounds):
        out = sc_dir if args.rounds == 1 else os.path.join(sc_dir, f"round{k + 1}")
        if args.rounds > 1:
            print(f"  round {k + 1} of {args.rounds}", flush=True)
        results = {}
        for i in round_order(len(modes), k):
            name = modes[i]
            print(f"  {name}: {MODES[name].nproc} ranks, {shlex.join(MODES[name].flags)}", flush=True)
            results[i] = measure_mode(name, workload, out, args)
        rounds.append(results)
    return [pool_rounds([results[i] for results in rounds], args.warmup) for i in range(len(modes))]


def round_order(n: int, k: int) -> list[int]:
    """The order round `k` (from 0) runs `n` modes in: as listed in even rounds, reversed in odd ones.
    Over two rounds every mode's mean position is the same, so a drift of the machine's speed that is
    linear in time adds the same to every mode's pooled steps."""
    order = list(range(n))
    return order[::-1] if k % 2 else order


def calibrate(args: argparse.Namespace, bench_dir: str, rows: list[dict]) -> str:
    """A device profile of the bench's model and size on this machine (lab/calibrate.py), timing
    training as the runs train (LoRA or full, from a finished run's config)."""
    path = os.path.join(bench_dir, "profile.json")
    cmd = [sys.executable, "-m", "lab.calibrate", "--out", path, "--height", str(args.height),
           "--width", str(args.width), "--max-batch", str(max(args.micro_batch, 4))]
    done = next((r["output_dir"] for r in rows if r.get("status") == "ok"), None)
    if done is not None:
        cmd += finetune_flags(done)
    if args.preset != "auto":
        cmd += ["--preset", args.preset]
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True, capture_output=True)
    return path


def select_modes(spec: str) -> list[str]:
    """The mode names of a comma-separated list, in order; unknown names are a ValueError."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; known modes: {', '.join(MODES)}")
    if not names:
        raise ValueError(f"--modes is empty; known modes: {', '.join(MODES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--modes names a mode twice: {names}")
    return names


def scenario_modes(names: list[str], spec: str | None) -> dict[str, tuple[str, ...]]:
    """Each named scenario's modes to run: all of them, or with --modes (`spec`) its baseline and
    those of its modes `spec` names, in the scenario's order. A named mode in none of the scenarios
    is a ValueError."""
    if spec is None:
        return {n: SCENARIOS[n].modes for n in names}
    only = select_modes(spec)
    unused = [m for m in only if not any(m in SCENARIOS[n].modes for n in names)]
    if unused:
        raise ValueError(f"--modes names {', '.join(unused)}, in none of the scenarios {', '.join(names)}")
    return {n: tuple(m for i, m in enumerate(SCENARIOS[n].modes) if i == 0 or m in only) for n in names}


def workload_flags(args: argparse.Namespace) -> list[str]:
    """The train_disagg.py flags shared by every mode. Images are not logged, so that no step pays
    for PNG and TensorBoard writes; traces stay on, the bubble fraction is computed from them. No
    checkpoint is written before the last step (`--save-every 0`): the default, every steps/10, wrote
    one every second step of a 20-step bench, and each added 0.06 s to a 0.69 s step of `window`'s
    colocated run (window: 0.75 s with a checkpoint every step, 0.69 s with none) and more where the
    state is larger, a cost a long run pays every few hundred steps."""
    flags = ["--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step),
             "--group-size", str(args.group_size), "--micro-batch", str(args.micro_batch),
             "--sample-steps", str(args.sample_steps), "--height", str(args.height), "--width", str(args.width),
             "--log-images-every", "0", "--eval-every", "0", "--save-every", "0"]
    if args.packing:
        flags += ["--tsp", "--train-micro-batch", str(args.train_micro_batch)]
    if args.preset != "auto":
        flags += ["--preset", args.preset]
    return flags + shlex.split(args.workload) + args.passthrough


# ---------------------------------------------------------------------------------------------
# One mode: run, then summarize
# ---------------------------------------------------------------------------------------------

def run_mode(name: str, workload: list[str], bench_dir: str, timeout: float, threads: int | None) -> dict[str, Any]:
    """Run one mode under torchrun (in bench_dir/name); returns its result (status, command, wall
    time, output dir)."""
    mode = MODES[name]
    out = os.path.join(bench_dir, name)
    if os.path.isdir(out):
        shutil.rmtree(out)  # a previous bench's run: metrics.jsonl would otherwise be appended to
    os.makedirs(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(mode.nproc),
           os.path.join(ROOT, "train_disagg.py"), *workload, *mode.flags, "--output-dir", out]
    num_threads = threads or max(1, (os.cpu_count() or 1) // mode.nproc)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(num_threads), "PYTHONUNBUFFERED": "1"}
    result = {"mode": name, "description": mode.description, "nproc": mode.nproc, "omp_num_threads": num_threads,
              "exceeds_cores": mode.nproc > (os.cpu_count() or 1), "output_dir": out, "command": shlex.join(cmd)}
    start = time.monotonic()
    with open(os.path.join(out, "stdout.log"), "w") as so, open(os.path.join(out, "stderr.log"), "w") as se:
        # A session of its own, so that a timeout ends torchrun and every rank it started.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=so, stderr=se, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = None
    result["wall_s"] = time.monotonic() - start
    if rc is None:
        result["status"] = f"timeout after {timeout:.0f} s"
    elif rc != 0:
        result["status"] = f"failed (exit {rc})"
    else:
        result["status"] = "ok"
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def ranks_stderr(text: str) -> str:
    """The ranks' part of a torchrun stderr: torchrun's own traceback (through runpy) and its
    failure summary, which follow the ranks' errors, are dropped (kept when nothing else is left)."""
    lines = text.splitlines()
    for i in range(len(lines) - 1):
        if lines[i].startswith("Traceback") and "<frozen runpy>" in lines[i + 1]:
            if any(line.strip() for line in lines[:i]):
                lines = lines[:i]
            break
    return "\n".join(lines)


def first_error(text: str) -> str | None:
    """The first user error (`error: ...`) or exception line of the ranks' stderr."""
    lines = text.splitlines()
    for line in lines:
        if line.startswith("error: "):
            return line[len("error: "):]
    errors = [line for line in lines if line and not line[0].isspace() and "Error" in line.split(":")[0]]
    return errors[-1] if errors else None


def run_info(out_dir: str) -> dict[str, Any]:
    """Model and resolution of a run, from its resolved config.json."""
    path = os.path.join(out_dir, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        cfg = json.load(f)
    m, s, rl = cfg["model"], cfg["sampling"], cfg["rl"]
    model = os.path.relpath(m["model_path"], ROOT) if m["model_path"] else f"{m['model']} preset {m['preset']}"
    return {"model": model, "resolution": f"{s['height']}x{s['width']}", "sample_steps": s["sample_steps"],
            "lora_rank": cfg["optim"]["lora_rank"], "steps": rl["steps"], "prompts_per_step": rl["prompts_per_step"],
            "group_size": rl["group_size"], "micro_batch": rl["micro_batch"]}


def add_ratios(results: list[dict[str, Any]]) -> None:
    """ratio_vs[baseline] = samples_per_s / the baseline's samples_per_s (None when it did not run)."""
    base = {r["mode"]: r["samples_per_s"] for r in results if r["mode"] in BASELINES and r["status"] == "ok"}
    for r in results:
        r["ratio_vs"] = {b: (r["samples_per_s"] / base[b] if r["status"] == "ok" and b in base else None)
                         for b in BASELINES}


def measure_mode(name: str, workload: list[str], bench_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one mode and summarize its metrics (medians after the warm-up, the bubble recomputed
    from the traces); a failed run keeps its first error."""
    r = run_mode(name, workload, bench_dir, args.timeout, args.threads)
    if r["status"] == "ok":
        try:
            rows = read_metrics(r["output_dir"])
            r.update(summarize(rows, args.warmup))
            r["bubble_check"] = bubble_check(r["output_dir"], median_row(rows, args.warmup))
        except (OSError, ValueError, KeyError) as e:
            r["status"] = f"failed ({e})"
    r["run"] = run_info(r["output_dir"])
    print(f"    {r['status']} in {r['wall_s']:.1f} s", flush=True)
    if r["status"] != "ok":
        with open(os.path.join(r["output_dir"], "stderr.log")) as f:
            ranks = ranks_stderr(f.read())
        r["error"] = first_error(ranks)
        print(f"    --- stderr tail ({r['output_dir']}/stderr.log)\n{ranks[-3000:]}\n    ---", file=sys.stderr,
              flush=True)
    return r


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        width = max(map(len, MODES))
        flags_width = max(len(shlex.join(m.flags)) for m in MODES.values())
        for name, mode in MODES.items():
            flags = shlex.join(mode.flags).ljust(flags_width)
            print(f"{name.ljust(width)}  {mode.nproc} ranks  {flags}  {mode.description}")
        print()
        for name, sc in SCENARIOS.items():
            print(f"scenario {name}: {sc.description}; modes {', '.join(sc.modes)} (baseline {sc.baseline})")
        return 0
    if args.scenarios is not None:
        return run_scenarios(args, workload_flags(args))
    try:
        names = select_modes(args.modes or ",".join(DEFAULT_MODES))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bench_dir = os.path.abspath(args.out or os.path.join(ROOT, "runs", time.strftime("bench-%Y%m%d-%H%M%S")))
    os.makedirs(bench_dir, exist_ok=True)
    workload = workload_flags(args)
    cores = os.cpu_count() or 1
    print(f"bench folder {bench_dir}; {cores} CPU cores; workload: {shlex.join(workload)}", flush=True)

    results = []
    for i, name in enumerate(names):
        print(f"[{i + 1}/{len(names)}] {name}: {MODES[name].nproc} ranks, {shlex.join(MODES[name].flags)}", flush=True)
        results.append(measure_mode(name, workload, bench_dir, args))
    add_ratios(results)

    info = next((r["run"] for r in results if r["run"]), {})
    report = {"cpu_count": cores, "bubble_definition": BUBBLE_DEFINITION, "baselines": list(BASELINES),
              "workload": {"flags": workload, "preset": args.preset, "warmup": args.warmup, **info},
              "modes": results}
    write_report(report, args.json or os.path.join(bench_dir, "bench.json"),
                 args.markdown or os.path.join(bench_dir, "bench.md"))
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
