"""Flow-GRPO (arXiv 2505.05470; yifan123/flow_grpo, docs/ALGORITHMS.md "Flow-GRPO"): the SDE rollout
at every step, the first int(K x fraction) steps trained in order (train_sd3.py:345, 864), the
clipped surrogate on their stored transitions with a KL term to the reference, advantages over the
step's rewards with the population std + 1e-4 (stat_tracking.py:27-37, global_std in its configs).
Every choice is the interface's default (rl/algorithms/algorithm.py)."""
from __future__ import annotations

from rl.algorithms.algorithm import Algorithm


class FlowGRPO(Algorithm):
    name = "flow_grpo"
    description = "Flow-GRPO: SDE rollout, the first int(fraction x K) steps trained in order"
    std_mode = "global"
