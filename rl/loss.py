"""The policy loss of a batch of transitions and its statistics, as one object (docs/ALGORITHMS.md,
"Loss"). The trainer sums it over forwards and the step log shows its statistics by the names the
object gives them, so a new loss brings its own statistics without touching either."""
from __future__ import annotations

import torch
from torch import Tensor


def clipped_policy_loss(logp_new: Tensor, logp_old: Tensor, adv: Tensor, clip_range: float) -> tuple[Tensor, Tensor]:
    """Per transition: max(-A r, -A clip(r, 1-eps, 1+eps)), r = exp(logp_new - logp_old). Returns (loss, ratio)."""
    ratio = torch.exp(logp_new - logp_old)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped), ratio


def kl_to_reference(mean: Tensor, mean_ref: Tensor, std: Tensor) -> Tensor:
    """Per transition: mean over dims of (mean_theta - mean_ref)^2 / (2 std^2) (Flow-GRPO)."""
    sq = (mean - mean_ref).pow(2).reshape(mean.shape[0], -1).mean(dim=1)
    return sq / (2 * std.pow(2))


class ClippedPolicyLoss:
    """The clipped surrogate of Flow-GRPO and DanceGRPO plus beta x KL to the reference policy.

    `__call__` returns the sum of the transitions' losses (what backward runs on) and a float64
    vector of per-transition sums of the statistics in `STATS` order, kept on the device: the
    trainer adds them up and reads them once per step, so no forward waits for the host."""

    STATS = ("loss", "policy_loss", "kl", "approx_kl", "clipfrac", "clipfrac_high", "clipfrac_low", "ratio")
    SUMMARY = ("approx_kl", "clipfrac")
    """the statistics the step's summary line shows beside the loss"""
    forward_process = False
    """replays stored transitions (rl/nft.py's loss trains clean samples instead)"""

    def __init__(self, clip_range: float, beta: float):
        self.clip_range, self.beta = clip_range, beta

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    def __call__(self, log_prob: Tensor, logp_old: Tensor, adv: Tensor, mean: Tensor | None = None,
                 mean_ref: Tensor | None = None, std: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Transitions' new and old log-probs and advantages (n,); with beta > 0 also the step's
        mean, the reference step's mean and the step's std."""
        policy, ratio = clipped_policy_loss(log_prob, logp_old, adv, self.clip_range)
        loss, kl = policy, None
        if self.beta > 0:
            kl = kl_to_reference(mean, mean_ref, std)
            loss = loss + self.beta * kl
        return loss.sum(), self._stats(loss, policy, ratio, log_prob, logp_old, kl)

    @torch.no_grad()
    def _stats(self, loss, policy, ratio, logp_new, logp_old, kl) -> Tensor:
        eps = self.clip_range
        d = (logp_new - logp_old).detach()
        zero = torch.zeros((), device=loss.device)
        values = (loss.detach().sum(), policy.detach().sum(), kl.detach().sum() if kl is not None else zero,
                  (0.5 * d.pow(2)).sum(), ((ratio - 1).abs() > eps).float().sum(), (ratio > 1 + eps).float().sum(),
                  (ratio < 1 - eps).float().sum(), ratio.detach().sum())
        return torch.stack([v.double() for v in values])
