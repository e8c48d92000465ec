"""Flow-DPPO (arXiv 2606.11025; VeRL-Omni verl_omni/trainer/diffusion/diffusion_algos.py `FlowDPPOLoss`,
lines 361-443 at commit a1139baf, and docs/algo/flowdppo.md; docs/ALGORITHMS.md "Flow-DPPO"):
Flow-GRPO's SDE rollout, advantages and per-step ratios, with the PPO ratio clip replaced by an
asymmetric trust-region mask. The current and the rollout policy share a step's variance, so their
divergence at step t is the Gaussian KL between their transition means:

    D_t = mean((mu_theta - mu_old)^2) / (2 sigma_t^2),  sigma_t = std_dev_t sqrt(sigma - sigma')
          (--add-kl-coefficient, the default; --no-add-kl-coefficient: mean((mu_theta - mu_old)^2) / 2)
    masked = D_t >= eps_D and (A > 0 and r > 1  or  A < 0 and r < 1)          (eps_D: --kl-mask-threshold)
    loss   = -A r where not masked, 0 where masked,  r = exp(log p_theta - log p_old)

so an update is dropped only when it is outside the trust region and still moving away from the
rollout policy; corrective updates stay. mu_old is the rollout's own transition mean: the rollout
records it at every step (`SamplingConfig.record`) and the fragments carry it beside the path.
std_dev_t is the step's (sampler.StepOutput), for `sde` Flow-GRPO's a sqrt(sigma / (1 - sigma)), so
sigma_t is the transition's std there. A KL term to the reference (--beta, --kl-form) is Flow-GRPO's.
Trained: Flow-GRPO's first int(K x fraction) steps, or with --sde-window START:END the window alone
(the SDE there, the ODE elsewhere), as VeRL-Omni's published run trains a window of 2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rl import timesteps
from rl.algorithms.algorithm import Algorithm, Cost, LossTerms, replace
from rl.algorithms.fields import flag
from rl.loss import KL_FORMS, kl_to_reference

RECORDED = "mean"
"""the StepOutput field the rollout records at every step: the transition's mean"""


def divergence(mean: Tensor, rollout_mean: Tensor, std_dev_t: Tensor, sqrt_dt: Tensor, scaled: bool = True) -> Tensor:
    """D_t of each transition (n,): the mean over the latent of (mu_theta - mu_old)^2 / (2 sigma_t^2),
    sigma_t = std_dev_t sqrt_dt (`scaled`), or of (mu_theta - mu_old)^2 / 2."""
    sq = (mean - rollout_mean).pow(2)
    if scaled:
        sigma_t = (std_dev_t.reshape(-1) * sqrt_dt.reshape(-1)).reshape(-1, *([1] * (sq.dim() - 1)))
        per = sq / (2 * sigma_t.pow(2))
    else:
        per = sq / 2
    return per.reshape(per.shape[0], -1).mean(dim=1)


def masked_policy_loss(log_prob: Tensor, logp_old: Tensor, adv: Tensor, kl_old: Tensor,
                       threshold: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per transition: -A r where the mask keeps it, 0 where it drops it. `adv` (n,) or (n, R): with
    R columns (one per reward) each column is masked by its own sign and the terms are summed.
    Returns (loss (n,), ratio (n,), dropped for A > 0 (n, R) bool, dropped for A < 0 (n, R) bool)."""
    ratio = torch.exp(log_prob - logp_old)
    a = adv.reshape(adv.shape[0], -1)
    r = ratio.unsqueeze(1)
    high = (kl_old >= threshold).unsqueeze(1)
    positive = high & (r > 1.0) & (a > 0)
    negative = high & (r < 1.0) & (a < 0)
    loss = torch.where(~(positive | negative), -a * r, torch.zeros((), dtype=r.dtype, device=r.device))
    return loss.sum(dim=1), ratio, positive, negative


class MaskedPolicyLoss:
    """Flow-DPPO's masked objective plus beta x KL to the reference, as the trainer's loss object:
    `__call__` returns the policy terms' weighted sum, beta x the KL terms' sum (None when beta is 0)
    and a float64 vector of per-transition sums of `STATS`, kept on the device."""

    STATS = ("loss", "policy_loss", "kl", "approx_kl", "divergence", "divergence_high", "masked", "masked_positive",
             "masked_negative", "ratio")
    SUMMARY = ("divergence", "masked")
    """divergence: D_t, to the rollout policy; divergence_high: D_t >= the threshold; masked: dropped"""

    def __init__(self, threshold: float, scaled: bool, beta: float, kl_form: str = KL_FORMS[0]):
        self.threshold, self.scaled, self.beta, self.kl_form = threshold, scaled, beta, kl_form

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    @property
    def unscaled_term(self) -> bool:
        return self.beta > 0

    def __call__(self, log_prob: Tensor, logp_old: Tensor, adv: Tensor, *, mean: Tensor, std_dev_t: Tensor,
                 rollout_mean: Tensor, sqrt_dt: Tensor, weight: Tensor | None = None, counted: Tensor | None = None,
                 mean_ref: Tensor | None = None, std: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
        """As rl.loss.ClippedPolicyLoss, with the rollout's transition means and sqrt(sigma - sigma')."""
        ones = torch.ones_like(log_prob)
        w = ones if weight is None else weight.to(log_prob.dtype)
        c = ones if counted is None else counted.to(log_prob.dtype)
        kl_old = divergence(mean.detach(), rollout_mean.to(mean.dtype), std_dev_t, sqrt_dt, self.scaled)
        policy, ratio, positive, negative = masked_policy_loss(log_prob, logp_old, adv, kl_old, self.threshold)
        kl = None
        if self.beta > 0:
            kl = kl_to_reference(mean, mean_ref, std_dev_t if self.kl_form == KL_FORMS[0] else std) * c
        kl_term = self.beta * kl.sum() if kl is not None else None
        with torch.no_grad():
            d = (log_prob - logp_old).detach()
            dropped_pos, dropped_neg = positive.any(dim=1).float(), negative.any(dim=1).float()
            p = (policy * w).detach().sum()
            k = kl.detach().sum() if kl is not None else torch.zeros((), device=p.device)
            high = (kl_old >= self.threshold).float()
            values = (p + self.beta * k, p, k, (0.5 * d.pow(2) * c).sum(), (kl_old * c).sum(), (high * c).sum(),
                      (torch.maximum(dropped_pos, dropped_neg) * c).sum(), (dropped_pos * c).sum(),
                      (dropped_neg * c).sum(), (ratio.detach() * c).sum())
            stats = torch.stack([v.double() for v in values])
        return (policy * w).sum(), kl_term, stats

    def rescale(self, sums: Tensor, scale: float) -> Tensor:
        """The step's statistic sums once its policy term is scaled by `scale` (the global std's
        1 / (std + eps): the mask depends on the advantages' signs only); the KL term is not scaled."""
        out = sums.clone()
        i, k = self.STATS.index("policy_loss"), self.STATS.index("kl")
        out[i] *= scale
        out[self.STATS.index("loss")] = out[i] + self.beta * out[k]
        return out


