"""The run configuration: one tree of dataclasses. Each field's `help` is its --help text; every
field is a flag (`--prompts-per-step`), the resolved tree is written to DIR/config.json."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field

import algorithm
import configfile
import preflight
import runfolder
import sampler
from checkpoint import EXPORT_DTYPES
from parallel import compress
from parallel.plan import DISPATCHES, ShapeTable, StepPlan, plan_step
from parallel.topology import SHARDINGS, Topology
from prompts import eval_records, load_prompts
from rewards import VIDEO_REWARDS, parse_reward_specs, reward_model_paths


ROOT = os.path.dirname(os.path.abspath(__file__))
SHIPPED_MODEL = os.path.join(ROOT, "assets", "shapes-flux")
DATA_DIR = os.path.join(ROOT, "data")
PRESETS = ("auto", "tiny", "mid")
VIDEO_MODELS = ("hunyuan_video", "wan")  # the families whose samples are videos (models/)
LORA_LR, FULL_LR = 3e-4, 1e-5  # docs/ALGORITHMS.md: LoRA 3e-4, full fine-tuning 1e-5


def _f(default, help: str, **kw):
    """A config field: `help` is its --help text, `parse` (optional) turns the flag's string into
    the field's typed value, `action="append"` makes it repeatable, `metavar` names its value."""
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
    dtype: str = _f("auto", "transformer weights: float32, bfloat16, float16 or auto (float32 weights, bf16 autocast "
                            "on CUDA); on CUDA the frozen text encoders are half precision unless float32")
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
    sde_window: tuple | None = _f(None, "START:END: SDE steps only for t in [START, END), ODE elsewhere "
                                        "(Flow-GRPO-Fast)", parse=lambda s: _parse_pair(s, ":", int, "--sde-window"),
                                  metavar="START:END")
    same_group_noise: bool = _f(False, "all samples of a group share their initial noise")


@dataclass
class RLConfig:
    prompts: str | None = _f(None, "prompt file (.txt one per line, or .jsonl with a 'prompt' field); "
                                   "default: data/shapes_train.txt")
    reward: list = _f([], "reward NAME[:WEIGHT], repeatable (default: shapes:1.0)", action="append",
                  metavar="NAME[:WEIGHT]")
    reward_model: list = _f([], "NAME=DIR: local weights folder of a model-based reward, repeatable",
                        action="append", metavar="NAME=DIR")
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
    lr: float | None = _f(None, f"learning rate (default: {LORA_LR:g} with LoRA, {FULL_LR:g} for full fine-tuning)")
    lora_rank: int = _f(32, "LoRA rank on the attention projections; 0 = full fine-tuning")
    lora_alpha: float | None = _f(None, "LoRA alpha (default 2 x rank)")
    lora_targets: str = _f("attn", "LoRA targets: attn (to_q/k/v/out) or attn+ff (also the feed-forward)")
    weight_decay: float = _f(1e-4, "AdamW weight decay")
    adam_betas: tuple = _f((0.9, 0.999), "AdamW betas B1,B2",
                           parse=lambda s: _parse_pair(s, ",", float, "--adam-betas"), metavar="B1,B2")
    grad_clip: float = _f(1.0, "gradient-norm clip")
    ema_decay: float = _f(0.0, "EMA of trained weights for export (0 = off; e.g. 0.95)")
    grad_checkpointing: bool = _f(False, "activation checkpointing of every DiT block during training")
    max_skipped_steps: int = _f(3, "a step whose rewards, advantages, loss or gradients are not finite is skipped "
                                   "(train/skipped_steps); the run stops after N such steps in a row")

    def learning_rate(self) -> float:
        """--lr, or the default of the fine-tuning kind: LoRA or full (--lora-rank 0)."""
        if self.lr is not None:
            return self.lr
        return LORA_LR if self.lora_rank > 0 else FULL_LR


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
    fragment_split: str = _f("auto", "how fragments are shared among generator replicas: even, speed (in proportion to "
                                     "each replica's speed, measured at start-up), or auto (speed when "
                                     "disaggregated; even when colocated, as colocated systems split)")
    dispatch: str = _f("lpt", "how fragments are ordered and given to generator replicas: lpt (predicted cost from "
                              "each prompt's shape, longest first, to the replica that finishes it first) or "
                              "round-robin (step order)")
    memory_budget_gb: float | None = _f(None, "GPU memory per rank, in GB: a plan whose weights, gradients and "
                                              "optimizer state do not fit is refused (forces FSDP for large models)")
    publish_compression: str = _f("none", "what weight publication sends: none, bf16, delta (the difference to the "
                                          "version the generators hold, in bf16) or delta-topk:F (its largest "
                                          "fraction F, with error feedback); generators rebuild bit-exactly what "
                                          "the trainer says they hold, and the trainers train those weights "
                                          "(colocated runs too)", metavar="CODEC")
    dist_timeout_s: int = _f(600, "timeout of every collective, point-to-point and store wait until the first "
                                  "step is measured (then 5 x the slowest step, at least 60 s, at most this)")
    heartbeat_timeout_s: float = _f(30.0, "a rank whose heartbeat stops for this long is reported by rank and role, "
                                          "and every rank exits")
    stop_grace_s: float = _f(25.0, "after SIGTERM or SIGINT, seconds to finish the step and write a checkpoint "
                                   "before exiting without one (torchrun kills its workers 30 s after a SIGTERM)")


