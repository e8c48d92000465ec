"""Side-by-side benchmark: run several modes of train_disagg.py on the same workload and compare
step time, trained samples/s, bubble fraction and busy fraction per role (docs/DESIGN.md section 8).

Each mode is one `torchrun --standalone --nproc_per_node N train_disagg.py ...` subprocess with
its own --output-dir under the bench folder. Its metrics.jsonl gives the per-step numbers; the
first --warmup steps are dropped and the rest summarized by their median. The table is printed,
written as JSON (--json) and as a markdown table (--markdown).

    python scripts/bench.py                                    # the default modes and workload
    python scripts/bench.py --list                             # known modes
    python scripts/bench.py --modes disagg,gap-stream --preset mid --steps 6
    python scripts/bench.py --modes disagg -- --lora-rank 0    # flags after -- go to every run
    python scripts/bench.py --workload "--reward jpeg_compressibility --sample-steps 10"

Adding a mode is one line in MODES.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from metrics import read_metrics  # noqa: E402
from tracing import BUSY_CATEGORIES, Span, Tracer  # noqa: E402


class Mode(NamedTuple):
    nproc: int
    """world size of the torchrun job"""
    flags: list[str]
    """train_disagg.py flags that select the mode (placed after the workload flags, so they win)"""
    description: str


MODES: dict[str, Mode] = {
    "colocated-replicate": Mode(2, ["--mode", "colocated"], "every rank generates then trains; full replicas"),
    "colocated-fsdp": Mode(2, ["--mode", "colocated", "--colocated-sharding", "fsdp"],
                           "every rank generates then trains; FSDP2-sharded generation and training"),
    "disagg": Mode(2, ["--generators", "1", "--trainers", "1", "--fragment-groups", "0"],
                   "naive disaggregation (DESIGN 5.1): 1 generator, 1 trainer"),
    "gap-stream": Mode(2, ["--generators", "1", "--trainers", "1", "--fragment-groups", "1"],
                       "GAP fragment streaming (DESIGN 5.2): one group per fragment, trainer starts on the first"),
    "gap-frag2": Mode(2, ["--generators", "1", "--trainers", "1", "--fragment-groups", "2"],
                      "GAP fragment streaming with fragments of two groups"),
    "gap-2rep": Mode(3, ["--generators", "2", "--trainers", "1", "--fragment-groups", "1"],
                     "two generator replicas + 1 trainer, fragments of one group (3 ranks on 2 cores: contention)"),
    "gap-stages": Mode(3, ["--generators", "2", "--trainers", "1", "--gap-stages", "2", "--fragment-groups", "1"],
                       "GAP block pipeline: one replica of 2 stages + 1 trainer (3 ranks on 2 cores: contention)"),
    "gap+tsp": Mode(2, ["--generators", "1", "--trainers", "1", "--fragment-groups", "1", "--tsp",
                        "--train-micro-batch", "16"], "+ TSP (DESIGN 5.3): transitions packed across timesteps"),
    "gap+tsp8": Mode(2, ["--generators", "1", "--trainers", "1", "--fragment-groups", "1", "--tsp",
                         "--train-micro-batch", "8"], "+ TSP with training forwards of 8 transitions"),
    "gap+tsp+tag": Mode(2, ["--generators", "1", "--trainers", "1", "--fragment-groups", "1", "--tsp",
                            "--train-micro-batch", "16", "--tag"], "+ TAG with BTS (DESIGN 5.4)"),
    "gap+tsp+tag+tcss": Mode(2, ["--generators", "1", "--trainers", "1", "--fragment-groups", "1", "--tsp",
                                 "--train-micro-batch", "16", "--tag", "--tcss"],
                             "+ TCSS (DESIGN 5.5): generators run at most one version stale"),
    "slow-gen": Mode(2, ["--generators", "1", "--trainers", "1", "--fragment-groups", "1",
                         "--debug-slow-rank", "0:3"], "GAP with the generator slowed 3x (an older GPU), TAG off"),
    "slow-gen+tag": Mode(2, ["--generators", "1", "--trainers", "1", "--fragment-groups", "1",
                             "--debug-slow-rank", "0:3", "--tag"], "the same with TAG: the trainer generates too"),
    "slow-gen-fsdp": Mode(3, ["--generators", "1", "--trainers", "2", "--fragment-groups", "1",
                              "--train-sharding", "fsdp", "--debug-slow-rank", "0:3"],
                          "slow-gen with 2 FSDP2 trainers, TAG off (3 ranks on 2 cores: contention)"),
    "slow-gen-fsdp+tag": Mode(3, ["--generators", "1", "--trainers", "2", "--fragment-groups", "1",
                                  "--train-sharding", "fsdp", "--debug-slow-rank", "0:3", "--tag"],
                              "the same with TAG: the FSDP trainers generate together"),
}

BASELINES = ("colocated-replicate", "colocated-fsdp")
"""Every mode's samples/s is reported as a ratio to each of these (when they ran)."""

