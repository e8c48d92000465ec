"""Time to reward: the wall-clock each algorithm needs to raise the held-out reward of the default task,
in the best placement for 2 ranks and colocated, two seeds each (issue #31).

    python -m lab.time_to_reward --out runs/time_to_reward        # 20 runs, then their evaluations

Every run is the README's main command (the shipped shapes model, 50 steps of 8 prompts x 8 samples,
2 ranks) with the algorithm's published settings (ALGORITHMS, from lab/time_to_reward.toml) and a
placement (PLACEMENTS). It runs with no evaluation inside it (--eval-every 0) and its default
checkpoint every 5 steps (kept); its wall-clock at step N is the sum of perf/step_s over steps
0..N-1 (the step loop's period: generation, training, publication and the checkpoints the run writes
anyway; start-up excluded). When every run has trained, each checkpoint is evaluated on the 64
held-out prompts exactly as a run evaluates (runtime.evaluation: the ODE sampler, the run's fixed
seeds: eval/reward), so evaluation never competes with training for the cores and a disaggregated
generator cannot run ahead during it.

The same samples are also scored by each --eval-scorer (default shapes_detector, a check the training
reward does not see: rewards/shapes_detector.py), reported beside eval/reward.

Writes OUT/time_to_reward.md (a row per run: seconds to each --thresholds value, at the first
checkpoint that reaches it, the final reward, each scorer at version 0 and at the end; a row per
algorithm and placement: the mean over the seeds that reached it, and each scorer's mean gain),
OUT/time_to_reward.json (every curve) and OUT/time_to_reward.png (reward against wall-clock, every
run). --skip-existing reuses finished run folders.

Issue #31 item 6 (a gain of 0.10 on the unfaded first-stage model within 10 minutes) is the same
measurement over the FIRST_STAGE settings:

    python -m lab.time_to_reward --settings first-stage --extra="--model-path runs/first-stage" \
        --placements disagg+tag --steps 60 --budget-s 600 --out runs/first-stage-rl
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass, field
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomllib is the standard library's copy of tomli (3.11)
    import tomli as tomllib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)

from checkpointing.checkpoint import checkpoint_dir, install_weights, read_state
from config.schema import RunConfig, default_eval_scorers, eval_scorers
from config.validate import check_scorers
from models import load_model
from models.lora import apply_lora
from prompts.sets import eval_records
from rewards import RewardSet, reward_model_paths
from runtime.context import run_sampling
from runtime.evaluation import evaluate, summarize
from lab.launch import torchrun
from telemetry.metrics import read_metrics

SETTINGS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "time_to_reward.toml")


def read_settings(path: str = SETTINGS_FILE) -> dict[str, dict[str, list[str]]]:
    """{settings name: {setting: flags}} of the settings file: [published] as given, every other
    table's entries as their `base` published setting's flags followed by their own `flags`."""
    with open(path, "rb") as f:
        tables = tomllib.load(f)
    published = {name: list(flags) for name, flags in tables["published"].items()}
    out = {"published": published}
    for table, entries in tables.items():
        if table != "published":
            out[table] = {name: published[e["base"]] + list(e.get("flags", [])) for name, e in entries.items()}
    return out


SETTINGS = read_settings()
ALGORITHMS = SETTINGS["published"]
"""each algorithm's published settings (the settings file's [published])"""
FIRST_STAGE = SETTINGS["first-stage"]
"""issue #31 item 6's candidates for the unfaded first-stage model"""
PLACEMENTS = {
    # Every rank generates, then trains (the colocated systems' placement).
    "colocated": ["--mode", "colocated"],
    # 1 generator + 1 trainer streaming fragments, and TAG: the trainer generates when BTS predicts a
    # shorter step (the rollout-bound algorithms); with training the longer phase it never claims.
    # The bench's best split 2-rank placement for a rollout-bound step (its window scenario: gap+tag,
    # 1.21x colocated); on the default task colocated measured faster for every algorithm (README).
    "disagg+tag": ["--mode", "disagg", "--tag"],
}
THRESHOLDS = (0.30, 0.40, 0.432)  # 0.432: the first-stage model on the same 64 prompts and seeds


