"""GPU memory per role and phase: the one model that the planner prices placements with and that the
runtime checks recipes and --memory-budget-gb with (runtime/budget.py gives it a run's sizes). A
test holds it within 10% of the peaks measured on the roles' own code (lab/memory/measure.py, committed
in docs/memory/*.json) for every recipe and topology.

A rank's peak is the largest of its phases, the ones lab/memory/measure.py measures: a generator's
"fragment" (encode, K steps per chunk, decode, score) and "publication" (receive, install); a
trainer's "micro-batch" (forward + backward), "optimizer step", "publication" (make and send a
version) and "evaluation"; every rank's "load" (its weights, a trainer's sharded a unit at a time)
and "start-up probe". Each item has a category: parameters, gradients, optimizer, activations,
communication, other.

What the roles hold (runtime/build.py, the roles, parallel/): generators the DiT in the compute
dtype (--dtype) and no gradient, the text encoders where prompts are encoded, the VAE and the
rewards (--reward-dtype) where samples are decoded and scored; trainers float32 trained weights,
gradients and AdamW moments (fused: no temporaries), sharded by FSDP2 under one root with mixed
precision (a unit gathered in the compute dtype, its reduce-scatter in float32, one at a time), a
KL reference (full fine-tuning, beta > 0) in the compute dtype and sharded alike, the text encoders
and VAE when they sample (evaluation, TAG); a publication travels and installs a
bucket at a time; a lossy codec's state is sharded in the compute dtype. Working sets are bytes per
(row, token, hidden unit) per family and precision, or per decoded pixel, measured (`ACTIVATIONS`,
fitted to docs/memory/*.json); every other item is counted from parameter counts and dtypes. A plan
whose peak does not fit is excluded, and `MemoryUse.why` says which items fill the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from planner.hardware import GPU
from planner.phases import reward_bytes, text_encoder_bytes, trajectory_bytes, weight_bytes
from planner.specs import lora_params
from planner.workload import Workload

USABLE_FRACTION = 0.92
"""Of a GPU's memory, what tensors may use (allocator fragmentation, NCCL and cuBLAS buffers)."""

CONTEXT_BYTES = 2.5e9
"""CUDA context, communicator buffers and kernel workspaces per process (not a tensor: never measured)."""

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "communication", "other")

BUCKET_BYTES = 64 << 20
"""One publication bucket (parallel/publish.py's default); a tensor larger than it travels alone."""


# ----- what the run is ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RunShape:
    """What memory depends on, counted: built from a planner Workload (`shape_of`) or by the runtime
    from a released config and a run's config (runtime/budget.py)."""

    family: str
    dit: float
    """DiT parameters"""
    text: float
    """text-encoder parameters (all of them)"""
    vae: float
    rewards: float
    """parameters of the model rewards held by the run (not those served over HTTP)"""
    hidden: int
    blocks: int
    largest_unit: float
    """parameters of the largest FSDP unit (a block)"""
    largest_tensor: float
    """elements of the largest weight (the largest a publication bucket must hold)"""
    tokens: int
    """tokens of one sample's forward (image + text)"""
    latent: float
    """elements of one sample's latent"""
    pixels: float
    """decoded pixels of one sample (height x width x frames)"""
    steps: int
    branches: int
    """2 with classifier-free guidance"""
    gen_micro: int
    """samples per generation forward"""
    train_micro: int
    """transitions per training forward"""
    fragment: int
    """samples per fragment"""
    lora: float = 0.0
    """adapter parameters (0: full fine-tuning)"""
    weight_bytes: int = 4
    """bytes per trained DiT weight on a trainer (a full fine-tune's float32; a LoRA base's compute dtype)"""
    compute_bytes: int = 2
    """bytes per element of the compute dtype (--dtype; auto: bf16 on CUDA)"""
    reward_bytes: int = 2
    """bytes per reward-model weight (--reward-dtype: float32, or the compute dtype)"""
    checkpointing: bool = True
    reference: bool = False
    """a frozen reference copy for a KL term (full fine-tuning)"""
    ema: bool = False
    state_copies: tuple[tuple[str, int], ...] = ()
    """(name, count) of float32 copies of the trained weights an algorithm keeps on each trainer,
    sharded alike (DiffusionNFT's old policy: rl.algorithms.Cost)"""
    lossy_codec: bool = False
    tcss: bool = False
    """TCSS: a generator receives the next version into an idle copy while it samples with the live one"""
    tail_assist: bool = False
    """tail assist: a generator trains its share of the last fragment (float32, replicated)"""
    trainers_sample: bool = True
    """trainers sample (evaluation, TAG): they hold the text encoders and the VAE"""
    encodes: bool = True
    """some rank encodes prompts (not with --prompt-embeds)"""


