"""A GPU-cluster cost model for the step simulator (docs/DESIGN.md 9): predictions, not measurements.

The cluster model (`cluster_candidates`, `predict`, `recommend`) turns a model, a GPU type, a GPU
count and a workload into `Costs` for every topology and predicts each step with the simulator.
Its assumptions, all of them (also printed with every prediction, `CLUSTER_ASSUMPTIONS`):

- FLOPs: a forward of one sample at one denoising step is branches x (2 x params x tokens +
  4 x layers x hidden x tokens^2) (matrix multiplies, attention scores and values; branches = 2
  with classifier-free guidance, which training runs too); training a transition costs 3 forwards
  (+1 reference forward with a KL term); Flow-GRPO trains the first floor(0.99 K) steps.
- Every forward and backward runs at an assumed model FLOP utilisation (default 0.4) of the GPU's
  dense bf16 peak (H100/H200 989 TFLOP/s, A100 312 TFLOP/s); decoding and scoring add 5% to a
  fragment's denoising.
- Collectives are rings at 80% of the link's peak: NVLink (450 GB/s per direction on H100/H200,
  300 on A100) inside a node of 8 GPUs, one InfiniBand NIC per GPU (400 Gb/s NDR, 200 Gb/s HDR on
  A100) across nodes. FSDP all-gathers overlap compute (a forward takes the longer of the two).
- Memory: weights and optimizer state get 60% of GPU memory; full fine-tuning keeps 16 bytes per
  parameter (fp32 weights, gradients, two AdamW moments) sharded by FSDP over the trainers, a
  generator holds the bf16 weights (2 bytes per parameter; GAP stages when they do not fit); LoRA
  (rank 32 on q/k/v/out) replicates the bf16 weights everywhere.
- Colocated splits the batch evenly over all N GPUs (Flow-GRPO gathers rewards, so a group may span
  ranks) and generates either with FSDP (an all-gather of the weights per forward) or from a bf16
  copy all-gathered once after every update (when memory allows); the faster is the baseline.
- Disaggregated: G generators (replicas of S stages) and T = N - G trainers, fragments of one
  group, TSP packing assumed perfect. Publication streams the bf16 weights (or adapters) to every
  generator stage over InfiniBand as a broadcast tree (independent of G) plus 5 ms; a fragment's
  trajectories (K+1 fp32 latents, log-probs, conditioning) cross InfiniBand plus 1 ms. TAG with full
  fine-tuning assumes each trainer also holds a bf16 inference copy (the runtime's TAG needs
  replicated trainers).
- Workload (flags of scripts/simulate.py): Flow-GRPO's defaults of 24 prompts x 24 samples per
  optimizer update and K = 10 at 512 px (its config/grpo.py); per model an assumed typical RL
  setting (resolution, frames, tokens, K, CFG, micro-batch: `MODELS`); full fine-tuning.
- Not modelled: stragglers, launch overheads, memory fragmentation, reward-model GPUs, checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.simulator import Costs, simulate_run

# ---------------------------------------------------------------------------------------------
# A FLOP and bandwidth model of a GPU cluster (predictions, not measurements)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float
    """dense bf16 FLOP/s (vendor peak)"""
    memory_bytes: float
    hbm_bytes_s: float
    nvlink_bytes_s: float
    """achievable per-GPU, per-direction bandwidth of collectives inside one node (80% of peak)"""
    ib_bytes_s: float
    """achievable per-GPU bandwidth across nodes (80% of one InfiniBand NIC per GPU)"""
    gpus_per_node: int = 8


GPUS = {
    "h100": GPU("H100 SXM 80GB", 989e12, 80e9, 3.35e12, 0.8 * 450e9, 0.8 * 50e9),  # NVLink4, NDR 400 Gb/s
    "h200": GPU("H200 SXM 141GB", 989e12, 141e9, 4.8e12, 0.8 * 450e9, 0.8 * 50e9),
    "a100": GPU("A100 SXM 80GB", 312e12, 80e9, 2.0e12, 0.8 * 300e9, 0.8 * 25e9),  # NVLink3, HDR 200 Gb/s
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    hidden: int
    num_layers: int
    """transformer blocks with full self-attention over the sequence"""
    tokens: int
    """sequence length of one sample's forward (image/video tokens, plus text tokens in joint attention)"""
    forwards_per_step: int
    """2 with classifier-free guidance (both branches run, in generation and in training), else 1"""
    latent_elems: int
    """elements of one stored latent (the trajectory keeps K+1 of them, fp32)"""
    cond_bytes: float
    """prompt conditioning sent with each sample (bf16; twice with CFG)"""
    sample_steps: int
    """K: denoising steps per sample"""
    setting: str
    micro_batch: int
    """samples per generation forward and transitions per training forward"""


