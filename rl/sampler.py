"""The flow-matching sampler: pure functions shared by every role (generators, trainers, TAG helpers).

Formulas: docs/ALGORITHMS.md ("SDE step with log-probability", "CPS variant", "DanceGRPO step").
sigma runs from 1 (noise) to 0 (data); the model predicts velocity v ~ eps - x0; dt = sigma' - sigma < 0.
All step math is float32 whatever the model dtype. All noise of sample i of step k comes from
generators seeded by (seed, k, i) alone (docs/DESIGN.md section 4), so a trajectory does not depend on
which rank produced it, on its batch neighbours, or on generation order.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from torch import Tensor

from rl import solvers
from rl.seeding import initial_noise, step_noise
from rl.conditioning import Conditioning

# Adapters (models.DiTAdapter) are passed in and used through their interface only: the sampler
# imports no model family.

SDE_TYPES = ("sde", "cps", "dance", "dpm")
SCHEDULES = ("dynamic", "static", "dance")
ODE_SOLVERS = solvers.ODE_SOLVERS
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


# ----- schedules --------------------------------------------------------------------------------
def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                    base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """FLUX's resolution-dependent shift mu (diffusers' pipelines compute it the same way)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def flow_scheduler(adapter: "DiTAdapter") -> FlowMatchEulerDiscreteScheduler:
    """A fresh FlowMatchEuler scheduler with the family's config (families whose pipeline ships
    another solver, e.g. Wan's UniPC, get FlowMatchEuler with the family's static shift)."""
    sched = adapter.pipe.scheduler
    if isinstance(sched, FlowMatchEulerDiscreteScheduler):
        return FlowMatchEulerDiscreteScheduler.from_config(sched.config)
    return FlowMatchEulerDiscreteScheduler(shift=adapter.static_shift or 1.0)


def make_sigmas(scheduler: FlowMatchEulerDiscreteScheduler, num_steps: int, schedule: str,
                image_seq_len: int | None = None, shift: float | None = None) -> Tensor:
    """sigmas [K+1] float32 ending in 0 (docs/ALGORITHMS.md, "Timestep schedules"): diffusers'
    scheduler's, or DanceGRPO's own.

    dynamic: linspace(1, 1/K, K) shifted by mu(image_seq_len) (FLUX, Qwen-Image pipelines);
    static:  the scheduler's own K-step schedule with a static shift (SD3, Wan, HunyuanVideo);
    dance:   DanceGRPO's linspace(1, 0, K+1) with a static shift, in float32 as DanceGRPO computes it
             without a scheduler (train_grpo_flux.py:127-128, 311-313): a float64 shift rounds one
             sigma of K=50 the other way, and int(sigma * 1000) with it.
    """
    if num_steps < 1:
        raise ValueError(f"number of sampling steps must be >= 1, got {num_steps}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
    config = dict(scheduler.config)
    if schedule == "dance":
        s = float(config.get("shift", 1.0) if shift is None else shift)
        t = torch.linspace(1, 0, num_steps + 1, dtype=torch.float32)
        return s * t / (1 + (s - 1) * t)
    if schedule == "dynamic":
        if image_seq_len is None:
            raise ValueError("the dynamic schedule needs image_seq_len")
        sched = FlowMatchEulerDiscreteScheduler.from_config({**config, "use_dynamic_shifting": True})
        mu = calculate_shift(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        sched.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps), mu=mu)
    else:
        overrides = {"use_dynamic_shifting": False}
        if shift is not None:
            overrides["shift"] = shift
        sched = FlowMatchEulerDiscreteScheduler.from_config({**config, **overrides})
        sched.set_timesteps(num_inference_steps=num_steps)
    sigmas = sched.sigmas.to(torch.float32).cpu()
    if sigmas.shape != (num_steps + 1,) or sigmas[-1] != 0:
        raise RuntimeError(f"the scheduler gave sigmas {sigmas.tolist()} for {num_steps} steps")
    return sigmas


