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

from rl.seeding import initial_noise, step_noise
from rl.conditioning import Conditioning

# Adapters (models.DiTAdapter) are passed in and used through their interface only: the sampler
# imports no model family.

SDE_TYPES = ("sde", "cps", "dance")
SCHEDULES = ("dynamic", "static", "dance")
ODE_SOLVERS = ("euler", "dpm2")
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
    x0: Tensor | None = None  # (B, ...) float32 x - sigma v, the data prediction a multistep solver keeps


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
    else:  # dance: DanceGRPO train_grpo_flux.py:141-153
        x0_hat = x - s * v
        score = -(x - (1 - s) * x0_hat) / s**2
        mean = x + dt * v - 0.5 * noise_level**2 * score * dt
        std = noise_level * torch.sqrt(-dt)

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
               x_next: Tensor, step: int | None = None) -> StepOutput:
    """`sde_step` scoring rows at different timesteps (a TSP micro-batch) of training step `step`:
    one call per distinct noise level (a windowed sampler is deterministic outside its window),
    rows put back in order."""
    levels = [cfg.noise_level_at(t, step) for t in timesteps]
    if len(set(levels)) == 1:
        return sde_step(x, v, sigma, sigma_next, sde_type=cfg.sde_type, noise_level=levels[0], x_next=x_next)
    parts, order = [], []
    for level in sorted(set(levels)):
        rows = to_device(torch.tensor([j for j, l in enumerate(levels) if l == level]), x.device)
        parts.append(sde_step(x[rows], v[rows], sigma[rows], sigma_next[rows], sde_type=cfg.sde_type,
                              noise_level=level, x_next=x_next[rows]))
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
    """a window that moves with the training step, in place of a fixed sde_window: an object whose
    `window(step)` gives (START, END) (an algorithm's, rl/algorithms/)"""
    ode_solver: str = "euler"
    """deterministic steps: euler, or dpm2 (DPM-Solver++(2M) after the last SDE step; docs/ALGORITHMS.md)"""
    quantize_timestep: bool = False
    """Feed the model int(sigma * 1000) / 1000 (DanceGRPO train_grpo_flux.py:231, 238); the step
    itself uses the exact sigma."""
    record: tuple[str, ...] = ()
    """StepOutput fields a trajectory keeps at every step besides the latent and the log-probability
    (`Trajectory.steps`): what an algorithm's loss reads of the rollout (rl/algorithms/)"""

    @classmethod
    def for_adapter(cls, adapter: "DiTAdapter", **overrides) -> "SamplingConfig":
        d = adapter.defaults
        sde_type = overrides.get("sde_type") or "sde"
        base = dict(height=d.height, width=d.width, num_steps=d.num_steps, sde_type=sde_type,
                    noise_level=d.dance_eta if sde_type == "dance" else d.noise_level,
                    schedule="dance" if sde_type == "dance" else d.shift,
                    shift=d.dance_shift if sde_type == "dance" else adapter.static_shift,
                    guidance=d.guidance, cfg_scale=d.cfg_scale, num_frames=d.num_frames)
        base.update({k: v for k, v in overrides.items() if v is not None})
        cfg = cls(**base)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.sde_type not in SDE_TYPES:
            raise ValueError(f"unknown sde type {self.sde_type!r}; choose one of {SDE_TYPES}")
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

    def model_sigma(self, sigma: Tensor) -> Tensor:
        """The sigma the model sees: exact, or truncated to thousandths in float32 as DanceGRPO
        computes int(sigma * 1000) and FLUX receives it divided by 1000."""
        if not self.quantize_timestep:
            return sigma
        return torch.floor(sigma.float() * 1000) / 1000

    def window_at(self, step: int | None) -> tuple[int, int] | None:
        """The SDE window of training step `step`: the fixed one, or the sliding window's."""
        if self.window_schedule is None:
            return self.sde_window
        if step is None:
            raise ValueError("an SDE window that moves with the step needs the training step")
        return self.window_schedule.window(step)

    def noise_level_at(self, t: int, step: int | None = None) -> float:
        window = self.window_at(step)
        if window is None or window[0] <= t < window[1]:
            return self.noise_level
        return 0.0

    def second_order_at(self, t: int, step: int | None = None) -> bool:
        """dpm2 takes the multistep second-order update at deterministic step t after the last SDE
        step, neither the first nor the last step (those stay first order, as NVlabs/DiffusionNFT
        solver.py dpm_step and MixGRPO's post-window DPM-Solver++ take them)."""
        if self.ode_solver != "dpm2" or not 0 < t < self.num_steps - 1 or self.noise_level_at(t, step) != 0:
            return False
        window = self.window_at(step)
        return self.noise_level == 0 or window is None or t >= window[1]


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