MODELS = {
    "flux-12b": ModelSpec("FLUX.1-dev 12B", 11.9e9, 3072, 57, 1024 + 512, 1, 16 * 64 * 64, 512 * 4096 * 2, 10,
                          "512x512 image: 1024 image + 512 T5 tokens, guidance-distilled (no CFG)", 8),
    "wan2.1-14b": ModelSpec("Wan2.1-T2V 14B", 14.0e9, 5120, 40, 9 * 15 * 26, 2, 16 * 9 * 30 * 52, 512 * 4096 * 2, 20,
                            "240x416, 33 frames: 9x15x26 = 3510 video tokens (text by cross-attention), CFG",
                            2),
    "qwen-image-20b": ModelSpec("Qwen-Image 20B", 20.4e9, 3072, 60, 1024 + 256, 2, 16 * 64 * 64, 256 * 3584 * 2, 10,
                                "512x512 image: 1024 image + 256 text tokens, true CFG", 8),
    "hunyuanvideo-13b": ModelSpec("HunyuanVideo 13B", 12.8e9, 3072, 60, 9 * 30 * 30 + 256, 1, 16 * 9 * 60 * 60,
                                  256 * 4096 * 2, 16,
                                  "480x480, 33 frames: 8100 video + 256 text tokens, guidance-distilled", 1),
}


@dataclass(frozen=True)
class Workload:
    """One logical step (Flow-GRPO defaults: 24 prompts per update x 24 samples, K=10 at 512px,
    timestep fraction 0.99, LoRA or full fine-tuning)."""

    prompts_per_step: int = 24
    group_size: int = 24
    sample_steps: int | None = None
    """K (None: the model's)"""
    timestep_fraction: float = 0.99
    mfu: float = 0.4
    """assumed model FLOP utilisation of every forward and backward"""
    finetune: str = "full"
    """full (FSDP trainers, full-weight publication) or lora (replicated trainers, adapters only)"""
    lora_rank: int = 32
    kl: bool = False
    """a KL term: one more (reference) forward per trained transition"""
    score_overhead: float = 0.05
    """VAE decode and reward models, as a fraction of a fragment's denoising time"""
    fragment_groups: int = 1
    state_fraction: float = 0.6
    """fraction of GPU memory for weights and optimizer state (the rest: activations, gathered
    FSDP units, workspace)"""

    def steps_of(self, model: ModelSpec) -> int:
        return self.sample_steps or model.sample_steps

    def trained_steps(self, model: ModelSpec) -> int:
        k = self.steps_of(model)
        return max(1, min(k, int(k * self.timestep_fraction)))  # flow_grpo: the first floor(K * fraction)


def forward_flops(model: ModelSpec, samples: float) -> float:
    """One denoising forward of `samples` samples (all CFG branches): 2 x params x tokens for the
    matrix multiplies plus 4 x layers x hidden x tokens^2 for attention scores and values."""
    per_branch = 2 * model.params * model.tokens + 4 * model.num_layers * model.hidden * model.tokens ** 2
    return samples * model.forwards_per_step * per_branch


def collective_s(num_bytes: float, group: int, gpu: GPU) -> float:
    """A ring all-gather / reduce-scatter of `num_bytes` over `group` GPUs: NVLink inside one node,
    InfiniBand (the slowest link of the ring) across nodes."""
    if group <= 1:
        return 0.0
    bw = gpu.nvlink_bytes_s if group <= gpu.gpus_per_node else gpu.ib_bytes_s
    return num_bytes * (group - 1) / group / bw


