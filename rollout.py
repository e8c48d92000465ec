"""The generator role (docs/DESIGN.md): sample trajectories of whole fragments with the
flow-matching SDE sampler, decode and score them, and emit them to the trainers.

One API serves every way a fragment is generated: `Generator.denoise` samples it, and a
`FragmentStream` decodes, scores and emits it. A replica's step (runtime/steps.py `generator_step`), a TAG trainer
(parallel/tag.py) and the last stage of a GAP replica (parallel/gap.py) all push their denoised
fragments into a stream.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rl import advantages
from prompts import resolutions
from rl import sampler
from parallel import fragment_records
from parallel.trainer_intake import TrainChunk
from parallel.stepplan import Chunk, Fragment, StepPlan
from parallel.publish import PublicationError
from parallel.scoring import LocalScorer, Ticket
from parallel import store_keys as keys
from rl.conditioning import Conditioning
from telemetry.tracing import Slowdown


def encode_batch(adapter, prompts: list[str], negative_prompt: str | None,
                 cfg: sampler.SamplingConfig) -> tuple[Conditioning, Conditioning | None]:
    cond = adapter.encode_prompts(prompts)
    neg = adapter.encode_prompts([negative_prompt or ""] * len(prompts)) if cfg.cfg_scale != 1.0 else None
    return cond, neg


def sample_images(adapter, prompts: list[str], cfg: sampler.SamplingConfig, *, step: int = 0,
                  first_sample_id: int = 0, batch_size: int = 8, negative_prompt: str | None = None,
                  sample_ids: list[int] | None = None):
    """Sample one image per prompt in micro-batches. Sample j gets the global id first_sample_id + j
    (or sample_ids[j]), so the result does not depend on batch_size. Returns (trajectory, images
    [B,3,H,W] in [0,1])."""
    trajs, images = [], []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        cond, neg = encode_batch(adapter, chunk, negative_prompt, cfg)
        ids = (list(sample_ids[start:start + len(chunk)]) if sample_ids is not None
               else list(range(first_sample_id + start, first_sample_id + start + len(chunk))))
        traj = sampler.denoise(adapter, cond, neg, ids, step, cfg)
        trajs.append(traj)
        images.append(adapter.decode(traj.latents[:, -1]).cpu())
    traj = sampler.Trajectory(latents=torch.cat([t.latents for t in trajs]).cpu(),
                              log_probs=torch.cat([t.log_probs for t in trajs]).cpu(), sigmas=trajs[0].sigmas,
                              steps={k: torch.cat([t.steps[k] for t in trajs]).cpu() for k in trajs[0].steps})
    return traj, torch.cat(images)


@dataclass
class Denoised:
    """A fragment's trajectories, chunk by chunk in plan order, before decoding and scoring."""

    fragment: Fragment
    trajectories: list[sampler.Trajectory]
    conds: list[Conditioning]
    negs: list[Conditioning | None]


@dataclass
class Scoring:
    """A decoded fragment handed to the scorer; `ticket` collects its scores."""

    denoised: Denoised
    version: int
    images: Tensor  # (n, 3, H, W) in [0, 1], on CPU
    ticket: Ticket


@dataclass
class FragmentResult:
    """A generated, decoded and scored fragment: its training chunks and what the logs need."""

    fragment: int
    chunks: list[TrainChunk]  # in plan order (emptied once sent: the sends hold their packed copies)
    sample_ids: list[int]
    rewards: dict[str, list[float]]  # per reward name, and "combined"
    zero_std: list[bool]
    images: torch.Tensor  # (n, 3, H, W) in [0, 1], on CPU
    prompts: list[str]