@dataclass
class Run:
    algorithm: str
    placement: str
    seed: int
    out: str
    curve: list[tuple[int, float, float]] = field(default_factory=list)
    """(step, wall-clock seconds, eval/reward) at every checkpoint, step 0 the base model"""
    scores: dict[str, list[float]] = field(default_factory=dict)
    """each --eval-scorer's mean at the same checkpoints (a check the training reward does not see)"""

    @property
    def name(self) -> str:
        return f"{self.algorithm}-{self.placement}-seed{self.seed}"


def plan_runs(algorithms, placements, seeds, out: str) -> list[Run]:
    return [Run(a, p, s, os.path.join(out, f"{a}-{p}-seed{s}")) for a in algorithms for p in placements for s in seeds]


def run_args(run: Run, steps: int, save_every: int, extra: list[str], settings: dict = ALGORITHMS) -> list[str]:
    return [*settings[run.algorithm], *PLACEMENTS[run.placement], "--seed", str(run.seed), "--steps", str(steps),
            "--save-every", str(save_every), "--keep-checkpoints", "0", "--eval-every", "0",
            "--output-dir", run.out, "--overwrite", *extra]


def finished(run: Run, steps: int) -> bool:
    return os.path.isdir(checkpoint_dir(run.out, steps))


def wall_clock(run_dir: str) -> dict[int, float]:
    """Step N -> seconds of the step loop until step N began (the sum of perf/step_s of the steps
    before it): the wall-clock at which checkpoint N's weights exist."""
    rows = sorted((r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "perf/step_s" in r),
                  key=lambda r: r["step"])
    out, total = {0: 0.0}, 0.0
    for r in rows:
        total += r["perf/step_s"]
        out[r["step"] + 1] = total
    return out


def _run_config(run_dir: str) -> RunConfig:
    with open(os.path.join(run_dir, "config.json")) as f:
        return RunConfig.from_dict(json.load(f))


class Evaluator:
    """The runs' evaluation outside them: the run's model with a checkpoint's trained float32 weights
    installed (step 0: version 0), the held-out prompts sampled and scored as runtime.evaluation does
    during a run (record j is sample j of the evaluation key of the run's seed). Models are kept per
    configuration; version 0 is evaluated once per seed and model."""

    def __init__(self, scorers: list[str] = ()):
        self.models: dict[str, tuple] = {}
        self.cache: dict[tuple, dict[str, float]] = {}
        self.scorers = RewardSet(scorers) if scorers else None

    def reward(self, run_dir: str, step: int) -> dict[str, float]:
        """eval/reward and eval/SCORER of checkpoint `step`."""
        cfg = _run_config(run_dir)
        key = (cfg.seed, json.dumps(cfg.to_dict()["model"]), run_dir if step else "version 0", step)
        if key not in self.cache:
            self.cache[key] = self._evaluate(cfg, checkpoint_dir(run_dir, step) if step else None)
        return self.cache[key]

    def _model(self, cfg: RunConfig):
        """(the run's model, its version-0 trained weights): LoRA is applied with the run's seed."""
        m, o = cfg.model, cfg.optim
        key = json.dumps([cfg.to_dict()["model"], o.lora_rank, o.lora_alpha, o.lora_targets, cfg.seed])
        if key not in self.models:
            adapter = load_model(m.model, m.model_path, preset=m.preset, seed=cfg.seed)
            if o.lora_rank > 0:
                apply_lora(adapter.transformer, o.lora_rank, o.lora_alpha, o.lora_targets, cfg.seed)
            trained = {n: p.detach().clone() for n, p in adapter.transformer.named_parameters()
                       if o.lora_rank == 0 or p.requires_grad}
            self.models[key] = (adapter, trained)
        return self.models[key]

    def _evaluate(self, cfg: RunConfig, path: str | None) -> dict[str, float]:
        adapter, version0 = self._model(cfg)
        install_weights(adapter.transformer, read_state(path, "model.") if path is not None else version0)
        o = cfg.output
        records = eval_records(o.eval_prompts, o.eval_num_prompts, o.eval_samples_per_prompt)
        rewards = RewardSet(cfg.rl.reward, device=adapter.device, model_paths=reward_model_paths(cfg.rl.reward_model))
        scores, _ = evaluate(adapter, run_sampling(cfg, adapter), records, rewards, batch_size=cfg.rl.micro_batch,
                             negative_prompt=cfg.sampling.negative_prompt, keep_images=0, scorers=self.scorers)
        return summarize(scores)


