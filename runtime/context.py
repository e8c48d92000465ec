"""What every role of a rank reads, built before any rank waits on another (runtime/build.py builds
the roles on it): the model without the components this rank never runs, in the dtype its role
holds, LoRA, the sampler, the prompts' shapes, the rewards where the rank scores, the tracer and
the intake. Every size, prompt and model folder is checked here, so a user error stops the run
before anything is written.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from config.schema import RunConfig
from config.validate import RunFacts
from models import TEXT_ENCODERS, DiTAdapter, load_model, model_dtypes, resolve_device, resolve_dtype
from models import set_attention
from models.lora import apply_lora, read_lora_file, trainable_names
from parallel.trainer_intake import TrainingSpec, make_intake
from parallel.topology import ProcessGroups, Topology
from prompts import resolutions as prompt_shapes
from prompts.embeds import PromptEmbeddings
from rewards import RewardSet
from rl import algorithms, sampler
from runtime import budget
from telemetry.tracing import Slowdown, Tracer


@dataclass
class RankContext:
    """What every role's step needs to know about its rank, passed as one object."""

    cfg: RunConfig
    facts: RunFacts
    rank: int
    device: torch.device
    tracer: Tracer
    adapter: DiTAdapter
    sampling: sampler.SamplingConfig
    records: list  # list[prompts.sets.PromptRecord]: the training prompt set
    intake: object  # parallel.trainer_intake.ChunkIntake or TransitionIntake: routing and the trainer's intake
    slowdown: Slowdown  # --debug-slow-rank: wraps every kind of this rank's work
    comms: ProcessGroups  # the communicators, one per direction of traffic
    rewards: RewardSet | None = None
    """this rank's rewards (a generator's, a scorer's, a TAG trainer's), built before any rank waits"""

    @property
    def topo(self) -> Topology:
        return self.facts.topology


def _load(cfg: RunConfig, device: torch.device, master: bool, release: tuple[str, ...],
          host: tuple[str, ...] = ()) -> DiTAdapter:
    """The base model without the components this rank never runs (`release`), float32 weights
    where a full fine-tune trains them (`master`), the components in `host` left in host memory;
    weights that do not fit the folder's config are a user error naming the folder."""
    try:
        return load_model(cfg.model.model, cfg.model.model_path, preset=cfg.model.preset, seed=cfg.seed,
                          dtype=model_dtypes(cfg.model.dtype, device, master=master), device=device, release=release,
                          host=host)
    except ValueError as e:
        where = f"--model-path {cfg.model.model_path}" if cfg.model.model_path else f"--preset {cfg.model.preset}"
        raise ValueError(f"{where}: {e}") from None


def make_context(cfg: RunConfig, facts: RunFacts, rank: int, groups: ProcessGroups,
                 tracer: Tracer | None = None) -> tuple[RankContext, object]:
    """The model and what every role reads; checks every size and prompt before any rank waits.
    `tracer`: the run's, when a placement is built again inside the run (it takes the new role)."""
    topo = facts.topology
    device = _device(cfg)
    if device.type == "cuda" and cfg.model.dtype != "float32":  # TF32 for the float32 matmuls that remain
        torch.set_float32_matmul_precision("high")  # (float32 rewards); --dtype float32 asks for true float32
    torch.manual_seed(cfg.seed)
    master = topo.is_trainer(rank) and not facts.lora  # float32 weights only where a full fine-tune trains them
    host = ("transformer",) if shards_from_host(facts, rank) else ()
    adapter = _load(cfg, device, master, released_components(cfg, facts, rank), host)
    if topo.gap_stages > len(adapter.blocks):
        raise ValueError(f"--gap-stages {topo.gap_stages}: the model has {len(adapter.blocks)} DiT blocks, fewer than "
                         f"the stages that would split them")
    if cfg.model.prompt_embeds:  # precomputed: no rank encodes
        adapter.prompt_cache = PromptEmbeddings(cfg.model.prompt_embeds, adapter.max_sequence_length)
    if cfg.model.offload_text_encoders:
        adapter.offload_text_encoders()  # on the device only while a step encodes (Rank.offload)
    set_attention(adapter, cfg.model.attention)
    if facts.lora:  # --init-lora: every rank copies the same file (a resume loads the checkpoint's weights instead)
        init = read_lora_file(cfg.optim.init_lora) if cfg.optim.init_lora and facts.resume is None else None
        apply_lora(adapter.transformer, cfg.optim.lora_rank, cfg.optim.lora_alpha, cfg.optim.lora_targets, cfg.seed,
                   init)
    compute = resolve_dtype(cfg.model.dtype, device)
    budget.check_budget(cfg, facts, adapter)  # --memory-budget-gb: the same on every rank, before any wait
    if not topo.is_trainer(rank):  # generators (and scorers) hold frozen weights in the compute dtype, no gradient
        trained = set(trainable_names(adapter.transformer)) if facts.tail_assist and topo.is_generator(rank) else set()
        adapter.transformer.requires_grad_(False).to(compute)
        for n, p in adapter.transformer.named_parameters():  # tail assist: a generator trains a share
            p.requires_grad_(n in trained)
    sampling = run_sampling(cfg, adapter)
    adapter.latent_shape(sampling.height, sampling.width, sampling.num_frames)  # a bad size fails alike everywhere
    records = list(facts.prompts.records)  # as read before anything loaded
    shapes = prompt_shapes.shape_table(adapter, records, sampling, cfg.rl.prompts)  # before any wait: names a bad line
    if cfg.output.eval_every:
        prompt_shapes.check_shapes(adapter, facts.eval_records, sampling, cfg.output.eval_prompts)
    replica = topo.replica_ranks(topo.replica_of(rank)) if topo.is_generator(rank) else ()
    scores = bool(replica) and replica[-1] == rank and not topo.scorer_ranks  # a replica scores on its last stage
    needs_rewards = scores or topo.is_scorer(rank) or (facts.tag and topo.is_trainer(rank))
    rewards = _reward_set(cfg, device) if needs_rewards else None  # a reward model's folder fails before any wait
    if tracer is None:
        tracer = Tracer(rank, topo.role(rank), enabled=cfg.output.trace,  # timed with device events, never a sync
                        event=(lambda: torch.cuda.Event(enable_timing=True)) if device.type == "cuda" else None)
    tracer.role = topo.role(rank)
    is_train = topo.is_trainer(rank)
    intake = make_intake(facts.tsp, TrainingSpec.of(cfg, sampling), topo.trainer_ranks,
                         lambda r: topo.replica_ranks(r)[-1], facts.train_micro_batch,
                         topo.trainer_ranks.index(rank) if is_train else None, tracer, groups, facts.tail_assist)
    slow = cfg.output.debug_slow_rank
    slowdown = Slowdown(slow[1] if slow and slow[0] == rank else 1.0)
    return RankContext(cfg, facts, rank, device, tracer, adapter, sampling, records, intake, slowdown, groups,
                       rewards), shapes


