"""The bench's modes and scenarios (lab/bench.py): each mode a torchrun world and the flags that
select it, each scenario the modes measured side by side in one regime, its colocated baseline
first. Adding a mode is one line in MODES."""
from __future__ import annotations

import os
from typing import NamedTuple

class Mode(NamedTuple):
    nproc: int
    """world size of the torchrun job"""
    flags: list[str]
    """train_disagg.py flags that select the mode (placed after the workload flags, so they win)"""
    description: str


G1T1 = ["--generators", "1", "--trainers", "1"]

MODES: dict[str, Mode] = {
    "colocated-replicate": Mode(2, ["--mode", "colocated"], "every rank generates then trains; full replicas"),
    "colocated-speed": Mode(2, ["--mode", "colocated", "--fragment-split", "speed"],
                            "colocated, each rank's share of fragments in proportion to its measured speed"),
    "colocated-fsdp": Mode(2, ["--mode", "colocated", "--colocated-sharding", "fsdp"],
                           "every rank generates then trains; FSDP2-sharded generation and training"),
    "colocated-fsdp3": Mode(3, ["--mode", "colocated", "--colocated-sharding", "fsdp"],
                            "colocated FSDP2 over 3 ranks (3 ranks on 2 cores: contention)"),
    "disagg": Mode(2, [*G1T1, "--fragment-groups", "0"], "naive disaggregation: 1 generator, 1 trainer"),
    "gap": Mode(2, [*G1T1, "--fragment-groups", "1"],
                "GAP fragment streaming: one group per fragment, the trainer starts on the first"),
    "gap-stages": Mode(3, ["--generators", "2", "--trainers", "1", "--gap-stages", "2", "--fragment-groups", "1"],
                       "GAP block pipeline: one replica of 2 stages + 1 trainer (3 ranks on 2 cores: contention)"),
    "gap+tag": Mode(2, [*G1T1, "--fragment-groups", "1", "--tag"], "+ TAG with BTS: the idle trainer generates"),
    "gap+tag+tcss": Mode(2, [*G1T1, "--fragment-groups", "1", "--tag", "--tcss"],
                         "+ TCSS: generators run at most one version stale"),
    "gap+tcss": Mode(2, [*G1T1, "--fragment-groups", "1", "--tcss"], "GAP + TCSS, TAG off"),
    "gap+tag+assist": Mode(2, [*G1T1, "--fragment-groups", "1", "--tag", "--tail-assist"],
                           "+ tail assist: the generator trains a share of the step's last fragment"),
    "gap+bf16": Mode(2, [*G1T1, "--fragment-groups", "1", "--publish-compression", "bf16"],
                     "GAP, publication cast to bf16"),
    "gap+topk": Mode(2, [*G1T1, "--fragment-groups", "1", "--publish-compression", "delta-topk:0.01"],
                     "GAP, publication of the top 1% of each delta (error feedback)"),
    "gap-fsdp": Mode(3, ["--generators", "1", "--trainers", "2", "--fragment-groups", "1", "--train-sharding", "fsdp"],
                     "1 generator with plain inference weights + 2 FSDP2 trainers (3 ranks on 2 cores: contention)"),
    "colocated-replicate3": Mode(3, ["--mode", "colocated"], "colocated over 3 ranks (3 ranks on 2 cores: contention)"),
    "gap2x1-rr": Mode(3, ["--generators", "2", "--trainers", "1", "--fragment-groups", "1", "--dispatch", "round-robin"],
                      "2 generator replicas + 1 trainer, fragments in step order, round-robin (3 ranks on 2 cores)"),
    "gap2x1-lpt": Mode(3, ["--generators", "2", "--trainers", "1", "--fragment-groups", "1", "--dispatch", "lpt"],
                       "2 generator replicas + 1 trainer, skew-aware dispatch: predicted cost, longest first, LPT "
                       "(3 ranks on 2 cores)"),
    "gap-fsdp+tag": Mode(3, ["--generators", "1", "--trainers", "2", "--fragment-groups", "1",
                             "--train-sharding", "fsdp", "--tag"], "the same with TAG: the FSDP trainers generate together"),
    # The measured runs behind the planner's out-of-sample fit (lab/make_plan_fixtures.py runs
    # them with --no-packing: each mode states its own TSP flags).
    "gap-stream": Mode(2, [*G1T1, "--fragment-groups", "1"], "GAP fragment streaming (the planner's fit run)"),
    "gap-frag2": Mode(2, [*G1T1, "--fragment-groups", "2"], "GAP fragment streaming with fragments of two groups"),
    "gap-2rep": Mode(3, ["--generators", "2", "--trainers", "1", "--fragment-groups", "1"],
                     "two generator replicas + 1 trainer, fragments of one group (3 ranks on 2 cores: contention)"),
    "gap+tsp": Mode(2, [*G1T1, "--fragment-groups", "1", "--tsp", "--train-micro-batch", "16"],
                    "GAP + TSP, training forwards of 16 transitions"),
    "gap+tsp8": Mode(2, [*G1T1, "--fragment-groups", "1", "--tsp", "--train-micro-batch", "8"],
                     "GAP + TSP, training forwards of 8 transitions"),
    "gap+tsp+tag+tcss": Mode(2, [*G1T1, "--fragment-groups", "1", "--tsp", "--train-micro-batch", "16", "--tag",
                                 "--tcss"], "GAP + TSP + TAG + TCSS"),
    "slow-gen": Mode(2, [*G1T1, "--fragment-groups", "1", "--debug-slow-rank", "0:3"],
                     "GAP with the generator slowed 3x, TAG off"),
    # --placement auto: the run measures the machine, ranks the placements and runs (and tries) them
    "auto": Mode(2, ["--placement", "auto"], "--placement auto: the run chooses its placement (on-policy ones)"),
    "auto+stale": Mode(2, ["--placement", "auto", "--placement-stale"],
                       "--placement auto --placement-stale: TCSS placements allowed too"),
    "auto3": Mode(3, ["--placement", "auto"], "--placement auto over 3 ranks (3 ranks on 2 cores: contention)"),
}
AUTO_MODES = ("auto", "auto+stale", "auto3")
"""modes in which the run chooses its placement (compared with the best fixed mode of their scenario)"""
STALE_MODES = ("gap+tag+tcss", "gap+tcss", "gap+tsp+tag+tcss", "auto+stale")
"""modes whose generators may run one version stale (TCSS): they train other weights"""