@dataclass(frozen=True)
class Activations:
    """Measured working sets of one family in one precision: bytes per (row, token, hidden unit) of a
    forward or a micro-batch, bytes per decoded pixel of a decode."""

    generate: float
    """a denoising forward under autocast, above what it leaves behind"""
    train: float
    """a micro-batch's forward + backward with per-block checkpointing"""
    train_full: float
    """the same without checkpointing"""
    decode: float
    """the VAE decode of one sample, per decoded pixel (tiled for the video families)"""


ACTIVATIONS = {
    ("flux", 4): Activations(generate=29.7, train=139.1, train_full=3632.0, decode=2546.0),
    ("flux", 2): Activations(generate=36.1, train=177.5, train_full=2096.5, decode=2546.0),
    ("hunyuan_video", 4): Activations(generate=56.9, train=245.0, train_full=4093.4, decode=407.0),
    ("qwen_image", 2): Activations(generate=37.5, train=146.8, train_full=2324.5, decode=6916.0),
    ("sd3", 2): Activations(generate=25.4, train=83.1, train_full=1358.7, decode=2548.0),
    ("wan", 2): Activations(generate=20.0, train=105.1, train_full=1952.2, decode=187.1),
}
"""Working sets of a family whose trained weights are float32 (4: full fine-tuning) or bf16 (2:
a LoRA base), measured at its recipe (docs/memory/*.json: "working_sets_gib" and the phases'
activations). A family measured in one precision stands in for the other. The video families
decode tile by tile, so their decode's working set follows the tile more than the clip: per
decoded pixel it holds at the recipes' sizes (HunyuanVideo 480 x 480 x 53, Wan 240 x 416 x 33)."""


# ----- the items of a phase -------------------------------------------------------------------------
@dataclass
class MemoryUse:
    role: str
    capacity: float
    items: dict[str, float] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    """each item's category (CATEGORIES)"""
    phase: str = ""

    def add(self, name: str, num_bytes: float, kind: str = "other") -> "MemoryUse":
        if num_bytes > 0:
            self.items[name] = self.items.get(name, 0.0) + num_bytes
            self.kinds[name] = kind
        return self

    @property
    def total(self) -> float:
        return sum(self.items.values())

    @property
    def tensors(self) -> float:
        """What the code allocates (the context is not a tensor)."""
        return self.total - self.items.get("context", 0.0)

    def categories(self) -> dict[str, float]:
        out = dict.fromkeys(CATEGORIES, 0.0)
        for name, b in self.items.items():
            if name != "context":
                out[self.kinds.get(name, "other")] += b
        return out

    @property
    def fits(self) -> bool:
        return self.total <= USABLE_FRACTION * self.capacity

    def why(self) -> str:
        top = sorted(self.items.items(), key=lambda kv: -kv[1])[:4]
        parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in top)
        where = f" at its {self.phase}" if self.phase else ""
        usable = USABLE_FRACTION * self.capacity / 1e9
        return f"{self.role}{where}: {self.total / 1e9:.1f} GB > {usable:.1f} GB usable ({parts} GB)"


