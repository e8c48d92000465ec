"""Cost models for the step simulator (DESIGN.md 9): the per-action costs measured in a run's traces,
the simulator setup that a run's config maps to, and the runtime's step metrics recomputed from a
simulated trace so that predictions and measurements are compared on the same definitions.

Measured costs (`measure_costs`), each the mean over the steps used (the first step, which warms
up kernels and allocators, is left out by default; the mean, not the median, because a step's
time is a sum of action times):

- replica_fragment_s[r]: the replica's generation window in a step (first start to last end of
  its `generate` spans, over all its stages) divided by the number of fragments it generated: the
  gaps between fragments (advantages, cutting into chunks, posting sends) and a pipeline's fill and
  drain are generator time too.
- trainer_fragment_s: the mean `tag_generate` span of trainers (TAG); without TAG spans a trainer
  is taken to be as fast as the mean replica.
- train_fragment_s: per fragment, the seconds of all trainer ranks' `train` spans of it divided by
  the number of trainer ranks (the simulator's definition: train_fragment_s * num_trainers
  rank-seconds of work per fragment).
- receiving: a trainer's `recv` of data that had already landed (posted after the generation
  ended) is trainer work; its mean duration is added to the fragment's training work once per
  receive (at most the receive's own duration).
- transfer_s: per fragment, the latest over trainers of recv end - max(generation end, recv start)
  - the receive work, for the fragment's first `recv` on each trainer: from when both sides are
  ready until the data has landed.
- update_s: last optimizer end - last `train` span end of the step (all trainers): FSDP padding,
  the gradient all-reduce and the optimizer step.
- publish_s: on-policy disagg, next step's first replica `generate` start - last optimizer end:
  publication, installation and the generators' step start. TCSS: the trainers' publish span
  (generators do not wait for it). Colocated: 0.

Not modelled: the inter-step work of the runtime (planning, the logging rank's metrics and image
writes), scorer ranks, colocated TSP's all-to-all before training, and differences in training
speed between trainer ranks (`Costs` has one training cost for all).

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

import glob
import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from parallel.plan import plan_step
from parallel.simulator import Costs, SimResult
from parallel.topology import Topology
from tracing import BUSY_CATEGORIES, bubble_fraction


@dataclass(frozen=True)
class TraceSpan:
    rank: int
    name: str
    cat: str
    step: int
    fragment: int | None
    start_s: float
    end_s: float


@dataclass
class RunTrace:
    """A run folder: its resolved config, its per-rank traces and its metrics."""

    config: dict[str, Any]
    spans: list[TraceSpan]
    world_size: int
    metrics: list[dict[str, Any]] = field(default_factory=list)

    def of(self, ranks, cat: str | None = None, name: str | None = None, step: int | None = None) -> list[TraceSpan]:
        ranks = set(ranks)
        return [s for s in self.spans if s.rank in ranks and (cat is None or s.cat == cat)
                and (name is None or s.name == name) and (step is None or s.step == step)]

    @property
    def steps(self) -> list[int]:
        """The steps trained (an optimizer span; generators also record the last publication's
        installation under step = the number of steps)."""
        return sorted({s.step for s in self.spans if s.cat == "optimizer"})


def read_trace_events(events: list[dict[str, Any]], rank: int) -> list[TraceSpan]:
    """The complete ("X") events of one rank's Chrome trace, in seconds."""
    out = []
    for e in events:
        if e.get("ph") != "X":
            continue
        args = e.get("args", {})
        start = e["ts"] / 1e6
        out.append(TraceSpan(rank, e["name"], e["cat"], int(args["step"]), args.get("fragment"), start,
                             start + e["dur"] / 1e6))
    return out


def load_run(run_dir: str) -> RunTrace:
    """DIR/config.json, DIR/trace/rank{R}.json (one per rank: the world size) and DIR/metrics.jsonl."""
    from metrics import read_metrics

    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir!r} is not a run folder: no config.json")
    with open(path) as f:
        config = json.load(f)
    files = glob.glob(os.path.join(run_dir, "trace", "rank*.json"))
    ranks = sorted(int(m.group(1)) for p in files if (m := re.fullmatch(r"rank(\d+)\.json", os.path.basename(p))))
    if not ranks or ranks != list(range(len(ranks))):
        raise ValueError(f"{run_dir!r}: need trace/rank0.json .. rank{{N-1}}.json, found ranks {ranks} "
                         f"(was the run made with --no-trace?)")
    spans = []
    for r in ranks:
        with open(os.path.join(run_dir, "trace", f"rank{r}.json")) as f:
            spans += read_trace_events(json.load(f)["traceEvents"], r)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    metrics = [m for m in read_metrics(metrics_path) if "perf/step_s" in m] if os.path.isfile(metrics_path) else []
    return RunTrace(config, spans, len(ranks), metrics)


