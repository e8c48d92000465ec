"""The run configuration: one tree of dataclasses. Each field's `help` is its --help text; every
field is a flag (`--prompts-per-step`), the resolved tree is written to DIR/config.json.

config.json describes a run, never an action: the fields marked `carried=False` (where a run goes,
whether it resumes or overwrites, the test hooks) are not read back from a --config file or a
checkpoint, so relaunching a run's config.json starts a new run where the command line says."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from checkpointing.manifest import write_json_atomic
from config import files
from models import model_names
from models.lora import read_lora_file
from rewards import judge_paths, parse_reward_spec, reward_model_paths, reward_scales
from rl import algorithms
from rl.algorithms.fields import flag as _f, parse_pair
from rl.loss import KL_FORMS


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED_MODEL = os.path.join(ROOT, "assets", "shapes-flux")
DATA_DIR = os.path.join(ROOT, "data")
PRESETS = ("auto", "tiny", "mid")
LORA_LR, FULL_LR = 3e-4, 1e-5  # docs/ALGORITHMS.md: LoRA 3e-4, full fine-tuning 1e-5


@dataclass
class ModelConfig:
    model: str = _f("flux", f"model family: {', '.join(model_names())}")
    model_path: str | None = _f(None, "local diffusers folder of the base model; default: the shipped "
                                      "shapes model (flux) if present, else the offline tiny preset")
    preset: str = _f("auto", "without --model-path: auto (the shipped shapes model for flux, else tiny), tiny "
                             "(a random offline model, for tests) or mid (random, ~42M parameters, for benchmarks)")
    dtype: str = _f("auto", "compute dtype: float32, bfloat16 or auto (bfloat16 on CUDA, float32 on CPU; float16, "
                            "which would need a gradient scaler, is refused). "
                            "Generators, text encoders, the VAE and frozen weights are held in it; trainers keep "
                            "trained weights and AdamW in float32 and compute in it (FSDP2 mixed precision, or "
                            "autocast)")
    attention: str = _f("sdpa", "attention kernel through diffusers' dispatcher: sdpa, flash, flash_varlen, sage")
    prompt_embeds: str | None = _f(None, "FILE of precomputed prompt embeddings (python -m scripts.encode_prompts): "
                                         "no rank loads a text encoder; it must hold every prompt the run encodes",
                                   metavar="FILE")
    offload_text_encoders: bool = _f(False, "keep the text encoders in host memory between steps: on the device only "
                                            "while a step encodes prompts (two host-device copies of their weights "
                                            "per step for their device memory during the rest of it)")
    device: str = _f("auto", "cpu, cuda or auto (each rank uses cuda:LOCAL_RANK when CUDA is available)")


@dataclass
class _SamplingCore:
    """The [sampling] flags of every run; SamplingArgs adds the algorithms' own."""

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
                                        "(Flow-GRPO-Fast)", parse=lambda s: parse_pair(s, ":", int, "--sde-window"),
                                  metavar="START:END")
    same_group_noise: bool = _f(False, "all samples of a group share their initial noise")
    ode_solver: str = _f("euler", "deterministic (ODE) steps: euler, or dpm2 (DPM-Solver++(2M), second order after "
                                  "the last SDE step; DiffusionNFT's rollout, MixGRPO-Flash's post-window solver)")
    quantize_timestep: bool = _f(False, "feed the model int(sigma*1000)/1000 as its timestep, in sampling and "
                                        "training, while the step uses the exact sigma (DanceGRPO, MixGRPO; their "
                                        "recipes set it)")
    schedule: str | None = _f(None, "timestep schedule: dynamic, static or dance (default: the family's, dance with "
                                    "--sde-type dance); dance is DanceGRPO's and MixGRPO's shift (the family's "
                                    "DanceGRPO shift: 3 for FLUX) of linspace(1, 0, K+1)")