@dataclass
class RLOptions:
    """Flow-DPPO's own flags of the [rl] section."""

    kl_mask_threshold: float = flag(1e-5, "Flow-DPPO: an update is dropped where the KL D_t between the current "
                                          "and the rollout transition reaches this and the ratio moves away from "
                                          "the rollout (VeRL-Omni: 1e-5)")
    add_kl_coefficient: bool = flag(True, "Flow-DPPO: D_t divides the squared mean drift by 2 (std_dev_t "
                                          "sqrt(-dt))^2, the step's SDE variance (VeRL-Omni's add_kl_coefficient); "
                                          "off: by 2")


class FlowDPPO(Algorithm):
    name = "flow_dppo"
    description = ("Flow-DPPO: Flow-GRPO with the ratio clip replaced by a trust-region mask on the KL to the "
                   "rollout's transition (--kl-mask-threshold)")
    flags = {"rl": RLOptions}
    options = ("sampling.sde_window",)
    std_mode = "global"

    def check_flags(self, cfg):
        t = cfg.rl.kl_mask_threshold
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"--kl-mask-threshold must be a finite number > 0, got {t}")

    def check_steps(self, cfg, num_steps):
        window = cfg.sampling.sde_window
        if window is not None and not window[1] <= num_steps:
            raise ValueError(f"--sde-window {window[0]}:{window[1]} ends after the {num_steps} sampling steps")
        super().check_steps(cfg, num_steps)

    def sampling(self, cfg, sampling):
        """Flow-GRPO's SDE rollout, recording every step's transition mean."""
        return replace(sampling, record=tuple(dict.fromkeys((*sampling.record, RECORDED))))

    def timesteps(self, num_steps, fraction, *, seed, step, sample_id, window=None):
        """The SDE window's steps when the rollout has one, else the first int(K x fraction)."""
        return timesteps.in_window(window) if window is not None else timesteps.first(num_steps, fraction)

    def loss(self, rl):
        return MaskedPolicyLoss(rl.kl_mask_threshold, rl.add_kl_coefficient, rl.beta, rl.kl_form)

    def policy_terms(self, loss, out, mean_ref, tr, pad):
        none = torch.zeros_like(out.log_prob)
        policy, kl, stats = loss(out.log_prob, tr.logp_old, tr.adv, weight=none if pad else tr.weight,
                                 counted=none.bool() if pad else tr.counted, mean=out.mean, mean_ref=mean_ref,
                                 std=out.std, std_dev_t=out.std_dev_t, rollout_mean=tr.steps[RECORDED],
                                 sqrt_dt=torch.sqrt(tr.sigma.float() - tr.sigma_next.float()))
        return LossTerms(policy, kl, stats)

    def cost(self, num_steps, fraction=None, window=2):
        """Flow-GRPO's, and a fragment carries the rollout's mean of every trained step."""
        trained = super().cost(num_steps, fraction, window).trained_timesteps
        return Cost(trained, carried=(2 * trained + 1, trained))
