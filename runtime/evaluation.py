"""Evaluation: the ODE sampler (noise level 0) on held-out prompts with fixed seeds, scored by the
run's rewards. Used during training (--eval-every) and by scripts/eval.py for any checkpoint."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from tqdm import tqdm

from config.schema import eval_scorers
from models import autocast
from prompts import resolutions
from prompts.sets import eval_records
from rewards import RewardSet
from rl import sampler
from rollout import sample_images
from telemetry.metrics import LOGGED_IMAGES, thumbnails

EVAL_STEP = -1  # the noise key of evaluation samples: never a training step


def evaluate(adapter, sampling: sampler.SamplingConfig, records, rewards, *, batch_size: int = 8,
             first_sample_id: int = 0, negative_prompt: str = "", sample_ids: list[int] | None = None,
             keep_images: int | None = None, thumbnail=None, progress: bool = False, scorers=None):
    """Returns (scores by reward name plus "combined", and by the name of each of `scorers` (a
    RewardSet of other names, outside "combined"), each a list of floats in record order; the images
    of the first `keep_images` records, all by default, each passed through `thumbnail` when
    given). Record j is sample first_sample_id + j (or sample_ids[j]: its fixed seed), sampled and
    scored batch by batch with the records of its shape (prompts/resolutions.py), with a progress bar when
    `progress`; a sample does not depend on its batch, so the batch size changes no score. The
    images are a tensor [n, 3, H, W] (videos [n, 3, F, H, W]) when they share one shape, else a list
    in record order (metrics.image_grid pads them to the largest)."""
    # Euler whatever the rollout's solver or window, so every algorithm is evaluated alike (NFT too)
    ode = dataclasses.replace(sampling, noise_level=0.0, sde_window=None, window_schedule=None, ode_solver="euler",
                              record=())
    keep = len(records) if keep_images is None else min(keep_images, len(records))
    by_shape = resolutions.rows_by_shape(records, sampling)
    images, scores = [None] * keep, {}
    bar = tqdm(total=len(records), desc="evaluate", unit="sample", disable=not progress, dynamic_ncols=True,
               leave=False)
    for shape, rows in by_shape.items():
        for lo in range(0, len(rows), batch_size):
            batch = rows[lo:lo + batch_size]
            prompts = [records[j].prompt for j in batch]
            _, got = sample_images(adapter, prompts, resolutions.sampling_for(ode, shape), step=EVAL_STEP,
                                   sample_ids=[first_sample_id + j if sample_ids is None else sample_ids[j]
                                               for j in batch], batch_size=batch_size,
                                   negative_prompt=negative_prompt)
            metadata = [records[j].metadata for j in batch]
            scored = rewards.score_combined(got, prompts, metadata)
            if scorers is not None:
                scored.update(scorers.score(got, prompts, metadata))
            for name, v in scored.items():
                scores.setdefault(name, [0.0] * len(records))
                for j, x in zip(batch, v.tolist()):
                    scores[name][j] = x
            for j, image in zip(batch, got):
                if j < keep:
                    images[j] = image if thumbnail is None else thumbnail(image[None], 1)[0]
            bar.update(len(batch))
    bar.close()
    return scores, (torch.stack(images) if images and len({tuple(t.shape) for t in images}) == 1 else images)


def summarize(scores: dict[str, list[float]], shape_names: list[str] | None = None) -> dict[str, float]:
    """Means of every score; with `shape_names` (one per record) of more than one shape, also the
    combined reward of each shape as eval/reward/<shape>."""
    out = {"eval/reward": float(torch.tensor(scores["combined"]).mean())}
    for k, v in scores.items():
        if k != "combined":
            out[f"eval/{k}"] = float(torch.tensor(v).mean())
    if shape_names is not None and len(set(shape_names)) > 1:
        for name in sorted(set(shape_names)):
            out[f"eval/reward/{name}"] = float(torch.tensor([s for s, n in zip(scores["combined"], shape_names)
                                                             if n == name]).mean())
    return out


def run_rewards(cfg, adapter) -> tuple[RewardSet, RewardSet | None]:
    """The run's rewards and its --eval-scorer set (None without one), as evaluation builds them."""
    kw = dict(device=adapter.device, dtype=torch.float32 if cfg.rl.reward_dtype == "float32" else adapter.dtype,
              **cfg.rl.reward_options())
    scorers = eval_scorers(cfg.output.eval_scorer)
    return RewardSet(cfg.rl.reward, **kw), RewardSet(scorers, **kw) if scorers else None


def evaluate_on_trainers(cfg, adapter, sampling, topo, rank: int, done: int, logger, tracer, group,
                         records=None) -> None:
    """During training: trainer ranks hold the newest version (k+1 right after update k) and the
    whole model, so they evaluate. The held-out prompts of each shape are split evenly over them
    (equal counts, so FSDP ranks run equally many forwards); results are gathered on the first
    trainer, which logs. Other ranks return at once. `records`: the held-out records as the run
    read them before anything loaded (else the file is read now)."""
    out = cfg.output
    if records is None:
        records = eval_records(out.eval_prompts, out.eval_num_prompts, out.eval_samples_per_prompt)
    evaluators = list(topo.trainer_ranks)
    if rank not in evaluators:
        return
    default = resolutions.default_shape(sampling)
    names = [resolutions.shape_name(resolutions.record_shape(r, default)) for r in records]
    share = resolutions.evaluation_share(names, len(evaluators), evaluators.index(rank))
    rows = [j for j, _ in share]  # record j is sample j: its fixed seed
    rewards, scorers = run_rewards(cfg, adapter)
    # Under the run's autocast, as the generators sample (FSDP2 trainers gather compute-dtype weights;
    # TF32 is on for what stays float32, runtime/build.py): float32 sampling of a 12B model takes minutes.
    with tracer.span("evaluate", "eval", done), autocast(adapter.device, cfg.model.dtype):
        scores, images = evaluate(adapter, sampling, [records[j] for j in rows], rewards,
                                  batch_size=cfg.rl.micro_batch, sample_ids=rows,
                                  negative_prompt=cfg.sampling.negative_prompt, thumbnail=thumbnails,
                                  progress=rank == evaluators[0], scorers=scorers)
    real = [n for n, (_, keep) in enumerate(share) if keep]
    # Only what the grid shows travels, as uint8 thumbnails.
    result = [(rows[n], {k: v[n] for k, v in scores.items()},
               (images[n].clamp(0, 1) * 255).round().to(torch.uint8) if rows[n] < LOGGED_IMAGES else None)
              for n in real]
    everyone = [None] * len(evaluators)
    dist.all_gather_object(everyone, result, group=group)  # sync point: the trainer ranks
    if rank == evaluators[0]:
        got = sorted((item for part in everyone for item in part), key=lambda item: item[0])  # record order
        scores = {k: [item[1][k] for item in got] for k in got[0][1]}
        logger.log(done, summarize(scores, names))
        shown = [(j, image.float() / 255) for j, _, image in got if image is not None][:LOGGED_IMAGES]
        same = len({tuple(image.shape) for _, image in shown}) == 1
        grid = torch.stack([image for _, image in shown]) if same else [image for _, image in shown]
        logger.log_images(done, "eval", grid, [records[j].prompt for j, _ in shown])