BASELINES = ("colocated-replicate", "colocated-fsdp")
"""With --modes, every mode's samples/s is reported as a ratio to each of these (when they ran)."""

DEFAULT_MODES = ("colocated-replicate", "colocated-fsdp", "disagg", "gap")


class Scenario(NamedTuple):
    modes: tuple[str, ...]
    """the modes measured side by side, the baseline first"""
    flags: tuple[str, ...]
    """train_disagg.py flags of the regime, for every mode of the scenario"""
    description: str

    @property
    def baseline(self) -> str:
        return self.modes[0]


WINDOW_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_window.toml")
"""the window scenario's sampler and algorithm"""
SCENARIOS: dict[str, Scenario] = {
    "fits": Scenario(("colocated-replicate", "gap", "gap+tag", "gap+tag+assist", "gap+tag+tcss", "auto", "auto+stale"),
                     (),
                     "identical ranks, the model replicated"),
    "sharded": Scenario(("colocated-fsdp3", "gap-fsdp", "gap-fsdp+tag", "auto3"),
                        ("--lora-rank", "0", "--memory-budget-gb", "auto", "--prompts-per-step", "3"),
                        "full fine-tuning whose training state must be sharded (--memory-budget-gb): colocated FSDP2 "
                        "for both phases against plain inference weights on the generator and FSDP2 trainers"),
    "hetero": Scenario(("colocated-replicate", "colocated-speed", "gap", "gap+tag", "gap+tag+assist", "gap+tcss",
                        "gap+tag+tcss", "auto", "auto+stale"),
                       ("--debug-slow-rank", "0:2"),
                       "rank 0 is 2x slower (an older or inference-class GPU): colocated splits evenly (or by speed); "
                       "DigenRL puts generation on the slow rank"),
    "window": Scenario(("colocated-replicate", "gap+tag", "gap+tag+assist", "gap+tag+tcss", "auto", "auto+stale"),
                       ("--config", WINDOW_CONFIG),
                       "a 2-timestep SDE window: training is cheap, rollout dominates"),
    "skew": Scenario(("colocated-replicate3", "gap2x1-rr", "gap2x1-lpt"),
                     ("--prompts", "data/shapes_mixed.jsonl", "--prompts-per-step", "8", "--group-size", "2",
                      "--fragment-split", "even"),
                     "prompts of mixed cost (16x16, 32x32, 48x48 at 1:1:2): round-robin against skew-aware (LPT) "
                     "dispatch over 2 generator replicas of equal share (the start-up speed probe, noisy when 3 "
                     "ranks time-share 2 cores, does not weight them); contention"),
    "link": Scenario(("colocated-replicate", "gap", "gap+bf16", "gap+topk"),
                     ("--lora-rank", "0", "--debug-link-bandwidth", "100"),
                     "full fine-tuning with generators behind a 100 MB/s link: compressed publication"),
}