# ----- phases of each role --------------------------------------------------------------------------
def _act(s: RunShape) -> Activations:
    for key in ((s.family, s.weight_bytes), (s.family, 6 - s.weight_bytes), ("flux", s.weight_bytes)):
        if key in ACTIVATIONS:
            return ACTIVATIONS[key]
    raise AssertionError("flux is measured in both precisions")


def _row_bytes(s: RunShape, rows: float) -> float:
    """rows x tokens x hidden: the unit the measured working sets are counted in."""
    return rows * s.tokens * s.hidden


def published_bytes(s: RunShape) -> float:
    """What a version carries: every DiT weight in the compute dtype, or the float32 adapters."""
    return 4 * s.lora if s.lora else s.dit * s.compute_bytes


def bucket_bytes(s: RunShape) -> float:
    """A publication's bucket: BUCKET_BYTES, or its largest tensor alone."""
    return min(published_bytes(s), max(BUCKET_BYTES, s.largest_tensor * s.compute_bytes))


def generator_phases(s: RunShape, capacity: float, *, stages: int = 1, stage: int = 0,
                     scores: bool = True) -> dict[str, MemoryUse]:
    """One rank of a generator replica of `stages` stages (stage 0 encodes prompts; the last stage
    decodes, scores and keeps the fragment until it is sent)."""
    last = stage == stages - 1

    def base(phase: str) -> MemoryUse:
        m = MemoryUse(f"generator stage {stage}" if stages > 1 else "generator", capacity, phase=phase)
        # Every stage loads the whole DiT; GAP releases the other stages' blocks once they are planned.
        held = 1 if phase == "load" else stages
        m.add("DiT weights", s.dit * s.compute_bytes / held, "parameters")
        m.add("adapters", 4 * s.lora / held, "parameters")
        if stage == 0 and s.encodes:
            m.add("text encoders", s.text * s.compute_bytes, "parameters")
        if last:
            m.add("VAE", s.vae * s.compute_bytes, "parameters")
            m.add("reward models", s.rewards * s.reward_bytes if scores else 0.0, "parameters")
        if phase != "load":  # the receiver's buffers are made after the start-up checks
            m.add("publication bucket", bucket_bytes(s), "communication")
        if s.tcss and phase not in ("load", "start-up probe"):  # allocated at the first publication, kept from then on
            m.add("idle copy (TCSS)", published_bytes(s) / stages, "communication")
        return m.add("context", CONTEXT_BYTES)

    a = _act(s)
    fragment = base("fragment")
    # The fragment's trajectories and conditioning stay on the device until they are sent.
    fragment.add("trajectories", 4 * s.latent * (s.steps + 1) * (s.fragment + s.gen_micro), "activations")
    denoise = a.generate * _row_bytes(s, s.gen_micro) / stages  # CFG's branches are forwards of their own
    decode = a.decode * s.gen_micro * s.pixels if last else 0.0
    fragment.add("denoising" if denoise >= decode else "VAE decode", max(denoise, decode), "activations")
    install = base("publication").add("install", 4 * bucket_bytes(s), "activations")  # checksums' int64 words
    probe = base("start-up probe").add("probe forward", a.generate * _row_bytes(s, s.gen_micro), "activations")
    out = {"load": base("load"), "fragment": fragment, "publication": install, "start-up probe": probe}
    if s.tail_assist:  # its share of the last fragment: a trainer's gradient and a micro-batch's working set
        assist = out["tail assist"] = base("tail assist").add("gradients", 4 * (s.lora or s.dit), "gradients")
        working = a.train if s.checkpointing else a.train_full
        assist.add("activations", working * _row_bytes(s, s.train_micro * s.branches), "activations")
    return out


