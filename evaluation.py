"""Evaluation: the ODE sampler (noise level 0) on held-out prompts with fixed seeds, scored by the
run's rewards. Used during training (--eval-every) and by scripts/eval.py for any checkpoint."""
from __future__ import annotations

import dataclasses

import torch

import sampler
from rollout import sample_images

EVAL_STEP = -1  # the noise key of evaluation samples: never a training step


def evaluate(adapter, sampling: sampler.SamplingConfig, records, rewards, *, batch_size: int = 8,
             first_sample_id: int = 0, negative_prompt: str = ""):
    """Returns (scores by reward name plus "combined", each a list of floats; images [n,3,H,W])."""
    ode = dataclasses.replace(sampling, noise_level=0.0, sde_window=None)
    prompts = [r.prompt for r in records]
    _, images = sample_images(adapter, prompts, ode, step=EVAL_STEP, first_sample_id=first_sample_id,
                              batch_size=batch_size, negative_prompt=negative_prompt)
    scores = rewards.score_combined(images, prompts, [r.metadata for r in records])
    return {k: v.tolist() for k, v in scores.items()}, images


def summarize(scores: dict[str, list[float]]) -> dict[str, float]:
    out = {"eval/reward": float(torch.tensor(scores["combined"]).mean())}
    for k, v in scores.items():
        if k != "combined":
            out[f"eval/{k}"] = float(torch.tensor(v).mean())
    return out
