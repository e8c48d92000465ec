"""GPU memory per role and phase: the one model that the planner prices placements with and that the
runtime checks recipes and --memory-budget-gb with (runtime/memory.py gives it a run's sizes). A
test holds it within 10% of the peaks measured on the roles' own code (runtime/measure.py, committed
in docs/memory/*.json) for every recipe and topology.

A rank's peak is the largest of its phases, the ones runtime/measure.py measures: a generator's
"fragment" (encode, K steps per chunk, decode, score) and "publication" (receive, install); a
trainer's "micro-batch" (forward + backward), "optimizer step", "publication" (make and send a
version) and "evaluation"; every rank's "start-up probe". Each item has a category: parameters,
gradients, optimizer, activations, communication, other.

What a rank holds depends on the code as much as on the run: a `Design` says which. TODAY is what
runtime/build.py builds now; LEAN is the lean roles of issue #29 (what the planner plans with:
`PLANNED`). Activations are bytes per (row, token, hidden unit) per family, measured
(`ACTIVATIONS`, fitted to docs/memory/*.json); every other item is counted from parameter counts
and dtypes. A plan whose peak does not fit is excluded, and `MemoryUse.why` says which items fill
the GPU.
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


# ----- what the code holds ----------------------------------------------------------------------
@dataclass(frozen=True)
class Design:
    """The choices of the role code that decide its memory (README, "Memory")."""

    name: str
    generator_dtype_bytes: int | None
    """bytes per DiT weight on a generator: None keeps the run's --dtype (today), 2 the compute dtype"""
    cast_copy: bool
    """float32 weights under bf16 autocast keep a bf16 copy of every cast weight while a chunk is denoised"""
    whole_staging: bool
    """a generator receives a publication into staging as large as the publication (else one bucket)"""
    whole_gather: bool
    """an FSDP trainer gathers the whole model to publish a version (else shard by shard)"""
    held_reduce_scatter: bool
    """FSDP units that are roots of their own keep every unit's float32 reduce-scatter input until the
    backward ends (one root frees each when the next unit's reduce-scatter starts)"""
    trainer_aux: bool
    """trainers load the whole pipeline: text encoders and VAE resident, reward models for evaluation"""
    aux_dtype_bytes: int
    """bytes per VAE and reward-model weight (4: float32; 2: bf16 where the reward allows it)"""
    whole_codec: bool
    """a lossy codec keeps the generators' copy and its residual in float32, unsharded"""
    probe_backward: bool
    """every rank runs an unsharded forward + backward at start-up (the speed probe)"""
    tiled_decode: bool
    """the VAE decodes a video tile by tile (models/: its working set is a tile's)"""


TODAY = Design("today", None, cast_copy=True, whole_staging=True, whole_gather=True, held_reduce_scatter=True,
               trainer_aux=True, aux_dtype_bytes=4, whole_codec=True, probe_backward=True, tiled_decode=False)
LEAN = Design("lean", 2, cast_copy=False, whole_staging=False, whole_gather=False, held_reduce_scatter=False,
              trainer_aux=False, aux_dtype_bytes=2, whole_codec=False, probe_backward=False, tiled_decode=True)
DESIGNS = {d.name: d for d in (TODAY, LEAN)}
PLANNED = LEAN
"""The design the planner prices DigenRL's roles with."""

BUCKET_BYTES = 64 << 20
"""One publication bucket (parallel/publish.py's default)."""


# ----- what the run is ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RunShape:
    """What memory depends on, counted: built from a planner Workload (`shape_of`) or by the runtime
    from a released config and a run's config (runtime/memory.py)."""

    family: str
    dit: float
    """DiT parameters"""
    text: float
    """text-encoder parameters (all of them)"""
    vae: float
    rewards: float
    """parameters of the model rewards"""
    hidden: int
    blocks: int
    largest_unit: float
    """parameters of the largest FSDP unit (a block)"""
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
    """bytes per DiT weight as --dtype loads it (auto: float32)"""
    text_bytes: int = 2
    checkpointing: bool = True
    reference: bool = False
    """a frozen reference copy for a KL term (full fine-tuning)"""
    ema: bool = False
    lossy_codec: bool = False
    reward_batch: int = 32
    reward_pixels: float = 224 * 224


