"""Checks that need neither a process group nor a loaded model, run by RunConfig.validate on every
rank before any rank loads a weight or waits on another: every numeric flag against its range (and
every float within float32's, which the weights and the optimizer compute in), every choice, every
file the run reads (the model folder's JSON that parses, safetensors files whose headers agree with
their bytes, no broken link or symlink loop; the reward models' folders), the sample size of the
run and of every prompt against the model's packing (the families' class attributes and
config.json, no weights), the prompts against the rewards' grammars, and the test hooks'
environment variables. Each error is a ValueError naming the flag, file or variable and the bad value.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os

import torch

from checkpointing import checkpoint
from checkpointing.checkpoint import EXPORT_DTYPES
from config.schema import PLACEMENTS, eval_scorers
from models import ATTENTION_BACKENDS, adapter_class, check_attention
from models.adapter import check_model_folder, preset_defaults, read_folder_defaults
from models.lora import split_targets
from models.released import released_config
from parallel import compress
from parallel.publish import CORRUPT_ENV, CORRUPT_MODES
from parallel.stepplan import DISPATCHES
from parallel.topology import SHARDINGS
from prompts import embeds
from prompts import resolutions
from prompts.sets import check_regular
from rl import algorithms, sampler
from rl.advantages import COMBINES, STD_MODES
from rl.loss import KL_FORMS
from rl.updates import SPLITS, UpdateSplit
from rewards import parse_reward_spec, prompt_checker, reward_model_paths

DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
FOLDER_JSON = ("model_index.json", "digenrl.json", "config.json", "scheduler_config.json", "tokenizer_config.json",
               "tokenizer.json", "special_tokens_map.json", "added_tokens.json", "generation_config.json")
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # 3.4028e38
RAISE_ENV = "DIGENRL_DEBUG_RAISE"  # test hook: RANK:STEP raises on that rank at that step (runtime/guard.py)
# bytes per element of each safetensors dtype (the format's spec)
SAFETENSORS_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                     "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _need(ok: bool, flag: str, value, what: str) -> None:
    if not ok:
        raise ValueError(f"{flag} must be {what}, got {value}")


def check_float32(cfg) -> None:
    """Every float flag (and float pair) within float32's range: the weights, the optimizer and the
    rewards compute in float32, where 1e39 is inf (an --lr of 1e39 overflowed inside AdamW)."""
    for section in ("model", "sampling", "rl", "optim", "topology", "output"):
        for f in dataclasses.fields(getattr(cfg, section)):
            value = getattr(getattr(cfg, section), f.name)
            values = value if isinstance(value, tuple) else (value,)
            if any(isinstance(v, float) and math.isfinite(v) and abs(v) > FLOAT32_MAX for v in values):
                raise ValueError(f"--{f.name.replace('_', '-')} {','.join(map(str, values))} is beyond float32's range "
                                 f"(|x| <= {FLOAT32_MAX:.4g}), in which the run computes")


def check_numbers(cfg) -> None:
    """Every numeric flag against its range, each once (config.validate calls this first)."""
    check_float32(cfg)
    o, s, rl, t = cfg.optim, cfg.sampling, cfg.rl, cfg.topology
    for name, value in (("--steps", rl.steps), ("--prompts-per-step", rl.prompts_per_step),
                        ("--group-size", rl.group_size), ("--micro-batch", rl.micro_batch),
                        ("--eval-num-prompts", cfg.output.eval_num_prompts),
                        ("--eval-samples-per-prompt", cfg.output.eval_samples_per_prompt),
                        ("--train-micro-batch", 1 if t.train_micro_batch is None else t.train_micro_batch),
                        ("--dist-timeout-s", t.dist_timeout_s), ("--placement-trials", t.placement_trials),
                        ("--placement-trial-steps", t.placement_trial_steps)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    for name, value in (("--save-every", cfg.output.save_every), ("--log-images-every", cfg.output.log_images_every),
                        ("--eval-every", cfg.output.eval_every), ("--lora-rank", cfg.optim.lora_rank),
                        ("--fragment-groups", t.fragment_groups or 0)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if rl.group_size < 2:
        raise ValueError(f"--group-size must be >= 2 for group-relative advantages, got {rl.group_size}")
    if t.fragment_groups and t.fragment_groups > rl.prompts_per_step:
        raise ValueError(f"--fragment-groups {t.fragment_groups} must be between 1 and --prompts-per-step "
                         f"{rl.prompts_per_step}")
    if cfg.output.debug_link_bandwidth is not None and not cfg.output.debug_link_bandwidth > 0:
        raise ValueError(f"--debug-link-bandwidth must be > 0 MB/s, got {cfg.output.debug_link_bandwidth}")
    _need(_finite(rl.reward_timeout_s) and rl.reward_timeout_s > 0, "--reward-timeout-s", rl.reward_timeout_s,
          "a finite number of seconds > 0")
    if t.memory_budget_gb is not None and not t.memory_budget_gb > 0:
        raise ValueError(f"--memory-budget-gb must be > 0, got {t.memory_budget_gb}")
    if not 0 < rl.timestep_fraction <= 1:
        raise ValueError(f"--timestep-fraction must be in (0, 1], got {rl.timestep_fraction}")
    if s.sample_steps is not None and s.sample_steps < 1:
        raise ValueError(f"--sample-steps must be >= 1, got {s.sample_steps}")
    if cfg.output.eval_sample_steps is not None and cfg.output.eval_sample_steps < 1:
        raise ValueError(f"--eval-sample-steps must be >= 1, got {cfg.output.eval_sample_steps}")
    if cfg.output.eval_ema and not o.ema_decay > 0:
        raise ValueError(f"--eval-ema evaluates the EMA of the trained weights: set --ema-decay > 0 (got "
                         f"{o.ema_decay})")
    _need(isinstance(cfg.seed, int) and 0 <= cfg.seed < 2 ** 63, "--seed", cfg.seed, "an integer in [0, 2**63)")
    _need(_finite(t.placement_margin) and t.placement_margin >= 0, "--placement-margin", t.placement_margin,
          "a finite number >= 0")
    _need(_finite(o.lr) and o.lr > 0, "--lr", o.lr, "a finite number > 0")
    _need(_finite(o.weight_decay) and o.weight_decay >= 0, "--weight-decay", o.weight_decay, "a finite number >= 0")
    betas = tuple(o.adam_betas)
    _need(len(betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in betas), "--adam-betas",
          ",".join(map(str, betas)), "two numbers in [0, 1)")
    # AdamW's first update moves a weight by lr / (1 - beta1) and decays it by lr * weight_decay, each a
    # float32 scalar (torch.optim.AdamW): beyond float32 they overflow at the first step
    first_step = max(o.lr / (1 - betas[0]), o.lr * o.weight_decay)
    _need(first_step <= FLOAT32_MAX, "--lr", o.lr, f"small enough that AdamW's first step (lr / (1 - beta1) = "
          f"{o.lr / (1 - betas[0]):.3g}, lr x weight decay = {o.lr * o.weight_decay:.3g}) stays within float32 "
          f"({FLOAT32_MAX:.4g})")
    _need(_finite(o.grad_clip) and o.grad_clip > 0, "--grad-clip", o.grad_clip, "a finite number > 0")
    _need(_finite(o.ema_decay) and 0 <= o.ema_decay < 1, "--ema-decay", o.ema_decay, "in [0, 1) (0 = off)")
    if o.lora_alpha is not None:
        _need(_finite(o.lora_alpha) and o.lora_alpha > 0, "--lora-alpha", o.lora_alpha, "a finite number > 0")
    _need(o.max_skipped_steps >= 1, "--max-skipped-steps", o.max_skipped_steps, ">= 1")
    _need(_finite(rl.clip_range) and 0 < rl.clip_range <= 1, "--clip-range", rl.clip_range, "in (0, 1]")
    _need(_finite(rl.adv_clip) and rl.adv_clip > 0, "--adv-clip", rl.adv_clip, "a finite number > 0")
    _need(_finite(rl.beta) and rl.beta >= 0, "--beta", rl.beta, "a finite number >= 0 (0 = no KL term)")
    _need(0 <= rl.best_of_n <= rl.group_size, "--best-of-n", rl.best_of_n,
          f"between 0 (all) and --group-size {rl.group_size}")
    _need(rl.readmit_multiple >= 1, "--readmit-multiple", rl.readmit_multiple, ">= 1 (1 = none)")
    UpdateSplit.of(cfg)  # --updates-per-rollout against the split's samples, groups or members
    if rl.readmit_multiple > 1 and not rl.drop_zero_std:
        raise ValueError(f"--readmit-multiple {rl.readmit_multiple} re-admits samples --drop-zero-std dropped; "
                         f"give --drop-zero-std too")
    if s.noise_level is not None:
        _need(_finite(s.noise_level) and s.noise_level >= 0, "--noise-level", s.noise_level, "a finite number >= 0")
    if s.guidance is not None:
        _need(_finite(s.guidance) and s.guidance >= 0, "--guidance", s.guidance, "a finite number >= 0")
    if s.cfg_scale is not None:
        _need(_finite(s.cfg_scale) and s.cfg_scale >= 1, "--cfg-scale", s.cfg_scale, "a finite number >= 1 (1 = off)")
    for flag, value in (("--height", s.height), ("--width", s.width), ("--num-frames", s.num_frames)):
        if value is not None:
            _need(value >= 1, flag, value, ">= 1")
    _need(_finite(t.heartbeat_timeout_s) and 5 <= t.heartbeat_timeout_s <= 3600, "--heartbeat-timeout-s",
          t.heartbeat_timeout_s, "in [5, 3600] seconds")
    _need(_finite(t.stop_grace_s) and 1 <= t.stop_grace_s <= 86400, "--stop-grace-s", t.stop_grace_s,
          "in [1, 86400] seconds")
    _need(cfg.output.keep_checkpoints >= 0, "--keep-checkpoints", cfg.output.keep_checkpoints, ">= 0 (0 = keep all)")


def _choice(flag: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown {flag} {value!r}; choose one of {tuple(choices)}")


def check_choices(cfg) -> None:
    """Every flag with a set of values (the algorithm's name and the algorithms' own options: rl.algorithms)."""
    rl, s, t, o = cfg.rl, cfg.sampling, cfg.topology, cfg.output
    _choice("--std-mode", rl.std_mode, STD_MODES)
    _choice("--reward-combine", rl.reward_combine, COMBINES)
    _choice("--kl-form", rl.kl_form, KL_FORMS)
    _choice("--update-split", rl.update_split, SPLITS)
    if rl.reward_combine != "rewards" and rl.std_mode != "group":
        raise ValueError(f"--std-mode {rl.std_mode} normalises the combined reward; --reward-combine "
                         f"{rl.reward_combine} normalises each reward by its group's std: use --std-mode group")
    if rl.reward_combine == "losses":
        negative = [spec for spec in rl.reward if parse_reward_spec(spec)[1] < 0]
        if negative:
            raise ValueError(f"--reward-combine losses weighs each reward's clipped loss, which needs weights >= 0; "
                             f"got {negative}")
    _choice("--sde-type", s.sde_type, sampler.SDE_TYPES)
    _choice("--colocated-sharding", t.colocated_sharding, SHARDINGS)
    _choice("--train-sharding", t.train_sharding, SHARDINGS)
    split_targets(cfg.optim.lora_targets, any_layer=bool(cfg.optim.init_lora))  # an adapter's targets: any layer
    _choice("--fragment-split", t.fragment_split, ("auto", "even", "speed"))
    if t.placement is not None:  # None until resolve_defaults
        _choice("--placement", t.placement, PLACEMENTS)
    _choice("--dispatch", t.dispatch, DISPATCHES)
    _choice("--export-dtype", o.export_dtype, EXPORT_DTYPES)
    _choice("--ode-solver", s.ode_solver, sampler.ODE_SOLVERS)
    compress.parse(t.publish_compression)
    m = cfg.model
    if m.dtype == "float16":  # every run trains
        raise ValueError("--dtype float16: training in float16 needs a gradient scaler (its 5-bit exponent flushes "
                         "small gradients to zero), which the trainer does not have; use --dtype bfloat16 (float32's "
                         "range, the same memory)")
    if m.dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {m.dtype!r}; choose one of {DTYPES}")
    if m.device not in DEVICES:
        raise ValueError(f"unknown --device {m.device!r}; choose one of {DEVICES}")
    if m.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda, but this torch {torch.__version__} sees no CUDA device "
                         f"(a CPU build, or no GPU visible); use --device cpu or auto")
    if m.attention not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown --attention {m.attention!r}; choose one of {ATTENTION_BACKENDS}")
    check_attention(adapter_class(m.model), m.attention)  # a family's mask the kernel cannot take
    _choice("--reward-dtype", rl.reward_dtype, ("auto", "float32"))


def check_environment() -> None:
    """The test hooks' variables: a value they do not know is an error, not silently no hook."""
    corrupt = os.environ.get(CORRUPT_ENV, "").strip().lower()
    if corrupt not in CORRUPT_MODES:
        raise ValueError(f"{CORRUPT_ENV}={corrupt!r} is not a known value; use one of {CORRUPT_MODES[1:]} "
                         f"or leave it unset")
    kill = os.environ.get(checkpoint.KILL_ENV, "").strip()
    if kill and not kill.isdigit():
        raise ValueError(f"{checkpoint.KILL_ENV}={kill!r} must be a checkpoint step (an integer) or unset")
    fault = os.environ.get(RAISE_ENV, "").strip()
    rank, _, step = fault.partition(":")
    if fault and not (rank.isdigit() and step.isdigit()):
        raise ValueError(f"{RAISE_ENV}={fault!r} must be RANK:STEP (the rank that raises, at which step) or unset")


WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")


def check_wandb(o) -> None:
    """--wandb PROJECT: the optional wandb package is importable and WANDB_MODE is one wandb knows,
    so that the logging rank does not fail after the others wait; its other flags need it."""
    if o.wandb is None:
        given = [f for f, v in (("--wandb-entity", o.wandb_entity), ("--wandb-run-name", o.wandb_run_name),
                                ("--wandb-tags", o.wandb_tags)) if v]
        if given:
            raise ValueError(f"{', '.join(given)} without --wandb PROJECT: nothing is logged to wandb")
        return
    if not o.wandb.strip() or any(c in o.wandb for c in "/\\#?%:"):
        raise ValueError(f"--wandb {o.wandb!r}: a project name, without / \\ # ? % or :")
    mode = os.environ.get("WANDB_MODE", "").strip()
    if mode and mode not in WANDB_MODES:
        raise ValueError(f"WANDB_MODE={mode!r} is not a mode wandb knows; use one of {WANDB_MODES} or leave it unset")
    if importlib.util.find_spec("wandb") is None:
        raise ValueError(f"--wandb {o.wandb}: the wandb package is not installed (it is optional: pip install wandb, "
                         f"or the version requirements.lock pins); without --wandb the run logs to metrics.jsonl and "
                         f"TensorBoard")


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:  # a symlink loop, a broken link, no permission
        raise ValueError(f"{path}: cannot be read ({e.strerror})") from None