def measure_curve(run: Run, evaluator: Evaluator, save_every: int, steps: int) -> None:
    clock = wall_clock(run.out)
    points = [0] + [s for s in range(save_every, steps + 1, save_every)]
    if points[-1] != steps:
        points.append(steps)
    summaries = [evaluator.reward(run.out, s) for s in points]
    run.curve = [(s, clock[s], summary["eval/reward"]) for s, summary in zip(points, summaries)]
    names = evaluator.scorers.names if evaluator.scorers is not None else []
    run.scores = {n: [summary[f"eval/{n}"] for summary in summaries] for n in names}


def time_to(curve: list[tuple[int, float, float]], threshold: float) -> float | None:
    """Seconds until the first checkpoint whose eval/reward reaches `threshold` (None: none does)."""
    return next((wall for _, wall, reward in curve if reward >= threshold), None)


def best_within(curve: list[tuple[int, float, float]], budget_s: float) -> float:
    """The best eval/reward of the checkpoints that exist within `budget_s` seconds."""
    return max(reward for _, wall, reward in curve if wall <= budget_s)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def table(runs: list[Run], thresholds, budget_s: float | None = None) -> str:
    """A row per run, then a row per algorithm and placement: the mean over the seeds that reached
    each threshold (k/n when only k of n did). With a budget, also each run's best reward within it
    and its gain over version 0. Each scorer adds its base and final value (per run) and its mean gain."""
    scorers = list(runs[0].scores) if runs else []
    head = ["algorithm", "placement", "seed", *[f"s to {t:g}" for t in thresholds], "base", "final eval/reward",
            "s for all steps", "s per step", *[f"{n}: base, final" for n in scorers]]
    if budget_s is not None:
        head += [f"best within {budget_s:g} s", "gain"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        steps = r.curve[-1][0]
        extra = "" if budget_s is None else (f" {best_within(r.curve, budget_s):.3f} | "
                                             f"{best_within(r.curve, budget_s) - r.curve[0][2]:+.3f} |")
        lines.append(f"| {r.algorithm} | {r.placement} | {r.seed} | "
                     + " | ".join(_s(time_to(r.curve, t)) for t in thresholds)
                     + f" | {r.curve[0][2]:.3f} | {r.curve[-1][2]:.3f} | {r.curve[-1][1]:.0f} | "
                       f"{r.curve[-1][1] / steps:.2f} |"
                     + "".join(f" {r.scores[n][0]:.3f}, {r.scores[n][-1]:.3f} |" for n in scorers) + extra)
    lines += ["", "| algorithm | placement | runs | " + " | ".join(f"mean s to {t:g}" for t in thresholds)
              + " | mean final eval/reward | mean s per step |" + "".join(f" mean {n} gain |" for n in scorers),
              "|" + "---|" * (5 + len(thresholds) + len(scorers))]
    groups: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.algorithm, r.placement), []).append(r)
    for (algorithm, placement), rs in groups.items():
        cells = []
        for t in thresholds:
            reached = [x for x in (time_to(r.curve, t) for r in rs) if x is not None]
            mean = _s(sum(reached) / len(reached)) if reached else "-"
            cells.append(mean if len(reached) == len(rs) else f"{mean} ({len(reached)}/{len(rs)})")
        final = sum(r.curve[-1][2] for r in rs) / len(rs)
        per_step = sum(r.curve[-1][1] / r.curve[-1][0] for r in rs) / len(rs)
        gains = "".join(f" {sum(r.scores[n][-1] - r.scores[n][0] for r in rs) / len(rs):+.3f} |" for n in scorers)
        lines.append(f"| {algorithm} | {placement} | {len(rs)} | " + " | ".join(cells) + f" | {final:.3f} | "
                     f"{per_step:.2f} |" + gains)
    return "\n".join(lines)


