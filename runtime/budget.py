"""A run's GPU memory per role from the one memory model (planner/memory.py): the sizes it needs,
read from the run's model (a loaded one, or a released config on the meta device) and its config.

The runtime checks --memory-budget-gb with it before any rank waits on another, and
scripts/check_recipe.py prints it beside the measurement (lab/memory/measure.py). Both count what
the roles allocate as tensors; planner.memory.CONTEXT_BYTES stands for the CUDA context and the
communicators' buffers.
"""
from __future__ import annotations

import functools
import json
import math
import os

import torch
import transformers

from config.cli import load_config_files
from config.schema import DATA_DIR, RunConfig
from config.validate import RunFacts, validate
from models import model_dtypes
from models.lora import lora_targets
from models.released import count_parameters, meta_adapter
from parallel import compress
from planner import hardware
from planner import memory as model
from rewards import parse_reward_spec, reward_url
from rl import algorithms

GiB = 1024 ** 3

REWARD_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rewards", "configs")
REWARD_MODELS = {"pickscore": "clip_vit_h_14", "hpsv2": "clip_vit_h_14", "clip_score": "clip_vit_l_14",
                 "laion_aesthetic": "clip_vit_l_14", "ocr": "trocr_large"}
"""The network of each model reward (rule rewards load none)."""


def reward_network(name: str) -> torch.nn.Module:
    """The released network of reward model `name` (rewards/configs/), on the meta device."""
    with open(os.path.join(REWARD_CONFIGS, f"{REWARD_MODELS[name]}.json")) as f:
        spec = json.load(f)
    spec.pop("about", None)
    cls = getattr(transformers, spec.pop("_class_name"))
    if cls is transformers.VisionEncoderDecoderModel:
        config = cls.config_class.from_encoder_decoder_configs(transformers.AutoConfig.for_model(**spec["encoder"]),
                                                               transformers.AutoConfig.for_model(**spec["decoder"]))
    else:
        config = cls.config_class(**spec)
    with torch.device("meta"):
        return cls(config).eval().requires_grad_(False)


@functools.lru_cache(maxsize=None)
def _reward_count(name: str) -> int:
    return count_parameters({name: reward_network(name)})[name]


def reward_parameters(specs: list[str]) -> float:
    """Parameters of the run's model rewards (their released networks; a served reward holds none)."""
    names = {parse_reward_spec(s)[0] for s in specs if not reward_url(s)}
    return float(sum(_reward_count(n) for n in names if n in REWARD_MODELS))


def fsdp_units(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP units parallel/fsdp.shard_modules makes: every block and every top-level module."""
    out = []
    for child in transformer.children():
        out.extend(child if isinstance(child, torch.nn.ModuleList) else [child])
    return out


def run_shape(cfg: RunConfig, facts: RunFacts, adapter) -> model.RunShape:
    """The model's view of a run on `adapter` (LoRA applied or not: adapters are counted by name)."""
    s, rl, o = cfg.sampling, cfg.rl, cfg.optim
    d = adapter.defaults
    height, width, frames = s.height or d.height, s.width or d.width, s.num_frames or d.num_frames
    latent = adapter.latent_shape(height, width, frames)
    counts = count_parameters(adapter.pipe.components)
    named = dict(adapter.transformer.named_parameters())
    lora = sum(p.numel() for n, p in named.items() if ".lora_" in n)
    if facts.lora and not lora:  # a model without its adapters yet: peft's own count
        lora = _lora_count(adapter, cfg)
    config = adapter.transformer.config
    dtypes = model_dtypes(cfg.model.dtype, torch.device("cuda"), master=not facts.lora)
    compute = dtypes["default"].itemsize
    plan = facts.step_plan(cfg, 0)
    text = adapter.max_sequence_length + (77 if adapter.family == "sd3" else 0)
    algorithm = algorithms.algorithm(rl.algorithm)
    steps = s.sample_steps or d.num_steps
    return model.RunShape(
        family=adapter.family, dit=counts["transformer"] - lora,
        text=sum(v for k, v in counts.items() if k.startswith("text_encoder")), vae=counts.get("vae", 0),
        rewards=reward_parameters(rl.reward), hidden=config.num_attention_heads * config.attention_head_dim,
        blocks=len(adapter.blocks), largest_unit=max(sum(p.numel() for p in u.parameters()) for u in
                                                     fsdp_units(adapter.transformer)),
        largest_tensor=max(p.numel() for p in named.values()), tokens=adapter.image_seq_len(latent) + text,
        latent=math.prod(latent), pixels=height * width * (frames or 1), steps=steps,
        branches=2 if (s.cfg_scale or d.cfg_scale) > 1 else 1, gen_micro=rl.micro_batch,
        train_micro=facts.train_micro_batch if facts.tsp else rl.micro_batch,
        fragment=max(len(f.sample_ids) for f in plan.fragments), lora=float(lora),
        weight_bytes=dtypes["transformer"].itemsize, compute_bytes=compute,
        reward_bytes=4 if rl.reward_dtype == "float32" else compute, checkpointing=o.grad_checkpointing,
        reference=algorithm.loss(rl).needs_reference, ema=o.ema_decay > 0,
        state_copies=algorithm.cost(steps, rl.timestep_fraction).state_copies,
        lossy_codec=compress.lossy(cfg.topology.publish_compression), tcss=facts.tcss, tail_assist=facts.tail_assist,
        trainers_sample=cfg.output.eval_every > 0 or facts.tag, encodes=not cfg.model.prompt_embeds)


def _lora_count(adapter, cfg: RunConfig) -> int:
    """Adapter parameters peft adds: rank x (in + out) for every targeted Linear."""
    targets = lora_targets(adapter.transformer, cfg.optim.lora_targets)
    return sum(cfg.optim.lora_rank * (m.in_features + m.out_features) for name, m in adapter.transformer.named_modules()
               if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets))


