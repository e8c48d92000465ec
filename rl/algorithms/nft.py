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
from dataclasses import dataclass

import torch
from torch import Tensor

from rl import sampler, timesteps
from rl.algorithms import old_policy
from rl.algorithms.algorithm import Algorithm, Cost, LossTerms, replace
from rl.algorithms.fields import flag
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


ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")
"""--adv-mode: NFT's config.train.adv_mode (train_nft_sd3.py:915-925); all: the clipped advantage itself"""


def mode_advantage(adv: Tensor, mode: str) -> Tensor:
    """NFT's adv_mode on an advantage (train_nft_sd3.py:915-925): all of it, its positive or negative
    part, 1 where positive (else 0), or its sign. The first three are positively homogeneous (a
    positive scale of the advantages scales them); one_only and binary do not depend on the scale."""
    if mode == "positive_only":
        return adv.clamp(min=0)
    if mode == "negative_only":
        return adv.clamp(max=0)
    if mode == "one_only":
        return (adv > 0).to(adv.dtype)
    if mode == "binary":
        return torch.sign(adv)
    return adv


class NFTLoss:
    """DiffusionNFT's forward-process loss as the trainer's loss object. The loss is affine in the
    advantage A (below the clamp): with l+- the adaptive-weighted errors of the implicit policies,

        c (r l+ + (1 - r) l-) / b  =  c (l+ + l-) / (2 b)  +  A (l+ - l-) / (2 b),    r = 1/2 + A / (2 c),

    so `__call__` returns the term linear in A (weighted per row, what the global std scales at the
    step's end: rl/gradients.py), the rest (the constant part and lambda x KL, counted rows only) and a
    float64 vector of per-transition sums of `STATS`, kept on the device. With adv_mode one_only or
    binary the advantage's scale does not matter, so all of the loss is in the rest."""

    STATS = ("loss", "policy_loss", "kl", "positive_loss", "negative_loss", "optimality", "old_deviation",
             "policy_linear", "optimality_linear")
    SUMMARY = ("policy_loss", "old_deviation")
    """old_deviation: mean((v - v_old)^2), how far the trained policy has moved from the sampling one;
    policy_linear, optimality_linear: the parts of policy_loss and optimality the global std scales"""

    def __init__(self, nft_beta: float, kl_weight: float, adv_clip: float, adv_mode: str = "all"):
        if not nft_beta > 0:
            raise ValueError(f"--nft-beta must be > 0, got {nft_beta}")
        if adv_mode not in ADV_MODES:
            raise ValueError(f"unknown --adv-mode {adv_mode!r}; choose one of {ADV_MODES}")
        self.nft_beta, self.kl_weight, self.adv_clip, self.adv_mode = nft_beta, kl_weight, adv_clip, adv_mode

    @property
    def needs_reference(self) -> bool:
        return self.kl_weight > 0

    @property
    def unscaled_term(self) -> bool:
        return True  # c (l+ + l-) / (2 b)

    def __call__(self, x0: Tensor, x_t: Tensor, t: Tensor, v: Tensor, v_old: Tensor, adv: Tensor,
                 v_ref: Tensor | None = None, weight: Tensor | None = None,
                 counted: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x0, x_t, v, v_old (and v_ref with a KL weight): (n, *latent); t, adv: (n,); `weight` (n,)
        of each row's linear term, `counted` (n,) bool: the row carries the rest and its statistics
        (default: every row weighs 1 and counts; a correction of the step's end weighs otherwise and
        does not count). Returns (linear term, the rest, statistics)."""
        b, c = self.nft_beta, self.adv_clip
        v, v_old = v.float(), v_old.detach().float()
        tt = _bcast(t.float(), x_t)
        positive = b * v + (1 - b) * v_old
        negative = (1 + b) * v_old - b * v
        l_pos, _ = _weighted(x_t - tt * positive, x0)
        l_neg, _ = _weighted(x_t - tt * negative, x0)
        ones = torch.ones_like(l_pos)
        w = ones if weight is None else weight.to(l_pos.dtype)
        n = ones if counted is None else counted.to(l_pos.dtype)
        a = mode_advantage(adv.double(), self.adv_mode)
        if self.adv_mode in ("one_only", "binary"):  # no scale to apply: the whole loss, as NFT writes it
            r = optimality(a, c)
            rest, linear, r_linear = c * (r * l_pos + (1 - r) * l_neg) / b, 0 * (l_pos - l_neg), r - 0.5
        else:
            rest, linear, r_linear = c * (l_pos + l_neg) / (2 * b), a * (l_pos - l_neg) / (2 * b), a / (2 * c)
        kl = _mean((v - v_ref.float()).double().pow(2)) if self.kl_weight > 0 else None
        unscaled = rest + self.kl_weight * kl if kl is not None else rest
        stats = self._stats(rest * n + linear * w, linear * w, kl, l_pos, l_neg, r_linear, v, v_old, n)
        return (linear * w).sum(), (unscaled * n).sum(), stats

    @torch.no_grad()
    def _stats(self, policy, linear, kl, l_pos, l_neg, r_linear, v, v_old, n) -> Tensor:
        zero = torch.zeros((), dtype=torch.float64, device=policy.device)
        k = (kl.detach() * n).sum() if kl is not None else zero
        p = policy.detach().sum()
        values = (p + self.kl_weight * k, p, k, (l_pos.detach() * n).sum(), (l_neg.detach() * n).sum(),
                  ((0.5 + r_linear) * n).sum(), (_mean((v.detach() - v_old).pow(2)) * n).sum(),
                  linear.detach().sum(), (r_linear * n).sum() * (self.adv_mode not in ("one_only", "binary")))
        return torch.stack([x.double() for x in values])

    def rescale(self, sums: Tensor, scale: float) -> Tensor:
        """The statistics once the linear term is scaled by `scale` (the global std's 1 / (std + eps))."""
        out = sums.clone()
        i = {name: j for j, name in enumerate(self.STATS)}
        for total, part in (("policy_loss", "policy_linear"), ("optimality", "optimality_linear")):
            out[i[total]] += (scale - 1) * sums[i[part]]
            out[i[part]] *= scale
        out[i["loss"]] = out[i["policy_loss"]] + self.kl_weight * out[i["kl"]]
        return out


@dataclass
class RLOptions:
    """DiffusionNFT's own flags of the [rl] section."""

    nft_beta: float = flag(1.0, "DiffusionNFT: strength beta of the implicit positive and negative policies "
                                "(NFT: 1.0 for GenEval, PickScore, HPSv2; 0.1 for OCR and the multi-reward run)")
    old_policy_decay: str = flag("linear_to_0_5", "DiffusionNFT: the old policy's soft update old <- d old + (1-d) "
                                                  "theta after update u: copy (d=0), linear_to_0_5 (d=min(0.001 u, "
                                                  "0.5), NFT's default), delayed_linear_to_0_999 (NFT's OCR run) or "
                                                  "FLAT:UPRATE:UPHOLD (d=0 before FLAT, then "
                                                  "min((u-FLAT) UPRATE, UPHOLD))")
    old_policy_interval: int = flag(1, "DiffusionNFT: optimizer updates between soft updates of the old policy")
    adv_mode: str = flag("all", "DiffusionNFT: the advantage the loss weighs by (adv_mode): all, positive_only, "
                                "negative_only, one_only (1 where positive, else 0) or binary (its sign)")


class NFT(Algorithm):
    name = "nft"
    description = ("DiffusionNFT: ODE rollout with the old policy, a flow-matching loss on the clean samples "
                   "(--nft-beta, --old-policy-*)")
    flags = {"rl": RLOptions}
    std_mode = "global"  # global_std=True in every NFT config: the std of all of the epoch's rewards

    def check_flags(self, cfg):
        rl = cfg.rl
        if not (isinstance(rl.nft_beta, (int, float)) and 0 < rl.nft_beta < float("inf")):
            raise ValueError(f"--nft-beta must be a finite number > 0, got {rl.nft_beta}")
        if rl.old_policy_interval < 1:
            raise ValueError(f"--old-policy-interval must be >= 1, got {rl.old_policy_interval}")
        old_policy.schedule(rl.old_policy_decay)
        if rl.adv_mode not in ADV_MODES:
            raise ValueError(f"unknown --adv-mode {rl.adv_mode!r}; choose one of {ADV_MODES}")

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
        return NFTLoss(rl.nft_beta, rl.beta, rl.adv_clip, rl.adv_mode)

    def forward(self, loss, model, tr, state, pad=False):
        """Each transition's clean sample x0 noised at its sigma with the noise keyed by (seed, step,
        sample, t), x_t = (1 - sigma) x0 + sigma eps; the old policy's and the reference's velocities
        without gradient (before the trained forward: the old policy's exchange writes the parameters
        in place), then the trained policy's. A row's linear term weighs its weight (the global std's
        corrections at the step's end weigh otherwise and carry nothing else); padding trains nothing."""
        x0 = tr.x_t.float()
        noised = dataclasses.replace(tr, x_t=noised_samples(x0, tr.sigma, tr.sample_ids, tr.timesteps,
                                                            model.cfg.seed, tr.step))
        with torch.no_grad(), state.swapped():
            v_old = model.velocity(noised, noised.x_t)
        v_ref = model.reference_velocity(noised, noised.x_t) if loss.needs_reference else None
        v = model.velocity(noised, noised.x_t)
        none = torch.zeros_like(tr.sigma, dtype=torch.float32)
        linear, rest, stats = loss(x0, noised.x_t, tr.sigma, v, v_old, tr.adv, v_ref,
                                   weight=none if pad else tr.weight, counted=none.bool() if pad else tr.counted)
        return LossTerms(linear, rest, stats)

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