DEFAULT_MODES = ("colocated-replicate", "colocated-fsdp", "disagg", "gap-stream")

BUBBLE_DEFINITION = (f"bubble = 1 - ideal / actual; ideal = busy seconds ({', '.join(BUSY_CATEGORIES)}) summed over "
                     f"all ranks / number of ranks; actual = the step's wall time (DESIGN 8)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="Flags after `--` are passed to every train_disagg.py run.")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated mode names (see --list)")
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
    w.add_argument("--workload", default="", help="more train_disagg.py flags, as one shell-quoted string")
    r = p.add_argument_group("runs")
    r.add_argument("--timeout", type=float, default=600, help="seconds before a mode's run is killed")
    r.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS per rank (default: CPU cores // ranks, at least 1)")
    args = p.parse_args(argv)
    args.passthrough = passthrough
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


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


def workload_flags(args: argparse.Namespace) -> list[str]:
    """The train_disagg.py flags shared by every mode. Images are not logged, so that no step pays
    for PNG and TensorBoard writes; traces stay on, the bubble fraction is computed from them."""
    flags = ["--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step),
             "--group-size", str(args.group_size), "--micro-batch", str(args.micro_batch),
             "--sample-steps", str(args.sample_steps), "--height", str(args.height), "--width", str(args.width),
             "--log-images-every", "0", "--eval-every", "0"]
    if args.preset != "auto":
        flags += ["--preset", args.preset]
    return flags + shlex.split(args.workload) + args.passthrough


# ---------------------------------------------------------------------------------------------
# One mode: run, then summarize
# ---------------------------------------------------------------------------------------------

def run_mode(name: str, workload: list[str], bench_dir: str, timeout: float, threads: int | None) -> dict[str, Any]:
    """Run one mode under torchrun; returns its result (status, command, wall time, output dir)."""
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


def summarize(rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Medians over the steps after the first `warmup`: step time, samples/s, bubble and busy
    fractions. samples/s is the trained samples of a step over the median step time, so that the
    step-time and throughput columns agree."""
    measured = rows[warmup:]
    if not measured:
        raise ValueError(f"{len(rows)} step(s) logged, none left after {warmup} warm-up step(s)")
    step_s = statistics.median(r["perf/step_s"] for r in measured)
    samples_per_step = statistics.median(round(r["perf/samples_per_s"] * r["perf/step_s"]) for r in measured)
    roles = sorted({k[len("perf/busy_fraction/"):] for r in measured for k in r if k.startswith("perf/busy_fraction/")})
    return {
        "measured_steps": [r["step"] for r in measured],
        "step_s": step_s,
        "samples_per_step": samples_per_step,
        "samples_per_s": samples_per_step / step_s,
        "bubble_fraction": statistics.median(r["perf/bubble_fraction"] for r in measured),
        "busy_fraction": {role: statistics.median(r[f"perf/busy_fraction/{role}"] for r in measured) for role in roles},
    }


def median_row(rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The measured step whose time is closest to the median step time."""
    measured = rows[warmup:]
    step_s = statistics.median(r["perf/step_s"] for r in measured)
    return min(measured, key=lambda r: abs(r["perf/step_s"] - step_s))


def bubble_check(out_dir: str, row: dict[str, Any]) -> dict[str, Any] | None:
    """The bubble of one step (a metrics.jsonl row) recomputed from the rank traces: per-rank busy
    seconds, ideal, actual, and the logged value to compare with (None when the traces are missing)."""
    step, step_s = row["step"], row["perf/step_s"]
    trace_dir = os.path.join(out_dir, "trace")
    if not os.path.isdir(trace_dir):
        return None
    busy = []
    for fname in sorted(os.listdir(trace_dir), key=lambda f: int("".join(c for c in f if c.isdigit()) or 0)):
        with open(os.path.join(trace_dir, fname)) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        tracer = Tracer(rank=-1, role="")
        tracer.spans = [Span(e["name"], e["cat"], e["args"]["step"], e["args"].get("fragment"), e["ts"], e["dur"])
                        for e in events]
        busy.append(tracer.busy_seconds(step))
    if not busy:
        return None
    ideal = sum(busy) / len(busy)
    return {"step": step, "busy_s": busy, "ideal_s": ideal, "actual_s": step_s, "bubble": 1 - ideal / step_s,
            "logged_bubble": row["perf/bubble_fraction"]}


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


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

def table_rows(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and cells, shared by the console and the markdown table."""
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    header = ["mode", "ranks", "step s", "samples/s", "bubble", "busy by role",
              *[f"x {b}" for b in BASELINES], "status"]
    rows = []
    for r in results:
        ok = r["status"] == "ok"
        busy = " ".join(f"{role} {v:.2f}" for role, v in r.get("busy_fraction", {}).items()) or "-"
        rows.append([r["mode"], f"{r['nproc']}{'*' if r['exceeds_cores'] else ''}",
                     num(r.get("step_s") if ok else None, ".3f"), num(r.get("samples_per_s") if ok else None, ".2f"),
                     num(r.get("bubble_fraction") if ok else None, ".3f"), busy if ok else "-",
                     *[num(r["ratio_vs"][b], ".2f") for b in BASELINES], r["status"]])
    return header, rows


def console_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def notes(report: dict[str, Any]) -> list[str]:
    w = report["workload"]
    if "model" in w:
        lines = [f"model {w['model']}, {w['resolution']}, {w['prompts_per_step']} prompts x {w['group_size']} samples "
                 f"per step, {w['sample_steps']} sample steps, micro-batch {w['micro_batch']}, LoRA rank "
                 f"{w['lora_rank']}; {w['steps']} steps, the first {w['warmup']} left out, medians over the rest; "
                 f"{report['cpu_count']} CPU cores"]
    else:
        lines = [f"workload {shlex.join(w['flags'])}; {report['cpu_count']} CPU cores"]
    if any(r["exceeds_cores"] for r in report["modes"]):
        lines.append(f"* more ranks than the {report['cpu_count']} CPU cores: ranks time-share cores")
    lines.append(BUBBLE_DEFINITION)
    for r in report["modes"]:
        c = r.get("bubble_check")
        if c:
            busy = " + ".join(f"{b:.3f}" for b in c["busy_s"])
            lines.append(f"{r['mode']}, step {c['step']} (from the traces): ideal = ({busy}) / {len(c['busy_s'])} = "
                         f"{c['ideal_s']:.3f} s, actual {c['actual_s']:.3f} s, bubble {c['bubble']:.3f} "
                         f"(logged {c['logged_bubble']:.3f})")
    lines += [f"{r['mode']} {r['status']}: {r.get('error') or 'see ' + r['output_dir'] + '/stderr.log'}"
              for r in report["modes"] if r["status"] != "ok"]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        width = max(map(len, MODES))
        flags_width = max(len(shlex.join(m.flags)) for m in MODES.values())
        for name, mode in MODES.items():
            flags = shlex.join(mode.flags).ljust(flags_width)
            print(f"{name.ljust(width)}  {mode.nproc} ranks  {flags}  {mode.description}")
        return 0
    try:
        names = select_modes(args.modes)
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
        results.append(r)
    add_ratios(results)

    info = next((r["run"] for r in results if r["run"]), {})
    report = {"cpu_count": cores, "bubble_definition": BUBBLE_DEFINITION,
              "workload": {"flags": workload, "preset": args.preset, "warmup": args.warmup, **info},
              "modes": results}
    write_report(report, args.json or os.path.join(bench_dir, "bench.json"),
                 args.markdown or os.path.join(bench_dir, "bench.md"))
    return 0 if all(r["status"] == "ok" for r in results) else 1


def write_report(report: dict[str, Any], json_path: str, md_path: str) -> None:
    """Print the table and its notes; write them as JSON and as markdown."""
    header, rows = table_rows(report["modes"])
    print("\n" + console_table(header, rows))
    for line in notes(report):
        print(line)
    for path in (json_path, md_path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    with open(md_path, "w") as f:
        f.write(markdown_table(header, rows) + "\n\n" + "\n".join(f"- {line}" for line in notes(report)) + "\n")
    print(f"wrote {json_path} and {md_path}")

if __name__ == "__main__":
    sys.exit(main())