@dataclass
class OutputConfig:
    output_dir: str = _f("runs/default", "run folder: config.json, metrics.jsonl, tb/, trace/, checkpoints/")
    resume: str | None = _f(None, "a run folder: continue from its newest valid checkpoint")
    overwrite: bool = _f(False, "start over in an --output-dir that holds a run: remove its run files first (a run "
                                "refuses such a folder otherwise)")
    save_every: int | None = _f(None, "save a checkpoint every N steps (default: every --steps/10, so an interrupted "
                                      "run loses at most a tenth of its steps; 0 = only at the end)")
    keep_checkpoints: int = _f(3, "keep the newest K checkpoints (0 = all); a checkpoint folder holding a file named "
                                  "KEEP is never removed")
    export_dtype: str = _f("bfloat16", "dtype of the exported weights (transformer/, pytorch_lora_weights, ema/): "
                                       "bfloat16, float16 or float32; the run state for --resume keeps float32")
    log_images_every: int = _f(5, "log a grid of training samples every N steps (0 = never)")
    eval_every: int = _f(10, "evaluate on held-out prompts with the ODE sampler every N steps (0 = never)")
    eval_prompts: str | None = _f(None, "held-out prompt file for evaluation (default: data/shapes_eval.txt)")
    eval_num_prompts: int = _f(64, "held-out prompts evaluated each time")
    eval_samples_per_prompt: int = _f(1, "images per held-out prompt, each with its own fixed seed (GenEval: 4)")
    trace: bool = _f(True, "write a Chrome trace per rank to DIR/trace/rank{R}.json")
    debug_link_bandwidth: float | None = _f(None, "MBPS: test-only, emulate a link of this many MB/s between "
                                                  "trainers and generators (publication waits each bucket's "
                                                  "transfer time)", metavar="MBPS")
    debug_slow_rank: tuple | None = _f(None, "R:FACTOR: test-only, rank R sleeps to run FACTOR x slower",
                                       parse=lambda s: _parse_pair(s, ":", (int, float), "--debug-slow-rank"),
                                       metavar="R:FACTOR")


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
        """config.json: the resolved tree, and the commit and package versions that ran it."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({**self.to_dict(), configfile.PROVENANCE: configfile.provenance()}, f, indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        """The inverse of to_dict (config.json, a recipe): typed fields are parsed again (JSON has no
        tuples), a value of the wrong type is a ValueError naming it; the provenance is skipped."""
        kwargs = {}
        for name, value in configfile.config_part(d).items():
            if name == "seed":
                kwargs[name] = configfile.typed("seed", dataclasses.fields(cls)[0], value)
                continue
            sub = _SECTIONS.get(name)
            if sub is None or not isinstance(value, dict):
                raise ValueError(f"config has no section {name!r}; sections: {['seed', *_SECTIONS]}")
            fields = {f.name: f for f in dataclasses.fields(sub)}
            unknown = sorted(set(value) - set(fields))
            if unknown:
                raise ValueError(f"config section {name!r} has no field(s) {unknown}")
            kwargs[name] = sub(**{k: configfile.typed(f"{name}.{k}", fields[k], v) for k, v in value.items()})
        return cls(**kwargs)

    def resolve_defaults(self) -> None:
        """Fill the embedded defaults: the shipped shapes model (flux, --preset auto), the shapes
        prompt sets and the shapes reward."""
        m = self.model
        if m.preset not in PRESETS:
            raise ValueError(f"unknown --preset {m.preset!r}; choose one of {PRESETS}")
        if m.model_path is None and m.preset == "auto":
            if m.model == "flux" and os.path.isdir(SHIPPED_MODEL):
                m.model_path = SHIPPED_MODEL
            else:
                m.preset = "tiny"
        if self.rl.prompts is None:
            self.rl.prompts = os.path.join(DATA_DIR, "shapes_train.txt")
        if self.output.eval_prompts is None:
            self.output.eval_prompts = os.path.join(DATA_DIR, "shapes_eval.txt")
        if not self.rl.reward:
            self.rl.reward = ["shapes:1.0"]
        if self.output.save_every is None:
            self.output.save_every = max(1, self.rl.steps // 10)
        self.optim.lr = self.optim.learning_rate()  # config.json records the value used

    def validate(self, world_size: int) -> "RunFacts":
        """Every user error that needs no process group, raised alike on every rank before any
        rank waits on another. Returns the facts the roles read (`RunFacts`)."""
        return validate(self, world_size)


def _parse_pair(text, sep: str, types, flag: str) -> tuple:
    """'A<sep>B' -> (types[0](A), types[1](B)); a tuple or list (from config.json) passes through
    the same conversion."""
    types = types if isinstance(types, tuple) else (types, types)
    parts = text.split(sep) if isinstance(text, str) else list(text)
    try:
        if len(parts) != 2:
            raise ValueError
        return tuple(t(p) for t, p in zip(types, parts))
    except (TypeError, ValueError):
        raise ValueError(f"{flag} {text!r}: expected two values as A{sep}B") from None


_SECTIONS = {"model": ModelConfig, "sampling": SamplingArgs, "rl": RLConfig, "optim": OptimConfig,
             "topology": TopologyConfig, "output": OutputConfig}
_FLAGS = {"--" + f.name.replace("_", "-"): (section, f.name) for section, cls in _SECTIONS.items()
          for f in dataclasses.fields(cls)}


def _arg_type(f: dataclasses.Field):
    """argparse's `type` of a field: its `parse` (user errors become argparse's clear message), or
    int / float / str from the annotation."""
    parse = f.metadata.get("parse")
    if parse is not None:
        def typed(text: str):
            try:
                return parse(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
        typed.__name__ = f.name
        return typed
    base = f.type.replace(" | None", "")
    return {"int": int, "float": float, "str": str}.get(base, str)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless its help already says what the default is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, [], False):
            return text
        return super()._get_help_string(action)


def build_parser(description: str, sections: tuple[str, ...] | None = None,
                 base: RunConfig | None = None) -> argparse.ArgumentParser:
    """One flag per field (`--prompts-per-step`); `sections` limits the parser to some sections
    (scripts that share the model and sampling flags); `base` (read from --config files) gives
    the defaults, so that flags override the files."""
    base = base or RunConfig()
    parser = argparse.ArgumentParser(description=description, formatter_class=_HelpFormatter)
    configfile.add_config_flag(parser)
    parser.add_argument("--seed", type=int, default=base.seed, help=dataclasses.fields(RunConfig)[0].metadata["help"])
    for section, cls in _SECTIONS.items():
        if sections is not None and section not in sections:
            continue
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            meta = f.metadata
            default = getattr(getattr(base, section), f.name)
            common = dict(dest=f"{section}.{f.name}", help=meta["help"])
            metavar = meta.get("metavar", f.name.upper())
            if meta.get("action") == "append":
                group.add_argument(flag, action="append", default=None, metavar=metavar, **common)
            elif f.type == "bool":
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, **common)
            else:
                group.add_argument(flag, type=_arg_type(f), default=default, metavar=metavar, **common)
    return parser


def config_from_args(args: argparse.Namespace, base: RunConfig | None = None) -> RunConfig:
    """The RunConfig of parsed flags (`section.field` destinations; other attributes are ignored)
    over `base` (the --config files), whose lists a repeatable flag replaces when given."""
    ns = vars(args)
    cfg = copy.deepcopy(base) if base is not None else RunConfig()
    cfg.seed = ns["seed"]
    for key, value in ns.items():
        if "." not in key:
            continue
        section, name = key.split(".")
        if value is None and isinstance(getattr(getattr(cfg, section), name), list):
            continue
        setattr(getattr(cfg, section), name, value)
    return cfg


def parse_config(argv: list[str] | None, description: str = "DigenRL") -> RunConfig:
    """Flags over --config files (read first, in order). A recipe's `[recipe.needs]` flags must be
    given by then: ValueError naming the flag and what it names, before any rank waits."""
    parser, base, recipe = config_parser(argv, description)
    cfg = config_from_args(parser.parse_args(argv), base)
    configfile.check_needs(recipe, lambda flag: getattr(getattr(cfg, _FLAGS[flag][0]), _FLAGS[flag][1]))
    return cfg


def config_parser(argv: list[str] | None, description: str, sections: tuple[str, ...] | None = None):
    """(parser whose defaults are the --config files of argv, their config or None, their [recipe])."""
    files = configfile.config_flag().parse_known_args(argv)[0].config
    base, recipe = load_config_files(files) if files else (None, {})
    return build_parser(description, sections, base), base, recipe


def load_config_files(paths: list[str]) -> tuple[RunConfig, dict]:
    """Recipes and config.json files merged in order (configfile.py) -> (config, [recipe] table)."""
    tree, recipe = configfile.read_config_files(paths, RunConfig.from_dict, set(_FLAGS))
    return RunConfig.from_dict(tree), recipe


@dataclass(frozen=True)
class RunFacts:
    """What a validated config and the world size imply, computed once and read by every role:
    no module decides again whether TSP or TAG is on, or counts the trainers."""

    topology: Topology
    disagg: bool
    tsp: bool
    tag: bool
    tcss: bool
    train_sharding: str
    """sharding of the ranks that train: --colocated-sharding in colocated mode, else --train-sharding"""
    train_micro_batch: int
    """transitions per packed training forward (TSP); without TSP a forward trains one timestep of a chunk"""
    fragment_split: str
    lora: bool
    num_prompts: int
    log_rank: int
    """the rank that logs: the first trainer, since trainers finish every step (generators may run ahead)"""
    resume: runfolder.ResumePoint | None = None
    """--resume: the verified checkpoint the run continues from"""

    @property
    def num_trainers(self) -> int:
        return self.topology.num_trainers

    @property
    def speed_split(self) -> bool:
        """Fragments are shared among replicas by measured speed (else evenly)."""
        return self.fragment_split == "speed" or (self.fragment_split == "auto" and self.disagg)

    def plan(self, cfg: RunConfig, step: int, replica_speeds: list[float] | None = None,
             shapes: ShapeTable | None = None) -> StepPlan:
        """Step k's fragment plan: a pure function of (seed, k, config, replica speeds, prompt
        shapes), the same on every rank (the speeds are measured once at start-up and shared)."""
        rl = cfg.rl
        return plan_step(step, seed=cfg.seed, num_prompts=self.num_prompts, prompts_per_step=rl.prompts_per_step,
                         group_size=rl.group_size, micro_batch=rl.micro_batch,
                         num_replicas=self.topology.num_replicas, num_trainers=self.num_trainers,
                         fragment_groups=cfg.topology.fragment_groups or None, colocated=not self.disagg,
                         replica_speeds=replica_speeds if self.speed_split else None, shapes=shapes,
                         dispatch=cfg.topology.dispatch)


def _choice(flag: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown {flag} {value!r}; choose one of {tuple(choices)}")


def validate(cfg: RunConfig, world_size: int) -> RunFacts:
    """Every user error that needs no process group, each naming the bad value (see RunConfig.validate)."""
    rl, t, o, s = cfg.rl, cfg.topology, cfg.output, cfg.sampling
    topo = Topology.build(world_size, t.mode, t.generators, t.trainers, t.scorers, t.gap_stages)
    for name, value in (("--steps", rl.steps), ("--prompts-per-step", rl.prompts_per_step),
                        ("--group-size", rl.group_size), ("--micro-batch", rl.micro_batch),
                        ("--eval-num-prompts", o.eval_num_prompts),
                        ("--eval-samples-per-prompt", o.eval_samples_per_prompt),
                        ("--train-micro-batch", 1 if t.train_micro_batch is None else t.train_micro_batch),
                        ("--dist-timeout-s", t.dist_timeout_s)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    for name, value in (("--save-every", o.save_every), ("--log-images-every", o.log_images_every),
                        ("--eval-every", o.eval_every), ("--lora-rank", cfg.optim.lora_rank),
                        ("--fragment-groups", t.fragment_groups or 0)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if rl.group_size < 2:
        raise ValueError(f"--group-size must be >= 2 for group-relative advantages, got {rl.group_size}")
    if t.fragment_groups and t.fragment_groups > rl.prompts_per_step:
        raise ValueError(f"--fragment-groups {t.fragment_groups} must be between 1 and --prompts-per-step "
                         f"{rl.prompts_per_step}")
    _choice("--algorithm", rl.algorithm, algorithm.ALGORITHMS)
    _choice("--std-mode", rl.std_mode, ("group", "running"))
    _choice("--sde-type", s.sde_type, sampler.SDE_TYPES)
    _choice("--colocated-sharding", t.colocated_sharding, SHARDINGS)
    _choice("--train-sharding", t.train_sharding, SHARDINGS)
    _choice("--lora-targets", cfg.optim.lora_targets, ("attn", "attn+ff"))
    _choice("--fragment-split", t.fragment_split, ("auto", "even", "speed"))
    _choice("--dispatch", t.dispatch, DISPATCHES)
    _choice("--export-dtype", o.export_dtype, EXPORT_DTYPES)
    compress.parse(t.publish_compression)
    if o.debug_link_bandwidth is not None and not o.debug_link_bandwidth > 0:
        raise ValueError(f"--debug-link-bandwidth must be > 0 MB/s, got {o.debug_link_bandwidth}")
    if t.memory_budget_gb is not None and not t.memory_budget_gb > 0:
        raise ValueError(f"--memory-budget-gb must be > 0, got {t.memory_budget_gb}")
    if not 0 < rl.timestep_fraction <= 1:
        raise ValueError(f"--timestep-fraction must be in (0, 1], got {rl.timestep_fraction}")
    if s.noise_level is not None and not s.noise_level >= 0:
        raise ValueError(f"--noise-level must be >= 0, got {s.noise_level}")
    if s.sample_steps is not None and s.sample_steps < 1:
        raise ValueError(f"--sample-steps must be >= 1, got {s.sample_steps}")
    if s.sde_window is not None:
        start, end = s.sde_window
        top = s.sample_steps if s.sample_steps is not None else end
        if not 0 <= start < end <= top:
            raise ValueError(f"--sde-window {start}:{end} must satisfy 0 <= START < END <= --sample-steps ({top})")
        if rl.algorithm != "window":
            raise ValueError(f"--sde-window {start}:{end} samples ODE steps outside the window, which have no "
                             f"log-probability to train: use --algorithm window (got {rl.algorithm!r})")
    if rl.algorithm == "window" and s.sde_window is None:
        raise ValueError("--algorithm window needs --sde-window START:END")
    if o.debug_slow_rank is not None:
        rank, factor = o.debug_slow_rank
        if not 0 <= rank < world_size or not factor >= 1:
            raise ValueError(f"--debug-slow-rank {rank}:{factor}: the rank must be in [0, {world_size}) and the "
                             f"factor >= 1")
    if t.tag and topo.mode != "disagg":
        raise ValueError(f"--tag needs --mode disagg (got {topo.mode}): colocated ranks all generate already")
    if t.tcss and topo.mode != "disagg":
        raise ValueError("--tcss needs --mode disagg (colocated ranks are never stale)")
    names = [n for n, _ in parse_reward_specs(rl.reward, reward_model_paths(rl.reward_model))]
    if cfg.model.model not in VIDEO_MODELS and VIDEO_REWARDS & set(names):
        raise ValueError(f"reward(s) {sorted(VIDEO_REWARDS & set(names))} score videos; {cfg.model.model!r} makes "
                         f"images (video models: {VIDEO_MODELS})")
    num_prompts = len(load_prompts(rl.prompts))  # a missing or empty prompt file raises here
    if o.eval_every:
        eval_records(o.eval_prompts, o.eval_num_prompts, o.eval_samples_per_prompt)
    preflight.check_run(cfg)  # every other flag, the model folder and sizes, the prompts' grammar
    resume = runfolder.check(cfg)  # the run folder and --resume
    disagg = topo.mode == "disagg"
    return RunFacts(topology=topo, disagg=disagg, tsp=t.tsp, tag=t.tag, tcss=t.tcss,
                    train_sharding=t.train_sharding if disagg else t.colocated_sharding,
                    train_micro_batch=t.train_micro_batch or rl.micro_batch, fragment_split=t.fragment_split,
                    lora=cfg.optim.lora_rank > 0, num_prompts=num_prompts, log_rank=topo.trainer_ranks[0],
                    resume=resume)