def check_safetensors(path: str) -> None:
    """A safetensors file is whole and agrees with itself: its header parses, every tensor's byte
    range holds exactly its shape x dtype, and the ranges tile the data with no gap or overlap up
    to the end of the file (a truncated copy, or a header edited to other shapes, fails here, not
    inside the loader)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise ValueError(f"{path}: truncated or not a safetensors file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
            tensors = sorted((int(v["data_offsets"][0]), int(v["data_offsets"][1]), k, [int(d) for d in v["shape"]],
                              v["dtype"]) for k, v in header.items() if k != "__metadata__")
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise ValueError(f"{path}: damaged safetensors header ({e})") from None
    position = 0
    for begin, end, name, shape, dtype in tensors:
        if begin != position:
            raise ValueError(f"{path}: damaged safetensors header: {name!r} starts at byte {begin}, the tensor before "
                             f"it ends at {position}")
        if dtype in SAFETENSORS_BYTES and end - begin != math.prod(shape) * SAFETENSORS_BYTES[dtype]:
            raise ValueError(f"{path}: damaged safetensors header: {name!r} is {dtype} {list(shape)}, "
                             f"{math.prod(shape) * SAFETENSORS_BYTES[dtype]} bytes, but its range holds {end - begin}")
        position = end
    if 8 + n + position != size:
        raise ValueError(f"{path}: truncated or damaged: its header describes {8 + n + position} bytes, the file has "
                         f"{size}")


def check_folder_files(path: str) -> None:
    """Every file of a weights folder can be reached (a link that leads nowhere or loops is named;
    os.walk does not follow links to folders), every JSON file it reads parses, every safetensors
    file is whole."""
    for folder, _, names in os.walk(path):
        for name in sorted(names):
            full = os.path.join(folder, name)
            try:
                os.stat(full)
            except OSError as e:
                raise ValueError(f"{full}: cannot be read ({e.strerror})") from None
            if name in FOLDER_JSON or name.endswith(".safetensors"):
                check_regular(full, "model file")  # a FIFO would block the reader
            if name in FOLDER_JSON:
                _read_json(full)
            elif name.endswith(".safetensors"):
                check_safetensors(full)


def check_reward_models(cfg) -> None:
    """Every --reward-model folder exists and its files are sound (the reward names what it lacks
    when it loads, still before any rank waits)."""
    for name, folder in reward_model_paths(cfg.rl.reward_model).items():
        if not os.path.isdir(folder):
            raise ValueError(f"--reward-model {name}={folder}: no such folder")
        check_folder_files(folder)


def check_model(cfg, prompts=(), released: str | None = None) -> None:
    """The model family, its folder, and the sample size (the run's and every prompt's of
    `prompts`, (file, record) pairs), steps and noise against its defaults and size factors, all
    without loading a weight. `released`: a released config (models/configs/) stands for the folder."""
    m, s = cfg.model, cfg.sampling
    cls = adapter_class(m.model)
    if m.model_path:
        check_model_folder(m.model_path, cls.required_components, cls.family)
        check_folder_files(m.model_path)
        t_file = os.path.join(m.model_path, "transformer", "config.json")
        v_file = os.path.join(m.model_path, "vae", "config.json")
        try:
            geometry = cls.geometry(_read_json(t_file), _read_json(v_file))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{t_file} or {v_file} lacks the entry {e} that {cls.family!r} needs") from None
        defaults = read_folder_defaults(m.model_path, cls.defaults)
    elif released is not None:
        config = released_config(released)
        geometry, defaults = cls.geometry(config["transformer"], config["vae"]), cls.defaults
    else:
        if m.preset not in cls.geometry_presets:
            raise ValueError(f"unknown preset {m.preset!r} for model {m.model!r}; use --model-path DIR or one of "
                             f"{sorted(cls.geometry_presets)}")
        geometry, defaults = cls.geometry_presets[m.preset], preset_defaults(cls, m.preset)
    height = s.height if s.height is not None else defaults.height
    width = s.width if s.width is not None else defaults.width
    frames = s.num_frames if s.num_frames is not None else defaults.num_frames
    steps = s.sample_steps if s.sample_steps is not None else defaults.num_steps
    shift = _shift_config(cls, m.model_path, defaults, s.sde_type)
    try:
        cls.check_size(geometry, height, width, frames)
        _check_shift(cls, geometry, shift, (height, width, frames), steps)
    except ValueError as e:
        raise ValueError(f"--height/--width/--num-frames: {e}") from None
    _check_prompt_shapes(cls, geometry, (height, width, frames), prompts, shift, steps)
    noise = s.noise_level if s.noise_level is not None else (
        defaults.dance_eta if s.sde_type == "dance" else defaults.noise_level)
    if s.sde_type == "cps" and not 0 <= noise <= 1:
        raise ValueError(f"--noise-level {noise} must be in [0, 1] for --sde-type cps (sin(a pi / 2) of the step)")
    algorithms.algorithm(cfg.rl.algorithm).check_steps(cfg, steps)  # what the algorithm asks of the K steps


def _shift_config(cls, model_path: str | None, defaults, sde_type: str) -> dict | None:
    """The scheduler config of a family whose timesteps shift by the sample's size (the folder's
    or, for a preset or a released config, the family's own); None where they do not."""
    if defaults.shift != "dynamic" or sde_type == "dance":
        return None
    if model_path:
        return _read_json(os.path.join(model_path, "scheduler", "scheduler_config.json"))
    return dict(cls.scheduler().config)


