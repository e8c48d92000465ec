"""Group-relative advantages (docs/ALGORITHMS.md, "Groups and advantages"): pure functions of rewards,
the same on whichever rank computes them.

A fragment's advantages are decided when it is scored (`fragment_advantages`), since a group never
spans fragments. What needs every reward of the step (Flow-GRPO's batch-global std, the clamp it
makes bind, the re-admission of dropped samples) is decided once the step's last fragment is
scored (`step_end`): trainers then scale the policy gradient they accumulated from group-centred
advantages and train the few samples whose clamp binds or that are re-admitted again (trainer.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from rl.seeding import derive_seed

STD_EPS = 1e-4
STD_MODES = ("group", "running", "global")
COMBINES = ("rewards", "advantages", "losses")


@dataclass(frozen=True)
class AdvantageRule:
    """How a run turns rewards into advantages: its algorithm's conventions and its options."""

    std_mode: str = "group"
    """group: the group's own std; running: of previous steps; global: of the whole step (Flow-GRPO)"""
    ddof: int = 0
    """0: population std (Flow-GRPO, np.std); 1: Bessel-corrected (DanceGRPO, torch.std)"""
    eps: float = STD_EPS
    """added to the std: 1e-4 (Flow-GRPO), 1e-8 (DanceGRPO)"""
    clip: float = 5.0
    """--adv-clip: advantages are clamped to [-clip, clip]"""
    combine: str = "rewards"
    """several rewards: rewards (weighted sum, then one advantage), advantages (one advantage per
    reward, their weighted sum), losses (one advantage and one clipped loss per reward, DanceGRPO)"""
    weights: tuple[tuple[str, float], ...] = ()
    """(reward name, weight) in the run's order; read by the advantages and losses combinations"""
    drop_zero: bool = False
    """--drop-zero-std: samples whose advantage is exactly 0 are not trained (Flow-GRPO)"""
    readmit_multiple: int = 1
    """re-admit dropped samples until the trained ones are a multiple of this (Flow-GRPO)"""
    best_of_n: int = 0
    """train the top ceil(n/2) and bottom floor(n/2) samples of each group (DanceGRPO); 0: all"""
    trim: float = 0.0
    """MixGRPO's trimmed_ratio: a group's mean and std are taken over its rewards without the lowest
    min(int(G x trim), G - 1) (train_grpo_flux.py:439-445); 0: all of them"""

    @property
    def needs_step_end(self) -> bool:
        """Some decision needs every reward of the step: the global std or the re-admission."""
        return self.std_mode == "global" or (self.drop_zero and self.readmit_multiple > 1)


# ----- the formulas ------------------------------------------------------------------------------
def std_of(rewards: Tensor, ddof: int) -> Tensor:
    """float64 std of a reward vector: population (ddof 0) or Bessel-corrected (ddof 1)."""
    return rewards.double().std(correction=ddof)


def trimmed(rewards: Tensor, trim: float) -> Tensor:
    """A group's rewards its mean and std are taken over: all, or with MixGRPO's trimmed_ratio the
    sorted rewards without the lowest min(int(G x trim), G - 1) (train_grpo_flux.py:439-443)."""
    if trim == 0:
        return rewards
    cut = min(int(len(rewards) * trim), len(rewards) - 1)
    return torch.sort(rewards).values[cut:]


def centred(rewards: Tensor, group_ids: Tensor, trim: float = 0.0) -> Tensor:
    """u = r - mean of the sample's group, float64 (an all-equal group gives exact zeros)."""
    rewards = rewards.double()
    out = torch.empty_like(rewards)
    for gid in group_ids.unique():
        m = group_ids == gid
        out[m] = rewards[m] - trimmed(rewards[m], trim).mean()
    return out


def group_stds(rewards: Tensor, group_ids: Tensor, ddof: int, trim: float = 0.0) -> Tensor:
    """Each sample's group std, float64."""
    out = torch.empty_like(rewards, dtype=torch.float64)
    for gid in group_ids.unique():
        m = group_ids == gid
        out[m] = std_of(trimmed(rewards[m].double(), trim), ddof)
    return out


def group_advantages(rewards: Tensor, group_ids: Tensor, *, adv_clip: float, std: float | None = None,
                     ddof: int = 0, eps: float = STD_EPS, trim: float = 0.0) -> Tensor:
    """A = clamp((r - mean_group) / (std + eps), -adv_clip, adv_clip) in float64, returned as float32.

    std None: each group's own std (Flow-GRPO stat_tracking.py:27-37 with global_std False, ddof 0,
    eps 1e-4; DanceGRPO train_grpo_flux.py:540-545, ddof 1, eps 1e-8). Otherwise the given std:
    the running std of previous steps, or the step's (Flow-GRPO's global_std, stat_tracking.py:27).
    `trim`: MixGRPO's trimmed group statistics (`trimmed`)."""
    u = centred(rewards, group_ids, trim)
    s = group_stds(rewards, group_ids, ddof, trim) if std is None else torch.full_like(u, std)
    return (u / (s + eps)).clamp(-adv_clip, adv_clip).float()