@dataclass(frozen=True)
class Activations:
    """Measured working sets of one family in one precision: bytes per (row, token, hidden unit) of a
    forward or a micro-batch, bytes per decoded pixel of a decode."""

    generate: float
    """a denoising forward under the run's autocast, above what it leaves behind"""
    evaluate: float
    """an evaluation forward (runtime/evaluation.py samples without autocast)"""
    train_ckpt: float
    """a micro-batch's forward + backward with per-block checkpointing"""
    train_full: float
    """the same without checkpointing (the start-up probe), at the end of its forward"""
    decode: float
    """the VAE decode of one sample under bf16 autocast, per decoded pixel"""
    decode_fp32: float
    """the same in float32 (evaluation)"""
    tiled: float = 1.0
    """a tiled decode's working set as a fraction of the whole decode's"""


ACTIVATIONS = {
    ("flux", 4): Activations(generate=29.7, evaluate=218.4, train_ckpt=139.1, train_full=3632.0, decode=2546.0,
                             decode_fp32=3061.0),
    ("flux", 2): Activations(generate=36.1, evaluate=34.1, train_ckpt=177.5, train_full=2096.5, decode=2546.0,
                             decode_fp32=3061.0),
    ("hunyuan_video", 4): Activations(generate=56.9, evaluate=116.4, train_ckpt=245.0, train_full=4093.4,
                                      decode=1250.0, decode_fp32=1502.0, tiled=0.293),
    ("qwen_image", 2): Activations(generate=37.5, evaluate=39.1, train_ckpt=146.8, train_full=2324.5, decode=6916.0,
                                   decode_fp32=6912.0),
    ("sd3", 2): Activations(generate=25.4, evaluate=26.1, train_ckpt=83.1, train_full=1358.7, decode=2548.0,
                            decode_fp32=3061.0),
    ("wan", 2): Activations(generate=20.0, evaluate=23.5, train_ckpt=105.1, train_full=1952.2, decode=534.3,
                            decode_fp32=590.7),
}
"""Working sets of a family with float32 (4) or bf16 (2) DiT weights, measured at its recipe
(docs/memory/*.json: "working_sets_gib" and the phases' activations). HunyuanVideo's decode under
autocast is its float32 decode scaled as FLUX's VAE scales (0.83); its tiled decode is 4.99 of
17.03 GiB in float32 at 480 x 480 x 53 (MemTracker on its VAE, tiled and not). A family measured
in one precision stands in for the other."""


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


def _decode(s: RunShape, d: Design, a: Activations) -> float:
    """The VAE decode of a chunk under bf16 autocast."""
    return a.decode * s.gen_micro * s.pixels * (a.tiled if d.tiled_decode else 1.0)


def published_bytes(s: RunShape) -> float:
    """What a version carries: every DiT weight in the trained dtype, or the float32 adapters."""
    return 4 * s.lora if s.lora else s.dit * s.weight_bytes


def _cast_copy(s: RunShape, d: Design, weight_bytes: int) -> float:
    """bf16 copies autocast keeps of float32 weights while its context lasts."""
    return 2 * (s.dit if not s.lora else s.lora) if d.cast_copy and weight_bytes == 4 else 0.0


