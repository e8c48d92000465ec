"""GPUs, links and kernel efficiency (docs/calibration.md, "Devices", "Collectives", "Efficiency").

Every number here is a datasheet value, a measured public fact named beside it, or a constant
fitted to the measured-MFU facts (the fit and its residuals are in docs/calibration.md). A device
profile written by lab/calibrate.py replaces the datasheet values of the GPU it was measured
on (`DeviceProfile`, read by lab/planning/profile.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    peak_flops: float
    """dense bf16 FLOP/s"""
    hbm_bytes_s: float
    memory_bytes: float
    nvlink_busbw: float
    """measured all-gather bus bandwidth inside one node (bytes/s)"""
    nic_bytes_s: float
    """InfiniBand bandwidth per GPU (one NIC per GPU, bytes/s)"""
    pcie_bytes_s: float
    """effective host <-> device copy bandwidth (offload, sleep / wake, weight staging)"""
    price_per_hour: float
    """illustrative on-demand price per GPU-hour in USD (--price overrides it)"""
    gpus_per_node: int = 8
    measured: Any = None
    """a device profile (lab/planning/profile.py) whose measured efficiency and all-gather bandwidth
    replace the constants below for this GPU"""

    @property
    def peak_ratio(self) -> float:
        return self.peak_flops / H100_PEAK


H100_PEAK = 989e12

GPUS: dict[str, GPU] = {g.key: g for g in (
    # NVLink busbw: 8xH100 all_gather ~360 GB/s (nccl-tests#326); H800 ~160 GB/s effective NVLink and
    # 50 GB/s IB per GPU (DeepSeek-V3); A100 ~200 GB/s (nccl-tests#149); L40S has no NVLink (PCIe 4).
    GPU("h100", "H100 SXM 80GB", 989e12, 3.35e12, 80e9, 360e9, 50e9, 25e9, 2.99),
    GPU("h800", "H800 SXM 80GB", 989e12, 3.35e12, 80e9, 160e9, 50e9, 25e9, 2.49),
    GPU("h200", "H200 SXM 141GB", 989e12, 4.8e12, 141e9, 360e9, 50e9, 25e9, 3.79),
    GPU("h20", "H20 96GB", 148e12, 4.0e12, 96e9, 360e9, 50e9, 25e9, 1.29),
    GPU("a100", "A100 SXM 80GB", 312e12, 2.0e12, 80e9, 200e9, 25e9, 20e9, 1.79),
    GPU("l40s", "L40S 48GB", 181e12, 0.864e12, 48e9, 20e9, 25e9, 20e9, 0.99),
    # A800: an A100 whose NVLink is cut from 600 to 400 GB/s, compute and memory unchanged (NVIDIA's
    # export variant; verl's flops_counter lists 312e12 for it). No 8 x A800 all-gather measurement
    # is public: the A100's ~200 GB/s busbw scaled by 400/600. NIC and PCIe as the A100's. No sourced
    # price: the A100's (--price a800=USD).
    GPU("a800", "A800 SXM 80GB", 312e12, 2.039e12, 80e9, 133e9, 25e9, 20e9, 1.79),
    # B200 (HGX, 1000 W): 2.25 PF dense bf16 (verl's flops_counter; HGX B200 datasheet 36 PF sparse per
    # 8 GPUs), 8 TB/s HBM3e, 180 GB as HGX / DGX B200 ship it (1.44 TB per 8), NVLink 5 at 900 GB/s a
    # direction: busbw 720 GB/s is an estimate (H100's 360 of 450 GB/s, scaled; no 8 x B200 all-gather
    # measurement is public); ConnectX-7 400 Gb/s per GPU (nccl-tests#389). No sourced price: a
    # placeholder of 1.5 x the H200's (--price b200=USD). Its efficiency extrapolates the Hopper fit
    # (HEADROOM_EXPONENT) to a 2.3x higher peak, with no anchor.
    GPU("b200", "B200 SXM 180GB", 2.25e15, 8.0e12, 180e9, 720e9, 50e9, 25e9, 5.69),
)}
"""L40S: 181 TFLOP/s is the dense bf16 rate (the datasheet's 362 counts structured sparsity)."""


def gpu(key: str) -> GPU:
    if key not in GPUS:
        raise ValueError(f"unknown GPU {key!r}; known: {sorted(GPUS)}")
    return GPUS[key]


# ---------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------

RAIL_EFFICIENCY = 0.5
"""Fraction of the node's aggregate NIC bandwidth (8 rails) an all-gather across nodes reaches:
256 x H100 (8 x 400 Gb/s per node) all_gather at 2 GB measured ~200 GB/s busbw (nccl#1218)."""

LINK_LATENCY_S = 8e-6
"""Per ring step: a collective over n ranks pays (n - 1) of these."""


def busbw(g: GPU, group: int) -> float:
    """All-gather / reduce-scatter bus bandwidth of a group of `group` GPUs: NVLink inside a node;
    across nodes the slower of NVLink and the node's rails (gpus_per_node x NIC x RAIL_EFFICIENCY)."""
    if g.measured is not None and g.measured.busbw(group) is not None:
        return g.measured.busbw(group)
    if group <= g.gpus_per_node:
        return g.nvlink_busbw
    return min(g.nvlink_busbw, g.gpus_per_node * g.nic_bytes_s * RAIL_EFFICIENCY)


def allgather_s(g: GPU, full_bytes: float, group: int) -> float:
    """All-gather (or reduce-scatter) of a tensor of `full_bytes` over `group` GPUs (ring: each
    moves (n-1)/n of it at the bus bandwidth)."""
    if group <= 1 or full_bytes <= 0:
        return 0.0
    return full_bytes * (group - 1) / group / busbw(g, group) + (group - 1) * LINK_LATENCY_S


def allreduce_s(g: GPU, full_bytes: float, group: int) -> float:
    return 2 * allgather_s(g, full_bytes, group)


def p2p_bytes_s(g: GPU, same_node: bool) -> float:
    """Point-to-point bandwidth between two GPUs: NVLink inside a node (a single pair reaches about
    the bus bandwidth), one NIC across nodes."""
    return g.nvlink_busbw if same_node else g.nic_bytes_s


@dataclass(frozen=True)
class Sharding:
    """How a model state is split over a group: FSDP over all of it, or HSDP (shards inside groups
    of `shard` GPUs, replicas across them)."""

    group: int
    shard: int

    @classmethod
    def fsdp(cls, group: int) -> "Sharding":
        return cls(group, group)

    @classmethod
    def hsdp(cls, group: int, shard: int) -> "Sharding":
        if shard < 1 or group % shard:
            raise ValueError(f"HSDP shard size {shard} must divide the group of {group}")
        return cls(group, shard)

    @property
    def replicas(self) -> int:
        return self.group // self.shard

    def gather_s(self, g: GPU, full_bytes: float) -> float:
        """One all-gather of the unsharded tensor (FSDP forward or backward)."""
        return allgather_s(g, full_bytes, self.shard)

    def grad_sync_s(self, g: GPU, full_grad_bytes: float) -> float:
        """Gradient reduction: reduce-scatter inside the shard group, plus an all-reduce of the
        shard across replicas (HSDP)."""
        return (allgather_s(g, full_grad_bytes, self.shard)
                + _cross_replica_allreduce_s(g, full_grad_bytes / self.shard, self.replicas, self.shard))


def _cross_replica_allreduce_s(g: GPU, shard_bytes: float, replicas: int, shard: int) -> float:
    """All-reduce of one shard across `replicas` GPUs that sit `shard` ranks apart (across nodes
    when the shard group fills a node; each rail carries one shard's reduction)."""
    if replicas <= 1:
        return 0.0
    across = shard * replicas > g.gpus_per_node
    bw = min(g.nic_bytes_s * RAIL_EFFICIENCY * 2, g.nvlink_busbw) if across else g.nvlink_busbw
    return 2 * shard_bytes * (replicas - 1) / replicas / bw + 2 * (replicas - 1) * LINK_LATENCY_S


FSDP_OVERLAP = 0.23
"""Fraction of an FSDP all-gather hidden behind compute when both are present: a 14B DiT on 8 x
H100 saved ~53 ms per forward by not resharding, of a ~69 ms whole-model gather (lingbot-world
PR#52), so 77% of the gather was exposed. Applied to every system alike (ours included)."""


def overlapped_s(compute_s: float, comm_s: float, overlap: float = FSDP_OVERLAP) -> float:
    """Wall time of compute and communication that overlap by `overlap` of the shorter."""
    return compute_s + comm_s - overlap * min(compute_s, comm_s)


# ---------------------------------------------------------------------------------------------
# Kernel efficiency
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kernels:
    compiled: bool = False
    """torch.compile (fused elementwise, fewer launches) or eager"""
    attention: str = "sdpa"
    """sdpa (FlashAttention-2 speed on Hopper), fa2, fa3"""

    def __post_init__(self):
        if self.attention not in ATTENTION_EFFICIENCY:
            raise ValueError(f"unknown attention backend {self.attention!r}; known: {sorted(ATTENTION_EFFICIENCY)}")


GEMM_EFFICIENCY = {False: 0.334, True: 0.587}
"""Best fraction of peak reached by the weight matmuls plus their elementwise neighbours on a
Hopper GPU, eager / compiled (fit: xDiT FLUX 1024^2 on 1 x H100, 31% eager and 49% compiled)."""

ATTENTION_EFFICIENCY = {"sdpa": 0.355, "fa2": 0.355, "fa3": 0.675}
"""Fraction of peak of the attention kernels on Hopper (fit: FastVideo Wan 720p on H200, FA2 38% /
FA3 52% / FA3 + compile 67%, and xDiT HunyuanVideo 720p on H100, 32%)."""

TOKENS_HALF = 512
"""Tokens per forward at which the matmuls reach half of their best efficiency (small micro-
batches of short sequences leave SMs idle). An assumption: no public fact pins it."""

HEADROOM_EXPONENT = 0.5
"""GPUs with a lower peak reach a larger fraction of it (the non-matmul time does not shrink with
the peak): e' = e / (e + (1 - e) * (peak / 989 TF)^x). Fit: xDiT HunyuanVideo 720p, H20 61% vs
H100 32%."""

TRAIN_EFFICIENCY = 0.876
"""Physical forward + backward efficiency relative to a forward of the same shape (fit:
VeRL-Omni Qwen-Image 512^2 full fine-tuning on 4 x H200, train 22.3% counted as 3 forwards with
checkpointing, i.e. 29.7% physical, against 33.9% predicted for its forward; verl-omni#124)."""

PHASES = ("rollout", "train", "reference")


def _headroom(e: float, g: GPU) -> float:
    r = g.peak_ratio ** HEADROOM_EXPONENT
    return e / (e + (1 - e) * r)


def efficiency(g: GPU, tokens: float, attn_share: float, kernels: Kernels = Kernels(),
               phase: str = "rollout") -> float:
    """Model FLOP utilisation of one forward (or forward + backward, phase 'train') that processes
    `tokens` tokens (micro-batch x branches x sequence) with `attn_share` of its FLOPs in attention."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; known: {PHASES}")
    if g.measured is not None:
        return g.measured.efficiency(g, tokens, phase)
    gemm = _headroom(GEMM_EFFICIENCY[kernels.compiled] * tokens / (tokens + TOKENS_HALF), g)
    attn = _headroom(ATTENTION_EFFICIENCY[kernels.attention], g)
    e = 1.0 / ((1 - attn_share) / gemm + attn_share / attn)
    return e * (TRAIN_EFFICIENCY if phase == "train" else 1.0)


def compute_s(g: GPU, flops: float, tokens: float, attn_share: float, kernels: Kernels = Kernels(),
              phase: str = "rollout") -> float:
    if flops <= 0:
        return 0.0
    return flops / (g.peak_flops * efficiency(g, tokens, attn_share, kernels, phase))


AUX_EFFICIENCY = 0.30
"""MFU assumed for the VAE decoder, text encoders and reward models (convolutions and short
sequences; no public measurement in the facts)."""


def aux_s(g: GPU, flops: float) -> float:
    return flops / (g.peak_flops * _headroom(AUX_EFFICIENCY, g)) if flops > 0 else 0.0


def memory_bound_s(g: GPU, num_bytes: float) -> float:
    return num_bytes / g.hbm_bytes_s


def with_price(g: GPU, price: float | None) -> GPU:
    return g if price is None else replace(g, price_per_hour=price)


__all__ = ["ATTENTION_EFFICIENCY", "FSDP_OVERLAP", "GEMM_EFFICIENCY", "GPU", "GPUS", "Kernels", "Sharding",
           "TRAIN_EFFICIENCY", "allgather_s", "allreduce_s", "aux_s", "busbw", "compute_s", "efficiency", "gpu",
           "memory_bound_s", "overlapped_s", "p2p_bytes_s", "with_price"]
