"""The deterministic (ODE) updates a rollout may take besides the Euler step, and MixGRPO-Flash's
compressed schedule (docs/ALGORITHMS.md, "Deterministic steps: ODE and windows"). Pure functions of
float32 latents and float64 coefficients, shared by every role through rl/sampler.py.

On the flow grid alpha = 1 - sigma, lambda = log(alpha / sigma) and the data prediction
x0_hat = x - sigma v. DPM-Solver++ in data-prediction form (Lu et al., arXiv 2211.01095; diffusers'
DPMSolverMultistepScheduler, midpoint):

    order 1:  x' = (sigma'/sigma) x - alpha' (e^-h - 1) D0                                   (= Euler)
    order 2:  ... - alpha' (e^-h - 1) D1 / 2,     D1 = (x0_t - x0_{t-1}) h / h_0
    order 3:  ... - alpha' (e^-h - 1) D0 + alpha' ((e^-h - 1)/h + 1) D1 - alpha' ((e^-h - 1 + h)/h^2 - 1/2) D2

as NVlabs/DiffusionNFT flow_grpo/diffusers_patch/solver.py (24af555) and Tencent-Hunyuan/MixGRPO
fastvideo/utils/sampling_utils.py:449-639 (e5cdd6a) write them. NFT's `ddim` and `dpm1` are first-order
updates too, written as DDIM with eta 0 and as DPM-Solver++(1): each equals the Euler step in exact
arithmetic and differs from it by rounding only; they are kept in their authors' form so a rollout
matches theirs to float32 rounding.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

ODE_SOLVERS = ("euler", "ddim", "dpm1", "dpm2", "dpm3")
"""--ode-solver: euler, NFT's ddim and dpm1 (first order), DPM-Solver++ of order 2 or 3 (multistep)"""


def order(solver: str) -> int:
    """The most previous data predictions a solver uses, plus one: 1 for the first-order solvers."""
    return int(solver[-1]) if solver.startswith("dpm") and solver != "dpm1" else 1


def lam(sigma: float) -> float:
    """lambda = log((1 - sigma) / sigma): -inf at sigma = 1 (a step from pure noise is first order),
    +inf at sigma = 0."""
    if sigma >= 1.0:
        return -math.inf
    if sigma <= 0.0:
        return math.inf
    return math.log((1.0 - sigma) / sigma)


def multistep_update(x: Tensor, history: tuple[Tensor, ...], sigmas: list[float], k: int) -> Tensor:
    """One DPM-Solver++ update of order k (2 or 3) from sigma_t to sigma' (`sigmas`: the sigmas of the
    k data predictions in `history`, oldest first, then sigma'; `history`: x0_hat at them, newest
    first). Coefficients in float64 as the peers' (their sigmas are float64 in NFT, their products
    as they write them), the update in float32."""
    *prev, s0, s_next = sigmas
    h = lam(s_next) - lam(s0)
    coef = (1.0 - s_next) * (math.exp(-h) - 1.0)  # alpha' (e^-h - 1)
    m0, m1 = history[0], history[1]
    r0 = (lam(s0) - lam(prev[-1])) / h
    d1_0 = (1.0 / r0) * (m0 - m1)
    if k == 2:  # midpoint
        return (s_next / s0) * x.float() - coef * m0 - (0.5 * coef) * d1_0
    r1 = (lam(prev[-1]) - lam(prev[-2])) / h
    d1_1 = (1.0 / r1) * (m1 - history[2])
    d1 = d1_0 + (r0 / (r0 + r1)) * (d1_0 - d1_1)
    d2 = (1.0 / (r0 + r1)) * (d1_0 - d1_1)
    c1 = (1.0 - s_next) * ((math.exp(-h) - 1.0) / h + 1.0)
    c2 = (1.0 - s_next) * ((math.exp(-h) - 1.0 + h) / h ** 2 - 0.5)
    return (s_next / s0) * x.float() - coef * m0 + c1 * d1 - c2 * d2


def ddim_update(x0: Tensor, x: Tensor, sigma: float, sigma_next: float) -> Tensor:
    """DDIM with eta 0 on the flow grid (NFT solver.py `ddim_update`): x' = (1 - sigma') x0_hat +
    sigma' eps_hat, eps_hat = (x - (1 - sigma) x0_hat) / sigma."""
    eps = (x.float() - (1.0 - sigma) * x0) / sigma
    return (1.0 - sigma_next) * x0 + math.sqrt(sigma_next ** 2) * eps


def dpm1_update(x0: Tensor, x: Tensor, sigma: float, sigma_next: float) -> Tensor:
    """DPM-Solver++(1) (NFT solver.py `dpm_solver_first_order_update`): x' = (sigma'/sigma) x -
    alpha' (e^-h - 1) x0_hat."""
    h = lam(sigma_next) - lam(sigma)
    return (sigma_next / sigma) * x.float() - ((1.0 - sigma_next) * (math.exp(-h) - 1.0)) * x0


def compressed(sigmas: Tensor, last_sde: int, ratio: float, shift: float) -> Tensor:
    """MixGRPO-Flash's rollout schedule (sampling_utils.py:31-54, dpm_post_compress_ratio): the K + 1
    sigmas up to the window's last SDE step `last_sde` kept, the rest replaced by n = max(1,
    int((K - last_sde) x ratio)) points of linspace(t_{last+1}, 0, n) shifted by `shift` (t the
    unshifted grid linspace(1, 0, K + 1)), all in float32 as MixGRPO computes them: last_sde + n model
    calls in place of K. The first new point is sigma_{last+1} itself."""
    k = len(sigmas) - 1
    n = post_points(k, last_sde, ratio)
    start = torch.linspace(1, 0, k + 1, dtype=torch.float32)[last_sde + 1].item()
    t = torch.linspace(start, 0, n, dtype=torch.float32)
    post = shift * t / (1 + (shift - 1) * t)
    return torch.cat([sigmas[:last_sde + 1].float(), post])


def post_points(num_steps: int, last_sde: int, ratio: float) -> int:
    """The points of the compressed tail: int(max((K - last_sde) x ratio, 1)), as MixGRPO computes it
    (a Python float product, truncated)."""
    return int(max((num_steps - last_sde) * ratio, 1))