def _check_shift(cls, geometry: dict, shift: dict | None, shape: tuple, steps: int) -> None:
    """A sample of `shape` gets a schedule the run can sample with (rl.sampler.check_schedule)."""
    if shift is not None:
        height, width, frames = shape
        sampler.check_schedule(shift, steps, cls.image_tokens(geometry, height, width, frames))


def _check_prompt_shapes(cls, geometry: dict, default: tuple, prompts, shift: dict | None = None,
                         steps: int = 1) -> None:
    """Each distinct shape a .jsonl prompt gives itself ((file, record) pairs), as the loaded
    model's check would (prompts.resolutions.check_shapes), from the size factors alone, and its
    timestep schedule (`shift`: the scheduler config of a family that shifts by the size)."""
    seen = {default}
    for path, r in prompts:
        shape = resolutions.record_shape(r, default)
        if shape in seen:
            continue
        seen.add(shape)
        where = f"{path}:{r.line}"
        if "frames" in r.metadata and not cls.video:
            raise ValueError(f"{where}: 'frames' {r.metadata['frames']} given for {cls.family!r}, an image model")
        try:
            cls.check_size(geometry, *shape)
            _check_shift(cls, geometry, shift, shape, steps)
        except ValueError as e:
            raise ValueError(f"{where}: prompt shape {resolutions.shape_name(shape)}: {e}") from None