def lora_params(model: ModelSpec, rank: int) -> float:
    """Adapters on q, k, v, out of every block: 4 x (A: r x d + B: d x r) = 8 r d per block."""
    return 8 * rank * model.hidden * model.num_layers


def generation_s(model: ModelSpec, gpu: GPU, wl: Workload, samples: float, *, fsdp_group: int = 1,
                 stages: int = 1) -> float:
    """Seconds for one replica to denoise, decode and score `samples` samples. Colocated FSDP
    generation all-gathers the bf16 weights for every forward, overlapped with compute (FSDP
    prefetch): each forward takes max(compute, gather). A replica of S pipeline stages runs
    K * max(micro-batches, S) + min(micro-batches, S) - 1 stage slots (the ring is full once S
    micro-batches are in flight; fill and drain otherwise), each compute / S plus one activation hop."""
    k, m = wl.steps_of(model), model.micro_batch
    compute = forward_flops(model, m) / (gpu.peak_flops * wl.mfu)
    per_forward = max(compute, collective_s(2 * model.params, fsdp_group, gpu))
    micro_batches = samples / m
    if stages == 1:
        total = micro_batches * k * per_forward
    else:
        hop = m * model.forwards_per_step * model.tokens * model.hidden * 2 / (
            gpu.nvlink_bytes_s if stages <= gpu.gpus_per_node else gpu.ib_bytes_s)
        slots = k * max(micro_batches, stages) + min(micro_batches, stages) - 1
        total = slots * (per_forward / stages + hop)
    return total * (1 + wl.score_overhead)


def training_s(model: ModelSpec, gpu: GPU, wl: Workload, samples: float, group: int) -> float:
    """Wall seconds for `group` trainer ranks to train every trained transition of `samples`
    samples, spread evenly (TSP, packing assumed perfect). Forward + backward = 3 forwards (plus a
    reference forward with KL). Full fine-tuning shards with FSDP over the group: per micro-batch
    two all-gathers of the bf16 weights and one reduce-scatter of bf16 gradients, overlapped with
    compute."""
    m = model.micro_batch
    factor = 3 + (1 if wl.kl else 0)
    compute = factor * forward_flops(model, m) / (gpu.peak_flops * wl.mfu)
    comm = 3 * collective_s(2 * model.params, group, gpu) if wl.finetune == "full" else 0.0
    micro_batches = samples * wl.trained_steps(model) / (m * group)
    return micro_batches * max(compute, comm)


def update_s(model: ModelSpec, gpu: GPU, wl: Workload, group: int) -> float:
    """The optimizer step: AdamW streams fp32 weights, gradients and two moments (read 16 bytes,
    write 12 per parameter) of the rank's shard through HBM. LoRA: replicated adapters, plus one
    gradient all-reduce of them."""
    if wl.finetune == "lora":
        p = lora_params(model, wl.lora_rank)
        return 28 * p / gpu.hbm_bytes_s + 2 * collective_s(4 * p, group, gpu)
    return 28 * model.params / group / gpu.hbm_bytes_s


def published_bytes(model: ModelSpec, wl: Workload) -> float:
    return 2 * (lora_params(model, wl.lora_rank) if wl.finetune == "lora" else model.params)


def transfer_s(model: ModelSpec, gpu: GPU, wl: Workload, samples: float) -> float:
    """A fragment's trajectories (K+1 fp32 latents, K log-probs, the conditioning) out of the
    generator's NIC, plus 1 ms of latency."""
    k = wl.steps_of(model)
    per_sample = (k + 1) * model.latent_elems * 4 + k * 4 + model.cond_bytes * model.forwards_per_step
    return samples * per_sample / gpu.ib_bytes_s + 1e-3


def min_trainers(model: ModelSpec, gpu: GPU, wl: Workload) -> int:
    """Trainer ranks needed to hold the training state: full fine-tuning keeps fp32 weights,
    gradients and AdamW moments (16 bytes per parameter) sharded by FSDP; LoRA replicates the
    bf16 weights."""
    budget = gpu.memory_bytes * wl.state_fraction
    if wl.finetune == "lora":
        return 1 if 2 * model.params <= budget else 0
    return math.ceil(16 * model.params / budget)


