"""A simple estimate of the GPU memory each role of a run needs, from the released model's parameter
counts (models/released.py) and the run's config: a check that a recipe fits the GPUs it names,
not a measurement.

What a rank holds, as the runtime allocates it:

- every rank: the whole pipeline (runtime.run loads it everywhere): the transformer in its weight
  dtype (--dtype: 4 bytes per parameter for auto / float32, else 2), the frozen text encoders in
  2 bytes on CUDA (4 with float32), the VAE in 4, and the reward models in 4 (`REWARD_PARAMS`:
  generators and scorers score, trainers evaluate);
- a generator: the staging buffers of a publication (parallel/publish.py: as large as what is
  published, the LoRA tensors or the whole transformer), one denoising forward's working set and
  the stored trajectories of one fragment (K+1 float32 latents per sample);
- a trainer: LoRA runs keep the adapters' weights, gradients, two AdamW moments, the summed
  gradient buffer and the EMA in float32; full fine-tuning keeps weights, gradients and both
  moments in the weight dtype, sharded over the trainers with FSDP, plus (FSDP) the whole transformer
  once more while a version is gathered for publication (Trainer.full_weights), plus an unsharded frozen
  reference copy when beta > 0; training activations for one forward of `micro_batch` samples
  (twice with CFG): with --grad-checkpointing every block's float32 input plus one block's
  recomputed activations, else every block's activations.

A block's activations are taken as ACT_BYTES bytes per (token, hidden unit) and sample (34: the
Megatron-LM estimate for a transformer layer with a 4x MLP under 16-bit autocast and a fused
attention kernel, Korthikanti et al. 2022); tokens are the image tokens plus the padded text.
Usable memory is USABLE of the GPU's (the CUDA context, the allocator's fragmentation and NCCL
buffers take the rest). Not modelled: the VAE decode's working set (large for long videos at full
size; diffusers' VAE tiling bounds it), reward-model activations, CPU offload.
"""
from __future__ import annotations

from dataclasses import dataclass

from config.schema import RunConfig
from config.validate import RunFacts
from models.released import count_parameters, meta_adapter
from rewards import parse_reward_spec, reward_url

GiB = 1024 ** 3
GPU_MEMORY = {"h100": 81559 * 2 ** 20, "h800": 81559 * 2 ** 20, "a100": 81920 * 2 ** 20, "h200": 143771 * 2 ** 20}
"""Total memory of the 80 GB and 141 GB parts as nvidia-smi reports it (MiB)."""
USABLE = 0.9
ACT_BYTES = 34
REWARD_PARAMS = {
    "pickscore": 986e6,  # CLIP ViT-H/14
    "hpsv2": 986e6,  # CLIP ViT-H/14
    "clip_score": 428e6,  # CLIP ViT-L/14
    "laion_aesthetic": 428e6,  # CLIP ViT-L/14 and a small MLP
    "image_reward": 470e6,  # BLIP ViT-L/16, BERT-base, MLP
    "ocr": 558e6,  # TrOCR large
}
"""Parameters of each model reward (approximate); rule rewards load none."""


@dataclass(frozen=True)
class Shape:
    """What the estimate needs to know of a released model at the run's sampling size."""

    params: dict[str, int]  # per component (models.released.parameter_counts)
    tokens: int  # image tokens plus padded text tokens of one sample's forward
    hidden: int
    num_blocks: int
    latent_elems: int  # elements of one sample's latent


def model_shape(name: str, cfg: RunConfig, adapter=None) -> Shape:
    """The released model `name` (models/configs/) at the run's height, width and frames (`adapter`:
    its meta_adapter, when already built)."""
    adapter = adapter or meta_adapter(name)
    s, d = cfg.sampling, adapter.defaults
    latent = adapter.latent_shape(s.height or d.height, s.width or d.width, s.num_frames or d.num_frames)
    text = adapter.max_sequence_length + (77 if adapter.family == "sd3" else 0)  # SD3: CLIP's 77, then T5
    config = adapter.transformer.config
    hidden = config.num_attention_heads * config.attention_head_dim
    elems = 1
    for n in latent:
        elems *= n
    return Shape(count_parameters(adapter.pipe.components), adapter.image_seq_len(latent) + text, hidden,
                 len(adapter.blocks), elems)


