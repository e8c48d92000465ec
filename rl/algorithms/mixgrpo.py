"""MixGRPO (arXiv 2507.21802; Tencent-Hunyuan/MixGRPO fastvideo/utils/grpo_states.py
at commit e5cdd6a, docs/ALGORITHMS.md "MixGRPO"): a sliding window, the denoising steps that run
the SDE and are trained move along the schedule as training proceeds; every other step is an ODE step.

MixGRPO keeps a start `cur` (0 at first) and after every training step counts it on: every
`interval` steps (iters_per_group) `cur` moves by `stride` (prog_overlap_step); past the last start
`K - 2` (max_timesteps = sampling_steps - 2) it rolls back to 0 (--roll_back, the default scripts)
or stays there (clamp). Step s trains range(cur, min(cur + size, K - 2)), taken before the count.
That is a closed form of s, so every rank and the planner compute a step's window alone:

    progressive:        cur(s) = (s // interval mod (last // stride + 1)) * stride   (stride 0: cur = 0)
    progressive-clamp:  cur(s) = min((s // interval) * stride, last)
    random:             cur(s) uniform in [0, last - size], seeded by (seed, s)  (MixGRPO's "random")

The window is empty when cur reaches K - 2 (MixGRPO trains nothing then and fails on it; here
`check_steps` refuses a run whose steps reach it). MixGRPO's decay and exp_decay strategies are not
implemented (no published script uses them). Advantages and loss are Flow-GRPO's clipped surrogate
on the window's transitions (train_grpo_flux.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from rl import solvers, timesteps
from rl.algorithms.algorithm import Algorithm, Cost, replace
from rl.algorithms.fields import flag
from rl.loss import ClippedPolicyLoss
from rl.seeding import derive_seed

WINDOW_SCHEDULES = ("progressive", "progressive-clamp", "random")


@dataclass(frozen=True)
class WindowSchedule:
    """The SDE / training window of every step of a run of K denoising steps."""

    size: int
    """steps in the window (MixGRPO group_size: 4)"""
    stride: int
    """steps the window moves at each shift (prog_overlap_step: 1; 0 freezes it, MixGRPO-Flash*)"""
    interval: int
    """training steps between shifts (iters_per_group: 25 in MixGRPO, 20 in MixGRPO-Flash)"""
    num_steps: int
    """K, the denoising steps of a sample"""
    schedule: str = "progressive"
    seed: int = 0

    def __post_init__(self):
        if self.schedule not in WINDOW_SCHEDULES:
            raise ValueError(f"unknown --window-schedule {self.schedule!r}; choose one of {WINDOW_SCHEDULES}")
        if self.size < 1 or self.interval < 1 or self.stride < 0:
            raise ValueError(f"window size {self.size} and interval {self.interval} must be >= 1, stride "
                             f"{self.stride} >= 0")
        if self.last < 1:
            raise ValueError(f"a MixGRPO window needs at least 3 sampling steps (it trains steps before K - 2), "
                             f"got {self.num_steps}")

    @property
    def last(self) -> int:
        """MixGRPO's max_timesteps, K - 2: the window never reaches the last two steps."""
        return self.num_steps - 2

    def start(self, step: int) -> int:
        """The window's first denoising step at training step `step`."""
        if self.schedule == "random":
            rng = np.random.default_rng(derive_seed(self.seed, step, "window"))
            return int(rng.integers(0, max(0, self.last - self.size) + 1))
        shifts = step // self.interval
        if self.schedule == "progressive-clamp":
            return min(shifts * self.stride, self.last)
        if self.stride == 0:
            return 0
        return (shifts % (self.last // self.stride + 1)) * self.stride

    per_sample = False
    """one window for every sample of a step"""

    def window(self, step: int, sample_id: int | None = None) -> tuple[int, int]:
        """(START, END): the steps START <= t < END run the SDE and are trained at training step `step`."""
        cur = self.start(step)
        return cur, max(cur, min(cur + self.size, self.last))

    def first_empty(self, steps: range) -> int | None:
        """The first training step of `steps` whose window is empty (None: there is none)."""
        return next((s for s in steps if self.window(s)[0] == self.window(s)[1]), None)


REARRANGES = ("none", "random", "balance")
"""--advantage-rerange: MixGRPO's advantage_rerange_strategy (null, random, balance)"""
DPM_APPLY = ("post", "all")
"""--dpm-apply: MixGRPO's dpm_apply_strategy"""


def training_order(sample_ids: list[int], adv: list[float], strategy: str, *, seed: int, step: int) -> list[int]:
    """The order MixGRPO trains a step's samples in (train_grpo_flux.py:529-539, reward_model/utils.py
    `balance_pos_neg`): as sampled (none); a permutation (random); or positives and negatives
    alternating, each shuffled, the smaller side first and the rest of the larger side after, the
    zero advantages left out (balance). MixGRPO shuffles with Python's global RNG per GPU; here by
    (seed, step), so every placement orders alike. With one update per step the order changes
    nothing but balance's dropped zeros; MixGRPO's updates take consecutive pieces of it, which
    --update-split cannot follow (the parts are fixed before the rewards), so `check` refuses a
    rerange with several updates per rollout."""
    if strategy == "none":
        return list(sample_ids)
    rng = np.random.default_rng(derive_seed(seed, step, "rerange"))
    if strategy == "random":
        return [sample_ids[j] for j in rng.permutation(len(sample_ids))]
    pos = [i for i, a in zip(sample_ids, adv) if a > 0]
    neg = [i for i, a in zip(sample_ids, adv) if a < 0]
    pos, neg = [pos[j] for j in rng.permutation(len(pos))], [neg[j] for j in rng.permutation(len(neg))]
    small, large = (pos, neg) if len(pos) < len(neg) else (neg, pos)
    return [i for pair in zip(small, large) for i in pair] + large[len(small):]


class MixGRPOLoss(ClippedPolicyLoss):
    """Flow-GRPO's clipped surrogate plus MixGRPO's kl_coeff x 1/2 (log p - log p_old)^2 per
    transition (train_grpo_flux.py:583-584), a term the advantages' scale does not touch."""

    STATS = ClippedPolicyLoss.STATS + ("kl_old",)

    def __init__(self, clip_range: float, beta: float, kl_form: str, kl_to_old: float):
        super().__init__(clip_range, beta, kl_form)
        self.kl_to_old = kl_to_old

    @property
    def unscaled_term(self) -> bool:
        return self.beta > 0 or self.kl_to_old > 0

    def __call__(self, log_prob, logp_old, adv, *, weight=None, counted=None, **kw):
        policy, kl, stats = super().__call__(log_prob, logp_old, adv, weight=weight, counted=counted, **kw)
        c = torch.ones_like(log_prob) if counted is None else counted.to(log_prob.dtype)
        old = 0.5 * (log_prob - logp_old).pow(2) * c
        if self.kl_to_old > 0:
            term = self.kl_to_old * old.sum()
            kl = term if kl is None else kl + term
        extra = self.kl_to_old * old.detach().sum().double()
        stats = torch.cat([stats[:1] + extra, stats[1:], old.detach().sum().double().reshape(1)])
        return policy, kl, stats

    def rescale(self, sums, scale):
        out = super().rescale(sums, scale)
        out[self.STATS.index("loss")] += self.kl_to_old * sums[self.STATS.index("kl_old")]
        return out


@dataclass
class SamplingOptions:
    """MixGRPO's own flags of the [sampling] section."""

    window_size: int = flag(4, "MixGRPO: steps in the sliding SDE / training window (MixGRPO: 4)")
    window_stride: int = flag(1, "MixGRPO: steps the window moves at each shift (MixGRPO: 1; 0 freezes it)")
    window_interval: int = flag(25, "MixGRPO: training steps between shifts of the window (MixGRPO: 25, Flash: 20)")
    window_schedule: str = flag("progressive", "MixGRPO: progressive (moves by the stride every interval, back to 0 "
                                               "after K-2, MixGRPO's scripts), progressive-clamp (stays at K-2) or "
                                               "random (a seeded start every step)")
    post_compress: float = flag(0.0, "MixGRPO: the steps after the window's last SDE step re-gridded to "
                                     "int((K - last) x RATIO) points (MixGRPO-Flash's dpm_post_compress_ratio: 0.4, "
                                     "Flash* 0.2; needs --schedule dance); 0 = all K steps")
    dpm_apply: str = flag("post", "MixGRPO: with a DPM --ode-solver, post (after the window only, MixGRPO-Flash) or "
                                  "all (every step, the SDE-DPM-Solver++ inside the window: dpm_apply_strategy all)")
    drop_last_sample: bool = flag(False, "MixGRPO: the sample is the last step's data prediction x - sigma v "
                                         "(drop_last_sample; equal where the schedule ends at 0)")


@dataclass
class RLOptions:
    """MixGRPO's own flags of the [rl] section."""

    trimmed_ratio: float = flag(0.0, "MixGRPO: a group's mean and std leave out its lowest int(G x RATIO) rewards "
                                     "(trimmed_ratio); 0 = none")
    kl_to_old: float = flag(0.0, "MixGRPO: adds COEF x 1/2 (log p - log p_old)^2 per trained transition (its "
                                 "kl_coeff; its scripts: 0)")
    advantage_rerange: str = flag("none", "MixGRPO: the order a step's samples are trained in: none, random or "
                                          "balance (positives and negatives alternating, zero advantages not "
                                          "trained; advantage_rerange_strategy)")


class MixGRPO(Algorithm):
    name = "mixgrpo"
    description = "MixGRPO: SDE and training only inside a window that slides along the steps (--window-*)"
    flags = {"sampling": SamplingOptions, "rl": RLOptions}
    std_ddof = 1  # torch.std, train_grpo_flux.py:445-448, 472-475
    std_eps = 1e-8
    quantize_timestep = True  # int(sigma * 1000) / 1000 in rollout and training (sampling_utils.py:64-71, :387)
    reward_combine = "advantages"  # multi_reward_mix advantage_aggr (its scripts; train_grpo_flux.py:428-456)

    def check_flags(self, cfg):
        s, rl = cfg.sampling, cfg.rl
        for flag, value, low in (("--window-size", s.window_size, 1), ("--window-stride", s.window_stride, 0),
                                 ("--window-interval", s.window_interval, 1)):
            if value < low:
                raise ValueError(f"{flag} must be >= {low}{' (0 = a fixed window)' if low == 0 else ''}, got {value}")
        if s.window_schedule not in WINDOW_SCHEDULES:
            raise ValueError(f"unknown --window-schedule {s.window_schedule!r}; choose one of {WINDOW_SCHEDULES}")
        if not 0 <= s.post_compress <= 1:
            raise ValueError(f"--post-compress must be in [0, 1] (0: off; MixGRPO-Flash 0.4, Flash* 0.2), "
                             f"got {s.post_compress}")
        if s.dpm_apply not in DPM_APPLY:
            raise ValueError(f"unknown --dpm-apply {s.dpm_apply!r}; choose one of {DPM_APPLY}")
        if not 0 <= rl.trimmed_ratio < 1:
            raise ValueError(f"--trimmed-ratio must be in [0, 1), got {rl.trimmed_ratio}")
        if not rl.kl_to_old >= 0:
            raise ValueError(f"--kl-to-old must be >= 0, got {rl.kl_to_old}")
        if rl.advantage_rerange not in REARRANGES:
            raise ValueError(f"unknown --advantage-rerange {rl.advantage_rerange!r}; choose one of {REARRANGES}")

    def check(self, cfg):
        s, rl = cfg.sampling, cfg.rl
        if s.post_compress and s.schedule != "dance":
            raise ValueError(f"--post-compress {s.post_compress} re-grids MixGRPO's own schedule (shift 3 of "
                             f"linspace(1, 0, K + 1)) after the window: add --schedule dance")
        if s.dpm_apply == "all" and s.ode_solver not in ("dpm1", "dpm2", "dpm3"):
            raise ValueError(f"--dpm-apply all takes DPM-Solver++ at every step: use --ode-solver dpm1, dpm2 or dpm3 "
                             f"(got {s.ode_solver})")
        if rl.advantage_rerange != "none" and rl.updates_per_rollout > 1:
            raise ValueError(f"--advantage-rerange {rl.advantage_rerange} orders a step's samples by their advantages, "
                             f"and MixGRPO's updates take consecutive pieces of that order; --update-split cuts the "
                             f"step before any reward is known (rl/updates.py): use --updates-per-rollout 1 or "
                             f"--advantage-rerange none")
        if rl.trimmed_ratio and int(rl.group_size * rl.trimmed_ratio) >= rl.group_size - 1:
            raise ValueError(f"--trimmed-ratio {rl.trimmed_ratio} leaves fewer than 2 of the {rl.group_size} rewards "
                             f"of a group for its std")

    def check_steps(self, cfg, num_steps):
        """The window exists (K >= 3) and no training step of the run has an empty one (MixGRPO
        reaches one at start K - 2 and trains nothing there). It never reaches the last step. With
        --post-compress, no step's tail is compressed to a single point (MixGRPO's schedule then ends
        at a sigma above 0 and the sample keeps that noise)."""
        window = self.schedule(cfg, num_steps)
        empty = window.first_empty(range(cfg.rl.steps))
        if empty is not None:
            raise ValueError(f"the MixGRPO window is empty at step {empty} (it starts at step {window.start(empty)} "
                             f"of the {window.num_steps} sampling steps, and MixGRPO trains only steps before "
                             f"K - 2 = {window.last}): use fewer --steps, a larger --window-interval or more "
                             f"--sample-steps")
        ratio = cfg.sampling.post_compress
        short = next((k for k in range(cfg.rl.steps)
                      if ratio and solvers.post_points(num_steps, window.window(k)[1] - 1, ratio) < 2), None)
        if short is not None:
            raise ValueError(f"--post-compress {ratio} leaves one point after the window of step {short} "
                             f"({window.window(short)}), so the sample would end at a sigma above 0: use fewer "
                             f"--steps, a larger --window-interval or a larger ratio")

    @staticmethod
    def schedule(cfg, num_steps: int) -> WindowSchedule:
        """The run's sliding window over `num_steps` denoising steps (a ValueError for fewer than 3)."""
        s = cfg.sampling
        return WindowSchedule(s.window_size, s.window_stride, s.window_interval, num_steps, s.window_schedule, cfg.seed)

    def sampling(self, cfg, sampling):
        """The window; MixGRPO-Flash's compressed tail; --dpm-apply all: DPM-Solver++ at every step,
        its SDE form inside the window (sampling_utils.py:99-111); drop_last_sample."""
        s = cfg.sampling
        everywhere = s.dpm_apply == "all"
        return replace(sampling, window_schedule=self.schedule(cfg, sampling.num_steps), post_compress=s.post_compress,
                       dpm_everywhere=everywhere, sde_type="dpm" if everywhere else sampling.sde_type,
                       final_prediction=s.drop_last_sample)

    def timesteps(self, num_steps, fraction, *, seed, step, sample_id, window=None):
        """The step's window: the SDE ran there and nowhere else."""
        return timesteps.in_window(window)

    def advantages(self, rl, weights=()):
        """Flow-GRPO's rule with MixGRPO's std (Bessel + 1e-8), its trimmed group statistics, and
        balance's dropped zero advantages."""
        rule = super().advantages(rl, weights)
        return dataclasses.replace(rule, trim=rl.trimmed_ratio,
                                   drop_zero=rule.drop_zero or rl.advantage_rerange == "balance")

    def loss(self, rl):
        return MixGRPOLoss(rl.clip_range, rl.beta, rl.kl_form, rl.kl_to_old)

    def cost(self, num_steps, fraction=None, window=2):
        """The window's size (a sliding window trains as many steps as a fixed one until it shrinks
        before K - 2)."""
        return Cost(min(window, num_steps))
