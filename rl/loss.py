"""The policy loss of a batch of transitions and its statistics, as one object (docs/ALGORITHMS.md,
"Loss"). The trainer sums it over forwards and the step log shows its statistics by the names the
object gives them, so a new loss brings its own statistics without touching either."""
from __future__ import annotations

import torch
from torch import Tensor

KL_FORMS = ("flow_grpo", "transition")
"""--kl-form: Flow-GRPO's divisor (the first, the default) or the transition's std"""


def clipped_policy_loss(logp_new: Tensor, logp_old: Tensor, adv: Tensor, clip_range: float) -> tuple[Tensor, Tensor]:
    """Per transition: max(-A r, -A clip(r, 1-eps, 1+eps)), r = exp(logp_new - logp_old)
    (Flow-GRPO train_sd3.py:886-893, DanceGRPO train_grpo_flux.py:589-603). `adv` (n,) or (n, R):
    with R columns (one per reward, DanceGRPO train_grpo_hunyuan.py:450-477) the clipped terms of
    the columns are summed. Returns (loss (n,), ratio (n,))."""
    ratio = torch.exp(logp_new - logp_old)
    a = adv.reshape(adv.shape[0], -1)
    r = ratio.unsqueeze(1)
    unclipped = -a * r
    clipped = -a * torch.clamp(r, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped).sum(dim=1), ratio


def kl_to_reference(mean: Tensor, mean_ref: Tensor, std: Tensor) -> Tensor:
    """Per transition: mean over dims of (mean_theta - mean_ref)^2 / (2 std^2). With Flow-GRPO's
    std_dev_t (the step's std without sqrt(-dt)) this is its KL term (train_sd3.py:895-896); with
    the transition std it is the exact KL between the two steps' Gaussian transition densities."""
    sq = (mean - mean_ref).pow(2).reshape(mean.shape[0], -1).mean(dim=1)
    return sq / (2 * std.pow(2))


class ClippedPolicyLoss:
    """The clipped surrogate of Flow-GRPO and DanceGRPO plus beta x KL to the reference policy.

    `__call__` returns the weighted sum of the transitions' policy terms, beta x the sum of their KL
    terms (None when beta is 0) and a float64 vector of per-transition sums of the statistics in
    `STATS` order, kept on the device: the trainer adds them up and reads them once per step, so no
    forward waits for the host. The trainer keeps the two terms' gradients apart when the policy
    term's scale is known only at the end of the step (docs/ALGORITHMS.md, "Global std")."""

    STATS = ("loss", "policy_loss", "kl", "approx_kl", "clipfrac", "clipfrac_high", "clipfrac_low", "ratio")
    SUMMARY = ("approx_kl", "clipfrac")
    """the statistics the step's summary line shows beside the loss"""

    def __init__(self, clip_range: float, beta: float, kl_form: str = "flow_grpo"):
        if kl_form not in KL_FORMS:
            raise ValueError(f"unknown --kl-form {kl_form!r}; choose one of {KL_FORMS}")
        self.clip_range, self.beta, self.kl_form = clip_range, beta, kl_form

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    def __call__(self, log_prob: Tensor, logp_old: Tensor, adv: Tensor, *, weight: Tensor | None = None,
                 counted: Tensor | None = None, mean: Tensor | None = None, mean_ref: Tensor | None = None,
                 std: Tensor | None = None, std_dev_t: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
        """Transitions' new and old log-probs and advantages (n,); `weight` (n,) of each policy term
        (default 1; 0 pads, a correction weighs otherwise); `counted` (n,) bool: the transition
        carries its KL term and its statistics (default all; a correction adds only its weighted
        policy term). With beta > 0 also the step's mean, the reference step's mean and the step's
        transition std and std_dev_t (sampler.StepOutput), of which `kl_form` picks the divisor."""
        ones = torch.ones_like(log_prob)
        w = ones if weight is None else weight.to(log_prob.dtype)
        c = ones if counted is None else counted.to(log_prob.dtype)
        policy, ratio = clipped_policy_loss(log_prob, logp_old, adv, self.clip_range)
        kl = None
        if self.beta > 0:
            kl = kl_to_reference(mean, mean_ref, std_dev_t if self.kl_form == "flow_grpo" else std) * c
        policy_sum = (policy * w).sum()
        kl_term = self.beta * kl.sum() if kl is not None else None
        return policy_sum, kl_term, self._stats(policy * w, ratio, log_prob, logp_old, kl, c)

    @torch.no_grad()
    def _stats(self, policy, ratio, logp_new, logp_old, kl, counted) -> Tensor:
        eps = self.clip_range
        d = (logp_new - logp_old).detach()
        zero = torch.zeros((), device=policy.device)
        p = policy.detach().sum()
        k = kl.detach().sum() if kl is not None else zero
        values = (p + self.beta * k, p, k, (0.5 * d.pow(2) * counted).sum(),
                  (((ratio - 1).abs() > eps).float() * counted).sum(), ((ratio > 1 + eps).float() * counted).sum(),
                  ((ratio < 1 - eps).float() * counted).sum(), (ratio.detach() * counted).sum())
        return torch.stack([v.double() for v in values])

    def rescale(self, sums: Tensor, scale: float) -> Tensor:
        """The step's statistic sums once its policy term is scaled by `scale` (the global std's
        1 / (std + eps)); the KL term is not scaled."""
        out = sums.clone()
        i, k = self.STATS.index("policy_loss"), self.STATS.index("kl")
        out[i] *= scale
        out[self.STATS.index("loss")] = out[i] + self.beta * out[k]
        return out
