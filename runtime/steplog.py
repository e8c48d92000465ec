"""The step log: every rank's step record on the store, and the logging rank (the first trainer)
turning them into one line of metrics.jsonl, TensorBoard scalars, a sample grid and the summary
line. The running reward std of --std-mode running is kept here, since it is computed from the
records of every rank."""
from __future__ import annotations

import base64
import os

import torch
from tqdm import tqdm

from checkpointing import folder
from parallel.store import StepStore
from parallel import store_keys as keys
from rl.advantages import RunningStd
from telemetry.metrics import MetricsLogger, thumbnails
from telemetry.wandb_sink import WandbOptions
from telemetry.tracing import summarize_step


class StepLog:
    """One rank's side of the step log: `record` on every rank, `log` on the logging rank."""

    def __init__(self, cfg, rank: int, logging: bool, store: StepStore, world_size: int, start: int,
                 in_place: bool, summary: tuple[str, ...], run: dict | None = None):
        """`in_place`: a resume into the same folder (TensorBoard replays the kept rows); `summary`:
        the loss statistics the summary line shows (the loss object's SUMMARY); `run`: the run record
        (config.json's), which wandb gets with the config."""
        self.cfg, self.rank, self.logging, self.store, self.world_size = cfg, rank, logging, store, world_size
        self.summary = summary
        self.running = RunningStd()
        self.std_history: dict[int, float | None] = {}
        out = cfg.output.output_dir
        self.logger = MetricsLogger(out, enabled=logging, purge_step=start if in_place else None,
                                    wandb=wandb_options(cfg, run or {}), config={**cfg.describe(), "run": run or {}})
        for row in folder.rows_to_replay(out, start) if logging and in_place else []:
            self.logger.log_tensorboard(row["step"], {k: v for k, v in row.items() if k not in ("step", "time")})
        self.progress = tqdm(total=cfg.rl.steps, initial=start, desc="steps", dynamic_ncols=True) if logging else None
        self.previous_end: float | None = None  # the end of the previous step: perf/step_s is the loop's period
        self.last_scalars: dict[str, float] = {}  # the logging rank's last step (--placement auto measures it)
        self.last_span_s = 0.0  # its first start to its last end over the ranks: the step without what came before

    def record(self, step: int, role: str, start_s: float, end_s: float, busy_s: float, train: dict | None,
               gen_out: list) -> None:
        """This rank's record of step `step`, put on the store (no rank waits here)."""
        self.store.put(keys.step_record(step, self.rank), {
            "rank": self.rank, "role": role, "start_s": start_s, "end_s": end_s, "busy_s": busy_s, "train": train,
            "samples": self._samples(step, gen_out), "rewards": merge_rewards([r.rewards for r in gen_out]),
            "zero_std": sum((r.zero_std for r in gen_out), [])})

    def log(self, plan) -> None:
        """The logging rank: collect every rank's record of the step, update the running reward std
        (published for the generators of the next steps), log scalars and the sample grid, warn
        about steps that train nothing."""
        step = plan.step
        everyone = [self.store.get(keys.step_record(step, r)) for r in range(self.world_size)]  # rank wait: every record
        for r in range(self.world_size):
            self.store.delete(keys.step_record(step, r))
        all_rewards = merge_rewards([rec["rewards"] for rec in everyone])
        self.running.update(all_rewards.get("combined", []))
        self.store.put(keys.running_std(step), self.running.std)
        self.std_history[step] = self.running.std
        if step >= 3 and self.store.ready(keys.running_std(step - 3)):
            self.store.delete(keys.running_std(step - 3))
        scalars = step_scalars(everyone, all_rewards, plan.num_samples, self.previous_end)
        self.logger.log(step, scalars)
        self.last_scalars = scalars
        self.last_span_s = max(rec["end_s"] for rec in everyone) - min(rec["start_s"] for rec in everyone)
        samples = next((rec["samples"] for rec in everyone if rec["samples"] is not None), None)
        if samples is not None:
            pixels = torch.frombuffer(bytearray(base64.b64decode(samples["pixels"])), dtype=torch.uint8)
            self.logger.log_images(step, "samples", pixels.reshape(samples["shape"]).float() / 255, samples["prompts"])
        self.progress.update(1)
        self.progress.write(summary_line(step, scalars, self.summary))
        if scalars["train/all_groups_zero_std"]:
            self.progress.write(f"warning: step {step}: every group's rewards are equal, so every advantage is 0 and "
                                f"the update has no policy gradient (a reward that cannot tell the samples apart?)")
        self.previous_end = max(rec["end_s"] for rec in everyone)

    def _samples(self, step: int, gen_out: list) -> dict | None:
        """Thumbnails of this step's first samples, for the logging rank's grid: from the rank that
        generated fragment 0, every --log-images-every steps."""
        every = self.cfg.output.log_images_every
        if not (gen_out and every and step % every == 0 and gen_out[0].fragment == 0):
            return None
        images = thumbnails(gen_out[0].images, 16)
        pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).contiguous()  # what the grid keeps anyway
        return {"shape": list(pixels.shape), "pixels": base64.b64encode(pixels.numpy().tobytes()).decode(),
                "prompts": gen_out[0].prompts[:len(images)]}  # the store carries JSON

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self.logger.close()