def zero_std_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """(n,) bool: the sample's group has all-equal rewards (its advantages are all 0)."""
    out = torch.zeros_like(group_ids, dtype=torch.bool)
    for gid in group_ids.unique():
        m = group_ids == gid
        out[m] = bool((rewards[m] == rewards[m][0]).all())
    return out


def best_of_n(scores: Tensor, group_ids: Tensor, n: int) -> Tensor:
    """(k,) bool: per group, the ceil(n/2) highest and floor(n/2) lowest scores (DanceGRPO
    train_grpo_hunyuan.py:394-409, where `sorted[-n//2:]` parses as `sorted[(-n)//2:]`). Ties are
    broken by position, so every rank keeps the same samples; n = 0 or n >= the group keeps all."""
    keep = torch.ones_like(group_ids, dtype=torch.bool)
    for gid in group_ids.unique():
        rows = torch.nonzero(group_ids == gid).flatten()
        if n == 0 or n >= len(rows):
            continue
        order = rows[torch.argsort(scores[rows].double(), stable=True)]
        keep[rows] = False
        keep[order[:n // 2]] = True
        keep[order[len(order) - (n - n // 2):]] = True
    return keep


def readmitted(eligible: list[int], num_kept: int, multiple: int, *, seed: int, step: int) -> list[int]:
    """Dropped samples trained after all, so the trained count is a multiple of `multiple`
    (Flow-GRPO train_sd3.py:797-809): the first `multiple - num_kept % multiple` of the eligible
    sample ids in an order drawn from (seed, step), none if there are not that many. Flow-GRPO draws
    them with the global torch RNG per process; a key of the data keeps every placement alike."""
    need = (multiple - num_kept % multiple) % multiple
    if need == 0 or len(eligible) < need:
        return []
    order = np.random.default_rng(derive_seed(seed, step, "readmit")).permutation(len(eligible))
    pool = sorted(eligible)
    return sorted(pool[i] for i in order[:need])


def step_std(rewards: list[float], sample_ids: list[int], ddof: int) -> float:
    """The std of a step's rewards summed in sample-id order, so every rank computes the same bits
    whichever fragment arrived first (Flow-GRPO's global std: np.std over the gathered batch)."""
    order = sorted(range(len(sample_ids)), key=sample_ids.__getitem__)
    return std_of(torch.tensor([rewards[j] for j in order], dtype=torch.float64), ddof).item()


def _unclamped(rewards: Tensor, group_ids: Tensor, rule: AdvantageRule) -> Tensor:
    """float64 (r - mean_group) / (std_group + eps) of one reward."""
    return centred(rewards, group_ids, rule.trim) / (group_stds(rewards, group_ids, rule.ddof, rule.trim) + rule.eps)


# ----- a fragment, when it is scored -------------------------------------------------------------
@dataclass
class FragmentAdvantages:
    advantages: Tensor  # (n,) float32, or (n, R) for --reward-combine losses (weights applied)
    keep: Tensor  # (n,) bool: trained now
    zero: Tensor  # (n,) bool: advantage exactly 0
    facts: dict  # what the end of the step reads (JSON): ids, rewards, centred, kept, eligible


def fragment_advantages(rule: AdvantageRule, scores: dict[str, Tensor], group_ids: Tensor, sample_ids: list[int],
                        *, std: float | None = None, whole_step: bool = False, seed: int = 0,
                        step: int = 0) -> FragmentAdvantages:
    """The advantages of a scored fragment and the samples it trains.

    `scores` holds every reward and "combined" (their weighted sum); `std` the running std of
    --std-mode running (None: the group's). With --std-mode global the advantages are the
    group-centred rewards u, scaled by the step's 1 / (std + eps) at the end of the step, unless the
    fragment is the whole step (`whole_step`): then they are final here."""
    u = centred(scores["combined"], group_ids, rule.trim)
    if rule.combine == "rewards":
        if rule.std_mode == "global":
            a = u / (step_std(scores["combined"].tolist(), sample_ids, rule.ddof) + rule.eps) if whole_step else u
            adv = (a.clamp(-rule.clip, rule.clip) if whole_step else a).float()
        else:
            adv = group_advantages(scores["combined"], group_ids, adv_clip=rule.clip, std=std, ddof=rule.ddof,
                                   eps=rule.eps, trim=rule.trim)
        combined, zero = u, u == 0
    else:
        per = torch.stack([_unclamped(scores[name], group_ids, rule) * w for name, w in rule.weights], dim=1)
        combined = per.sum(dim=1)  # (n,) sum_j w_j A_j: DanceGRPO's total_scores (train_grpo_hunyuan.py:396)
        if rule.combine == "advantages":
            adv, zero = combined.clamp(-rule.clip, rule.clip).float(), combined == 0
        else:  # losses: w_j clamp(A_j), one clipped loss per column (train_grpo_hunyuan.py:450-477)
            clip = torch.tensor([w * rule.clip for _, w in rule.weights], dtype=torch.float64)
            adv, zero = torch.maximum(torch.minimum(per, clip), -clip).float(), (per == 0).all(dim=1)
    chosen = best_of_n(combined, group_ids, rule.best_of_n)
    keep = chosen & ~zero if rule.drop_zero else chosen
    facts = {"ids": list(sample_ids), "rewards": scores["combined"].double().tolist(), "centred": u.tolist(),
             "kept": keep.tolist(), "eligible": (chosen & zero & rule.drop_zero).tolist()}
    if whole_step and rule.readmit_multiple > 1:
        again = set(readmitted([i for i, e in zip(sample_ids, facts["eligible"]) if e], int(keep.sum()),
                               rule.readmit_multiple, seed=seed, step=step))
        keep = keep | torch.tensor([i in again for i in sample_ids])
    return FragmentAdvantages(adv, keep, zero, facts)


# ----- the step, when its last fragment is scored ------------------------------------------------
@dataclass
class StepEnd:
    """What the step's rewards decide at its end (every trainer computes the same from the same facts)."""

    scale: float = 1.0
    """the policy gradient's factor: 1 / (std + eps) with the global std while streaming, else 1"""
    rows: dict[int, tuple[float, bool]] = field(default_factory=dict)
    """sample id -> (weight of its policy term, counted) of the samples trained again: a binding
    clamp (weight clip / |A| - 1, not counted: a correction) or a re-admission (1, counted)"""
    metrics: dict[str, float] = field(default_factory=dict)


def step_end(rule: AdvantageRule, facts: list[dict], *, whole_step: bool, seed: int, step: int) -> StepEnd:
    """The end of a step from every fragment's facts. The clipped objective is linear in a positive
    scale of the advantages (which branch of max() is active depends only on their sign), so the
    gradient of u-advantages times 1/(std + eps) is the gradient of the scaled ones; a sample whose
    clamp binds is trained again with weight clip/|A| - 1, which makes its total weight clip/|A|.
    A whole-step fragment has applied all of this itself (`whole_step`): only the metrics remain."""
    ids = [i for f in facts for i in f["ids"]]
    col = {k: [v for f in facts for v in f[k]] for k in ("rewards", "centred", "kept", "eligible")}
    end = StepEnd()
    if rule.std_mode == "global":
        s = step_std(col["rewards"], ids, rule.ddof)
        scaled = [u / (s + rule.eps) for u in col["centred"]]
        binding = [j for j, a in enumerate(scaled) if col["kept"][j] and abs(a) > rule.clip]
        end.metrics.update({"train/adv_std": s, "train/adv_clamped": float(len(binding))})
        if not whole_step:
            end.scale = 1.0 / (s + rule.eps)
            end.rows.update({ids[j]: (rule.clip / abs(scaled[j]) - 1.0, False) for j in binding})
    if rule.drop_zero and rule.readmit_multiple > 1:
        again = readmitted([i for i, e in zip(ids, col["eligible"]) if e], sum(col["kept"]), rule.readmit_multiple,
                           seed=seed, step=step)
        end.metrics["train/readmitted"] = float(len(again))
        if not whole_step:
            end.rows.update({i: (1.0, True) for i in again})
    return end


class RunningStd:
    """Std of all rewards of previous batches (Welford); None before the first batch."""

    def __init__(self):
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, rewards: list[float]) -> None:
        for r in rewards:
            self.n += 1
            d = r - self.mean
            self.mean += d / self.n
            self.m2 += d * (r - self.mean)

    @property
    def std(self) -> float | None:
        return (self.m2 / self.n) ** 0.5 if self.n > 1 else None

    def state_dict(self) -> dict:
        return {"n": self.n, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, d: dict) -> None:
        self.n, self.mean, self.m2 = d["n"], d["mean"], d["m2"]