# ---------------------------------------------------------------------------------------------
# A run's config -> the simulator's setup
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SimSetup:
    """The arguments of `simulator.simulate_run` that describe a run's topology and mode."""

    mode: str
    """simulator mode: colocated, disagg (naive), gap (fragment streaming), tag, tcss"""
    tag_policy: str | None
    num_fragments: int
    num_trainers: int
    stages_per_replica: int
    chunks_per_fragment: int | None
    """None with TSP; else the chunks (micro-batches) of one fragment"""
    topology: Topology

    @property
    def num_replicas(self) -> int:
        return self.topology.num_replicas

    @property
    def label(self) -> str:
        names = {"colocated": "colocated", "disagg": "naive disagg", "gap": "gap streaming",
                 "tag": "gap + tag (bts)", "tcss": "tcss" + (" + tag (bts)" if self.tag_policy else "")}
        stages = f", {self.stages_per_replica} stages" if self.stages_per_replica > 1 else ""
        tsp = ", tsp" if self.chunks_per_fragment is None else ""
        return names[self.mode] + stages + tsp


def sim_setup(config: dict[str, Any], world_size: int) -> SimSetup:
    """The simulator mode of a run: colocated; disagg with --tcss -> tcss (tag policy bts with --tag);
    --tag -> tag; more fragments than replicas -> gap (streaming); else naive disagg."""
    t, rl = config["topology"], config["rl"]
    topo = Topology.build(world_size, t["mode"], t.get("generators"), t.get("trainers"), t.get("scorers", 0),
                          t.get("gap_stages", 1))
    colocated = topo.mode == "colocated"
    num_trainers = len(topo.trainer_ranks)
    plan = plan_step(0, seed=0, num_prompts=rl["prompts_per_step"], prompts_per_step=rl["prompts_per_step"],
                     group_size=rl["group_size"], micro_batch=rl["micro_batch"], num_replicas=topo.num_replicas,
                     num_trainers=num_trainers, fragment_groups=t.get("fragment_groups") or None, colocated=colocated)
    num_fragments = len(plan.fragments)
    chunks = None if t.get("tsp") else len(plan.fragments[0].chunks)
    if colocated:
        mode, policy = "colocated", None
    elif t.get("tcss"):
        mode, policy = "tcss", ("bts" if t.get("tag") else None)
    elif t.get("tag"):
        mode, policy = "tag", "bts"
    elif num_fragments > topo.num_replicas:
        mode, policy = "gap", None
    else:
        mode, policy = "disagg", None
    return SimSetup(mode, policy, num_fragments, num_trainers, topo.gap_stages, chunks, topo)


# ---------------------------------------------------------------------------------------------
# Measured costs
# ---------------------------------------------------------------------------------------------

def _mean(xs: list[float], default: float | None = None) -> float | None:
    return sum(xs) / len(xs) if xs else default


def used_steps(run: RunTrace, skip: int = 1) -> list[int]:
    """The steps whose costs and times count: all but the first `skip` (all, if that leaves none)."""
    steps = run.steps
    return steps[skip:] if len(steps) > skip else steps