@dataclass
class _RLCore:
    """The [rl] flags of every run; RLConfig adds the algorithms' own."""

    prompts: str | None = _f(None, "prompt file (.txt one per line, or .jsonl with a 'prompt' field); "
                                   "default: data/shapes_train.txt")
    reward: list = _f([], "reward NAME[:WEIGHT] (registered), module.path:function[:WEIGHT] or "
                          "file.py:function[:WEIGHT] (your own), or [PROTOCOL+]http://HOST:PORT/NAME[:WEIGHT] for a "
                          "reward service (protocols: digenrl, flow_grpo, verl_omni, openai; rewards/README.md), "
                          "repeatable (default: shapes:1.0)",
                  action="append", metavar="NAME[:WEIGHT]")
    reward_scale: list = _f([], "NAME=FACTOR: multiply a reward's scores before they are logged and combined, to "
                                "use a peer's unit (jpeg_compressibility=0.002 is Flow-GRPO's -kB/500), repeatable",
                        action="append", metavar="NAME=FACTOR")
    reward_judge: list = _f([], "NAME=FILE: the judge file (TOML: model, template, score rule) of an "
                                "openai+http://.../NAME reward, a VLM judge (rewards/judge.py), repeatable",
                        action="append", metavar="NAME=FILE")
    reward_timeout_s: float = _f(60.0, "a reward service must return a fragment's scores within this many seconds "
                                       "of its sending, retries included (a restart within it loses no sample); "
                                       "then the run stops, naming the URL and its answer")
    reward_model: list = _f([], "NAME=DIR: local weights folder of a model-based reward, repeatable",
                        action="append", metavar="NAME=DIR")
    reward_dtype: str = _f("auto", "model rewards' weights: auto (the compute dtype, --dtype: half the memory on "
                                   "GPUs) or float32 (the peers' own scores, e.g. Flow-GRPO's PickScore)")
    steps: int = _f(50, "training steps (one rollout each, --updates-per-rollout optimizer updates)")
    prompts_per_step: int = _f(8, "B: prompts (groups) per step")
    group_size: int = _f(8, "G: samples per prompt")
    micro_batch: int = _f(8, "samples per forward pass, in generation and in training")
    algorithm: str = _f(algorithms.DEFAULT, f"RL algorithm (rl/algorithms/): {algorithms.describe()}")
    timestep_fraction: float = _f(0.99, "fraction of the K steps trained (Flow-GRPO 0.99, DanceGRPO 0.6)")
    clip_range: float = _f(1e-4, "PPO clip range eps of the importance ratio")
    adv_clip: float = _f(5.0, "advantages are clamped to [-adv_clip, adv_clip]")
    beta: float = _f(0.0, "KL coefficient to the reference policy (0 disables the reference forward)")
    kl_form: str = _f(KL_FORMS[0], f"the KL term: {KL_FORMS[0]} (mean (mu - mu_ref)^2 / (2 std_dev_t^2), "
                                   "Flow-GRPO's, std_dev_t without sqrt(-dt)) or transition (the exact KL of the two "
                                   "Gaussian steps: Flow-GRPO's divided by sigma - sigma' for sde)")
    std_mode: str = _f("group", "advantage std: group (the group's own), global (of the whole step's rewards, exact "
                                "while streaming: Flow-GRPO's default, which its recipes set) or running (of the "
                                "previous steps)")
    reward_combine: str = _f("rewards", "several rewards: rewards (one advantage of their weighted sum), advantages "
                                        "(the weighted sum of one advantage per reward) or losses (one advantage and "
                                        "one clipped loss per reward, weighted and summed: DanceGRPO's video run)")
    drop_zero_std: bool = _f(False, "do not train samples whose advantage is exactly 0, e.g. of groups with all-equal "
                                    "rewards (Flow-GRPO)")
    readmit_multiple: int = _f(1, "with --drop-zero-std: re-admit dropped samples, drawn by (seed, step), until the "
                                  "trained ones are a multiple of M (Flow-GRPO's num_batches_per_epoch); 1 = none")
    best_of_n: int = _f(0, "train only the ceil(N/2) best and floor(N/2) worst samples of each group by advantage "
                           "(DanceGRPO's --bestofn); 0 = all")
    updates_per_rollout: int = _f(1, "N: optimizer updates per step, each after training one part of the step's "
                                     "samples (their every trained transition), the loss of a part the mean over "
                                     "its transitions; after the first the ratio is off-policy and the clip range "
                                     "binds, as in the peers (Flow-GRPO: 2 per epoch, MixGRPO: 4)")
    update_split: str = _f("samples", "which samples each of the N updates trains: samples (a permutation drawn "
                                      "from (seed, step), cut in N: Flow-GRPO, DiffusionNFT), members (by position "
                                      "in the group: MixGRPO) or groups (whole groups in step order: a disaggregated "
                                      "trainer updates on one part while the next is generated)")

    def reward_options(self) -> dict:
        """What a RewardSet takes of these flags beside the specs, the device and the dtype: the model
        folders, the services' deadline, the judge files and the scales."""
        return dict(model_paths=reward_model_paths(self.reward_model), timeout_s=self.reward_timeout_s,
                    judges=judge_paths(self.reward_judge), scales=reward_scales(self.reward_scale))


