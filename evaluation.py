"""Evaluation: the ODE sampler (noise level 0) on held-out prompts with fixed seeds, scored by the
run's rewards. Used during training (--eval-every) and by scripts/eval.py for any checkpoint."""
from __future__ import annotations

import dataclasses

import torch

import buckets
import sampler
from rollout import sample_images

EVAL_STEP = -1  # the noise key of evaluation samples: never a training step


def evaluate(adapter, sampling: sampler.SamplingConfig, records, rewards, *, batch_size: int = 8,
             first_sample_id: int = 0, negative_prompt: str = "", sample_ids: list[int] | None = None):
    """Returns (scores by reward name plus "combined", each a list of floats; images). Record j is
    sample first_sample_id + j (or sample_ids[j]: its fixed seed), sampled and scored with the
    records of its shape (buckets.py);
    images is [n,3,H,W] when all records have one shape, else a list of [3,H,W] in record order
    (metrics.image_grid pads them to the largest)."""
    ode = dataclasses.replace(sampling, noise_level=0.0, sde_window=None)
    default = buckets.default_shape(sampling)
    by_shape: dict = {}
    for j, r in enumerate(records):
        by_shape.setdefault(buckets.record_shape(r, default), []).append(j)
    images, scores = [None] * len(records), {}
    for shape, rows in by_shape.items():
        prompts = [records[j].prompt for j in rows]
        _, got = sample_images(adapter, prompts, buckets.sampling_for(ode, shape), step=EVAL_STEP,
                               sample_ids=[first_sample_id + j if sample_ids is None else sample_ids[j]
                                           for j in rows], batch_size=batch_size,
                               negative_prompt=negative_prompt)
        for name, v in rewards.score_combined(got, prompts, [records[j].metadata for j in rows]).items():
            scores.setdefault(name, [0.0] * len(records))
            for j, x in zip(rows, v.tolist()):
                scores[name][j] = x
        for j, image in zip(rows, got):
            images[j] = image
    return scores, (torch.stack(images) if len(by_shape) == 1 else images)


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