def predict(cfg: RunConfig, facts: RunFacts, adapter,
            capacity: float = float("inf")) -> dict[str, dict[str, model.MemoryUse]]:
    """{role: {phase: MemoryUse}} of every role the run's topology has."""
    shape, topo = run_shape(cfg, facts, adapter), facts.topology
    shard = facts.num_trainers if facts.train_sharding == "fsdp" else 1
    evaluates = bool(cfg.output.eval_every)
    if not facts.disagg:
        return {"colocated": model.colocated_phases(shape, capacity, shard=shard, evaluates=evaluates)}
    out = {}
    stages = topo.gap_stages
    for stage in sorted({0, stages - 1}):
        role = "generator" if stages == 1 else f"generator stage {stage}"
        out[role] = model.generator_phases(shape, capacity, stages=stages, stage=stage, scores=not topo.scorer_ranks)
    out["trainer"] = model.trainer_phases(shape, capacity, shard=shard, evaluates=evaluates)
    if topo.scorer_ranks:
        out["scorer"] = {"scoring": model.scorer_phase(shape, capacity)}
    return out


def check_budget(cfg: RunConfig, facts: RunFacts, adapter) -> None:
    """--memory-budget-gb: refuse a run whose predicted peak on some rank exceeds the budget, naming the
    role, its phase and its largest items. The same on every rank, before any rank waits on another."""
    budget = cfg.topology.memory_budget_gb
    if budget is None:
        return
    for role, phases in predict(cfg, facts, adapter, budget * 1e9).items():
        top = model.peak(phases)
        if top.total > budget * 1e9:
            items = ", ".join(f"{k} {v / 1e9:.3g}" for k, v in sorted(top.items.items(), key=lambda kv: -kv[1])[:4])
            fix = ("shard the training state with more trainer ranks (--train-sharding fsdp) or use LoRA"
                   if role in ("trainer", "colocated") else "use more --gap-stages")
            raise ValueError(f"--memory-budget-gb {budget:g}: a {role} needs {top.total / 1e9:.3g} GB at its "
                             f"{top.phase} ({items} GB, planner/memory.py); {fix}")


# ----- recipes ----------------------------------------------------------------------------------
def load_recipe(paths: list[str]):
    """(config, recipe table, RunFacts) of a recipe and its extra config files, with stand-ins for
    what the recipe needs from the user (weights, prompts): nothing is loaded."""
    cfg, recipe = load_config_files(paths)
    for key in ("model_config", "gpu", "gpus"):
        if key not in recipe:
            raise ValueError(f"{paths[0]!r} has no recipe.{key}: not a recipe")
    cfg.rl.reward_model = [f"{spec.split(':')[0]}=/weights" for spec in cfg.rl.reward]
    cfg.rl.prompts = cfg.output.eval_prompts = os.path.join(DATA_DIR, "shapes_train.txt")
    cfg.resolve_defaults()
    facts = validate(cfg, recipe["gpus"], released=recipe["model_config"])  # stands for the weights
    return cfg, recipe, facts


def recipe_report(cfg, recipe, facts, gpu: hardware.GPU, measured: dict | None) -> dict:
    """Per role: the measured peak phase (lab/memory/measure.py's RankMemory; the predicted one without a
    measurement) with the model's figure for it, the categories at the peak, every phase's figures."""
    predicted = predict(cfg, facts, meta_adapter(recipe["model_config"]), gpu.memory_bytes)
    roles = []
    for role, phases in predicted.items():
        got = measured.get(role) if measured else None
        phase = got.peak_phase if got is not None else model.peak(phases).phase
        row = {"role": role, "phase": phase,
               "measured_peak_gib": round(got.peak["total"] / GiB, 2) if got is not None else None,
               "predicted_peak_gib": round(phases[phase].tensors / GiB, 2) if phase in phases else None,
               "categories": {k: round(v / GiB, 2) for k, v in (got.peak if got is not None else
                                                                phases[phase].categories()).items() if k != "total"},
               "phases": {p: {"measured_gib": round(got.phases[p]["total"] / GiB, 2) if got and p in got.phases
                              else None, "predicted_gib": round(m.tensors / GiB, 2),
                              "categories": {k: round(v / GiB, 2) for k, v in got.phases[p].items() if k != "total"}
                              if got and p in got.phases else None} for p, m in phases.items()}}
        if got is not None:
            row.update(rank=got.rank, seconds=round(got.seconds, 1), unknown_reads=got.unknown_reads,
                       working_sets_gib={k: round(v / GiB, 3) for k, v in got.rises.items()})
        roles.append(row)
    usable = model.USABLE_FRACTION * gpu.memory_bytes - model.CONTEXT_BYTES
    return {"recipe": recipe.get("name"), "gpus": recipe["gpus"], "gpu": gpu.key, "gpu_memory_gib":
            round(gpu.memory_bytes / GiB, 2), "usable_gib": round(usable / GiB, 2),
            "topology": f"{len(facts.topology.generator_ranks)} generators + {facts.topology.num_trainers} trainers "
                        f"({facts.train_sharding})", "roles": roles}

__all__ = ["GiB", "REWARD_MODELS", "check_budget", "load_recipe", "predict", "recipe_report",
           "reward_network", "reward_parameters", "run_shape"]
