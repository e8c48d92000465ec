"""DiffusionNFT's loss (arXiv 2509.16117; NVlabs/DiffusionNFT scripts/train_nft_sd3.py:908-970 at
commit 24af555, docs/ALGORITHMS.md "DiffusionNFT"): a flow-matching loss on the forward process,
trained on clean samples noised at chosen times, weighted by each sample's reward and contrasted
against the frozen old policy. No log-probabilities, no trajectories: any sampler produced the
samples.

For a clean sample x0, noise eps, time t and x_t = (1 - t) x0 + t eps, with the trained policy's
velocity v (gradient) and the old policy's v_old (none):

    v+ = beta v + (1 - beta) v_old            v- = (1 + beta) v_old - beta v       (implicit policies)
    x0+- = x_t - t v+-                         w+- = max(mean|x0+- - x0|, 1e-5)    (float64, no gradient)
    l+- = mean((x0+- - x0)^2) / w+-
    r = 1/2 + 1/2 clip(A / c, -1, 1)           (the optimality probability of the advantage A; c = --adv-clip)
    loss = c (r l+ + (1 - r) l-) / beta  +  lambda mean((v - v_ref)^2)

lambda is --beta (the KL weight to the reference, NFT's config.train.beta), beta is --nft-beta
(NFT's config.beta). The factor c and the 1/beta are in the peer's code and kept: they scale the
gradient, which AdamW mostly undoes, but not the gradient-norm clip.
"""
from __future__ import annotations

import torch
from torch import Tensor

from rl.seeding import forward_noise

WEIGHT_MIN = 1e-5
"""the floor of the adaptive weights w+- (NFT train_nft_sd3.py:944)"""


def optimality(adv: Tensor, adv_clip: float) -> Tensor:
    """r = 1/2 + 1/2 clip(A / c, -1, 1): NFT's (clamp(A, -c, c) / c) / 2 + 1/2, clamped to [0, 1]."""
    return (adv.double().clamp(-adv_clip, adv_clip) / adv_clip / 2 + 0.5).clamp(0.0, 1.0)


def noised(x0: Tensor, sigma: Tensor, sample_ids: list[int], timesteps: list[int], seed: int, step: int) -> Tensor:
    """x_t = (1 - sigma) x0 + sigma eps of each transition, eps keyed by (seed, step, sample, t)
    (rl.seeding.forward_noise), so every trainer and placement noises a clean sample alike."""
    eps = torch.stack([forward_noise(seed, step, i, t, tuple(x0.shape[1:]))
                       for i, t in zip(sample_ids, timesteps)]).to(x0.device)
    s = _bcast(sigma.float(), x0)
    return (1 - s) * x0.float() + s * eps


def _mean(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], -1).mean(dim=1)


def _weighted(x0_hat: Tensor, x0: Tensor) -> tuple[Tensor, Tensor]:
    """(l, w): the adaptive-weighted x0 error of one implicit policy, per sample, in float64."""
    err = x0_hat.double() - x0.double()
    with torch.no_grad():
        w = _mean(err.abs()).clamp(min=WEIGHT_MIN)
    return _mean(err.pow(2)) / w, w


def _bcast(t: Tensor, like: Tensor) -> Tensor:
    return t.reshape(-1, *([1] * (like.dim() - 1)))


class NFTLoss:
    """DiffusionNFT's forward-process loss as the trainer's loss object (rl/loss.py's interface for
    forward-process algorithms): `__call__` returns the sum of the transitions' losses and a float64
    vector of per-transition sums of `STATS`, kept on the device."""

    STATS = ("loss", "policy_loss", "kl", "positive_loss", "negative_loss", "optimality", "old_deviation")
    SUMMARY = ("policy_loss", "old_deviation")
    """old_deviation: mean((v - v_old)^2), how far the trained policy has moved from the sampling one"""
    forward_process = True
    """trains clean samples noised on the trainer (no trajectory, no log-probability)"""

    def __init__(self, nft_beta: float, kl_weight: float, adv_clip: float):
        if not nft_beta > 0:
            raise ValueError(f"--nft-beta must be > 0, got {nft_beta}")
        self.nft_beta, self.kl_weight, self.adv_clip = nft_beta, kl_weight, adv_clip

    @property
    def needs_reference(self) -> bool:
        return self.kl_weight > 0

    def __call__(self, x0: Tensor, x_t: Tensor, t: Tensor, v: Tensor, v_old: Tensor, adv: Tensor,
                 v_ref: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x0, x_t, v, v_old (and v_ref with a KL weight): (n, *latent); t, adv: (n,)."""
        b = self.nft_beta
        v, v_old = v.float(), v_old.detach().float()
        tt = _bcast(t.float(), x_t)
        positive = b * v + (1 - b) * v_old
        negative = (1 + b) * v_old - b * v
        l_pos, _ = _weighted(x_t - tt * positive, x0)
        l_neg, _ = _weighted(x_t - tt * negative, x0)
        r = optimality(adv, self.adv_clip)
        policy = self.adv_clip * (r * l_pos + (1 - r) * l_neg) / b
        kl = _mean((v - v_ref.float()).double().pow(2)) if self.kl_weight > 0 else None
        loss = policy + self.kl_weight * kl if kl is not None else policy
        return loss.sum(), self._stats(loss, policy, kl, l_pos, l_neg, r, v, v_old)

    @torch.no_grad()
    def _stats(self, loss, policy, kl, l_pos, l_neg, r, v, v_old) -> Tensor:
        zero = torch.zeros((), dtype=torch.float64, device=loss.device)
        values = (loss.detach().sum(), policy.detach().sum(), kl.detach().sum() if kl is not None else zero,
                  l_pos.detach().sum(), l_neg.detach().sum(), r.sum(), _mean((v.detach() - v_old).pow(2)).sum())
        return torch.stack([x.double() for x in values])