def trainer_phases(s: RunShape, capacity: float, *, shard: int, evaluates: bool = True,
                   publishes: bool = True) -> dict[str, MemoryUse]:
    """One trainer rank of a group of `shard` (FSDP2 over the group for full fine-tuning; replicated
    LoRA adapters otherwise, their base under FSDP2 over the rank alone)."""
    full = not s.lora
    n = shard if full else 1
    trained = s.dit if full else s.lora

    def base(phase: str) -> MemoryUse:
        m = MemoryUse("trainer", capacity, phase=phase)
        m.add("weights fp32" if full else "base weights", s.dit * s.weight_bytes / n, "parameters")
        m.add("adapters", 4 * s.lora, "parameters")
        if s.reference and full:
            m.add("reference copy", s.dit * s.compute_bytes / n, "parameters")
        if s.trainers_sample:
            m.add("text encoders", s.text * s.compute_bytes if s.encodes else 0.0, "parameters")
            m.add("VAE", s.vae * s.compute_bytes, "parameters")
        m.add("optimizer", 8 * trained / n if phase not in ("load", "start-up probe") else 0.0, "optimizer")
        m.add("EMA", 4 * trained / n if s.ema else 0.0, "other")
        for name, copies in s.state_copies:
            m.add(name, 4 * copies * trained / n, "other")
        if phase != "load":  # started after the start-up checks
            m.add("codec copy and residual", 2 * s.compute_bytes * trained / n if s.lossy_codec else 0.0, "other")
        return m.add("context", CONTEXT_BYTES)

    a = _act(s)
    rows = s.train_micro * s.branches
    unit = s.largest_unit if full else s.dit / s.blocks  # what FSDP2 gathers at a time
    # Loading: FSDP2 (over the group, or over the rank for mixed precision) shards the transformer a
    # unit at a time (trainer.py), each unit whole on the device until its shards are made (a
    # sharded trainer's comes from host memory: runtime/context.py).
    fsdp = shard > 1 or s.compute_bytes < 4
    phases = {"load": base("load").add("unit being sharded", unit * s.weight_bytes if fsdp else 0.0, "parameters")}
    for phase in ("start-up probe", "micro-batch"):  # the probe trains as the trainer trains, before any update
        m = phases[phase] = base(phase).add("gradients", 4 * trained / n, "gradients")
        m.add("activations", (a.train if s.checkpointing else a.train_full) * _row_bytes(s, rows), "activations")
        m.add("gathered unit and its reduce-scatter", unit * (s.compute_bytes + (4 if full else 0)), "communication")
    phases["optimizer step"] = base("optimizer step").add("gradients", 4 * trained / n, "gradients")
    if publishes:
        phases["publication"] = base("publication").add("gathered bucket", 5 * bucket_bytes(s),  # and its int64 words
                                                        "activations")
    if evaluates:
        ev = phases["evaluation"] = base("evaluation").add("reward models", s.rewards * s.reward_bytes, "parameters")
        ev.add("gathered unit", unit * s.compute_bytes, "communication")
        ev.add("sampling", max(a.generate * _row_bytes(s, s.gen_micro), a.decode * s.gen_micro * s.pixels),
               "activations")
    return phases


def colocated_phases(s: RunShape, capacity: float, *, shard: int, evaluates: bool = True) -> dict[str, MemoryUse]:
    """A colocated DigenRL rank: a trainer's phases (no publication), and a fragment generated beside
    the training state; it scores its own fragments, so the reward models stay."""
    phases = trainer_phases(s, capacity, shard=shard, evaluates=evaluates, publishes=False)
    gen = generator_phases(s, capacity)["fragment"]
    frag = MemoryUse("colocated", capacity, phase="fragment")
    for name, b in phases["micro-batch"].items.items():
        if name != "activations":
            frag.add(name, b, phases["micro-batch"].kinds[name])
    for name in ("trajectories", "denoising", "VAE decode"):
        frag.add(name, gen.items.get(name, 0.0), gen.kinds.get(name, "activations"))
    for m in [*phases.values(), frag]:
        m.role = "colocated"
        m.add("scoring reward models", s.rewards * s.reward_bytes, "parameters")
    return {**phases, "fragment": frag}