def _lora_params(shape: Shape, rank: int, targets: str) -> float:
    """Adapter parameters, an upper bound: rank x (in + out) per adapted projection of width `hidden`,
    8 attention projections a block (q, k, v, out of both streams), 16 with the feed-forward layers."""
    per_block = 8 if targets == "attn" else 16
    return shape.num_blocks * per_block * rank * 2 * shape.hidden


def estimate(cfg: RunConfig, facts: RunFacts, shape: Shape) -> dict[str, float]:
    """Peak bytes per role ("generator", "trainer") of a disaggregated run (see the module docstring)."""
    if not facts.disagg:
        raise ValueError("the memory estimate models disaggregated runs only")
    p, o, rl = shape.params, cfg.optim, cfg.rl
    weight_bytes = 4 if cfg.model.dtype in ("auto", "float32") else 2
    text_bytes = 4 if cfg.model.dtype == "float32" else 2
    transformer = p["transformer"] * weight_bytes
    rewards = sum(REWARD_PARAMS.get(parse_reward_spec(spec)[0], 0) for spec in rl.reward if not reward_url(spec))
    frozen = sum(v for k, v in p.items() if k.startswith("text_encoder")) * text_bytes + p["vae"] * 4 + rewards * 4
    branches = 2 if (cfg.sampling.cfg_scale or 1.0) > 1 else 1
    token_bytes = shape.tokens * shape.hidden * rl.micro_batch * branches  # a generation forward's (token, unit)s
    train_batch = facts.train_micro_batch if facts.tsp else rl.micro_batch  # TSP: transitions per forward
    train_bytes = shape.tokens * shape.hidden * train_batch * branches
    lora = _lora_params(shape, o.lora_rank, o.lora_targets) if o.lora_rank > 0 else 0
    published = lora * 4 if lora else transformer
    group_samples = (cfg.topology.fragment_groups or rl.prompts_per_step) * rl.group_size
    steps = cfg.sampling.sample_steps or 1
    generator = (frozen + transformer + published + ACT_BYTES * token_bytes
                 + group_samples * (steps + 1) * shape.latent_elems * 4)
    if o.grad_checkpointing:
        activations = shape.num_blocks * 4 * train_bytes + ACT_BYTES * train_bytes
    else:
        activations = shape.num_blocks * ACT_BYTES * train_bytes
    if lora:
        state = transformer + lora * (4 + 4 + 8 + 4 + (4 if o.ema_decay > 0 else 0))
        trainer = frozen + state + activations
    else:
        shards = facts.num_trainers if facts.train_sharding == "fsdp" else 1
        moments = 4 * weight_bytes + (weight_bytes if o.ema_decay > 0 else 0)
        state = p["transformer"] * moments / shards + (transformer if rl.beta > 0 else 0)
        gathered = 2 * transformer / shape.num_blocks if shards > 1 else 0  # a unit in use, the next prefetched
        publication = transformer if shards > 1 else 0  # FSDP: the whole transformer gathered to publish
        trainer = frozen + state + max(publication, activations + gathered)
    return {"generator": generator, "trainer": trainer}


def check_fits(cfg: RunConfig, facts: RunFacts, shape: Shape, gpu: str) -> dict[str, float]:
    """The estimate per role; ValueError naming the role, its GiB and the GPU's when it does not fit."""
    if gpu not in GPU_MEMORY:
        raise ValueError(f"unknown GPU {gpu!r}; known: {sorted(GPU_MEMORY)}")
    usable = USABLE * GPU_MEMORY[gpu]
    need = estimate(cfg, facts, shape)
    for role, nbytes in need.items():
        if nbytes > usable:
            raise ValueError(f"a {role} needs about {nbytes / GiB:.1f} GiB, above the {usable / GiB:.1f} GiB usable "
                             f"on a {gpu}")
    return need
