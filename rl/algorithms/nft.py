"""DiffusionNFT (arXiv 2509.16117; NVlabs/DiffusionNFT scripts/train_nft_sd3.py at commit 24af555,
docs/ALGORITHMS.md "DiffusionNFT"): a flow-matching loss on the forward process, trained on clean
samples noised at chosen times, weighted by each sample's reward and contrasted against the old
policy, a frozen copy of the weights the generators sample with (rl/algorithms/old_policy.py). No
log-probabilities, no trajectories: the rollout is the ODE (unless --noise-level says otherwise) and
a fragment carries each sample's clean latent only.

The loss (train_nft_sd3.py:908-970). For a clean sample x0, noise eps, time t and
x_t = (1 - t) x0 + t eps, with the trained policy's velocity v (gradient) and the old policy's
v_old (none):

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

import dataclasses

import torch
from torch import Tensor

from rl import sampler, timesteps
from rl.algorithms import old_policy
from rl.algorithms.algorithm import Algorithm, Cost, LossTerms, replace
from rl.seeding import forward_noise

WEIGHT_MIN = 1e-5
"""the floor of the adaptive weights w+- (NFT train_nft_sd3.py:944)"""


def optimality(adv: Tensor, adv_clip: float) -> Tensor:
    """r = 1/2 + 1/2 clip(A / c, -1, 1): NFT's (clamp(A, -c, c) / c) / 2 + 1/2, clamped to [0, 1]."""
    return (adv.double().clamp(-adv_clip, adv_clip) / adv_clip / 2 + 0.5).clamp(0.0, 1.0)


def noised_samples(x0: Tensor, sigma: Tensor, sample_ids: list[int], steps: list[int], seed: int, step: int) -> Tensor:
    """x_t = (1 - sigma) x0 + sigma eps of each transition, eps keyed by (seed, step, sample, t)
    (rl.seeding.forward_noise), so every trainer and placement noises a clean sample alike."""
    eps = torch.stack([forward_noise(seed, step, i, t, tuple(x0.shape[1:]))
                       for i, t in zip(sample_ids, steps)]).to(x0.device)
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
    """DiffusionNFT's forward-process loss as the trainer's loss object: `__call__` returns the sum of
    the transitions' losses and a float64 vector of per-transition sums of `STATS`, kept on the device."""

    STATS = ("loss", "policy_loss", "kl", "positive_loss", "negative_loss", "optimality", "old_deviation")
    SUMMARY = ("policy_loss", "old_deviation")
    """old_deviation: mean((v - v_old)^2), how far the trained policy has moved from the sampling one"""

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


class NFT(Algorithm):
    name = "nft"
    description = ("DiffusionNFT: ODE rollout with the old policy, a flow-matching loss on the clean samples "
                   "(--nft-beta, --old-policy-*)")
    options = ("rl.nft_beta", "rl.old_policy_decay", "rl.old_policy_interval")

    def check_flags(self, cfg):
        rl = cfg.rl
        if not (isinstance(rl.nft_beta, (int, float)) and 0 < rl.nft_beta < float("inf")):
            raise ValueError(f"--nft-beta must be a finite number > 0, got {rl.nft_beta}")
        if rl.old_policy_interval < 1:
            raise ValueError(f"--old-policy-interval must be >= 1, got {rl.old_policy_interval}")
        old_policy.schedule(rl.old_policy_decay)

    def check(self, cfg):
        if cfg.rl.std_mode == "global":
            raise ValueError(f"--std-mode global scales the gradient of a loss that is linear in the advantages' "
                             f"scale; --algorithm {self.name}'s loss is not: use --std-mode group or running")

    # ----- the rollout: the ODE with the old policy, clean samples only
    def sampling(self, cfg, sampling):
        """The ODE unless --noise-level says otherwise (NFT samples deterministically)."""
        return replace(sampling, noise_level=0.0) if cfg.sampling.noise_level is None else sampling

    def carried(self, traj):
        """The clean samples (n, 1, ...), no log-probabilities (n, 0): the trainers noise them."""
        return sampler.Trajectory(traj.latents[:, -1:].contiguous(), traj.log_probs[:, :0].contiguous(), traj.sigmas)

    # ----- training
    def timesteps(self, num_steps, fraction, *, seed, step, sample_id, window=None):
        """int(K x fraction) of all K sigmas of the schedule, seeded by (seed, step, sample)
        (train_nft_sd3.py:810-816: a permutation of the K timesteps per sample, the first
        int(K x fraction) kept): the sigmas at which the clean sample is noised."""
        return timesteps.seeded_subset(num_steps, fraction, seed=seed, step=step, sample_id=sample_id)

    def loss(self, rl):
        return NFTLoss(rl.nft_beta, rl.beta, rl.adv_clip)

    def forward(self, loss, model, tr, state, pad=False):
        """Each transition's clean sample x0 noised at its sigma with the noise keyed by (seed, step,
        sample, t), x_t = (1 - sigma) x0 + sigma eps; the old policy's and the reference's velocities
        without gradient (before the trained forward: the old policy's exchange writes the parameters
        in place), then the trained policy's. Every row weighs 1 (the global std, whose corrections
        weigh otherwise, is refused)."""
        x0 = tr.x_t.float()
        noised = dataclasses.replace(tr, x_t=noised_samples(x0, tr.sigma, tr.sample_ids, tr.timesteps,
                                                            model.cfg.seed, tr.step))
        with torch.no_grad(), state.swapped():
            v_old = model.velocity(noised, noised.x_t)
        v_ref = model.reference_velocity(noised, noised.x_t) if loss.needs_reference else None
        v = model.velocity(noised, noised.x_t)
        policy, stats = loss(x0, noised.x_t, tr.sigma, v, v_old, tr.adv, v_ref)
        return LossTerms(policy * (not pad), None, stats)

    # ----- the old policy: what the trainers keep, update and publish
    def trainer_state(self, cfg, params):
        return old_policy.OldPolicy(params, old_policy.schedule(cfg.rl.old_policy_decay), cfg.rl.old_policy_interval)

    def after_update(self, state, updates):
        state.after_update(updates)  # the soft update, after the optimizer's

    def sampling_policy(self, state):
        return state.swapped()

    def sampled_tensors(self, state):
        return state.tensors

    def cost(self, num_steps, fraction=None, window=2):
        """floor(0.99 K) of the K sigmas, the old policy's forward per transition and its float32 copy
        of the trained weights, clean samples on the wire."""
        return Cost(timesteps.count(num_steps, 0.99 if fraction is None else fraction), frozen_forwards=1,
                    state_copies=(("old policy", 1),), carried=(1, 0))