def scorer_phase(s: RunShape, capacity: float) -> MemoryUse:
    """A scorer rank: the reward models and one batch of scoring."""
    m = MemoryUse("scorer", capacity, phase="scoring").add("reward models", s.rewards * s.reward_bytes, "parameters")
    return m.add("context", CONTEXT_BYTES)


def peak(phases: dict[str, MemoryUse]) -> MemoryUse:
    """The phase with the most memory (a MemoryUse whose `phase` names it)."""
    return max(phases.values(), key=lambda m: m.total)


# ----- the planner's view: a Workload -----------------------------------------------------------------
def shape_of(wl: Workload, *, gen_micro: int | None = None, train_micro: int | None = None,
             fragment: int | None = None, trainers_sample: bool = False) -> RunShape:
    """The RunShape of a planner workload (its largest shape for a shape mix)."""
    wl = wl.largest()
    spec, res = wl.spec, wl.resolution
    latent = spec.latent_channels * res.latent_frames * (res.height // 8) * (res.width // 8)
    full = wl.finetune == "full"
    return RunShape(
        family=spec.family, dit=spec.params, text=sum(e.params for e in spec.text_encoders), vae=spec.vae.params,
        rewards=reward_bytes(wl) / 2, hidden=spec.hidden, blocks=spec.num_blocks,
        largest_unit=max(b.params for b in spec.blocks), largest_tensor=5 * spec.hidden ** 2,  # a block's widest
        tokens=wl.seq, latent=latent, pixels=res.pixels, steps=wl.sampling_steps, branches=wl.branches,
        gen_micro=gen_micro or wl.rollout_micro_batch, train_micro=train_micro or wl.train_micro_batch,
        fragment=fragment or wl.group_size, lora=0.0 if full else lora_params(spec, wl.lora_rank),
        weight_bytes=wl.param_bytes if full else 2, checkpointing=wl.gradient_checkpointing,
        reference=wl.kl and full, state_copies=wl.state_copies, trainers_sample=trainers_sample)


def generator_memory(wl: Workload, g: GPU, *, stages: int = 1, stage: int = 0, micro: int,
                     fragment_samples: int, scores: bool = True) -> MemoryUse:
    """The peak of one rank of a generator replica of `stages` stages."""
    s = shape_of(wl, gen_micro=micro, fragment=fragment_samples)
    return peak(generator_phases(s, g.memory_bytes, stages=stages, stage=stage, scores=scores))


def trainer_memory(wl: Workload, g: GPU, *, shard: int, micro: int, buffered_samples: int = 0,
                   generates: bool = False) -> MemoryUse:
    """The peak of one trainer rank; with TAG (`generates`) it also holds what generation needs.
    Landed trajectories wait in host memory (parallel/trainer_intake.py)."""
    s = shape_of(wl, train_micro=micro)
    phases = trainer_phases(s, g.memory_bytes, shard=shard, evaluates=False)
    for m in phases.values():
        if generates:
            m.add("text encoders", s.text * s.compute_bytes, "parameters")
            m.add("VAE", s.vae * s.compute_bytes, "parameters")
            m.add("reward models", s.rewards * s.reward_bytes, "parameters")
    out = peak(phases)
    out.phases = phases
    return out


def training_state(wl: Workload, shard: int, *, reference_copy: bool | None = None,
                   grad_bytes_per_param: int = 4) -> dict[str, float]:
    """Weights, gradients and AdamW state of the trainer group, per GPU of a shard group of `shard`
    (the peer systems' view): full fine-tuning keeps float32 weights, gradients and two moments;
    LoRA a frozen bf16 base and adapters with their float32 state. A KL term keeps a frozen bf16
    reference copy for full fine-tuning (LoRA's reference is the base with adapters off)."""
    p = wl.spec.params
    out = {}
    if wl.finetune == "full":
        out["weights fp32"] = 4 * p / shard
        out["gradients"] = grad_bytes_per_param * p / shard
        out["optimizer"] = 8 * p / shard
        if reference_copy if reference_copy is not None else wl.kl:
            out["reference copy"] = 2 * p / shard
        for name, copies in wl.state_copies:  # an algorithm's fp32 copies of the trained weights, sharded alike
            out[name] = 4 * copies * p / shard
    else:
        lp = lora_params(wl.spec, wl.lora_rank)
        out["base weights bf16"] = 2 * p / shard
        out["adapters + optimizer"] = 16 * lp + sum(4 * copies * lp for _, copies in wl.state_copies)
    if shard > 1:
        out["gathered blocks"] = 4 * max(b.params for b in wl.spec.blocks)
    return out


def activations_train(wl: Workload, transitions: int) -> float:
    """Activations of one training micro-batch (every branch), measured per family."""
    s = shape_of(wl, train_micro=transitions)
    a = _act(s)
    return (a.train if wl.gradient_checkpointing else a.train_full) * _row_bytes(s, transitions * s.branches)


def activations_infer(wl: Workload, samples: int) -> float:
    s = shape_of(wl, gen_micro=samples)
    return _act(s).generate * _row_bytes(s, samples * s.branches)


def colocated_memory(wl: Workload, g: GPU, *, num_gpus: int, variant: str, rollout_micro: int,
                     train_micro: int, samples_per_gpu: int, resident_aux: bool = True,
                     shard: int | None = None) -> MemoryUse:
    """Every rank generates, scores and trains (DigenRL colocated, and the peer systems). variant:
    replicate (a full bf16 rollout copy beside the training state), fsdp (generation gathers the
    training shards), sleepwake (the rollout copy and the training state take turns: the peak is
    the larger phase plus what stays)."""
    shard = num_gpus if shard is None else shard
    state = training_state(wl, shard if (wl.finetune == "full" or variant != "replicate") else 1)
    m = MemoryUse(f"colocated ({variant})", g.memory_bytes)
    kinds = {"gradients": "gradients", "optimizer": "optimizer", "adapters + optimizer": "optimizer",
             "gathered blocks": "communication"}
    if variant == "sleepwake":
        train_phase = sum(state.values()) + activations_train(wl, train_micro)
        roll_phase = weight_bytes(wl) + activations_infer(wl, rollout_micro)
        m.add("larger phase (offloaded other)", max(train_phase, roll_phase), "activations")
    else:
        for name, b in state.items():
            m.add(name, b, kinds.get(name, "parameters"))
        if variant == "replicate" and wl.finetune == "full":
            m.add("rollout copy bf16", weight_bytes(wl), "parameters")
        m.add("activations", max(activations_train(wl, train_micro), activations_infer(wl, rollout_micro)),
              "activations")
    if resident_aux:
        m.add("text encoders", text_encoder_bytes(wl), "parameters")
        m.add("VAE", 2 * wl.spec.vae.params, "parameters")
        m.add("reward models", reward_bytes(wl), "parameters")
    m.add("trajectory buffer", trajectory_bytes(wl, samples_per_gpu), "other")
    return m.add("context", CONTEXT_BYTES)


def max_micro_batch(fits, start: int, limit: int = 64) -> int:
    """The largest micro-batch b <= limit (powers of two from `start` down) for which fits(b)."""
    b = start
    while b > 1 and not fits(b):
        b //= 2
    while b * 2 <= limit and fits(b * 2) and b * 2 <= start:
        b *= 2
    return b if fits(b) else 0


__all__ = ["ACTIVATIONS", "Activations", "BUCKET_BYTES", "CATEGORIES", "CONTEXT_BYTES", "MemoryUse", "RunShape",
           "USABLE_FRACTION", "activations_infer", "activations_train", "bucket_bytes", "colocated_memory",
           "colocated_phases", "generator_memory", "generator_phases", "max_micro_batch", "peak", "published_bytes",
           "scorer_phase", "shape_of", "trainer_memory", "trainer_phases", "training_state"]
