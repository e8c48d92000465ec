"""Rewards: one signature, an explicit name -> factory registry, weighted combination.

A reward spec (`--reward`) is one of (rewards/README.md):
- `NAME[:WEIGHT]`: a registered reward, computed in the run;
- `module.path:function[:WEIGHT]` or `path/to/file.py:function[:WEIGHT]`: a user's own function
  (rewards/user.py), loaded and checked on a dummy batch at start-up;
- `[PROTOCOL+]http://HOST:PORT/NAME[:WEIGHT]`: a reward service of any NAME, in this project's
  protocol or a peer's (rewards/remote.py, rewards/server.py).
A weight is a number after the spec's last colon. `--reward-scale NAME=FACTOR` multiplies a reward's
scores before they are logged and combined (a peer's unit: Flow-GRPO's jpeg_compressibility is ours
divided by 500).

Every reward is called as `reward(images, prompts, metadata) -> Tensor[B]` (float32, CPU); see
rewards/reward.py and rewards/README.md. Factories are "module:Class" strings imported on first use,
so naming a reward costs nothing until it is built and a model reward's dependencies are needed only
by the ranks that build it. Rule rewards are built as `Factory(device=...)`, model rewards as
`Factory(device=..., model_path=DIR)` with DIR a local folder (`--reward-model NAME=DIR`)."""
from __future__ import annotations

import importlib
import math
from typing import Sequence

import torch
from torch import Tensor

from rewards import user
from rewards.judge import JudgeConfig, judge_paths
from rewards.remote import (DEFAULT_TIMEOUT_S, HttpReward, PendingRequest, is_url, make_protocol, service_token,
                            split_url_spec, url_protocol)

_REWARDS = {
    "shapes": "rewards.shapes:ShapesReward",
    "shapes_detector": "rewards.shapes_detector:ShapesDetector",
    "jpeg_compressibility": "rewards.rule:JpegCompressibility",
    "jpeg_incompressibility": "rewards.rule:JpegIncompressibility",
    "rule_aesthetic": "rewards.rule:RuleAesthetic",
    "pickscore": "rewards.clip:PickScore",
    "clip_score": "rewards.clip:ClipScore",
    "hpsv2": "rewards.clip:HPSv2",
    "laion_aesthetic": "rewards.clip:LaionAesthetic",
    "image_reward": "rewards.image_reward:ImageReward",
    "ocr": "rewards.ocr:OcrReward",
    "hpsv3": "rewards.hpsv3:HPSv3",
    "temporal_consistency": "rewards.video:TemporalConsistency",
}

MAX_WEIGHT = 1e6  # reward weights are O(1); the bound keeps every weighted sum finite in float32

# Rewards that load weights and so need `--reward-model NAME=DIR`.
MODEL_REWARDS = frozenset({"pickscore", "clip_score", "hpsv2", "hpsv3", "laion_aesthetic", "image_reward", "ocr"})
# Rewards of whole videos, which image models cannot take (every other reward scores video frame by frame).
VIDEO_REWARDS = frozenset({"temporal_consistency"})


def reward_names() -> list[str]:
    return sorted(_REWARDS)


def reward_class(name: str):
    if name not in _REWARDS:
        raise ValueError(f"unknown reward {name!r}; known rewards: {reward_names()}")
    module_name, class_name = _REWARDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def build_reward(name: str, device: str | torch.device = "cpu", model_path: str | None = None,
                 dtype: torch.dtype = torch.float32):
    """Build one reward by name. Model rewards need `model_path` and hold their weights in `dtype`;
    rule rewards refuse a model path."""
    cls = reward_class(name)
    if name in MODEL_REWARDS:
        return cls(device=device, model_path=model_path, dtype=dtype)
    if model_path is not None:
        raise ValueError(f"reward {name!r} loads no weights, but a model path was given ({model_path!r})")
    return cls(device=device)


