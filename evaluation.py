"""Evaluation: the ODE sampler (noise level 0) on held-out prompts with fixed seeds, scored by the
run's rewards. Used during training (--eval-every) and by scripts/eval.py for any checkpoint."""
from __future__ import annotations

import dataclasses

import torch
from tqdm import tqdm

import sampler
from rollout import sample_images

EVAL_STEP = -1  # the noise key of evaluation samples: never a training step


def evaluate(adapter, sampling: sampler.SamplingConfig, records, rewards, *, batch_size: int = 8,
             first_sample_id: int = 0, negative_prompt: str = "", keep_images: int | None = None,
             thumbnail=None, progress: bool = False):
    """Returns (scores by reward name plus "combined", each a list of floats; the first `keep_images`
    images [n, 3, H, W] or videos [n, 3, F, H, W], all by default, each batch's passed through
    `thumbnail` when given). Batch by batch, with a progress bar when `progress`; a sample does not
    depend on its batch, so the batch size changes no score."""
    ode = dataclasses.replace(sampling, noise_level=0.0, sde_window=None)
    keep = len(records) if keep_images is None else keep_images
    parts: dict[str, list[float]] = {}
    kept = []
    for lo in tqdm(range(0, len(records), batch_size), desc="evaluate", unit="batch", disable=not progress,
                   dynamic_ncols=True, leave=False):
        batch = records[lo:lo + batch_size]
        prompts = [r.prompt for r in batch]
        _, images = sample_images(adapter, prompts, ode, step=EVAL_STEP, first_sample_id=first_sample_id + lo,
                                  batch_size=batch_size, negative_prompt=negative_prompt)
        for k, v in rewards.score_combined(images, prompts, [r.metadata for r in batch]).items():
            parts.setdefault(k, []).extend(v.tolist())
        kept.append(images[:max(0, keep - lo)] if thumbnail is None else thumbnail(images[:max(0, keep - lo)]))
    return parts, torch.cat(kept)


def summarize(scores: dict[str, list[float]]) -> dict[str, float]:
    out = {"eval/reward": float(torch.tensor(scores["combined"]).mean())}
    for k, v in scores.items():
        if k != "combined":
            out[f"eval/{k}"] = float(torch.tensor(v).mean())
    return out
