"""One RL step's workload, as the planner and the peer-system models see it: model and resolution,
the sampling and training settings, the reward models, and the kernel settings of the run."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from parallel.compress import parse as parse_codec
from planner.hardware import Kernels
from planner.released_specs import model_spec
from planner.specs import AuxModel, ModelSpec, Resolution, attention_share, forward_flops, image_tokens
from rl import algorithms

REWARDS: dict[str, AuxModel] = {r.name: r for r in (
    # CLIP-H/14 scorers: ~1B parameters, 257 image + 77 text tokens.
    AuxModel("pickscore", 0.99e9, 334),
    AuxModel("hpsv2", 0.99e9, 334),
    # A generative OCR judge (VeRL-Omni: Qwen3-VL-8B through vLLM): ~330 image tokens of a 512^2
    # image plus ~100 prompt tokens, ~32 generated tokens.
    AuxModel("ocr_vlm", 8.2e9, 430, 32),
    # VideoAlign (Qwen2-VL-2B) over a short clip: ~1500 visual tokens, one scoring pass.
    AuxModel("videoalign", 2.2e9, 1500),
    # PaddleOCR runs on the CPU in Flow-GRPO / GenRL: no GPU time, no GPU memory.
    AuxModel("ocr_cpu", 0.0, 0),
)}


def reward_model(name: str) -> AuxModel:
    if name not in REWARDS:
        raise ValueError(f"unknown reward model {name!r}; known: {sorted(REWARDS)}")
    return REWARDS[name]


@dataclass(frozen=True)
class Workload:
    model: str
    height: int
    width: int
    frames: int = 1
    sampling_steps: int = 10
    trained_timesteps: int = 9
    """timesteps trained per sample (Flow-GRPO floor(0.99 K), DanceGRPO 0.6 K, a window of 2)"""
    prompts_per_step: int = 24
    group_size: int = 24
    cfg_scale: float = 1.0
    """> 1: classifier-free guidance, two branches per forward in rollout and in training"""
    finetune: str = "lora"
    lora_rank: int = 32
    gradient_checkpointing: bool = False
    kl: bool = False
    """a KL term: one reference forward per trained transition"""
    text_tokens: int | None = None
    rewards: tuple[str, ...] = ("pickscore",)
    kernels: Kernels = field(default_factory=Kernels)
    rollout_micro_batch: int = 8
    """samples per rollout forward (DigenRL generators; peer systems use their own)"""
    train_micro_batch: int = 16
    """transitions per training forward (TSP; peer systems use their own)"""
    optimizer_steps: int = 1
    """optimizer updates per step (mini-batches)"""
    shapes: tuple[tuple[int, int, int, float], ...] = ()
    """a shape mix: (height, width, frames, weight) buckets, one shape per prompt group, the step's
    prompts drawn in proportion to the weights (`group_keys`); empty: every prompt at height x width
    x frames. height, width and frames stay the run's default shape (the description)"""
    publish_compression: str = "bf16"
    """the codec of weight publication (parallel/compress.py, --publish-compression): bf16 (the
    planner's default), none (the trained tensors in their dtype, `param_bytes`), delta, delta-topk:F"""
    param_bytes: int = 4
    """bytes per element of the trained tensors (fp32 under the runtime's --dtype auto)"""
    frozen_forwards: int = 0
    """forwards without gradient per trained transition besides the KL reference's (an algorithm's:
    DiffusionNFT's old policy; rl.algorithms.Cost)"""
    state_copies: tuple[tuple[str, int], ...] = ()
    """(name, count) of float32 copies of the trained weights each trainer keeps (DiffusionNFT: the old policy)"""
    carried: tuple[int, int] | None = None
    """(latents, log-probabilities) a fragment carries per sample; None: the path around every trained
    step (DiffusionNFT: the clean sample alone, (1, 0))"""
    reward_gpus: int = 0
    """GPUs of a reward service (the runtime's --reward http://HOST:PORT/NAME): the reward models
    run there, not on the plan's ranks, while the generators denoise their next fragment; the plan
    pays for these GPUs too (lab.planning.placements.with_reward_service)"""

    def __post_init__(self):
        model_spec(self.model)
        Resolution(self.height, self.width, self.frames)
        if self.finetune not in ("lora", "full"):
            raise ValueError(f"finetune must be lora or full, got {self.finetune!r}")
        if not 1 <= self.trained_timesteps <= self.sampling_steps:
            raise ValueError(f"trained_timesteps {self.trained_timesteps} must be in 1..sampling_steps "
                             f"{self.sampling_steps}")
        for name in ("prompts_per_step", "group_size", "rollout_micro_batch", "train_micro_batch",
                     "optimizer_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.finetune == "lora" and self.lora_rank < 1:
            raise ValueError(f"LoRA needs lora_rank >= 1, got {self.lora_rank}")
        for r in self.rewards:
            reward_model(r)
        for bucket in self.shapes:
            if len(bucket) != 4 or not bucket[3] > 0:
                raise ValueError(f"a shape bucket is (height, width, frames, weight > 0), got {bucket}")
            Resolution(*bucket[:3])
        if len({b[:3] for b in self.shapes}) != len(self.shapes):
            raise ValueError(f"a shape appears twice in the mix {self.shapes}")
        parse_codec(self.publish_compression)
        if self.reward_gpus < 0:
            raise ValueError(f"reward_gpus must be >= 0, got {self.reward_gpus}")

    # -- derived quantities -------------------------------------------------------------------
    @property
    def spec(self) -> ModelSpec:
        return model_spec(self.model)

    @property
    def resolution(self) -> Resolution:
        return Resolution(self.height, self.width, self.frames)

    @property
    def n_img(self) -> int:
        return image_tokens(self.resolution)

    @property
    def n_txt(self) -> int:
        return self.spec.text_tokens if self.text_tokens is None else self.text_tokens

    @property
    def seq(self) -> int:
        return self.n_img + self.n_txt

    @property
    def branches(self) -> int:
        return 2 if self.cfg_scale > 1.0 else 1

    @property
    def samples(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def transitions(self) -> int:
        return self.samples * self.trained_timesteps

    @property
    def fwd_flops(self) -> float:
        """One sample, one denoising step, one branch."""
        return forward_flops(self.spec, self.n_img, self.n_txt)

    @property
    def attn_share(self) -> float:
        return attention_share(self.spec, self.n_img, self.n_txt)

    @property
    def train_factor(self) -> int:
        """Physical forward-equivalents of one trained transition: forward + activation gradients
        (+ weight gradients for full fine-tuning) (+ the recomputed forward with checkpointing)
        (+ the algorithm's frozen forwards: DiffusionNFT's old policy)."""
        return (3 if self.finetune == "full" else 2) + (1 if self.gradient_checkpointing else 0) + self.frozen_forwards

    # -- a shape mix ----------------------------------------------------------------------------
    def group_keys(self) -> list[tuple[int, int, int]]:
        """The shape (height, width, frames) of each of the step's prompt groups: the mix's weights
        apportioned to `prompts_per_step` groups by largest remainder (ties: the earlier bucket), in
        bucket order. The planner hands them to the runtime's step plan, which draws them in a
        seeded order, as it draws a prompt file with this mix."""
        if not self.shapes:
            return [(self.height, self.width, self.frames)] * self.prompts_per_step
        total = sum(b[3] for b in self.shapes)
        quota = [self.prompts_per_step * b[3] / total for b in self.shapes]
        counts = [int(q) for q in quota]
        by_remainder = sorted(range(len(quota)), key=lambda i: (-(quota[i] - counts[i]), i))
        for i in by_remainder[:self.prompts_per_step - sum(counts)]:
            counts[i] += 1
        return [tuple(b[:3]) for b, n in zip(self.shapes, counts) for _ in range(n)]

    def at(self, key: tuple[int, int, int]) -> "Workload":
        """This workload with every prompt at one shape (height, width, frames)."""
        return replace(self, height=key[0], width=key[1], frames=key[2], shapes=())

    def largest(self) -> "Workload":
        """The one-shape workload of the mix's shape with the most tokens (what memory must hold)."""
        if not self.shapes:
            return self
        return max((self.at(tuple(b[:3])) for b in self.shapes), key=lambda w: (w.seq, w.height * w.width))

    def model_flops(self) -> float:
        """The step's model FLOPs as MFU counts them: every rollout forward, 3 forwards per trained
        transition, a reference forward per transition with KL (recomputation not counted)."""
        if self.shapes:
            keys = self.group_keys()
            return sum(self.at(k).model_flops() * keys.count(k) / len(keys) for k in set(keys))
        per = self.fwd_flops * self.branches
        return self.samples * (self.sampling_steps * per
                               + self.trained_timesteps * per * (3 + int(self.kl) + self.frozen_forwards))

    def describe(self) -> str:
        frames = f"x{self.frames}" if self.frames > 1 else ""
        size = f"{self.height}x{self.width}{frames}" if not self.shapes else "shapes " + ",".join(
            f"{h}x{w}{f'x{f}' if f > 1 else ''}:{weight:g}" for h, w, f, weight in self.shapes)
        return (f"{self.spec.name} {size}, K={self.sampling_steps} "
                f"({self.trained_timesteps} trained), {self.prompts_per_step}x{self.group_size} samples, "
                f"{'CFG ' + format(self.cfg_scale, 'g') if self.branches == 2 else 'no CFG'}, "
                f"{'LoRA r' + str(self.lora_rank) if self.finetune == 'lora' else 'full FT'}"
                f"{', checkpointing' if self.gradient_checkpointing else ''}{', KL' if self.kl else ''}"
                f"{f', {self.frozen_forwards} frozen forward(s)' if self.frozen_forwards else ''}"
                f"{''.join(f', {name}' for name, _ in self.state_copies)}"
                f"{f', {self.carried[0]} latent(s) carried' if self.carried else ''}"
                f"{f', rewards served on {self.reward_gpus} GPU(s)' if self.reward_gpus else ''}")

    def with_(self, **kw) -> "Workload":
        return replace(self, **kw)


ALGORITHMS = algorithms.names()


def for_algorithm(base: Workload, algorithm: str, *, window: int = 2, fraction: float | None = None) -> Workload:
    """`base` (its model, shape, batch and fine-tuning) as `algorithm` prices it (its `cost`,
    rl/algorithms/): the trained (sample, t) pairs per sample of its K rollout steps, the forwards
    without gradient each costs, the weight copies its trainers keep and what a fragment carries (its
    KL to the reference as `base.kl` says). `window`: an SDE window's steps; `fraction`: the trained
    fraction (None: the authors')."""
    cost = algorithms.algorithm(algorithm).cost(base.sampling_steps, fraction, window)
    return replace(base, trained_timesteps=cost.trained_timesteps, frozen_forwards=cost.frozen_forwards,
                   state_copies=cost.state_copies, carried=cost.carried)


def ceil_div(a: float, b: float) -> int:
    return int(math.ceil(a / b - 1e-12))


def parse_shape_mix(text: str) -> tuple[tuple[int, int, int, float], ...]:
    """'512x512:1,1024x1024:1' (HxW[xFRAMES][:WEIGHT], weight 1 when left out) -> Workload.shapes."""
    out = []
    for item in text.split(","):
        size, _, weight = item.strip().partition(":")
        dims = size.split("x")
        try:
            h, w, f = int(dims[0]), int(dims[1]), int(dims[2]) if len(dims) == 3 else 1
            wt = float(weight) if weight else 1.0
            if len(dims) not in (2, 3):
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(f"shape mix item {item!r}: expected HxW[xFRAMES][:WEIGHT], e.g. 1024x1024:2") from None
        out.append((h, w, f, wt))
    return tuple(out)


__all__ = ["ALGORITHMS", "REWARDS", "Workload", "ceil_div", "for_algorithm", "parse_shape_mix", "reward_model"]