def _split_weight(spec: str) -> tuple[str, str | None]:
    """(the spec without its weight, the weight's text or None): a weight is the number after the last
    colon ("mod:fn:0.5", "shapes:0.5"), or any text after a registered name's colon ("shapes:x", an error)."""
    head, sep, tail = spec.rpartition(":")
    if not sep:
        return spec, None
    try:
        float(tail)
    except ValueError:
        return (head, tail) if head in _REWARDS else (spec, None)
    return head, tail


def parse_reward_spec(spec: str) -> tuple[str, float]:
    """A reward spec -> (name, weight); weight defaults to 1.0. The name of a user's function is its
    spec without the weight ("mymod:score"), of a service the URL's last segment."""
    spec = spec.strip()
    if is_url(spec):
        _, name, weight_text = split_url_spec(spec)
    else:
        name, weight_text = _split_weight(spec)
        if user.is_target(name):
            user.check_target(spec, name)
        elif name and name not in _REWARDS:
            raise ValueError(f"bad reward spec {spec!r}: unknown reward {name!r}; known rewards: {reward_names()}, "
                             f"or a function of your own as module.path:function or file.py:function")
    if not name:
        raise ValueError(f"bad reward spec {spec!r}: expected NAME, NAME:WEIGHT, module:function[:WEIGHT] or "
                         f"http://HOST:PORT/NAME[:WEIGHT]")
    if weight_text is None:
        return name, 1.0
    try:
        weight = float(weight_text)
    except ValueError:
        raise ValueError(f"bad reward spec {spec!r}: weight {weight_text!r} is not a number") from None
    if not math.isfinite(weight) or abs(weight) > MAX_WEIGHT:
        # checked here, not after the float32 weighted sum has overflowed to inf
        raise ValueError(f"bad reward spec {spec!r}: weight {weight_text} must be a finite number in "
                         f"[-{MAX_WEIGHT:g}, {MAX_WEIGHT:g}]")
    return name, weight


def reward_url(spec: str) -> str | None:
    """The URL of the service that scores a reward spec, None for a reward computed in the run."""
    return split_url_spec(spec)[0] if is_url(spec) else None


def user_target(spec: str) -> str | None:
    """The 'module:function' or 'file.py:function' of a user's reward spec, None for any other."""
    if is_url(spec):
        return None
    name, _ = _split_weight(spec.strip())
    return name if user.is_target(name) else None


def prompt_checker(spec: str):
    """The registered reward class whose `check_prompt` a spec's prompts must pass, None for a user's
    function or a service of a name the registry does not know (they score any prompt)."""
    name = parse_reward_spec(spec)[0]
    return reward_class(name) if name in _REWARDS and not user_target(spec) else None


def check_user_rewards(specs: Sequence[str], video: bool = False) -> None:
    """Load every user function among `specs` and score a dummy batch with it (rewards/user.py): a
    ValueError naming the spec, on every rank alike, before any rank waits on another."""
    for spec in specs:
        if user_target(spec):
            user.check_user_reward(user_target(spec), video=video)


def reward_scales(items: Sequence[str]) -> dict[str, float]:
    """Parse `--reward-scale NAME=FACTOR` items into {name: factor}."""
    scales: dict[str, float] = {}
    for item in items:
        name, sep, text = item.rpartition("=")
        name = name.strip()
        try:
            factor = float(text)
        except ValueError:
            factor = math.nan
        if not sep or not name or not math.isfinite(factor) or factor == 0 or abs(factor) > MAX_WEIGHT:
            raise ValueError(f"bad --reward-scale {item!r}: expected NAME=FACTOR, a finite nonzero number "
                             f"(e.g. jpeg_compressibility=0.002, Flow-GRPO's -kB/500)")
        if name in scales:
            raise ValueError(f"bad --reward-scale {item!r}: {name!r} given twice")
        scales[name] = factor
    return scales


