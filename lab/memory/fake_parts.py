"""What a memory measurement (lab/memory/measure.py) runs in place of what it cannot run on fake
tensors: the data a generator sends its trainers (as shapes), a trainer's packed micro-batches of
them, the reward models (their networks, on inputs of their processors' sizes, scoring zeros) and
the step store of one rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers

from parallel.trainer_intake import TransitionBatch
from rewards import parse_reward_spec, reward_class, reward_url
from rl import sampler
from rl.conditioning import Conditioning
from lab.memory import fake_run
from runtime.budget import REWARD_MODELS, reward_network

TRAIN_MICRO_BATCHES = 1
"""Packed micro-batches per measured training call (it accumulates into the gradients held before it)."""


@dataclass(frozen=True)
class Sent:
    """What a generator sends its trainers, as shapes: the conditioning of one sample (and of its
    negative prompt with CFG) and the latent of one step."""

    cond: dict[str, tuple[tuple[int, ...], torch.dtype]]
    neg: dict[str, tuple[tuple[int, ...], torch.dtype]] | None
    latent: tuple[int, ...]

    @classmethod
    def of(cls, cond: Conditioning, neg: Conditioning | None, latent) -> "Sent":
        def shapes(c):
            return {k: (tuple(v.shape[1:]), v.dtype) for k, v in c.tensors.items()}
        return cls(shapes(cond), shapes(neg) if neg is not None else None, tuple(latent))


def conditioning(shapes: dict, rows: int) -> Conditioning:
    return Conditioning({k: torch.ones((rows, *s), dtype=dt) if not dt.is_floating_point else
                         torch.empty((rows, *s), dtype=dt) for k, (s, dt) in shapes.items()})


def transition_batch(sent: Sent, sampling: sampler.SamplingConfig, sigmas: torch.Tensor, t: int,
                     rows: int) -> TransitionBatch:
    """TRAIN_MICRO_BATCHES packed micro-batches of `rows` transitions at timestep t, each of its own sample."""
    n = TRAIN_MICRO_BATCHES * rows
    return TransitionBatch(
        step=0, fragment=0, version=0, micro_batches=tuple(range(TRAIN_MICRO_BATCHES)),
        sizes=(rows,) * TRAIN_MICRO_BATCHES, sample_ids=torch.tensor(list(range(n))),
        timesteps=torch.tensor([t] * n), x_t=torch.empty((n, *sent.latent)), x_next=torch.empty((n, *sent.latent)),
        sigma=torch.tensor([float(sigmas[t])] * n), sigma_next=torch.tensor([float(sigmas[t + 1])] * n),
        log_probs=torch.tensor([0.0] * n), advantages=torch.tensor([1.0] * n), keep=torch.tensor([True] * n),
        cond_index=torch.tensor(list(range(n))), cond=conditioning(sent.cond, n),
        neg_cond=conditioning(sent.neg, n) if sent.neg is not None else None,
        steps={name: torch.empty((n,) if name in sampler.PER_SAMPLE_FIELDS else (n, *sent.latent))
               for name in sampling.record})  # the step fields the algorithm's rollout records


# ----- rewards ---------------------------------------------------------------------------------
class FakeRewards:
    """A RewardSet's GPU work: each model reward's network, resident in the run's reward dtype,
    scoring a batch of the reward's size (every frame of a video is an image); the scores are zeros.
    A reward served over HTTP (`--reward URL`) holds nothing here."""

    remote = False

    def __init__(self, specs: list[str], mode, dtype: torch.dtype = torch.float32):
        self.names = [parse_reward_spec(s)[0] for s in specs]
        self.models = {name: (fake_run.fake_module(reward_network(name), mode, dtype), dtype)
                       for name, spec in zip(self.names, specs) if name in REWARD_MODELS and not reward_url(spec)}

    @torch.no_grad()
    def _score(self, name: str, images: int) -> None:
        model, dtype = self.models[name]
        b = min(reward_class(name).batch_size or images, images)
        if isinstance(model, transformers.CLIPModel):
            size, text = model.config.vision_config.image_size, model.config.text_config.max_position_embeddings
            ids = torch.ones((b, text), dtype=torch.long)
            model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.empty((b, 3, size, size),
                                                                                                 dtype=dtype))
        else:  # an encoder-decoder OCR model: the image encoded, then its text decoded (32 tokens)
            size = model.config.encoder.image_size
            model(pixel_values=torch.empty((b, 3, size, size), dtype=dtype),
                  decoder_input_ids=torch.ones((b, 32), dtype=torch.long))

    def score_combined(self, images: torch.Tensor, prompts, metadata=None) -> dict[str, torch.Tensor]:
        count = images.shape[0] * (images.shape[2] if images.dim() == 5 else 1)
        for name in self.models:
            self._score(name, count)
        zeros = torch.tensor([0.0] * images.shape[0])
        return {**{n: zeros for n in self.names}, "combined": zeros}

    def submit(self, images: torch.Tensor, prompts, metadata=None) -> "_Scored":
        return _Scored(self.score_combined(images, prompts, metadata))


@dataclass
class _Scored:
    """RewardSet.submit's pending scores, already there."""

    scores: dict

    def result(self) -> dict:
        return dict(self.scores)


class Store(dict):
    """The step store's interface (parallel/store.py) on one rank: what a generator publishes for
    the end of the step (the global std) stays here."""

    def put(self, key, value) -> None:
        self[key] = value

    def ready(self, key) -> bool:
        return key in self