def plot(runs: list[Run], thresholds, path: str) -> None:
    """eval/reward against wall-clock for every run, and each scorer beside it in a panel of its own."""
    algorithms = sorted({r.algorithm for r in runs})
    colors = {a: plt.get_cmap("tab10")(i) for i, a in enumerate(algorithms)}
    styles = {p: s for p, s in zip(PLACEMENTS, ("-", "--", ":", "-."))}
    scorers = list(runs[0].scores) if runs else []
    fig, axes = plt.subplots(1, 1 + len(scorers), figsize=(8 + 6 * len(scorers), 5), squeeze=False)
    panels = [("eval/reward (held-out prompts)", lambda r: [x for _, _, x in r.curve])]
    panels += [(f"{n} (the same samples; not trained on)", lambda r, n=n: r.scores[n]) for n in scorers]
    for ax, (label, values) in zip(axes[0], panels):
        for r in runs:
            ax.plot([w / 60 for _, w, _ in r.curve], values(r), styles.get(r.placement, "-"),
                    color=colors[r.algorithm], marker="o", markersize=3, label=r.name)
        ax.set_xlabel("wall-clock (minutes of the step loop)")
        ax.set_ylabel(label)
    for t in thresholds:
        axes[0][0].axhline(t, color="gray", linewidth=0.5)
    axes[0][0].set_title("time to reward: the default task, 2 ranks")
    axes[0][0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--out", default="runs/time_to_reward")
    p.add_argument("--settings", choices=list(SETTINGS), default="published",
                   help="published: each algorithm's published settings (ALGORITHMS); first-stage: issue #31 item "
                        "6's candidates for the unfaded model (FIRST_STAGE, with --extra=--model-path DIR)")
    p.add_argument("--algorithms", default=None, help="comma-separated names of the settings (default: all)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="also report each run's best eval/reward within this many seconds and its gain")
    p.add_argument("--placements", default=",".join(PLACEMENTS), help=f"comma-separated, of {list(PLACEMENTS)}")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--save-every", type=int, default=5, help="checkpoints (evaluated afterwards) every N steps")
    p.add_argument("--thresholds", default=",".join(f"{t:g}" for t in THRESHOLDS))
    p.add_argument("--extra", default="", help="flags appended to every run (e.g. a tiny preset for a test)")
    p.add_argument("--skip-existing", action="store_true", help="keep run folders that reached --steps")
    p.add_argument("--timeout-s", type=int, default=4 * 3600, help="per run")
    p.add_argument("--eval-scorer", action="append", default=[],
                   help="NAME, repeatable: a scorer of the same samples reported beside eval/reward, as in a run "
                        "(default: shapes_detector; none: no scorer)")
    a = p.parse_args(argv)
    settings = SETTINGS[a.settings]
    algorithms = a.algorithms.split(",") if a.algorithms else list(settings)
    placements = a.placements.split(",")
    for name, known in ((algorithms, settings), (placements, PLACEMENTS)):
        bad = [x for x in name if x not in known]
        if bad:
            raise ValueError(f"unknown {bad}; choose from {list(known)}")
    thresholds = [float(t) for t in a.thresholds.split(",")]
    runs = plan_runs(algorithms, placements, [int(s) for s in a.seeds.split(",")], a.out)
    os.makedirs(a.out, exist_ok=True)
    for run in runs:  # training first, alone on the machine
        if a.skip_existing and finished(run, a.steps):
            continue
        print(f"training {run.name}", flush=True)
        torchrun(2, run_args(run, a.steps, a.save_every, shlex.split(a.extra), settings), timeout=a.timeout_s)
    scorers = a.eval_scorer or default_eval_scorers(["shapes"])  # every setting trains the shapes reward
    check_scorers(scorers, ["shapes"], {})
    evaluator = Evaluator(eval_scorers(scorers))
    for run in runs:
        print(f"evaluating {run.name}", flush=True)
        measure_curve(run, evaluator, a.save_every, a.steps)
    text = table(runs, thresholds, a.budget_s)
    with open(os.path.join(a.out, "time_to_reward.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(a.out, "time_to_reward.json"), "w") as f:
        json.dump([{"algorithm": r.algorithm, "placement": r.placement, "seed": r.seed,
                    "args": run_args(r, a.steps, a.save_every, shlex.split(a.extra), settings),
                    "curve": [{"step": s, "wall_s": w, "eval_reward": x, **{n: v[i] for n, v in r.scores.items()}}
                              for i, (s, w, x) in enumerate(r.curve)],
                    "time_to": {f"{t:g}": time_to(r.curve, t) for t in thresholds}} for r in runs], f, indent=1)
    plot(runs, thresholds, os.path.join(a.out, "time_to_reward.png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
