"""Validation: every user error that needs no process group, raised alike on every rank before any
rank waits on another, and the facts a valid config implies (`RunFacts`), decided once."""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from checkpointing import folder
from checkpointing.digests import folder_digest
from config import preflight
from config.schema import NOT_CARRIED, RunConfig, eval_scorers
from models import adapter_class, model_names
from parallel import compress
from parallel.stepplan import ShapeTable, StepPlan, plan_step
from parallel.topology import Topology
from prompts.sets import PromptRecord, PromptSet, eval_records, read_prompt_file
from rewards import (VIDEO_REWARDS, check_reward_options, check_user_rewards, judge_paths, parse_reward_spec,
                     parse_reward_specs,
                     reward_model_paths, reward_scales, reward_url, service_token)
from rl import algorithms


def check_scorers(specs: list[str], trained: list[str], model_paths: dict[str, str]) -> None:
    """--eval-scorer: 'none' alone, or scorers named once each, none of them a reward the run trains
    on (evaluation reports those already, and a scorer is the check the training does not see)."""
    if "none" in specs:
        if specs != ["none"]:
            raise ValueError(f"--eval-scorer none means no scorer; it cannot go with others ({specs})")
        return
    if not specs:
        return
    if any(":" in spec and not reward_url(spec) for spec in specs):
        raise ValueError(f"--eval-scorer {specs}: a scorer is reported alone, as eval/NAME; give it no weight")
    for name, _ in parse_reward_specs(specs, model_paths):
        if name in trained:
            raise ValueError(f"--eval-scorer {name}: the run trains on {name!r}, which evaluation reports as "
                             f"eval/{name} already; a scorer is a check the training does not see")


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
    prompts: PromptSet | None = None
    """the training prompts, read once before anything loads: what every rank trains on"""
    eval_records: tuple[PromptRecord, ...] = ()
    """the held-out records evaluated (--eval-num-prompts x --eval-samples-per-prompt), read once"""
    eval_sha256: str | None = None
    resume: folder.ResumePoint | None = None
    """--resume: the verified checkpoint the run continues from"""
    model_digest: dict | None = None
    """the base model folder's bytes (checkpointing/digests.py); None for a preset"""
    tail_assist: bool = False
    """the rank that generates a step's last fragment trains a share of it (docs/DESIGN.md 5.9)"""

    @property
    def digests(self) -> dict:
        """The SHA-256 of the prompt files as read and the model folder's digest, for config.json's
        run record (and every checkpoint's): what a resume compares its own with."""
        return {"prompts_sha256": self.prompts.sha256 if self.prompts else None,
                "eval_prompts_sha256": self.eval_sha256, "model_digest": self.model_digest}

    @property
    def num_trainers(self) -> int:
        return self.topology.num_trainers

    @property
    def speed_split(self) -> bool:
        """Fragments are shared among replicas by measured speed (else evenly)."""
        return self.fragment_split == "speed" or (self.fragment_split == "auto" and self.disagg)

    def step_plan(self, cfg: RunConfig, step: int, replica_speeds: list[float] | None = None,
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


def validate(cfg: RunConfig, world_size: int, released: str | None = None) -> RunFacts:
    """Every user error that needs no process group, each naming the bad value. `released`: a
    recipe checked on a machine without its weights (scripts/check_recipe.py): that released config
    (models/configs/) stands for the model folder, and the reward models' folders are not read."""
    rl, t, o, s = cfg.rl, cfg.topology, cfg.output, cfg.sampling
    topo = placed_topology(cfg, world_size)
    preflight.check_numbers(cfg)  # every range, in one place
    preflight.check_choices(cfg)
    algorithms.check(cfg)  # the algorithms' own options, and what the run's algorithm asks of the flags
    if o.debug_slow_rank is not None:
        rank, factor = o.debug_slow_rank
        if not 0 <= rank < world_size or not factor >= 1:
            raise ValueError(f"--debug-slow-rank {rank}:{factor}: the rank must be in [0, {world_size}) and the "
                             f"factor >= 1")
    names = [n for n, _ in parse_reward_specs(rl.reward, reward_model_paths(rl.reward_model))]
    check_scorers(o.eval_scorer, names, reward_model_paths(rl.reward_model))
    scored = [*rl.reward, *eval_scorers(o.eval_scorer)]
    if any(map(reward_url, scored)):
        service_token()  # DIGENRL_REWARD_TOKEN_FILE names a readable token, or is unset
    check_reward_options([parse_reward_spec(spec)[0] for spec in scored], judge_paths(rl.reward_judge),
                         reward_scales(rl.reward_scale), scored)
    check_user_rewards(scored, video=adapter_class(cfg.model.model).video)  # a user's function, on a dummy batch
    video_models = [n for n in model_names() if adapter_class(n).video]
    if not adapter_class(cfg.model.model).video and VIDEO_REWARDS & set(names):
        raise ValueError(f"reward(s) {sorted(VIDEO_REWARDS & set(names))} score videos; {cfg.model.model!r} makes "
                         f"images (video models: {video_models})")
    prompts = read_prompt_file(rl.prompts)  # read once: a missing or empty prompt file raises here
    sets, held_out, held_out_sha = [(rl.prompts, prompts.records)], (), None
    if o.eval_every:
        read = prompts if o.eval_prompts == rl.prompts else read_prompt_file(o.eval_prompts)
        held_out = tuple(eval_records(o.eval_prompts, o.eval_num_prompts, o.eval_samples_per_prompt, read))
        held_out_sha = read.sha256
        sets.append((o.eval_prompts, read.records[:o.eval_num_prompts]))
    preflight.check_run(cfg, sets, released)  # every other flag, the model folder and sizes, the prompts' shapes and grammar
    model_digest = folder_digest(cfg.model.model_path) if cfg.model.model_path and released is None else None
    resume = folder.check(cfg, prompts.sha256, NOT_CARRIED, model_digest)  # the run folder, its lock and --resume
    facts = RunFacts(topology=topo, disagg=False, tsp=t.tsp, tag=False, tcss=False, train_sharding=t.train_sharding,
                     train_micro_batch=t.train_micro_batch or rl.micro_batch, fragment_split=t.fragment_split,
                     lora=cfg.optim.lora_rank > 0, num_prompts=len(prompts.records), log_rank=0, prompts=prompts,
                     eval_records=held_out, eval_sha256=held_out_sha, resume=resume, model_digest=model_digest)
    return with_placement(probe_config(cfg) if t.placement == "auto" else cfg, facts, topo)


def probe_config(cfg: RunConfig) -> RunConfig:
    """With --placement auto, the run before it has chosen: colocated, every rank holding the whole
    model (the start-up probe measures it, runtime/autoplace.py), no memory budget (the planner
    applies it to each candidate). Its placement flags say nothing yet: what they held (a resumed
    run's last choice, the user's) is not read."""
    out = copy.deepcopy(cfg)
    t = out.topology
    t.mode, t.generators, t.trainers, t.scorers, t.gap_stages = "colocated", None, None, 0, 1
    t.colocated_sharding, t.tag, t.tcss, t.memory_budget_gb = "replicate", False, False, None
    return out


def placed_topology(cfg: RunConfig, world_size: int) -> Topology:
    """The topology of the config's placement flags (--placement auto: the probe's, `probe_config`)."""
    t = (probe_config(cfg) if cfg.topology.placement == "auto" else cfg).topology
    return Topology.build(world_size, t.mode, t.generators, t.trainers, t.scorers, t.gap_stages)


def with_placement(cfg: RunConfig, facts: RunFacts, topo: Topology | None = None) -> RunFacts:
    """`facts` with what the config's placement implies (its topology, TSP, TAG, TCSS, sharding,
    the logging rank), decided once: at validation, and for a placement --placement auto chose."""
    t = cfg.topology
    topo = topo or Topology.build(facts.topology.world_size, t.mode, t.generators, t.trainers, t.scorers,
                                  t.gap_stages)
    disagg = topo.mode == "disagg"
    if t.tag and not disagg:
        raise ValueError(f"--tag needs --mode disagg (got {topo.mode}): colocated ranks all generate already")
    if t.tcss and not disagg:
        raise ValueError("--tcss needs --mode disagg (colocated ranks are never stale)")
    refusal = tail_assist_refusal(cfg, topo) if t.tail_assist else None
    if refusal is not None and t.placement != "auto":  # auto: on where the chosen placement allows it
        raise ValueError(f"--tail-assist {refusal}")
    return dataclasses.replace(facts, topology=topo, disagg=disagg, tsp=t.tsp, tag=t.tag, tcss=t.tcss,
                               train_sharding=t.train_sharding if disagg else t.colocated_sharding,
                               train_micro_batch=t.train_micro_batch or cfg.rl.micro_batch,
                               fragment_split=t.fragment_split, log_rank=topo.trainer_ranks[0],
                               tail_assist=t.tail_assist and refusal is None)


def tail_assist_refusal(cfg: RunConfig, topo: Topology) -> str | None:
    """Why the placement cannot run tail assist (None: it can). The rank that generated the step's
    last fragment trains a share of it with the weights it generated with, and its gradient is
    added to the trainers': that is the trainers' gradient only where it holds exactly the trainers'
    weights of the step, whole, and the loss needs nothing else a trainer keeps."""
    t, rl = cfg.topology, cfg.rl
    algorithm = algorithms.algorithm(rl.algorithm)
    reasons = [
        (topo.mode != "disagg", f"needs --mode disagg (got {topo.mode}): colocated ranks all train already"),
        (not t.tsp, "needs --tsp: the share it trains is packed transitions"),
        (t.train_sharding != "replicate", f"needs replicated trainers (got --train-sharding {t.train_sharding})"),
        (topo.gap_stages > 1, f"needs whole generator replicas (got --gap-stages {topo.gap_stages}): a stage holds "
                              f"only its blocks"),
        (t.tcss, "is on-policy: with --tcss a generator may hold the version before the trainers'"),
        (compress.lossy(t.publish_compression), f"needs exact publication (got --publish-compression "
                                                f"{t.publish_compression})"),
        (rl.updates_per_rollout > 1, f"needs one update per step (got --updates-per-rollout "
                                      f"{rl.updates_per_rollout})"),
        (algorithm.advantages(rl).needs_step_end, "needs advantages decided fragment by fragment (the global std "
                                                  "or re-admission decide at the step's end, where trainers train "
                                                  "again what they kept)"),
        (type(algorithm).trainer_state is not algorithms.Algorithm.trainer_state,
         f"cannot run {rl.algorithm}: its trainers keep a policy beside the weights the generators hold"),
        (cfg.optim.lora_rank == 0 and algorithm.loss(rl).needs_reference, "with full fine-tuning and a KL term "
                                                                          "needs a reference copy on the generator"),
    ]
    return next((why for bad, why in reasons if bad), None)