def check_prompts(cfg, prompt_sets) -> None:
    """Every training (and evaluated) prompt is one each reward (and each --eval-scorer, of the
    evaluated ones) can score: a grammar reward such as shapes fails here, naming the file, line and
    prompt, not at step 0. `prompt_sets`: (path, records) as the run read them."""
    checkers = [c for c in map(prompt_checker, cfg.rl.reward) if c is not None]
    scorers = [c for c in map(prompt_checker, eval_scorers(cfg.output.eval_scorer)) if c is not None]
    for path, records in prompt_sets:
        for n, record in enumerate(records, 1):
            for cls in checkers + (scorers if path == cfg.output.eval_prompts else []):
                try:
                    cls.check_prompt(record.prompt)
                except ValueError as e:
                    raise ValueError(f"prompt file {path!r}, prompt {n}: {e}") from None


def check_run(cfg, prompt_sets, released: str | None = None) -> None:
    """What config.validate checks after the flags: the environment, the model folder (or the
    released config that stands for it) and sizes (every prompt's shape among them), the reward
    models' folders (not with a released config), the
    prompts' grammar, precomputed prompt embeddings. `prompt_sets`: [(path, records)] of the
    training and evaluation prompts as read once."""
    check_environment()
    check_wandb(cfg.output)
    check_model(cfg, [(path, r) for path, records in prompt_sets for r in records], released)
    if released is None:
        check_reward_models(cfg)
    check_prompts(cfg, prompt_sets)
    if cfg.model.prompt_embeds:
        encoder = None if released else embeds.encoder_record(cfg.model.model_path, cfg.model.preset, cfg.seed)
        embeds.check(cfg.model.prompt_embeds, cfg.model.model, embedded_prompts(cfg, prompt_sets), encoder)


def embedded_prompts(cfg, prompt_sets) -> list[str]:
    """Every prompt a run encodes: training and evaluated prompts, the empty prompt (the start-up
    probes) and with CFG the negative prompt."""
    return ["", cfg.sampling.negative_prompt] + [r.prompt for _, records in prompt_sets for r in records]