def check_schedule(config: dict, num_steps: int, image_seq_len: int) -> None:
    """The dynamic schedule of a sample of `image_seq_len` image tokens is one a run can sample
    with: diffusers' time shift exp(mu) / (exp(mu) + (1 / t - 1)) stays finite (mu grows with the
    tokens: beyond about 4M of FLUX's, exp(mu) overflows) and the sigmas fall at every step in
    float32 (a large mu saturates them at 1, and a step of zero length trains nothing). ValueError
    saying which otherwise (the caller names the sample's size and where it came from)."""
    mu = calculate_shift(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                         config.get("base_shift", 0.5), config.get("max_shift", 1.15))
    try:
        with warnings.catch_warnings():  # numpy's warning of the cast this check reports
            warnings.simplefilter("ignore", RuntimeWarning)
            sigmas = make_sigmas(FlowMatchEulerDiscreteScheduler.from_config(config), num_steps, "dynamic",
                                 image_seq_len)
    except (OverflowError, RuntimeError) as e:
        raise ValueError(f"its timestep shift overflows at {image_seq_len} image tokens (mu = {mu:.4g}: {e})") from None
    shown = ", ".join(f"{x:.4g}" for x in sigmas.tolist()[:6]) + (", ..." if len(sigmas) > 6 else "")
    if not bool(torch.isfinite(sigmas).all()):
        raise ValueError(f"its timestep shift overflows float32 at {image_seq_len} image tokens (mu = {mu:.4g}, "
                         f"exp(mu) = inf): sigmas [{shown}]")
    if not bool((sigmas[1:] < sigmas[:-1]).all()):
        raise ValueError(f"its timestep schedule degenerates at {image_seq_len} image tokens: the shift mu = {mu:.4g} "
                         f"saturates the sigmas [{shown}] in float32, so steps have zero length")


# ----- one step with log-probability ------------------------------------------------------------
@dataclass
class StepOutput:
    x_next: Tensor     # (B, ...) float32, detached
    log_prob: Tensor   # (B,) float32: log p(x_next | x), averaged over non-batch dims
    mean: Tensor       # (B, ...) float32, carries the velocity's gradient
    std: Tensor        # (B,) float32 std of the Gaussian step (0 for a deterministic step)
    std_dev_t: Tensor  # (B,) float32: the std the peer's step function returns and Flow-GRPO's KL divides
    #                    by: std_t without sqrt(-dt) for sde (sd3_sde_with_logprob.py:47), the step's std for
    #                    cps (54809b5:71) and dance (train_grpo_flux.py:148)
    x0: tuple[Tensor, ...] = ()  # (B, ...) float32 x - sigma v of this step and the ones before it that a
    #                              multistep solver keeps, newest first (rl/solvers.py)


PER_SAMPLE_FIELDS = ("log_prob", "std", "std_dev_t")
"""StepOutput fields of one value per sample; the others have the latent's shape"""


def _bcast(v: Tensor | float, like: Tensor) -> Tensor:
    if isinstance(v, (int, float)):  # filled on the device: no host-to-device copy in the denoising loop
        v = torch.full((like.shape[0],), float(v), dtype=torch.float32, device=like.device)
    v = torch.as_tensor(v, dtype=torch.float32, device=like.device)
    if v.dim() == 0:
        v = v.expand(like.shape[0])
    return v.reshape(-1, *([1] * (like.dim() - 1)))


def to_device(t: Tensor, device) -> Tensor:
    """A CPU tensor on `device` without waiting for the device: drawn noise goes through pinned
    memory asynchronously (a plain copy from pageable memory synchronizes the stream)."""
    device = torch.device(device)
    if device.type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _mean_over_sample(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], -1).mean(dim=1)