def measure_costs(run: RunTrace, setup: SimSetup, skip: int = 1) -> Costs:
    """The simulator's costs measured in a run's traces (see the module docstring)."""
    topo = setup.topology
    trainers = topo.trainer_ranks
    steps = used_steps(run, skip)
    replica_s = []
    for r in range(topo.num_replicas):
        per_step = []
        for k in steps:
            spans = run.of(topo.replica_ranks(r), cat="generate", step=k)
            frags = {s.fragment for s in spans if s.fragment is not None}
            if frags:
                per_step.append((max(s.end_s for s in spans) - min(s.start_s for s in spans)) / len(frags))
        replica_s.append(_mean(per_step))
    measured = [x for x in replica_s if x is not None]
    if not measured:
        raise ValueError("the traces hold no generate span in the steps used: no replica generated anything")
    replica_s = [_mean(measured) if x is None else x for x in replica_s]
    tag_spans = [] if setup.mode == "colocated" else [
        s for k in steps for s in run.of(trainers, cat="generate", step=k)]
    trainer_s = _mean([s.end_s - s.start_s for s in tag_spans], _mean(replica_s))
    train_work: dict[tuple[int, int], float] = {}
    for k in steps:
        for s in run.of(trainers, cat="train", step=k):
            if s.fragment is not None:  # fragment None: FSDP padding, counted in the update
                train_work[(k, s.fragment)] = train_work.get((k, s.fragment), 0.0) + s.end_s - s.start_s
    if not train_work:
        raise ValueError("the traces hold no train span in the steps used")
    receives = [] if setup.mode == "colocated" else _receives(run, steps, topo)
    receive_s = _mean([s.end_s - s.start_s for _, _, s, ready in receives if s.start_s >= ready], 0.0)
    for k, f, s, _ in receives:
        if (k, f) in train_work:
            train_work[(k, f)] += min(receive_s, s.end_s - s.start_s)
    train_s = _mean([w / len(trainers) for w in train_work.values()])
    first: dict[tuple[int, int, int], tuple[TraceSpan, float]] = {}
    for k, f, s, ready in receives:  # only a fragment's first receive on each trainer waits for it to land
        if (k, f, s.rank) not in first or s.start_s < first[(k, f, s.rank)][0].start_s:
            first[(k, f, s.rank)] = (s, ready)
    latency: dict[tuple[int, int], float] = {}
    for (k, f, _), (s, ready) in first.items():
        wait = max(0.0, s.end_s - max(ready, s.start_s) - min(receive_s, s.end_s - s.start_s))
        latency[(k, f)] = max(latency.get((k, f), 0.0), wait)
    update, publish = [], []
    for k in steps:
        last_train = [s.end_s for s in run.of(trainers, cat="train", step=k) if s.fragment is not None]
        opt = run.of(trainers, cat="optimizer", step=k)
        if not opt or not last_train:
            continue
        opt_end = max(s.end_s for s in opt)
        update.append(max(0.0, opt_end - max(last_train)))
        if setup.mode == "colocated":
            continue
        if setup.mode == "tcss":
            publish += [s.end_s - s.start_s for s in run.of(trainers, cat="publish", name="publish", step=k)]
        else:
            nxt = run.of(topo.generator_ranks, cat="generate", step=k + 1)
            if nxt:
                publish.append(max(0.0, min(s.start_s for s in nxt) - opt_end))
    if not publish and setup.mode != "colocated":  # no next step in the steps used: the trainers' own span
        publish = [s.end_s - s.start_s for k in steps for s in run.of(trainers, cat="publish", name="publish", step=k)]
    return Costs(replica_fragment_s=replica_s, trainer_fragment_s=trainer_s, train_fragment_s=train_s,
                 transfer_s=_mean(list(latency.values()), 0.0), update_s=_mean(update, 0.0),
                 publish_s=_mean(publish, 0.0), chunks_per_fragment=setup.chunks_per_fragment)


def _receives(run: RunTrace, steps: list[int], topo: Topology) -> list[tuple[int, int, TraceSpan, float]]:
    """Every trainer `recv` span of a generated fragment: (step, fragment, span, when the
    fragment's generation ended)."""
    out = []
    for k in steps:
        ready: dict[int, float] = {}
        for s in run.of(range(run.world_size), cat="generate", step=k):
            if s.fragment is not None:
                ready[s.fragment] = max(ready.get(s.fragment, s.end_s), s.end_s)
        recvs = run.of(topo.trainer_ranks, cat="comm", name="recv", step=k)
        out += [(k, s.fragment, s, ready[s.fragment]) for s in recvs if s.fragment in ready]
    return out


# ---------------------------------------------------------------------------------------------
# Step metrics on the runtime's definitions
# ---------------------------------------------------------------------------------------------

