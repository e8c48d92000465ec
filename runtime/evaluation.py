"""Evaluation: the ODE sampler (noise level 0) on held-out prompts with fixed seeds, scored by the
run's rewards. Used during training (--eval-every) and by scripts/eval.py for any checkpoint."""
from __future__ import annotations

import dataclasses

import torch
from tqdm import tqdm

from prompts import shapes as buckets
from rl import sampler
from rollout import sample_images

EVAL_STEP = -1  # the noise key of evaluation samples: never a training step


def evaluate(adapter, sampling: sampler.SamplingConfig, records, rewards, *, batch_size: int = 8,
             first_sample_id: int = 0, negative_prompt: str = "", sample_ids: list[int] | None = None,
             keep_images: int | None = None, thumbnail=None, progress: bool = False):
    """Returns (scores by reward name plus "combined", each a list of floats in record order; the
    images of the first `keep_images` records, all by default, each passed through `thumbnail` when
    given). Record j is sample first_sample_id + j (or sample_ids[j]: its fixed seed), sampled and
    scored batch by batch with the records of its shape (prompts/shapes.py), with a progress bar when
    `progress`; a sample does not depend on its batch, so the batch size changes no score. The
    images are a tensor [n, 3, H, W] (videos [n, 3, F, H, W]) when they share one shape, else a list
    in record order (metrics.image_grid pads them to the largest)."""
    ode = dataclasses.replace(sampling, noise_level=0.0, sde_window=None)
    default = buckets.default_shape(sampling)
    keep = len(records) if keep_images is None else min(keep_images, len(records))
    by_shape: dict = {}
    for j, r in enumerate(records):
        by_shape.setdefault(buckets.record_shape(r, default), []).append(j)
    images, scores = [None] * keep, {}
    bar = tqdm(total=len(records), desc="evaluate", unit="sample", disable=not progress, dynamic_ncols=True,
               leave=False)
    for shape, rows in by_shape.items():
        for lo in range(0, len(rows), batch_size):
            batch = rows[lo:lo + batch_size]
            prompts = [records[j].prompt for j in batch]
            _, got = sample_images(adapter, prompts, buckets.sampling_for(ode, shape), step=EVAL_STEP,
                                   sample_ids=[first_sample_id + j if sample_ids is None else sample_ids[j]
                                               for j in batch], batch_size=batch_size,
                                   negative_prompt=negative_prompt)
            for name, v in rewards.score_combined(got, prompts, [records[j].metadata for j in batch]).items():
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
