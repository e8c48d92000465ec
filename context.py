"""What every role's step needs to know about its rank, passed as one object."""
from __future__ import annotations

from dataclasses import dataclass

import torch

import sampler
from config import RunConfig
from models import DiTAdapter
from parallel.topology import Topology
from tracing import Tracer


@dataclass
class RankContext:
    cfg: RunConfig
    topo: Topology
    rank: int
    device: torch.device
    tracer: Tracer
    adapter: DiTAdapter
    sampling: sampler.SamplingConfig
    records: list  # list[prompts.PromptRecord]: the training prompt set

    @property
    def disagg(self) -> bool:
        return self.topo.mode == "disagg"