@dataclass
class SamplingArgs(*reversed(algorithms.flags("sampling")), _SamplingCore):
    """[sampling]: the flags of every run, then each algorithm's own (`flags` in rl/algorithms/NAME.py) in
    registry order (a dataclass takes its bases' fields from the last base first)."""


@dataclass
class RLConfig(*reversed(algorithms.flags("rl")), _RLCore):
    """[rl]: the flags of every run, then each algorithm's own, as SamplingArgs."""


@dataclass
class OptimConfig:
    lr: float | None = _f(None, f"learning rate (default: {LORA_LR:g} with LoRA, {FULL_LR:g} for full fine-tuning)")
    lora_rank: int = _f(32, "LoRA rank on the attention projections; 0 = full fine-tuning")
    lora_alpha: float | None = _f(None, "LoRA alpha (default 2 x rank)")
    lora_targets: str = _f("attn", "LoRA targets: attn (to_q/k/v/out), attn+ff (also the feed-forward), or module-name "
                                   "suffixes separated by commas (attn.to_q,attn.to_v)")
    init_lora: str | None = _f(None, "start LoRA training from this adapter: a peft folder (adapter_config.json + "
                                     "adapter_model.safetensors, as Flow-GRPO saves) or a diffusers LoRA "
                                     "(pytorch_lora_weights.safetensors, as diffusers and DanceGRPO save); its rank, "
                                     "alpha and targets replace --lora-rank, --lora-alpha and --lora-targets "
                                     "(docs/peer-formats.md)", metavar="PATH")
    weight_decay: float = _f(1e-4, "AdamW weight decay")
    adam_betas: tuple = _f((0.9, 0.999), "AdamW betas B1,B2",
                           parse=lambda s: parse_pair(s, ",", float, "--adam-betas"), metavar="B1,B2")
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

    def take_init_lora(self) -> None:
        """--init-lora: the adapter's rank, alpha and targets become the run's (config.json records
        them, and a resume reads them there: the file is not needed again)."""
        if self.lora_rank == 0:
            raise ValueError(f"--init-lora {self.init_lora}: it starts LoRA training, and --lora-rank 0 means full "
                             f"fine-tuning")
        lora = read_lora_file(self.init_lora)
        self.lora_rank, self.lora_alpha, self.lora_targets = lora.rank, lora.alpha, lora.lora_targets()