def dpm2_update(x: Tensor, x0: Tensor, x0_prev: Tensor, sigma_prev: float, sigma: float,
                sigma_next: float) -> Tensor:
    """DPM-Solver++(2M), data prediction, midpoint form, on the flow grid (alpha = 1 - sigma,
    lambda = log(alpha / sigma)): x' = (sigma'/sigma) x - alpha' (e^-h - 1) (x0 + D1 / 2),
    h = lambda' - lambda, D1 = (x0 - x0_prev) h / (lambda - lambda_prev) (Lu et al. 2022; diffusers'
    DPMSolverMultistepScheduler with solver_type midpoint). Coefficients in float64."""
    def lam(s: float) -> float:  # -inf at sigma = 1: the step after it is first order (D1 = 0)
        return -math.inf if s >= 1.0 else math.log((1.0 - s) / s)

    h = lam(sigma_next) - lam(sigma)
    r0 = (lam(sigma) - lam(sigma_prev)) / h
    coef = (1.0 - sigma_next) * math.expm1(-h)
    return (sigma_next / sigma) * x.float() - coef * (x0 + 0.5 / r0 * (x0 - x0_prev))


def sample_step(x: Tensor, v: Tensor, sigmas: Tensor, t: int, sample_ids: list[int], step: int,
                cfg: SamplingConfig, x0_prev: Tensor | None = None) -> StepOutput:
    """Denoising step t of a batch: draw each sample's seeded step noise and take the SDE step (an
    ODE step outside the step's window: Euler, or with dpm2 the multistep update from `x0_prev`,
    the previous step's data prediction). The one step of rollout, whether one rank runs the whole
    DiT or GAP stages share it; the returned x0 is the next step's `x0_prev`."""
    level = cfg.noise_level_at(t, step)
    sigma, sigma_next = float(sigmas[t]), float(sigmas[t + 1])  # sigmas live on the host: no device wait
    eps = (to_device(torch.stack([step_noise(cfg.seed, step, i, t, tuple(x.shape[1:])) for i in sample_ids]),
                     x.device) if level > 0 else torch.zeros_like(x, dtype=torch.float32))
    out = sde_step(x, v, sigma, sigma_next, sde_type=cfg.sde_type, noise_level=level, noise=eps)
    out.x0 = x.float() - sigma * v.float()
    if x0_prev is not None and cfg.second_order_at(t, step):
        out.x_next = out.mean = dpm2_update(x, out.x0, x0_prev, float(sigmas[t - 1]), sigma, sigma_next)
    return out


@torch.no_grad()
def denoise(adapter: "DiTAdapter", cond: Conditioning, neg_cond: Conditioning | None, sample_ids: list[int],
            step: int, cfg: SamplingConfig, init_ids: list[int] | None = None,
            sigmas: Tensor | None = None) -> Trajectory:
    """Sample K steps for a batch. `sample_ids` are the global sample indices i of step `step`
    that seed all noise; `init_ids` (default sample_ids) seed the initial noise, so a group can
    share its initial noise by passing the group index (docs/ALGORITHMS.md, "Groups")."""
    cfg.validate()
    latent_shape = adapter.latent_shape(cfg.height, cfg.width, cfg.num_frames)
    sigmas = sigmas_for(adapter, cfg) if sigmas is None else sigmas
    device = adapter.device
    x = initial_latents(cfg, step, sample_ids if init_ids is None else init_ids, latent_shape, device)
    path, x0 = PathRecorder(x, cfg.record), None
    for t in range(cfg.num_steps):
        sigma = torch.full((len(sample_ids),), float(sigmas[t]), device=device)  # no host-to-device copy
        v = guided_velocity(adapter, x, sigma, cond, neg_cond, cfg)
        out = sample_step(x, v, sigmas, t, sample_ids, step, cfg, x0)
        x, x0 = out.x_next, out.x0
        path.add(out)
    return path.trajectory(sigmas)