def min_stages(model: ModelSpec, gpu: GPU, wl: Workload) -> int:
    """GAP stages a replica needs to hold the bf16 weights."""
    return math.ceil(2 * model.params / (gpu.memory_bytes * wl.state_fraction))


@dataclass(frozen=True)
class Candidate:
    """One topology and mode, with the costs the cluster model gives it."""

    label: str
    mode: str
    tag_policy: str | None
    generators: int
    trainers: int
    stages: int
    num_fragments: int
    costs: Costs
    note: str = ""


def cluster_candidates(model: ModelSpec, gpu: GPU, num_gpus: int, wl: Workload) -> tuple[list[Candidate], list[str]]:
    """Every feasible topology of `num_gpus` GPUs: colocated (FSDP generation; and, when memory
    allows, a bf16 generation copy resharded once per step), and disagg with G generators and
    T = N - G trainers in the simulator's modes. Returns (candidates, reasons topologies were left out)."""
    if wl.prompts_per_step % wl.fragment_groups:
        raise ValueError(f"--fragment-groups {wl.fragment_groups} must divide --prompts-per-step {wl.prompts_per_step}")
    samples_per_step = wl.prompts_per_step * wl.group_size
    budget = gpu.memory_bytes * wl.state_fraction
    out, skipped = [], []
    # Colocated: the batch split evenly over all N ranks (rewards are gathered, so groups may split).
    n = num_gpus
    per_rank = samples_per_step / n
    state = (16 * model.params / n) if wl.finetune == "full" else 2 * model.params
    if state > budget:
        skipped.append(f"colocated: {state / 1e9:.0f} GB of training state per GPU > {budget / 1e9:.0f} GB")
    else:
        train = training_s(model, gpu, wl, per_rank, n)
        upd = update_s(model, gpu, wl, n)
        if wl.finetune == "full":
            gen = generation_s(model, gpu, wl, per_rank, fsdp_group=n)
            out.append(Candidate("colocated (fsdp generation)", "colocated", None, n, n, 1, n,
                                 Costs([gen] * n, gen, train, update_s=upd)))
            if state + 2 * model.params <= budget:
                gen = generation_s(model, gpu, wl, per_rank)
                reshard = collective_s(2 * model.params, n, gpu)
                out.append(Candidate("colocated (reshard per step)", "colocated", None, n, n, 1, n,
                                     Costs([gen] * n, gen, train, update_s=upd + reshard),
                                     "a bf16 generation copy all-gathered after every update"))
            else:
                skipped.append("colocated (reshard): no memory for a bf16 generation copy beside the training state")
        else:
            gen = generation_s(model, gpu, wl, per_rank)
            out.append(Candidate("colocated (replicated)", "colocated", None, n, n, 1, n,
                                 Costs([gen] * n, gen, train, update_s=upd)))
    # Disaggregated: G generators (replicas of S stages), T trainers.
    stages, t_min = min_stages(model, gpu, wl), min_trainers(model, gpu, wl)
    if t_min == 0:
        return out, skipped + ["disagg: the bf16 weights do not fit one GPU for LoRA training"]
    frag_samples = wl.fragment_groups * wl.group_size
    num_fragments = wl.prompts_per_step // wl.fragment_groups
    no_tag = []
    for g in range(stages, num_gpus, stages):
        t = num_gpus - g
        if t < t_min:
            skipped.append(f"G={g} T={t}: fewer than {t_min} trainers cannot hold the training state")
            continue
        gen = generation_s(model, gpu, wl, frag_samples, stages=stages)
        train = training_s(model, gpu, wl, frag_samples, t)
        publish = published_bytes(model, wl) / stages / gpu.ib_bytes_s + 5e-3
        base = dict(replica_fragment_s=[gen] * (g // stages), train_fragment_s=train,
                    transfer_s=transfer_s(model, gpu, wl, frag_samples), update_s=update_s(model, gpu, wl, t),
                    publish_s=publish)
        topo = f"G={g} T={t}" + (f" S={stages}" if stages > 1 else "")
        for label, mode in (("naive disagg", "disagg"), ("gap", "gap"), ("tcss", "tcss")):
            out.append(Candidate(f"{label} {topo}", mode, None, g, t, stages, num_fragments,
                                 Costs(trainer_fragment_s=gen, **base)))
        tag_state = (16 * model.params / t if wl.finetune == "full" else 0) + 2 * model.params
        if stages == 1 and tag_state <= budget:
            # A trainer generates with a full bf16 copy, as fast as a one-stage replica.
            out.append(Candidate(f"gap+tag (bts) {topo}", "tag", "bts", g, t, 1, num_fragments,
                                 Costs(trainer_fragment_s=generation_s(model, gpu, wl, frag_samples), **base),
                                 "" if wl.finetune == "lora" else
                                 "assumes each trainer holds a bf16 inference copy (the runtime's TAG needs "
                                 "--train-sharding replicate)"))
        else:
            no_tag.append(f"G={g}")
    if no_tag:
        why = "GAP stages" if stages > 1 else "no memory for a bf16 inference copy beside the training shard"
        skipped.append(f"gap+tag at {', '.join(no_tag)}: {why}")
    return out, skipped


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    step_s: float
    """simulated steady-state step time (mean over the steps after the first)"""
    bubble_fraction: float
    samples_per_s: float


def predict(candidates: list[Candidate], wl: Workload, tcss_steps: int = 4) -> list[Prediction]:
    """Simulate each candidate. On-policy steps all start from idle ranks and repeat exactly, so
    one step is their steady state; TCSS overlaps steps, so it runs `tcss_steps` and its steady
    step is the mean after the first."""
    out = []
    for c in candidates:
        res = simulate_run(c.mode, tcss_steps if c.mode == "tcss" else 1, c.num_fragments, c.costs, c.trainers,
                           c.tag_policy, stages_per_replica=c.stages)
        out.append(Prediction(c, res.steady_step_s, res.bubble_fraction,
                              wl.prompts_per_step * wl.group_size / res.steady_step_s))
    return out


def recommend(predictions: list[Prediction]) -> Prediction:
    """The candidate with the shortest predicted step (ties: the first listed)."""
    if not predictions:
        raise ValueError("no feasible topology to recommend")
    return min(predictions, key=lambda p: p.step_s)


CLUSTER_ASSUMPTIONS = (
    "forward FLOPs per sample and denoising step = branches x (2 x params x tokens + 4 x layers x hidden x tokens^2); "
    "branches = 2 with CFG",
    "training = 3 forwards per trained transition (+1 reference forward with --kl); trained steps = floor(K x 0.99)",
    "every forward and backward runs at the assumed MFU of the GPU's dense bf16 peak",
    "decode + reward scoring = --score-overhead x the denoising time",
    "collectives: ring over NVLink (80% of peak per direction) inside a node of 8 GPUs, over one InfiniBand NIC "
    "per GPU (80% of peak) across nodes; FSDP gathers overlap compute (time = max of the two)",
    "full fine-tuning: FSDP trainers hold 16 bytes/param; generators hold bf16 weights (2 bytes/param) in "
    "--state-fraction of GPU memory; LoRA: every rank holds the bf16 weights, adapters on q/k/v/out",
    "publication: bf16 weights (or adapters) streamed to every generator stage over InfiniBand (a broadcast "
    "tree: time independent of the number of generators) + 5 ms",
    "trajectories: K+1 fp32 latents + conditioning per sample over InfiniBand + 1 ms per fragment",
    "disagg fragments of --fragment-groups groups; colocated splits the batch evenly over all GPUs (the faster of "
    "FSDP generation and a bf16 copy resharded per step is the baseline)",
    "workload: Flow-GRPO defaults (24 prompts x 24 samples per update, K=10 for images); per-model resolution, "
    "frames, K and micro-batch are assumed typical RL settings",
    "TSP packing is perfect; GAP stage hops carry bf16 hidden states and are not overlapped",
    "not modelled: stragglers, kernel launch overheads, memory fragmentation, reward-model GPUs, checkpointing",
)


__all__ = ["CLUSTER_ASSUMPTIONS", "Candidate", "GPU", "GPUS", "MODELS", "ModelSpec", "Prediction", "Workload",
           "cluster_candidates", "collective_s", "forward_flops", "generation_s", "predict", "recommend", "training_s"]