@dataclass
class TopologyConfig:
    placement: str | None = _f(None, "auto: measure this machine at start-up (a denoising and a training forward "
                                     "per rank, the link), rank every placement the world size and memory allow by "
                                     "the planner's model and run the fastest, checked against measured steps "
                                     "(--placement-trials); the placement flags (--mode, --generators, --trainers, "
                                     "--gap-stages, the shardings, --tag, --tcss) then record its choice. fixed: the "
                                     "placement the flags give. Default: auto unless a placement flag is given "
                                     "(docs/placement.md)")
    placement_stale: bool = _f(False, "--placement auto: rank TCSS placements too (generators at most one version "
                                      "stale, which trains other weights than on-policy placements)")
    placement_trials: int = _f(2, "--placement auto: run up to N of the best predicted placements (those within "
                                  "--placement-margin of the best) for --placement-trial-steps steps each, switching "
                                  "placement inside the run from its own checkpoint, and keep the fastest measured; "
                                  "1 runs the best prediction")
    placement_trial_steps: int = _f(4, "--placement auto: steps each trial runs; those after its first are "
                                       "measured (the first after a switch warms up again), their median decides "
                                       "(of 3 or more, one disturbed step does not)")
    placement_margin: float = _f(0.1, "--placement auto: a placement predicted within this fraction of the best is "
                                      "tried (--placement-trials)")
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
    tail_assist: bool = _f(False, "tail assist: the rank that generates a step's last fragment trains a share of it "
                                  "too, with the step's weights, and its gradient joins the trainers' update "
                                  "(on-policy disaggregated runs with --tsp and replicated trainers)")
    fragment_split: str = _f("auto", "how fragments are shared among generator replicas: even, speed (in proportion to "
                                     "each replica's speed, measured at start-up; with --tsp replicated trainers' "
                                     "shares of transitions follow their speeds too), or auto (speed when "
                                     "disaggregated; even when colocated, as colocated systems split)")
    dispatch: str = _f("lpt", "how fragments are ordered and given to generator replicas: lpt (predicted cost from "
                              "each prompt's shape, longest first, to the replica that finishes it first) or "
                              "round-robin (step order)")
    memory_budget_gb: float | None = _f(None, "GPU memory per rank, in GB: a plan whose predicted peak on some rank "
                                              "(planner/memory.py: weights, gradients, optimizer state, activations, "
                                              "buffers, the CUDA context) does not fit is refused")
    publish_compression: str = _f("none", "what weight publication sends: none, bf16, delta (the difference to the "
                                          "version the generators hold, in bf16) or delta-topk:F (its largest "
                                          "fraction F, with error feedback); generators rebuild bit-exactly what "
                                          "the trainer says they hold, and the trainers train those weights "
                                          "(colocated runs too)", metavar="CODEC")
    dist_timeout_s: int = _f(600, "timeout of every collective, point-to-point and store wait until the first "
                                  "step is measured, or 5 x the step the start-up probe predicts if longer (then "
                                  "5 x the slowest step, at least 60 s; at least this around checkpoints and "
                                  "evaluations); each wait counts from when it starts")
    heartbeat_timeout_s: float = _f(30.0, "a rank whose heartbeat stops for this long is reported by rank and role, "
                                          "and every rank exits")
    stop_grace_s: float = _f(25.0, "after SIGTERM or SIGINT, seconds to finish the step and write a checkpoint "
                                   "before exiting without one (torchrun kills its workers 30 s after a SIGTERM)")


