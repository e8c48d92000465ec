"""The run configuration: one tree of dataclasses. Each field's `help` is its --help text; every
field is a flag (`--prompts-per-step`), the resolved tree is written to DIR/config.json."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field


def _f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ModelConfig:
    model: str = _f("flux", "model family: flux, wan, qwen_image, hunyuan_video, sd3")
    model_path: str | None = _f(None, "local diffusers folder of the base model; default: the shipped "
                                      "shapes model (flux) if present, else the offline tiny preset")
    preset: str = _f("auto", "without --model-path: auto (the shipped shapes model for flux, else tiny), tiny "
                             "(a random offline model, for tests) or mid (random, ~42M parameters, for benchmarks)")
    dtype: str = _f("auto", "model dtype: float32, bfloat16, float16, auto (bf16 autocast on CUDA, fp32 on CPU)")
    attention: str = _f("sdpa", "attention kernel through diffusers' dispatcher: sdpa, flash, flash_varlen, sage")
    device: str = _f("auto", "cpu, cuda or auto (each rank uses cuda:LOCAL_RANK when CUDA is available)")


@dataclass
class SamplingArgs:
    height: int | None = _f(None, "image height in pixels (default: the model's)")
    width: int | None = _f(None, "image width in pixels (default: the model's)")
    num_frames: int | None = _f(None, "video families: frames per sample")
    sample_steps: int | None = _f(None, "denoising steps K per sample (default: the model's)")
    sde_type: str = _f("sde", "sampler: sde (Flow-GRPO), cps (coefficients-preserving), dance (DanceGRPO)")
    noise_level: float | None = _f(None, "SDE noise level a (sde/cps) or eta (dance); default: the model's")
    guidance: float | None = _f(None, "guidance-embedding scale (FLUX: 3.5)")
    cfg_scale: float | None = _f(None, "classifier-free guidance scale, also used at training time; 1 = off")
    negative_prompt: str = _f("", "negative prompt for CFG")
    sde_window: str | None = _f(None, "START:END: SDE steps only in this window, ODE elsewhere (Flow-GRPO-Fast)")
    same_group_noise: bool = _f(False, "all samples of a group share their initial noise")


@dataclass
class RLConfig:
    prompts: str | None = _f(None, "prompt file (.txt one per line, or .jsonl with a 'prompt' field); "
                                   "default: data/shapes_train.txt")
    reward: list = _f([], "reward NAME[:WEIGHT], repeatable (default: shapes:1.0)", action="append")
    reward_model: list = _f([], "NAME=DIR: local weights folder of a model-based reward, repeatable", action="append")
    steps: int = _f(50, "training steps (one optimizer update each)")
    prompts_per_step: int = _f(8, "B: prompts (groups) per step")
    group_size: int = _f(8, "G: samples per prompt")
    micro_batch: int = _f(8, "samples per forward pass, in generation and in training")
    algorithm: str = _f("flow_grpo", "trained-timestep selection: flow_grpo (first frac*K steps in order), "
                                     "dance_grpo (random per-sample subset), window (the SDE window only)")
    timestep_fraction: float = _f(0.99, "fraction of the K steps trained (Flow-GRPO 0.99, DanceGRPO 0.6)")
    clip_range: float = _f(1e-4, "PPO clip range eps of the importance ratio")
    adv_clip: float = _f(5.0, "advantages are clamped to [-adv_clip, adv_clip]")
    beta: float = _f(0.0, "KL coefficient to the reference policy (0 disables the reference forward)")
    std_mode: str = _f("group", "advantage std: group (the group's own) or running (running std of previous batches)")
    drop_zero_std: bool = _f(False, "drop transitions of groups whose rewards are all equal")


@dataclass
class OptimConfig:
    lr: float = _f(3e-4, "learning rate (3e-4 for LoRA, 1e-5 for full fine-tuning)")
    lora_rank: int = _f(32, "LoRA rank on the attention projections; 0 = full fine-tuning")
    lora_alpha: float | None = _f(None, "LoRA alpha (default 2 x rank)")
    lora_targets: str = _f("attn", "LoRA targets: attn (to_q/k/v/out) or attn+ff (also the feed-forward)")
    weight_decay: float = _f(1e-4, "AdamW weight decay")
    adam_betas: str = _f("0.9,0.999", "AdamW betas")
    grad_clip: float = _f(1.0, "gradient-norm clip")
    ema_decay: float = _f(0.0, "EMA of trained weights for export (0 = off; e.g. 0.95)")
    grad_checkpointing: bool = _f(False, "activation checkpointing of every DiT block during training")


@dataclass
class TopologyConfig:
    mode: str = _f("disagg", "disagg: generator and trainer ranks; colocated: every rank does both")
    generators: int | None = _f(None, "number of generator ranks (disagg; default: half the world)")
    trainers: int | None = _f(None, "number of trainer ranks (disagg; default: the rest)")
    scorers: int = _f(0, "number of scorer ranks (run the rewards of fragments they receive)")
    gap_stages: int = _f(1, "pipeline stages per generator replica (GAP)")
    fragment_groups: int | None = _f(1, "groups per fragment (GAP streaming); 0 = naive: all of a replica's groups "
                                           "in one fragment")
    colocated_sharding: str = _f("replicate", "colocated mode: replicate (every rank a full copy) or fsdp")
    train_sharding: str = _f("replicate", "trainer group: replicate (data parallel) or fsdp (FSDP2 fully_shard)")
    tsp: bool = _f(False, "TSP: pack transitions across samples and timesteps and spread every fragment over all "
                          "trainer ranks")
    train_micro_batch: int | None = _f(None, "TSP: transitions per training forward (default: --micro-batch)")
    tag: bool = _f(False, "TAG: idle trainers generate unstarted fragments when BTS predicts a shorter step "
                          "(FSDP trainers generate together, as trainer 0 decides)")
    tcss: bool = _f(False, "TCSS: generators may start step k+1 with version k (staleness at most 1)")
    dist_timeout_s: int = _f(600, "timeout of every collective and point-to-point wait, in seconds")


@dataclass
class OutputConfig:
    output_dir: str = _f("runs/default", "run folder: config.json, metrics.jsonl, tb/, trace/, checkpoints/")
    resume: str | None = _f(None, "a run folder: continue from its newest checkpoint")
    save_every: int = _f(0, "save a checkpoint every N steps (0 = only at the end)")
    log_images_every: int = _f(5, "log a grid of training samples every N steps (0 = never)")
    eval_every: int = _f(10, "evaluate on held-out prompts with the ODE sampler every N steps (0 = never)")
    eval_prompts: str | None = _f(None, "held-out prompt file for evaluation (default: data/shapes_eval.txt)")
    eval_num_prompts: int = _f(64, "held-out prompts evaluated each time")
    eval_samples_per_prompt: int = _f(1, "images per held-out prompt, each with its own fixed seed (GenEval: 4)")
    trace: bool = _f(True, "write a Chrome trace per rank to DIR/trace/rank{R}.json")
    debug_slow_rank: str | None = _f(None, "R:FACTOR: test-only, rank R sleeps to run FACTOR x slower")


@dataclass
class RunConfig:
    seed: int = _f(0, "seed: sample i of step k draws all its noise from (seed, k, i) only")
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingArgs = field(default_factory=SamplingArgs)
    rl: RLConfig = field(default_factory=RLConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        kwargs = {}
        for name, value in d.items():
            sub = _SECTIONS.get(name)
            kwargs[name] = sub(**value) if sub else value
        return cls(**kwargs)


_SECTIONS = {"model": ModelConfig, "sampling": SamplingArgs, "rl": RLConfig, "optim": OptimConfig,
             "topology": TopologyConfig, "output": OutputConfig}


def _arg_type(annotation: str):
    base = annotation.replace(" | None", "")
    return {"int": int, "float": float, "str": str}.get(base, str)


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help=dataclasses.fields(RunConfig)[0].metadata["help"])
    for section, cls in _SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            meta = f.metadata
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if meta.get("action") == "append":
                group.add_argument(flag, dest=f"{section}.{f.name}", action="append", default=None, help=meta["help"])
            elif f.type == "bool":
                group.add_argument(flag, dest=f"{section}.{f.name}", action=argparse.BooleanOptionalAction,
                                   default=default, help=meta["help"])
            else:
                group.add_argument(flag, dest=f"{section}.{f.name}", type=_arg_type(f.type), default=default,
                                   help=meta["help"])
    return parser


def parse_config(argv: list[str] | None, description: str = "DigenRL") -> RunConfig:
    ns = vars(build_parser(description).parse_args(argv))
    cfg = RunConfig(seed=ns.pop("seed"))
    for key, value in ns.items():
        section, name = key.split(".")
        if value is None and isinstance(getattr(getattr(cfg, section), name), list):
            continue
        setattr(getattr(cfg, section), name, value)
    return cfg