def check_reward_options(names: Sequence[str], judges: dict[str, str], scales: dict[str, float],
                         specs: Sequence[str] = ()) -> None:
    """--reward-judge and --reward-scale name rewards of the run (`names`: its rewards and scorers);
    a judge goes with an openai+http:// reward and each such reward has one (read here, so a bad
    judge file fails before any rank waits)."""
    for flag, given in (("--reward-judge", judges), ("--reward-scale", scales)):
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ValueError(f"{flag} names {unknown}, which the run does not score; its rewards: {list(names)}")
    for spec in specs:
        if is_url(spec):
            name = split_url_spec(spec)[1]
            make_protocol(spec, JudgeConfig.read(name, judges[name]) if name in judges else None)


def reward_model_paths(items: Sequence[str]) -> dict[str, str]:
    """Parse `--reward-model NAME=DIR` items into {name: dir}."""
    paths: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        name = name.strip()
        if not sep or not name or not path:
            raise ValueError(f"bad --reward-model {item!r}: expected NAME=DIR")
        if name not in MODEL_REWARDS:
            raise ValueError(f"bad --reward-model {item!r}: {name!r} is not a model reward; "
                             f"model rewards: {sorted(MODEL_REWARDS)}")
        if name in paths:
            raise ValueError(f"bad --reward-model {item!r}: {name!r} given twice")
        paths[name] = path
    return paths


def parse_reward_specs(specs: Sequence[str], model_paths: dict[str, str] | None = None) -> list[tuple[str, float]]:
    """Validate a whole reward configuration without building anything (cheap: every rank can call it
    at start-up, so a bad flag fails the job before any model loads)."""
    if not specs:
        raise ValueError(f"no reward given; known rewards: {reward_names()}")
    parsed = [parse_reward_spec(s) for s in specs]
    names = [n for n, _ in parsed]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"reward(s) {duplicates} given more than once in {list(specs)}")
    model_paths = model_paths or {}
    for name in model_paths:
        if name not in MODEL_REWARDS:
            raise ValueError(f"model path given for {name!r}, which is not a model reward; "
                             f"model rewards: {sorted(MODEL_REWARDS)}")
    served = {n: reward_url(s) for (n, _), s in zip(parsed, specs) if reward_url(s)}
    both = sorted(set(served) & set(model_paths))
    if both:
        raise ValueError(f"reward(s) {both} are scored by {[served[n] for n in both]}: their weights are the "
                         f"service's, so leave out --reward-model for them")
    missing = [n for n in names if n in MODEL_REWARDS and n not in served and not model_paths.get(n)]
    if missing:
        raise ValueError(f"reward(s) {missing} load weights from a local folder: give "
                         + " ".join(f"--reward-model {n}=DIR" for n in missing) + " (see rewards/README.md)")
    return parsed


class PendingScores:
    """The scores of one batch on their way: `result()` waits for the rewards served over HTTP and
    returns every score plus "combined", as `RewardSet.score_combined` does."""

    def __init__(self, reward_set: "RewardSet", parts: dict[str, Tensor | PendingRequest]):
        self.reward_set, self.parts = reward_set, parts

    def result(self) -> dict[str, Tensor]:
        """Waits at most until each request's deadline (--reward-timeout-s from `submit`)."""
        scores = {n: self.reward_set.scaled(n, v.result() if isinstance(v, PendingRequest) else v)
                  for n, v in self.parts.items()}
        scores["combined"] = self.reward_set.combine(scores).float().cpu().contiguous()
        return scores