def wandb_options(cfg, run: dict) -> WandbOptions | None:
    """--wandb and its flags; the run's name defaults to the output folder's, its group is the run's id."""
    o = cfg.output
    if o.wandb is None:
        return None
    name = o.wandb_run_name or os.path.basename(os.path.normpath(o.output_dir))
    tags = tuple(t.strip() for t in o.wandb_tags.split(",") if t.strip())
    return WandbOptions(o.wandb, o.wandb_entity, name, tags, run.get("id"))


def merge_rewards(parts: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Concatenate per-reward score lists (of fragments, or of ranks)."""
    out: dict[str, list[float]] = {}
    for rewards in parts:
        for k, v in rewards.items():
            out.setdefault(k, []).extend(v)
    return out


def step_scalars(records, rewards, num_samples, previous_end: float | None) -> dict[str, float]:
    scalars: dict[str, float] = {}
    comb = torch.tensor(rewards.get("combined", [float("nan")]), dtype=torch.float64)
    scalars["reward/mean"] = comb.mean().item()
    scalars["reward/std"] = comb.std(unbiased=False).item()
    for k, v in rewards.items():
        if k != "combined":
            t = torch.tensor(v, dtype=torch.float64)
            scalars[f"reward/{k}/mean"] = t.mean().item()
            scalars[f"reward/{k}/std"] = t.std(unbiased=False).item()
    zero = [z for rec in records for z in rec["zero_std"]]
    scalars["train/zero_std_fraction"] = sum(zero) / max(1, len(zero))
    scalars["train/all_groups_zero_std"] = float(bool(zero) and all(zero))  # summed over steps: their count
    trains = [rec["train"] for rec in records if rec["train"] is not None]
    train = dict(trains[0])
    if "tag_fragments" in train:  # TAG: fragments generated by trainers, BTS's predicted step time and costs
        train.pop("tag_fragments")
        predicted = train.pop("tag_predicted_s")
        scalars["tag/fragments"] = float(sum(t["tag_fragments"] for t in trains))
        if predicted is not None:
            scalars["tag/predicted_step_s"] = predicted
        for name, seconds in train.pop("tag_costs").items():  # the first trainer's: the logging rank's
            scalars[f"bts/{name}"] = seconds
    scalars.update(train)
    summary = summarize_step([{k: rec[k] for k in ("role", "busy_s", "start_s", "end_s")} for rec in records],
                             previous_end)
    scalars["perf/step_s"] = summary["step_s"]
    scalars["perf/samples_per_s"] = num_samples / summary["step_s"]
    scalars["perf/bubble_fraction"] = summary["bubble_fraction"]
    for k, v in summary.items():
        if k.startswith("busy_fraction/"):
            scalars[f"perf/{k}"] = v
    return scalars


def summary_line(step: int, s: dict, stats: tuple[str, ...]) -> str:
    """One line per step: reward, loss and the loss's own summary statistics, speed."""
    shown = "  ".join(f"{k} {s[f'train/{k}']:.3g}" for k in stats if f"train/{k}" in s)
    return (f"step {step}: reward {s['reward/mean']:.4f} +- {s['reward/std']:.4f}  loss {s['train/loss']:.3e}  "
            f"{shown}  {s['perf/step_s']:.2f} s/step  {s['perf/samples_per_s']:.1f} samples/s  "
            f"bubble {s['perf/bubble_fraction']:.2f}")