def measured_step_metrics(run: RunTrace, skip: int = 1) -> dict[str, float | None]:
    """Medians over the steps used: `step_s` and `bubble_fraction` as the runtime logged them
    (perf/step_s: the union of every rank's step window, from when its loop entered the step to
    when it left it), and `period_s` from the traces: the end of a step's last trainer span minus
    the previous step's (the simulator's step time)."""
    steps = set(used_steps(run, skip))
    logged = [m for m in run.metrics if m["step"] in steps]
    trainers = sim_setup(run.config, run.world_size).topology.trainer_ranks
    ends = {k: max(s.end_s for s in run.of(trainers, step=k) if s.cat != "eval") for k in run.steps}
    periods = [ends[k] - ends[k - 1] for k in sorted(steps) if k - 1 in ends]
    return {"step_s": statistics.median(m["perf/step_s"] for m in logged) if logged else None,
            "bubble_fraction": statistics.median(m["perf/bubble_fraction"] for m in logged) if logged else None,
            "period_s": statistics.median(periods) if periods else None}


def predicted_step_metrics(result: SimResult, setup: SimSetup, costs: Costs, skip: int = 1) -> dict[str, float]:
    """The same three medians from a simulated run. The runtime's window of step k starts, on a
    trainer (and a colocated rank), when step k-1 ends; on a generator, when its sends of step k-1
    are consumed or when it starts step k, whichever is first (the runtime drains a generator's
    sends at the end of its step; a send is consumed when its trainer receives it, right before
    training it: with TSP a trainer's share of a fragment is one payload, without TSP each chunk
    is one, so the last is received one chunk's training before the share ends). It ends when
    step k ends. Busy time is the union of generate/train/optimizer spans of step k per rank."""
    world = setup.topology.world_size
    chunk_us = None if costs.chunks_per_fragment is None else \
        costs.train_fragment_s * setup.num_trainers / costs.chunks_per_fragment * 1e6
    spans: dict[int, list[dict]] = {}
    for e in result.events:
        if e.get("ph") == "X":
            spans.setdefault(e["pid"], []).append(e)
    gen_ranks = [] if setup.mode == "colocated" else list(setup.topology.generator_ranks)
    windows, bubbles = [], []
    first = max(1, skip)
    for k in range(first, len(result.step_end_s)):
        starts, busy = [], []
        for rank in range(world):
            mine = spans.get(rank, [])
            start = result.step_end_s[k - 1]
            if rank in gen_ranks:
                replica_first = setup.topology.replica_ranks(setup.topology.replica_of(rank))[0]
                own = {f for f, g in enumerate(result.generated_by[k - 1]) if g == replica_first}
                prev = [e["ts"] + e["dur"] for e in mine if e["args"]["step"] == k - 1 and e["cat"] == "generate"]
                consumed = [e["ts"] if chunk_us is None else max(e["ts"], e["ts"] + e["dur"] - chunk_us)
                            for es in spans.values() for e in es if e["cat"] == "train"
                            and e["args"]["step"] == k - 1 and e["args"]["fragment"] in own]
                start = max(prev + consumed) / 1e6 if prev or consumed else start
                now = [e["ts"] for e in mine if e["args"]["step"] == k and e["cat"] == "generate"]
                start = min([start] + [t / 1e6 for t in now])
            starts.append(start)
            busy.append(_union_s([(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in mine
                                  if e["args"]["step"] == k and e["cat"] in BUSY_CATEGORIES]))
        window = result.step_end_s[k] - min(starts)
        windows.append(window)
        bubbles.append(bubble_fraction(busy, window))
    periods = result.step_s[first:] or result.step_s
    return {"step_s": statistics.median(windows) if windows else result.makespan_s,
            "bubble_fraction": statistics.median(bubbles) if bubbles else result.bubble_fraction,
            "period_s": statistics.median(periods)}


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals (overlapping spans count once, as `Tracer.busy_seconds`)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0 or math.isnan(measured):
        return None
    return (predicted - measured) / measured


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
    from parallel.simulator import simulate_run

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


__all__ = ["CLUSTER_ASSUMPTIONS", "Candidate", "GPU", "GPUS", "MODELS", "ModelSpec", "Prediction", "RunTrace",
           "SimSetup", "TraceSpan", "Workload", "cluster_candidates", "collective_s", "forward_flops", "generation_s",
           "load_run", "measure_costs", "measured_step_metrics", "predict", "predicted_step_metrics",
           "read_trace_events", "recommend", "relative_error", "sim_setup", "training_s", "used_steps"]