def shards_from_host(facts: RunFacts, rank: int) -> bool:
    """Whether rank `rank` loads its transformer into host memory for the Trainer to shard: an FSDP2
    trainer's, whose device then holds its own shards and, while FSDP2 shards a unit, that unit
    whole (trainer.py; the whole float32 model on the device first would take HunyuanVideo's 48 GiB
    on every trainer). Other ranks hold their whole transformer and load it onto the device."""
    return facts.topology.is_trainer(rank) and facts.train_sharding == "fsdp"


def released_components(cfg: RunConfig, facts: RunFacts, rank: int) -> tuple[str, ...]:
    """The pipeline components rank `rank` never runs, freed before the model moves to its device.
    Text encoders run where prompts are encoded: a replica's first stage (the conditioning travels
    to the other stages and, with every fragment, to the trainers), and trainers that generate (TAG)
    or evaluate; with --prompt-embeds nowhere. The VAE runs where samples are decoded: a replica's
    last stage, and trainers that generate or evaluate. Scorers run neither (nor, once the start-up
    checks are done, the transformer)."""
    topo = facts.topology
    replica = topo.replica_ranks(topo.replica_of(rank)) if topo.is_generator(rank) else ()
    samples = topo.is_trainer(rank) and (facts.tag or cfg.output.eval_every > 0)  # generates or evaluates
    encodes = (bool(replica) and replica[0] == rank or samples) and not cfg.model.prompt_embeds
    decodes = bool(replica) and replica[-1] == rank or samples
    return (() if encodes else TEXT_ENCODERS) + (() if decodes else ("vae",))


def run_sampling(cfg: RunConfig, adapter: DiTAdapter) -> sampler.SamplingConfig:
    """The run's sampler: the flags over the family's defaults, as the algorithm samples and records
    (`Algorithm.sampling`: its noise level, its window, the step fields its loss reads)."""
    s = cfg.sampling
    sampling = sampler.SamplingConfig.for_adapter(
        adapter, height=s.height, width=s.width, num_steps=s.sample_steps, sde_type=s.sde_type,
        noise_level=s.noise_level, guidance=s.guidance, cfg_scale=s.cfg_scale, seed=cfg.seed, num_frames=s.num_frames,
        sde_window=s.sde_window, ode_solver=s.ode_solver, quantize_timestep=s.quantize_timestep, schedule=s.schedule)
    return algorithms.algorithm(cfg.rl.algorithm).sampling(cfg, sampling)


def _reward_set(cfg: RunConfig, device) -> RewardSet:
    return RewardSet(cfg.rl.reward, device=device, dtype=reward_dtype(cfg, device), **cfg.rl.reward_options())


def reward_dtype(cfg: RunConfig, device) -> torch.dtype:
    """The model rewards' weights (--reward-dtype): float32, or auto: the compute dtype."""
    return torch.float32 if cfg.rl.reward_dtype == "float32" else resolve_dtype(cfg.model.dtype, device)


def _device(cfg: RunConfig) -> torch.device:
    if cfg.model.device == "cpu":
        return torch.device("cpu")
    dev = resolve_device(cfg.model.device)
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" else dev