def sde_step(x: Tensor, v: Tensor, sigma: Tensor | float, sigma_next: Tensor | float, *, sde_type: str,
             noise_level: float, noise: Tensor | None = None, x_next: Tensor | None = None) -> StepOutput:
    """One denoising step x -> x' and log p(x' | x) (docs/ALGORITHMS.md).

    Give `noise` to sample x' (rollout) or `x_next` to score a stored x' (training). sigma and
    sigma_next are scalars or per-sample [B] tensors (TSP packs different timesteps together).
    noise_level is Flow-GRPO's `a` (sde, cps) or DanceGRPO's eta (dance); 0 gives the Euler ODE step.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"unknown sde type {sde_type!r}; choose one of {SDE_TYPES}")
    if not (math.isfinite(noise_level) and noise_level >= 0):  # NaN compares false to everything
        raise ValueError(f"noise level must be >= 0, got {noise_level}")
    if (noise is None) == (x_next is None):
        raise ValueError("give exactly one of noise (to sample) or x_next (to score)")
    x = x.float()
    v = v.float()
    s = _bcast(sigma, x)
    s_next = _bcast(sigma_next, x)
    dt = s_next - s

    std_dev_t = None
    if noise_level == 0:
        mean = x + v * dt
        std = torch.zeros_like(s)
    elif sde_type == "sde":  # Flow-GRPO sd3_sde_with_logprob.py:47-50
        # At sigma = 1 use the next sigma in the denominator (Flow-GRPO) to avoid dividing by zero.
        std_dev_t = noise_level * torch.sqrt(s / (1 - torch.where(s == 1, s_next, s)))
        mean = x * (1 + std_dev_t**2 / (2 * s) * dt) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
        std = std_dev_t * torch.sqrt(-dt)
    elif sde_type == "cps":  # Flow-GRPO 54809b5 sd3_sde_with_logprob.py:70-74
        std = s_next * math.sin(noise_level * math.pi / 2)
        x0_hat = x - s * v
        eps_hat = x + (1 - s) * v
        mean = (1 - s_next) * x0_hat + torch.sqrt(s_next**2 - std**2) * eps_hat
    elif sde_type == "dance":  # DanceGRPO train_grpo_flux.py:141-153
        x0_hat = x - s * v
        score = -(x - (1 - s) * x0_hat) / s**2
        mean = x + dt * v - 0.5 * noise_level**2 * score * dt
        std = noise_level * torch.sqrt(-dt)
    else:  # dpm: SDE-DPM-Solver++(1), MixGRPO sampling_utils.py:421-434; the noise level only turns it on
        h = (torch.log(1 - s_next) - torch.log(s_next)) - (torch.log(1 - s) - torch.log(s))
        decay = torch.exp(-h)
        mean = (s_next / s * decay) * x + ((1 - s_next) * (1 - torch.exp(-2.0 * h))) * (x - s * v)
        std_dev_t = s_next
        std = s_next * torch.sqrt(1.0 - torch.exp(-2 * h))

    if x_next is None:
        x_next = mean + std * noise.to(device=x.device, dtype=torch.float32)
    x_next = x_next.detach().float()

    if noise_level == 0:  # the ODE step has no density: log-prob 0, whatever the batch holds
        log_prob = torch.zeros(x.shape[0], device=x.device, dtype=torch.float32)
    elif sde_type == "cps":
        # CPS's "log-prob" drops the variance and the constants (54809b5:86, 89); at sigma' = 0 its
        # std is 0 and it still scores x' against the mean, as every other row.
        log_prob = _mean_over_sample(-((x_next - mean) ** 2))
    else:  # the Gaussian log-density averaged over the sample (sd3_sde_with_logprob.py:61-68)
        log_prob = _mean_over_sample(-((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - LOG_SQRT_2PI)
    std = std.reshape(-1)
    return StepOutput(x_next=x_next, log_prob=log_prob, mean=mean, std=std,
                      std_dev_t=std if std_dev_t is None else std_dev_t.reshape(-1))


def score_rows(cfg: "SamplingConfig", x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, timesteps: list[int],
               x_next: Tensor, step: int | None = None, sample_ids: list[int] | None = None) -> StepOutput:
    """`sde_step` scoring rows at different timesteps (a TSP micro-batch) of training step `step`:
    one call per distinct noise level (a windowed sampler is deterministic outside its window, which
    may depend on the row's sample: `sample_ids`), rows put back in order."""
    ids = [None] * len(timesteps) if sample_ids is None else sample_ids
    levels = [cfg.noise_level_at(t, step, i) for t, i in zip(timesteps, ids)]
    return by_level(levels, x, lambda rows, level: sde_step(
        x if rows is None else x[rows], v if rows is None else v[rows],
        sigma if rows is None else sigma[rows], sigma_next if rows is None else sigma_next[rows],
        sde_type=cfg.sde_type, noise_level=level, x_next=x_next if rows is None else x_next[rows]))


def by_level(levels: list[float], like: Tensor, step_fn) -> StepOutput:
    """`step_fn(rows, level)` once per distinct noise level of the rows (rows None: all of them at
    one level), the outputs put back in row order."""
    if len(set(levels)) == 1:
        return step_fn(None, levels[0])
    parts, order = [], []
    for level in sorted(set(levels)):
        rows = to_device(torch.tensor([j for j, l in enumerate(levels) if l == level]), like.device)
        parts.append(step_fn(rows, level))
        order.append(rows)
    inverse = torch.argsort(torch.cat(order))
    return StepOutput(*(torch.cat([getattr(p, k) for p in parts])[inverse]
                        for k in ("x_next", "log_prob", "mean", "std", "std_dev_t")))


# ----- the denoising loop -----------------------------------------------------------------------
@dataclass
class SamplingConfig:
    """How to sample one batch; `for_adapter` fills the family's defaults."""

    height: int
    width: int
    num_steps: int
    sde_type: str = "sde"
    noise_level: float = 0.9
    """Flow-GRPO's `a` (sde, cps) or DanceGRPO's eta (dance); 0 = deterministic ODE sampling."""
    schedule: str = "dynamic"
    shift: float | None = None
    """Static shift for the static and dance schedules (None: the scheduler's own)."""
    guidance: float | None = None
    """Guidance-embedding scale (FLUX, HunyuanVideo); None where the model has none."""
    cfg_scale: float = 1.0
    """Classifier-free guidance scale; 1.0 runs no unconditional branch."""
    seed: int = 0
    num_frames: int | None = None
    sde_window: tuple[int, int] | None = None
    """SDE steps only for t in [start, end), ODE elsewhere (--sde-window)."""
    window_schedule: object | None = None
    """a window that moves with the training step (or is drawn per group), in place of a fixed
    sde_window: an object whose `window(step, sample_id)` gives (START, END) (an algorithm's,
    rl/algorithms/); `per_sample` says whether it depends on the sample"""
    ode_solver: str = "euler"
    """deterministic steps: euler, NFT's ddim or dpm1, or DPM-Solver++ of order 2 or 3 (dpm2, dpm3)
    after the last SDE step (rl/solvers.py; docs/ALGORITHMS.md)"""
    dpm_everywhere: bool = False
    """MixGRPO's dpm_apply_strategy all: the multistep solver at every deterministic step, before
    the window too (default: after the window's last SDE step only, MixGRPO's post)"""
    post_compress: float = 0.0
    """MixGRPO-Flash's dpm_post_compress_ratio: the steps after the window's last SDE step replaced
    by max(1, int((K - last) x ratio)) points of the shifted linear grid (rl/solvers.py
    `compressed`); 0: all K steps. Needs the dance schedule (MixGRPO's shift of linspace(1, 0, K+1))"""
    final_prediction: bool = False
    """MixGRPO's drop_last_sample: the sample is the last step's data prediction x - sigma v, not its
    x' (the same where the schedule ends at sigma' = 0)"""
    quantize_timestep: bool = False
    """Feed the model int(sigma * 1000) / 1000 (DanceGRPO train_grpo_flux.py:231, 238); the step
    itself uses the exact sigma."""
    record: tuple[str, ...] = ()
    """StepOutput fields a trajectory keeps at every step besides the latent and the log-probability
    (`Trajectory.steps`): what an algorithm's loss reads of the rollout (rl/algorithms/)"""

    @classmethod
    def for_adapter(cls, adapter: "DiTAdapter", **overrides) -> "SamplingConfig":
        """The family's defaults under `overrides` (None: the default). The dance schedule (the dance
        sampler's, or --schedule dance) takes the family's DanceGRPO shift."""
        d = adapter.defaults
        sde_type = overrides.get("sde_type") or "sde"
        schedule = overrides.get("schedule") or ("dance" if sde_type == "dance" else d.shift)
        base = dict(height=d.height, width=d.width, num_steps=d.num_steps, sde_type=sde_type,
                    noise_level=d.dance_eta if sde_type == "dance" else d.noise_level, schedule=schedule,
                    shift=d.dance_shift if schedule == "dance" else adapter.static_shift,
                    guidance=d.guidance, cfg_scale=d.cfg_scale, num_frames=d.num_frames)
        base.update({k: v for k, v in overrides.items() if v is not None})
        cfg = cls(**base)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.sde_type not in SDE_TYPES:
            raise ValueError(f"unknown sde type {self.sde_type!r}; choose one of {SDE_TYPES}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {SCHEDULES}")
        if not (math.isfinite(self.noise_level) and self.noise_level >= 0):
            raise ValueError(f"noise level must be >= 0, got {self.noise_level}")
        if self.num_steps < 1:
            raise ValueError(f"number of sampling steps must be >= 1, got {self.num_steps}")
        if not (math.isfinite(self.cfg_scale) and self.cfg_scale >= 1):
            raise ValueError(f"cfg scale must be >= 1 (1 disables CFG), got {self.cfg_scale}")
        if self.ode_solver not in ODE_SOLVERS:
            raise ValueError(f"unknown ODE solver {self.ode_solver!r}; choose one of {ODE_SOLVERS}")
        if self.sde_window is not None:
            start, end = self.sde_window
            if not 0 <= start < end <= self.num_steps:
                raise ValueError(f"sde window {self.sde_window} must satisfy 0 <= start < end <= {self.num_steps}")
        if self.post_compress:
            if not 0 < self.post_compress <= 1:
                raise ValueError(f"--post-compress must be in (0, 1] (0: off), got {self.post_compress}")
            if self.schedule != "dance" or self.shift is None or self.window_schedule is None:
                raise ValueError(f"--post-compress re-grids MixGRPO's shifted linear schedule after its window: it "
                                 f"needs --schedule dance and a MixGRPO window (got schedule {self.schedule!r})")

    def model_sigma(self, sigma: Tensor) -> Tensor:
        """The sigma the model sees: exact, or truncated to thousandths in float32 as DanceGRPO
        computes int(sigma * 1000) and FLUX receives it divided by 1000."""
        if not self.quantize_timestep:
            return sigma
        return torch.floor(sigma.float() * 1000) / 1000

    def window_at(self, step: int | None, sample_id: int | None = None) -> tuple[int, int] | None:
        """The SDE window of training step `step` (and sample `sample_id`, for a window drawn per
        group): the fixed one, or the window schedule's."""
        if self.window_schedule is None:
            return self.sde_window
        if step is None:
            raise ValueError("an SDE window that moves with the step needs the training step")
        return self.window_schedule.window(step, sample_id)

    def noise_level_at(self, t: int, step: int | None = None, sample_id: int | None = None) -> float:
        window = self.window_at(step, sample_id)
        if window is None or window[0] <= t < window[1]:
            return self.noise_level
        return 0.0

    def steps_at(self, step: int | None) -> int:
        """The denoising steps (model calls) of a sample at training step `step`: K, or with
        --post-compress the window's last SDE step plus the compressed tail's points."""
        if not self.post_compress:
            return self.num_steps
        last = self.window_at(step)[1] - 1
        return last + solvers.post_points(self.num_steps, last, self.post_compress)

    def sigmas_at(self, sigmas: Tensor, step: int | None) -> Tensor:
        """The sigmas a sample of training step `step` is denoised along: the schedule's K + 1, or
        MixGRPO-Flash's compressed ones."""
        if not self.post_compress:
            return sigmas
        return solvers.compressed(sigmas, self.window_at(step)[1] - 1, self.post_compress, float(self.shift))

    def solver_at(self, t: int, step: int | None = None, sample_id: int | None = None) -> int:
        """How deterministic step t is taken: 0 the Euler step (the euler solver, the SDE's steps
        and, with a window, the steps before its end unless --dpm-apply all); else by the ODE solver,
        1 in a first-order form (ddim, dpm1, and every solver's first and last steps) or 2, 3 a
        multistep DPM-Solver++ update of that order, min(order, t + 1), the second-to-last step of a
        third-order solver below 15 steps second order (NVlabs/DiffusionNFT solver.py dpm_step;
        MixGRPO sampling_utils.py:308-367)."""
        if self.ode_solver == "euler" or self.noise_level_at(t, step, sample_id) != 0:
            return 0
        window = self.window_at(step, sample_id)
        if not (self.dpm_everywhere or self.noise_level == 0 or window is None or t >= window[1]):
            return 0
        k, n = solvers.order(self.ode_solver), self.steps_at(step)
        if t == 0 or t == n - 1:
            return 1
        k = min(k, t + 1)
        return 2 if k == 3 and t == n - 2 and n < 15 else k


@dataclass
class Trajectory:
    """Stored paths of a batch of samples (docs/DESIGN.md, "trajectory")."""

    latents: Tensor    # (B, K+1, *latent_shape) float32: x at every sigma, x[:, 0] the initial noise
    log_probs: Tensor  # (B, K) float32: log p(x_{t+1} | x_t) under the generating policy
    sigmas: Tensor     # (K+1,) float32
    steps: dict[str, Tensor] = field(default_factory=dict)  # SamplingConfig.record: name -> (B, K, ...)


class PathRecorder:
    """A batch's path as it is denoised, step by step: the latents, the log-probabilities and the
    step fields the sampling config records (one recorder for a whole-model rank and a GAP stage)."""

    def __init__(self, x0: Tensor, record: tuple[str, ...] = ()):
        self.latents, self.log_probs = [x0], []
        self.steps: dict[str, list[Tensor]] = {name: [] for name in record}

    def add(self, out: StepOutput) -> None:
        self.latents.append(out.x_next)
        self.log_probs.append(out.log_prob)
        for name, values in self.steps.items():
            values.append(getattr(out, name).detach())

    def trajectory(self, sigmas: Tensor) -> Trajectory:
        return Trajectory(torch.stack(self.latents, dim=1), torch.stack(self.log_probs, dim=1), sigmas,
                          {name: torch.stack(v, dim=1) for name, v in self.steps.items()})


def sigmas_for(adapter: "DiTAdapter", cfg: SamplingConfig) -> Tensor:
    latent_shape = adapter.latent_shape(cfg.height, cfg.width, cfg.num_frames)
    return make_sigmas(flow_scheduler(adapter), cfg.num_steps, cfg.schedule,
                       image_seq_len=adapter.image_seq_len(latent_shape), shift=cfg.shift)


def guided_velocity(adapter: "DiTAdapter", x: Tensor, sigma: Tensor, cond: Conditioning,
                    neg_cond: Conditioning | None, cfg: SamplingConfig) -> Tensor:
    """Velocity with the family's guidance: the guidance embedding and/or CFG. Training calls this
    too, so the log-prob is taken on the same guided velocity with the same scale (docs/ALGORITHMS.md).
    `sigma` is the step's exact sigma; the model sees `cfg.model_sigma(sigma)`."""
    sigma = cfg.model_sigma(sigma)
    v = adapter.velocity(x, sigma, cond, cfg.guidance)
    if cfg.cfg_scale == 1.0:
        return v
    if neg_cond is None:
        raise ValueError(f"cfg scale {cfg.cfg_scale} needs negative-prompt conditioning")
    v_uncond = adapter.velocity(x, sigma, neg_cond, cfg.guidance)
    return adapter.combine_cfg(v, v_uncond, cfg.cfg_scale)


def initial_latents(cfg: SamplingConfig, step: int, init_ids: list[int], latent_shape: tuple[int, ...],
                    device) -> Tensor:
    """x at sigma = 1 for a batch: the seeded initial noise of each id, (B, *latent_shape)."""
    return to_device(torch.stack([initial_noise(cfg.seed, step, i, latent_shape) for i in init_ids]), device)


def sample_step(x: Tensor, v: Tensor, sigmas: Tensor, t: int, sample_ids: list[int], step: int,
                cfg: SamplingConfig, history: tuple[Tensor, ...] = ()) -> StepOutput:
    """Denoising step t of a batch along `sigmas` (the step's: `SamplingConfig.sigmas_at`): draw each
    sample's seeded step noise and take the SDE step (an ODE step outside the sample's window:
    Euler, NFT's first-order forms, or a DPM-Solver++ multistep update from `history`, the previous
    steps' data predictions, newest first). The one step of rollout, whether one rank runs the whole
    DiT or GAP stages share it; the returned `x0` is the next step's `history`."""
    levels = [cfg.noise_level_at(t, step, i) for i in sample_ids]
    sigma, sigma_next = float(sigmas[t]), float(sigmas[t + 1])  # sigmas live on the host: no device wait
    shape = tuple(x.shape[1:])

    def one(rows, level):
        ids = sample_ids if rows is None else [sample_ids[j] for j in rows.tolist()]
        xs, vs = (x, v) if rows is None else (x[rows], v[rows])
        eps = (to_device(torch.stack([step_noise(cfg.seed, step, i, t, shape) for i in ids]), x.device)
               if level > 0 else torch.zeros_like(xs, dtype=torch.float32))
        return sde_step(xs, vs, sigma, sigma_next, sde_type=cfg.sde_type, noise_level=level, noise=eps)

    out = by_level(levels, x, one)
    x0 = x.float() - sigma * v.float()
    last = len(sigmas) - 2
    if max(levels) == 0:  # a deterministic step for every row: the run's ODE solver
        k = cfg.solver_at(t, step, sample_ids[0])
        if k > 1 and len(history) >= k - 1:
            out.x_next = out.mean = solvers.multistep_update(
                x, (x0, *history), [float(sigmas[t - j]) for j in range(k - 1, 0, -1)] + [sigma, sigma_next], k)
        elif k == 1 and (cfg.ode_solver != "dpm1" or t in (0, last)):  # NFT's first and last steps: DDIM
            out.x_next = out.mean = solvers.ddim_update(x0, x, sigma, sigma_next)
        elif k == 1:
            out.x_next = out.mean = solvers.dpm1_update(x0, x, sigma, sigma_next)
    out.x0 = (x0, *history)[:max(1, solvers.order(cfg.ode_solver) - 1)]
    if cfg.final_prediction and t == last:
        out.x_next = x0
    return out


@torch.no_grad()
def denoise(adapter: "DiTAdapter", cond: Conditioning, neg_cond: Conditioning | None, sample_ids: list[int],
            step: int, cfg: SamplingConfig, init_ids: list[int] | None = None,
            sigmas: Tensor | None = None) -> Trajectory:
    """Sample a batch along the step's sigmas (K steps, or MixGRPO-Flash's compressed ones; `sigmas`:
    the schedule's K + 1, default the family's). `sample_ids` are the global sample indices i of step `step`
    that seed all noise; `init_ids` (default sample_ids) seed the initial noise, so a group can
    share its initial noise by passing the group index (docs/ALGORITHMS.md, "Groups")."""
    cfg.validate()
    latent_shape = adapter.latent_shape(cfg.height, cfg.width, cfg.num_frames)
    sigmas = cfg.sigmas_at(sigmas_for(adapter, cfg) if sigmas is None else sigmas, step)  # the step's
    device = adapter.device
    x = initial_latents(cfg, step, sample_ids if init_ids is None else init_ids, latent_shape, device)
    path, history = PathRecorder(x, cfg.record), ()
    for t in range(len(sigmas) - 1):
        sigma = torch.full((len(sample_ids),), float(sigmas[t]), device=device)  # no host-to-device copy
        v = guided_velocity(adapter, x, sigma, cond, neg_cond, cfg)
        out = sample_step(x, v, sigmas, t, sample_ids, step, cfg, history)
        x, history = out.x_next, out.x0
        path.add(out)
    return path.trajectory(sigmas)