@dataclass
class OutputConfig:
    output_dir: str = _f("runs/default", "run folder: config.json, metrics.jsonl, tb/, trace/, checkpoints/; "
                                         "never taken from --config", carried=False)
    resume: str | None = _f(None, "a run folder: continue from its newest valid checkpoint, with that checkpoint's "
                                  "config (flags override it; a change of what the weights mean is refused)",
                            carried=False, one_command=True)
    resume_anyway: bool = _f(False, "resume although the checkpoint comes from another run, or its seed, prompts or "
                                    "training settings differ from this command's (each difference is named and "
                                    "recorded in config.json's run.resumes)", carried=False, one_command=True)
    overwrite: bool = _f(False, "start over in an --output-dir that holds a run: remove its run files first (a run "
                                "refuses such a folder otherwise, and a folder a live run holds always)",
                         carried=False, one_command=True)
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
    eval_sample_steps: int | None = _f(None, "denoising steps of evaluation (default: the training K; DiffusionNFT and "
                                             "Flow-GRPO evaluate with 40)")
    eval_ema: bool = _f(False, "evaluate the EMA of the trained weights (--ema-decay > 0), as DiffusionNFT does, in "
                               "place of the live weights")
    eval_scorer: list = _f([], "a scorer evaluation reports besides the run's rewards, as eval/NAME, never trained "
                               "on; repeatable (default: shapes_detector when the run trains on shapes, GenEval's "
                               "strict rule by a learned detector; 'none': no scorer)",
                           action="append", metavar="NAME")
    trace: bool = _f(True, "write a Chrome trace per rank to DIR/trace/rank{R}.json")
    wandb: str | None = _f(None, "also log every metric, the config and the sample grids to this Weights & Biases "
                                 "project, from the logging rank (needs the optional wandb package; WANDB_MODE=offline "
                                 "writes the run to DIR/wandb/ only, for `wandb sync`)", metavar="PROJECT")
    wandb_entity: str | None = _f(None, "--wandb: the team or user the project belongs to (default: wandb's)")
    wandb_run_name: str | None = _f(None, "--wandb: the run's name (default: the --output-dir folder's name)")
    wandb_tags: str = _f("", "--wandb: the run's tags, separated by commas", metavar="TAG,TAG")
    debug_link_bandwidth: float | None = _f(None, "MBPS: test-only, emulate a link of this many MB/s between "
                                                  "trainers and generators (publication waits each bucket's "
                                                  "transfer time)", metavar="MBPS", carried=False)
    debug_slow_rank: tuple | None = _f(None, "R:FACTOR: test-only, rank R sleeps to run FACTOR x slower",
                                       parse=lambda s: parse_pair(s, ":", (int, float), "--debug-slow-rank"),
                                       metavar="R:FACTOR", carried=False)


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

    def describe(self) -> dict:
        """What config.json and a checkpoint record of the run: the tree without the actions of one
        command (--resume, --resume-anyway, --overwrite)."""
        tree = self.to_dict()
        for section, name in ACTIONS:
            tree[section].pop(name)
        return tree

    def save(self, path: str, run: dict | None = None) -> None:
        """config.json, atomically: the resolved tree, the commit and package versions that ran it,
        and `run` (its id, prompt digests and resumes: checkpointing/folder.py)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        record = {**self.describe(), files.PROVENANCE: files.provenance()}
        write_json_atomic(path, {**record, files.RUN: run} if run is not None else record)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        """The inverse of to_dict (config.json, a recipe): typed fields are parsed again (JSON has no
        tuples), a value of the wrong type is a ValueError naming it; the provenance is skipped."""
        kwargs = {}
        for name, value in files.config_part(d).items():
            if name == "seed":
                kwargs[name] = files.typed("seed", dataclasses.fields(cls)[0], value)
                continue
            sub = SECTIONS.get(name)
            if sub is None or not isinstance(value, dict):
                raise ValueError(f"config has no section {name!r}; sections: {['seed', *SECTIONS]}")
            fields = {f.name: f for f in dataclasses.fields(sub)}
            unknown = sorted(set(value) - set(fields))
            if unknown:
                raise ValueError(f"config section {name!r} has no field(s) {unknown}")
            kwargs[name] = sub(**{k: files.typed(f"{name}.{k}", fields[k], v) for k, v in value.items()})
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
        if not self.output.eval_scorer:
            self.output.eval_scorer = default_eval_scorers(self.rl.reward)
        if self.topology.placement is None:  # a placement flag given: the placement it names
            given = any(getattr(self.topology, name) != getattr(TopologyConfig(), name) for name in PLACEMENT_FLAGS)
            self.topology.placement = "fixed" if given else "auto"
        if self.output.save_every is None:
            self.output.save_every = max(1, self.rl.steps // 10)
        if self.optim.init_lora and self.output.resume is None:  # a resume has the checkpoint's LoRA shape
            self.optim.take_init_lora()
        self.optim.lr = self.optim.learning_rate()  # config.json records the value used
        if self.rl.algorithm in algorithms.ALIASES:  # config.json records the current spelling
            self.rl.algorithm = algorithms.algorithm(self.rl.algorithm).name


def default_eval_scorers(reward_specs: list[str]) -> list[str]:
    """shapes_detector, an independent check, for a run trained on the shapes reward; else none."""
    return ["shapes_detector"] if any(parse_reward_spec(spec)[0] == "shapes" for spec in reward_specs) else []


def eval_scorers(specs: list[str]) -> list[str]:
    """The scorers evaluation reports besides the run's rewards ('none' in --eval-scorer: none)."""
    return [] if "none" in specs else list(specs)


PLACEMENT_FLAGS = ("mode", "generators", "trainers", "scorers", "gap_stages", "colocated_sharding", "train_sharding",
                   "tag", "tcss")
"""the topology fields that name a placement: given, the run takes it (--placement fixed); all at their
defaults, the run chooses (--placement auto)"""
PLACEMENTS = ("auto", "fixed")

SECTIONS = {"model": ModelConfig, "sampling": SamplingArgs, "rl": RLConfig, "optim": OptimConfig,
             "topology": TopologyConfig, "output": OutputConfig}
FLAGS = {"--" + f.name.replace("_", "-"): (section, f.name) for section, cls in SECTIONS.items()
          for f in dataclasses.fields(cls)}
NOT_CARRIED = frozenset((section, f.name) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
                        if f.metadata.get("carried") is False)
"""(section, field) that a --config file or a resumed checkpoint never sets"""
ACTIONS = tuple((section, f.name) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
                if f.metadata.get("one_command"))
"""(section, field) that config.json leaves out: what one command does"""


def flag_of(key: str) -> str:
    """'optim.lr' -> '--lr', 'seed' -> '--seed'."""
    return "--" + key.rpartition(".")[2].replace("_", "-")