def generator_phases(s: RunShape, d: Design, capacity: float, *, stages: int = 1, stage: int = 0,
                     scores: bool = True) -> dict[str, MemoryUse]:
    """One rank of a generator replica of `stages` stages (stage 0 encodes prompts; the last stage
    decodes, scores and keeps the fragment until it is sent)."""
    wb = d.generator_dtype_bytes or s.weight_bytes
    last = stage == stages - 1

    def base(phase: str) -> MemoryUse:
        m = MemoryUse(f"generator stage {stage}" if stages > 1 else "generator", capacity, phase=phase)
        m.add("DiT weights", s.dit * wb / stages, "parameters")
        m.add("adapters", 4 * s.lora / stages, "parameters")
        if stage == 0 or d.trainer_aux:  # today every rank loads the whole pipeline
            m.add("text encoders", s.text * s.text_bytes, "parameters")
        if last or d.trainer_aux:
            m.add("VAE", s.vae * d.aux_dtype_bytes, "parameters")
        if last and scores:
            m.add("reward models", s.rewards * d.aux_dtype_bytes, "parameters")
        staging = published_bytes(s) / stages
        m.add("publication staging", staging if d.whole_staging else min(staging, BUCKET_BYTES), "communication")
        return m.add("context", CONTEXT_BYTES)

    a = _act(s)
    fragment = base("fragment")
    fragment.add("trajectories", 4 * s.latent * (s.steps + 1) * (s.fragment + s.gen_micro), "activations")
    # CFG runs the unconditional branch as a forward of its own (rl/sampler.guided_velocity)
    denoise = _cast_copy(s, d, wb) / stages + a.generate * _row_bytes(s, s.gen_micro) / stages
    decode = _decode(s, d, a) if last else 0.0
    fragment.add("denoising" if denoise >= decode else "VAE decode", max(denoise, decode), "activations")
    install = base("publication").add("install", min(published_bytes(s), BUCKET_BYTES), "activations")
    return {"fragment": fragment, "publication": install}


def trainer_phases(s: RunShape, d: Design, capacity: float, *, shard: int, evaluates: bool = True,
                   publishes: bool = True) -> dict[str, MemoryUse]:
    """One trainer rank of a group of `shard` (FSDP over the group when shard > 1 and full
    fine-tuning; replicated LoRA adapters otherwise)."""
    full = not s.lora
    n = shard if full else 1
    trained = s.dit if full else s.lora
    grad_bytes = s.weight_bytes if full else 4
    sharded = full and shard > 1

    def base(phase: str) -> MemoryUse:
        m = MemoryUse("trainer", capacity, phase=phase)
        m.add("weights fp32" if s.weight_bytes == 4 else "weights", s.dit * s.weight_bytes / n, "parameters")
        m.add("adapters", 4 * s.lora, "parameters")
        if s.reference and full:
            m.add("reference copy", s.dit * s.weight_bytes, "parameters")  # copied before sharding
        if d.trainer_aux:
            m.add("text encoders", s.text * s.text_bytes, "parameters")
            m.add("VAE", s.vae * d.aux_dtype_bytes, "parameters")
        m.add("optimizer", 8 * trained / n, "optimizer")
        m.add("EMA", 4 * trained / n if s.ema else 0.0, "other")
        if s.lossy_codec:
            m.add("codec copy and residual", 8 * trained / (1 if d.whole_codec else n), "other")
        return m.add("context", CONTEXT_BYTES)

    a = _act(s)
    micro = base("micro-batch").add("gradients", grad_bytes * trained / n, "gradients")
    rows = s.train_micro * s.branches
    micro.add("activations", (a.train_ckpt if s.checkpointing else a.train_full) * _row_bytes(s, rows), "activations")
    if sharded:
        micro.add("gathered unit", s.largest_unit * s.weight_bytes, "parameters")
        micro.add("reduce-scatter", s.dit * s.weight_bytes if d.held_reduce_scatter else
                  2 * s.largest_unit * s.weight_bytes, "communication")
    step = base("optimizer step").add("gradients", grad_bytes * trained / n, "gradients")
    step.add("optimizer temporaries", 4 * trained / n, "optimizer")
    phases = {"micro-batch": micro, "optimizer step": step}
    if publishes:
        out = published_bytes(s) if (sharded and d.whole_gather) else min(published_bytes(s), BUCKET_BYTES)
        phases["publication"] = base("publication").add("gathered version", out, "activations")
    if evaluates:
        ev = base("evaluation").add("reward models", s.rewards * d.aux_dtype_bytes, "parameters")
        if not d.trainer_aux:
            ev.add("text encoders", s.text * s.text_bytes, "parameters").add("VAE", s.vae * d.aux_dtype_bytes,
                                                                              "parameters")
        if sharded:
            ev.add("gathered unit", s.largest_unit * s.weight_bytes, "communication")
        decode = a.decode_fp32 * s.gen_micro * s.pixels * (a.tiled if d.tiled_decode else 1.0)
        ev.add("sampling", max(a.evaluate * _row_bytes(s, s.gen_micro), decode), "activations")  # no autocast
        phases["evaluation"] = ev
    return phases