class Generator:
    """The generator role's work: sample, decode and score whole fragments with the current policy
    version. A GAP stage uses its encoding and noise keys and streams what its last stage denoised."""

    def __init__(self, adapter, sampling: sampler.SamplingConfig, scorer, records, *, seed: int,
                 negative_prompt: str = "", same_group_noise: bool = False,
                 rule: advantages.AdvantageRule | None = None, store=None, autocast_ctx=None,
                 slowdown: Slowdown | None = None, carried: Callable | None = None, policy=None):
        """`scorer`: a parallel.scoring.LocalScorer or RemoteScorer (a RewardSet is scored locally).
        `rule`: how rewards become advantages (default: group std, clamp 5); `store` receives each
        fragment's facts when the rule needs the end of the step. `slowdown` (--debug-slow-rank)
        wraps all of this rank's generation work. `carried`: what a chunk carries of a sampled
        trajectory (the algorithm's `carried`; default all of it). `policy`: a context that puts the
        sampling policy into the model while this generator denoises (a trainer's `sampling_policy`,
        for ranks that generate with the trainer's model)."""
        self.adapter, self.sampling, self.records = adapter, sampling, records
        self.scorer = scorer if hasattr(scorer, "wait") else LocalScorer(scorer)  # a RewardSet has `submit` too
        self.seed, self.negative_prompt = seed, negative_prompt
        self.same_group_noise, self.rule, self.store = same_group_noise, rule or advantages.AdvantageRule(), store
        self.autocast = autocast_ctx or contextlib.nullcontext
        self.carried, self.policy = carried or (lambda traj: traj), policy or contextlib.nullcontext
        self.sigmas = sampler.sigmas_for(adapter, sampling)
        self.shapes: dict = {}  # shape key -> (its SamplingConfig, its sigmas): the dynamic shift depends on it
        self.slowdown = slowdown or Slowdown()

    def sampling_for(self, shape) -> tuple[sampler.SamplingConfig, torch.Tensor]:
        """The sampling config and sigmas of a fragment's shape (parallel.plan.Fragment.shape; None:
        the run's own), computed once per shape."""
        if shape is None:
            return self.sampling, self.sigmas
        if shape not in self.shapes:
            cfg = resolutions.sampling_for(self.sampling, shape)
            self.shapes[shape] = (cfg, sampler.sigmas_for(self.adapter, cfg))
        return self.shapes[shape]

    def records_of(self, plan: StepPlan, sample_ids) -> list:
        return [self.records[plan.prompt_indices[i // plan.group_size]] for i in sample_ids]

    def chunk_inputs(self, plan: StepPlan, chunk: Chunk) -> tuple[Conditioning, Conditioning | None]:
        """A chunk's prompts encoded: (cond, neg_cond)."""
        prompts = [r.prompt for r in self.records_of(plan, chunk.sample_ids)]
        return encode_batch(self.adapter, prompts, self.negative_prompt, self.sampling)

    def init_ids(self, plan: StepPlan, chunk: Chunk) -> list[int]:
        """Keys of the initial noise: the sample ids, or the group's (a negative id) when a group shares it."""
        g = plan.group_size
        return [-1 - i // g for i in chunk.sample_ids] if self.same_group_noise else list(chunk.sample_ids)

    def denoise(self, plan: StepPlan, fragment: Fragment) -> Denoised:
        """Sample a fragment's K steps at its shape, one chunk (micro-batch) per batch."""
        out = Denoised(fragment, [], [], [])
        cfg, sigmas = self.sampling_for(fragment.shape)
        with self.policy():
            for chunk in fragment.chunks:
                cond, neg = self.chunk_inputs(plan, chunk)
                with self.autocast(), self.slowdown():
                    out.trajectories.append(sampler.denoise(self.adapter, cond, neg, list(chunk.sample_ids),
                                                            plan.step, cfg, init_ids=self.init_ids(plan, chunk),
                                                            sigmas=sigmas))
                out.conds.append(cond)
                out.negs.append(neg)
        return out

    @staticmethod
    def denoised(fragment: Fragment, trajectories, conds, negs) -> Denoised:
        """The record of a fragment denoised elsewhere (the stages of a GAP replica)."""
        return Denoised(fragment, list(trajectories), list(conds), list(negs))

    def denoise_padding(self, step: int) -> None:
        """Denoise one sample of an empty prompt and keep nothing: the transformer forwards of a
        chunk, for ranks whose collectives must pair up with another rank's chunk (FSDP TAG)."""
        cond, neg = encode_batch(self.adapter, [""], self.negative_prompt, self.sampling)
        with self.policy(), self.autocast(), self.slowdown():
            sampler.denoise(self.adapter, cond, neg, [0], step, self.sampling, sigmas=self.sigmas)

    def submit(self, plan: StepPlan, denoised: Denoised, version: int) -> Scoring:
        """Decode a denoised fragment and hand it to the scorer (local: scored now; remote: sent)."""
        records = self.records_of(plan, denoised.fragment.sample_ids)
        with self.slowdown():
            with self.autocast():
                images = torch.cat([self.adapter.decode(t.latents[:, -1]).cpu() for t in denoised.trajectories])
            ticket = self.scorer.submit(plan.step, denoised.fragment.index, images, [r.prompt for r in records],
                                        [r.metadata for r in records])
        return Scoring(denoised, version, images, ticket)

    def complete(self, plan: StepPlan, scoring: Scoring, reward_std: float | None) -> "FragmentResult":
        """Wait for a fragment's scores, compute its group advantages and cut it into chunks; put
        the facts the end of the step reads on the store (parallel/fragment_records.py)."""
        fragment = scoring.denoised.fragment
        scores = self.scorer.wait(scoring.ticket)
        ids = list(fragment.sample_ids)
        group_ids = torch.tensor([i // plan.group_size for i in ids])
        out = advantages.fragment_advantages(self.rule, scores, group_ids, ids, std=reward_std,
                                             whole_step=len(plan.fragments) == 1, seed=self.seed, step=plan.step)
        if self.rule.needs_step_end:
            fragment_records.publish(self.store, plan.step, fragment.index, out.facts)
        combined = scores.pop("combined")
        zero_std = advantages.zero_std_groups(combined, group_ids)
        adv, keep = out.advantages, out.keep
        chunks, start = [], 0
        d = scoring.denoised
        for chunk, traj, cond, neg in zip(fragment.chunks, d.trajectories, d.conds, d.negs):
            sl = slice(start, start + len(chunk.sample_ids))
            kept = self.carried(traj)
            # The trajectories and conditioning stay on the device until they are sent (or, colocated,
            # trained); the per-sample metadata is small and read on the host.
            chunks.append(TrainChunk(plan.step, fragment.index, chunk.index, scoring.version,
                                     torch.tensor(chunk.sample_ids, dtype=torch.int64), kept.latents, kept.log_probs,
                                     adv[sl].clone(), keep[sl].clone(), traj.sigmas.cpu(), cond, neg, kept.steps))
            start = sl.stop
        rewards = {name: v.float().cpu().tolist() for name, v in scores.items()}
        rewards["combined"] = combined.tolist()
        prompts = [r.prompt for r in self.records_of(plan, ids)]
        return FragmentResult(fragment.index, chunks, ids, rewards, zero_std.tolist(), scoring.images, prompts)

    def stream(self, plan: StepPlan, reward_std: float | None, emit: Callable, tracer=None) -> "FragmentStream":
        return FragmentStream(self, plan, reward_std, emit, tracer)

    def generate(self, plan: StepPlan, fragments, version: int, reward_std: float | None, emit: Callable) -> None:
        """Generate, score and emit `fragments` in order with one version."""
        stream = self.stream(plan, reward_std, emit)
        for fragment in fragments:
            stream.push(self.denoise(plan, fragment), version)
        stream.close()


class FragmentStream:
    """Decodes, scores and emits denoised fragments in the order they are pushed.

    With scorer ranks, a fragment's scores are collected only after the next fragment has been
    pushed, so the scorer works while this rank denoises; local scoring emits a fragment at once.
    `close` emits what is left."""

    def __init__(self, generator: Generator, plan: StepPlan, reward_std: float | None, emit: Callable,
                 tracer=None):
        self.gen, self.plan, self.reward_std, self.emit, self.tracer = generator, plan, reward_std, emit, tracer
        self.lagged = generator.scorer.remote
        self.pending: list[Scoring] = []

    def submit(self, denoised: Denoised, version: int) -> None:
        self.pending.append(self.gen.submit(self.plan, denoised, version))

    def collect(self, keep: int | None = None) -> None:
        """Emit the submitted fragments whose scores are due: all but the newest with scorer ranks."""
        keep = (1 if self.lagged else 0) if keep is None else keep
        while len(self.pending) > keep:
            scoring = self.pending.pop(0)
            span = (self.tracer.span("wait_scores", "comm", self.plan.step, scoring.denoised.fragment.index)
                    if self.lagged and self.tracer is not None else contextlib.nullcontext())
            with span:
                self.emit(self.gen.complete(self.plan, scoring, self.reward_std))

    def push(self, denoised: Denoised, version: int) -> None:
        self.submit(denoised, version)
        self.collect()

    def close(self) -> None:
        self.collect(keep=0)


class VersionSync:
    """Which policy version a generator rank runs (docs/DESIGN.md 5.5, 5.6).

    Step k is generated with exactly version k - lag (lag 0: on-policy; lag 1: TCSS, from step 1
    on), never a newer one, so the data of a step does not depend on timing and a resumed run
    repeats it bitwise. With TCSS a version announced while this rank still generates the previous
    step is received into staging at a fragment boundary (the trainer's send completes, nothing
    changes here) and installed when its step starts. The stages of a GAP replica switch together:
    stage 0 picks the version of a step and the other stages install exactly that one."""

    def __init__(self, receiver, store, trainer_rank: int, start_version: int, lag: int, layout=None,
                 replica: int | None = None, tracer=None, group=None):
        """`group`: the communicator versions arrive on (ProcessGroups.publish), apart from this
        rank's fragment sends: with TCSS trainer 0 publishes before it receives the fragments this
        rank sent before it receives the version (docs/communication.md)."""
        self.receiver, self.store, self.src, self.group = receiver, store, trainer_rank, group
        self.version, self.lag, self.layout, self.replica, self.tracer = start_version, lag, layout, replica, tracer

    def _receive_next(self, step: int, install: bool = False) -> int:
        """Receive version + 1: into the live weights bucket by bucket (`install`, at a step
        boundary), or into the receiver's idle copy (TCSS, while this rank still samples)."""
        with self.tracer.span("receive_weights", "publish", step, version=self.version + 1):
            got = self.receiver.receive(src=self.src, group=self.group, install=install)  # rank wait: trainer 0 sends version + 1
        if got != self.version + 1:  # a real check: python -O removes asserts
            raise PublicationError(f"rank received version {got} from trainer rank {self.src} while holding "
                                   f"version {self.version}: publications must arrive in order")
        return got

    def _install_next(self, step: int) -> None:
        if self.receiver.staged_version is None:
            self.version = self._receive_next(step, install=True)  # verified against the trainer's checksum
            return
        with self.tracer.span("install", "publish", step, version=self.version + 1):
            self.version = self.receiver.install()  # the idle copy goes live, verified

    def at_step_start(self, step: int) -> int:
        need = max(step - self.lag, self.version)
        if self.layout is not None and not self.layout.first:
            need = max(need, self.store.get(keys.replica_version(self.replica, step)))  # stage 0's choice
        while self.version < need:
            self._install_next(step)
        if self.layout is not None and self.layout.first:
            self.store.put(keys.replica_version(self.replica, step), self.version)
        return self.version

    def at_fragment_boundary(self, step: int) -> int:
        """TCSS: stage an announced publication (never install it inside a step)."""
        if self.lag and self.layout is None and self.receiver.staged_version is None \
                and self.store.ready(keys.version_published(self.version + 1)):
            self._receive_next(step)
        return self.version

    def take_publication(self, version: int, next_step: int) -> None:
        """Between steps, before this rank waits on a rank that publishes `version` first (a
        --placement auto decision, runtime/autoplace.py): take it off the wire without changing the
        version step `next_step` generates with. What `at_step_start(next_step)` installs is
        installed now; a version beyond it (TCSS) is staged, as a fragment boundary would stage it.
        The trainers' send completes, and the step trains what it would have trained."""
        self.at_step_start(next_step)
        if self.version < version and self.receiver.staged_version is None:
            self._receive_next(next_step)  # rank wait: trainer 0 sends `version`

    def drain(self, last_version: int, step: int) -> None:
        """Receive every publication still addressed to this rank (the trainers' sends complete)."""
        while self.version < last_version:
            self._install_next(step)