class RewardSet:
    """The rewards of a run and their weights. `score` returns every reward separately (for per-reward
    logging); `combine` makes the weighted sum that the advantages are computed from (docs/ALGORITHMS.md).
    A reward given as a URL is scored by that service (`timeout_s`: how long a batch's scores may take,
    retries included; the token of DIGENRL_REWARD_TOKEN_FILE, if set, goes with every request);
    `remote` says whether any is."""

    def __init__(self, specs: Sequence[str], device: str | torch.device = "cpu",
                 model_paths: dict[str, str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 dtype: torch.dtype = torch.float32, judges: dict[str, str] | None = None,
                 scales: dict[str, float] | None = None):
        """`timeout_s`: of a reward service (--reward-timeout-s); `dtype`: the weights of the model
        rewards (--reward-dtype); `judges`: {NAME: judge file} of the openai+http:// rewards
        (--reward-judge); `scales`: {NAME: factor} (--reward-scale). Names of `judges` and `scales`
        that are not in this set are left to the set that has them (a run's scorers)."""
        parsed = parse_reward_specs(specs, model_paths)  # all checks before any model loads
        self.names = [n for n, _ in parsed]
        self.weights = [w for _, w in parsed]
        self.scales = {n: float(f) for n, f in (scales or {}).items() if n in self.names and f != 1.0}
        model_paths = model_paths or {}
        judges = {n: JudgeConfig.read(n, p) for n, p in (judges or {}).items() if n in self.names}
        token = service_token() if any(map(reward_url, specs)) else None

        def build(name: str, spec: str):
            if reward_url(spec):
                return HttpReward(reward_url(spec), name, timeout_s, token, make_protocol(spec, judges.get(name)))
            if user_target(spec):
                return user.UserReward(user_target(spec))
            return build_reward(name, device=device, model_path=model_paths.get(name), dtype=dtype)

        self.rewards = {n: build(n, s) for (n, _), s in zip(parsed, specs)}
        self.remote = any(isinstance(r, HttpReward) for r in self.rewards.values())

    def scaled(self, name: str, scores: Tensor) -> Tensor:
        """A reward's scores in its --reward-scale unit, float32 on the CPU."""
        scores = scores.float().cpu()
        return (scores * self.scales[name] if name in self.scales else scores).contiguous()

    def score(self, images: Tensor, prompts: Sequence[str],
              metadata: Sequence[dict] | None = None) -> dict[str, Tensor]:
        """images (B, 3, H, W) or (B, 3, F, H, W) in [0, 1] -> {name: (B,) float32 CPU}, each in its
        --reward-scale unit."""
        return {n: self.scaled(n, reward(images, prompts, metadata)) for n, reward in self.rewards.items()}

    def combine(self, scores: dict[str, Tensor]) -> Tensor:
        """sum_i weight_i * scores[name_i] -> (B,)."""
        if set(scores) != set(self.names):
            raise ValueError(f"scores for {sorted(scores)} but this set has rewards {sorted(self.names)}")
        return sum(w * scores[n].float() for n, w in zip(self.names, self.weights))

    def submit(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> PendingScores:
        """Send the batch to every reward service first, then compute the local rewards while the
        services work; the result is collected later."""
        sent = {n: r.submit(images, prompts, metadata) for n, r in self.rewards.items() if isinstance(r, HttpReward)}
        parts = {n: sent[n] if n in sent else r(images, prompts, metadata) for n, r in self.rewards.items()}
        return PendingScores(self, parts)

    def score_combined(self, images: Tensor, prompts: Sequence[str],
                       metadata: Sequence[dict] | None = None) -> dict[str, Tensor]:
        """Every reward and their weighted sum under "combined", float32 on CPU: what a generator,
        a scorer rank and evaluation all report, combined alike wherever it is computed."""
        return self.submit(images, prompts, metadata).result()

    def __repr__(self) -> str:
        return "RewardSet(" + ", ".join(f"{n}:{w:g}" for n, w in zip(self.names, self.weights)) + ")"


__all__ = ["MODEL_REWARDS", "VIDEO_REWARDS", "PendingScores", "RewardSet", "build_reward", "check_reward_options",
           "check_user_rewards", "judge_paths", "parse_reward_spec", "parse_reward_specs", "prompt_checker",
           "reward_class", "reward_model_paths", "reward_names", "reward_scales", "reward_url", "service_token",
           "url_protocol", "user_target"]