def start_up_phase(s: RunShape, d: Design, capacity: float, role: str) -> MemoryUse:
    """The start-up speed probe, before anything is sharded: the whole model, and with
    `probe_backward` one forward + backward of the run's micro-batch without checkpointing."""
    wb = s.weight_bytes if role == "trainer" or d.generator_dtype_bytes is None else d.generator_dtype_bytes
    m = MemoryUse(role, capacity, phase="start-up probe")
    m.add("DiT weights", s.dit * wb, "parameters").add("adapters", 4 * s.lora, "parameters")
    if d.trainer_aux or role == "generator":
        m.add("text encoders", s.text * s.text_bytes, "parameters")
        m.add("VAE", s.vae * d.aux_dtype_bytes, "parameters")
    a = _act(s)
    if d.probe_backward:  # the peak ends the forward: every block's saved activations, autocast's casts
        m.add("activations", _cast_copy(s, d, wb) + a.train_full * _row_bytes(s, s.gen_micro), "activations")
    else:
        m.add("activations", a.generate * _row_bytes(s, s.gen_micro), "activations")
    return m.add("context", CONTEXT_BYTES)


def colocated_phases(s: RunShape, d: Design, capacity: float, *, shard: int,
                     evaluates: bool = True) -> dict[str, MemoryUse]:
    """A colocated DigenRL rank: a trainer's phases (no publication), and a fragment generated beside
    the training state (under FSDP every unit is gathered as it runs)."""
    phases = trainer_phases(s, d, capacity, shard=shard, evaluates=evaluates, publishes=False)
    gen = generator_phases(s, d, capacity)["fragment"]
    frag = MemoryUse("colocated", capacity, phase="fragment")
    for name, b in phases["micro-batch"].items.items():
        if name not in ("activations", "reduce-scatter"):
            frag.add(name, b, phases["micro-batch"].kinds[name])
    for name in ("trajectories", "denoising", "VAE decode"):
        frag.add(name, gen.items.get(name, 0.0), gen.kinds.get(name, "activations"))
    for m in [*phases.values(), frag]:
        m.role = "colocated"  # every rank scores its own fragments: the reward models stay
        m.add("scoring reward models", s.rewards * d.aux_dtype_bytes, "parameters")
    return {**phases, "fragment": frag, "start-up probe": start_up_phase(s, d, capacity, "trainer")}


def scorer_phase(s: RunShape, d: Design, capacity: float) -> MemoryUse:
    """A scorer rank: the reward models and one batch of scoring."""
    m = MemoryUse("scorer", capacity, phase="scoring").add("reward models", s.rewards * d.aux_dtype_bytes, "parameters")
    return m.add("context", CONTEXT_BYTES)


def peak(phases: dict[str, MemoryUse]) -> MemoryUse:
    """The phase with the most memory (a MemoryUse whose `phase` names it)."""
    return max(phases.values(), key=lambda m: m.total)


def role_phases(s: RunShape, d: Design, capacity: float, role: str, *, shard: int = 1,
                evaluates: bool = True, publishes: bool = True) -> dict[str, MemoryUse]:
    """Every phase of a role ("generator", "trainer"), the start-up probe included."""
    if role == "generator":
        phases = generator_phases(s, d, capacity)
    else:
        phases = trainer_phases(s, d, capacity, shard=shard, evaluates=evaluates, publishes=publishes)
    return {**phases, "start-up probe": start_up_phase(s, d, capacity, role)}


# ----- the planner's view: a Workload -----------------------------------------------------------------
def shape_of(wl: Workload, *, gen_micro: int | None = None, train_micro: int | None = None,
             fragment: int | None = None) -> RunShape:
    """The RunShape of a planner workload (its largest shape for a shape mix)."""
    wl = wl.largest()
    spec, res = wl.spec, wl.resolution
    latent = spec.latent_channels * res.latent_frames * (res.height // 8) * (res.width // 8)
    return RunShape(
        family=spec.family, dit=spec.params, text=sum(e.params for e in spec.text_encoders), vae=spec.vae.params,
        rewards=reward_bytes(wl) / 2, hidden=spec.hidden, blocks=spec.num_blocks,
        largest_unit=max(b.params for b in spec.blocks), tokens=wl.seq, latent=latent, pixels=res.pixels,
        steps=wl.sampling_steps, branches=wl.branches, gen_micro=gen_micro or wl.rollout_micro_batch,
        train_micro=train_micro or wl.train_micro_batch, fragment=fragment or wl.group_size,
        lora=lora_params(spec, wl.lora_rank) if wl.finetune == "lora" else 0.0, weight_bytes=wl.param_bytes,
        checkpointing=wl.gradient_checkpointing, reference=wl.kl and wl.finetune == "full")


def generator_memory(wl: Workload, g: GPU, *, stages: int = 1, stage: int = 0, micro: int,
                     fragment_samples: int, scores: bool = True) -> MemoryUse:
    """The peak of one rank of a generator replica of `stages` stages (PLANNED design)."""
    s = shape_of(wl, gen_micro=micro, fragment=fragment_samples)
    return peak(generator_phases(s, PLANNED, g.memory_bytes, stages=stages, stage=stage, scores=scores))


def trainer_memory(wl: Workload, g: GPU, *, shard: int, micro: int, buffered_samples: int = 0,
                   generates: bool = False) -> MemoryUse:
    """The peak of one trainer rank (PLANNED design); with TAG (`generates`) it also holds what
    generation needs. Landed trajectories wait in host memory (parallel/intake.py)."""
    s = shape_of(wl, train_micro=micro)
    phases = trainer_phases(s, PLANNED, g.memory_bytes, shard=shard, evaluates=False)
    for m in phases.values():
        if generates:
            m.add("text encoders", s.text * s.text_bytes, "parameters")
            m.add("VAE", s.vae * PLANNED.aux_dtype_bytes, "parameters")
            m.add("reward models", s.rewards * PLANNED.aux_dtype_bytes, "parameters")
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
        if wl.old_policy:  # DiffusionNFT's old policy: an fp32 copy of the trained weights, sharded alike
            out["old policy"] = 4 * p / shard
    else:
        lp = lora_params(wl.spec, wl.lora_rank)
        out["base weights bf16"] = 2 * p / shard
        out["adapters + optimizer"] = 16 * lp + (4 * lp if wl.old_policy else 0)
    if shard > 1:
        out["gathered blocks"] = 4 * max(b.params for b in wl.spec.blocks)
    return out


def activations_train(wl: Workload, transitions: int) -> float:
    """Activations of one training micro-batch (every branch), measured per family."""
    s = shape_of(wl, train_micro=transitions)
    a = _act(s)
    return (a.train_ckpt if wl.gradient_checkpointing else a.train_full) * _row_bytes(s, transitions * s.branches)


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


__all__ = ["ACTIVATIONS", "Activations", "CATEGORIES", "CONTEXT_BYTES", "DESIGNS", "Design", "LEAN", "MemoryUse",
           "PLANNED", "RunShape", "TODAY", "USABLE_FRACTION", "activations_infer", "activations_train",
           "colocated_memory", "colocated_phases", "generator_memory", "generator_phases", "max_micro_batch", "peak",
           "published_bytes", "role_phases", "scorer_phase", "shape_of", "start_up_phase", "trainer_memory",
           "trainer_phases", "training_state"]
