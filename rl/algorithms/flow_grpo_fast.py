"""Flow-GRPO-Fast (yifan123/flow_grpo scripts/train_sd3_fast.py, docs/ALGORITHMS.md "Flow-GRPO-Fast"):
the SDE only inside a window of steps (--sde-window START:END), the ODE elsewhere, and only the
window trained; Flow-GRPO's loss and advantages otherwise. Its old spelling is `window`."""
from __future__ import annotations

from rl import timesteps
from rl.algorithms.algorithm import Algorithm, Cost


class FlowGRPOFast(Algorithm):
    name = "flow_grpo_fast"
    description = "Flow-GRPO-Fast: SDE and training only inside --sde-window START:END"
    options = ("sampling.sde_window",)
    std_mode = "global"

    def check_flags(self, cfg):
        s = cfg.sampling
        if s.sde_window is not None:
            start, end = s.sde_window
            top = s.sample_steps if s.sample_steps is not None else end
            if not 0 <= start < end <= top:
                raise ValueError(f"--sde-window {start}:{end} must satisfy 0 <= START < END <= --sample-steps ({top})")

    def check(self, cfg):
        if cfg.sampling.sde_window is None:
            raise ValueError(f"--algorithm {self.name} needs --sde-window START:END")

    def check_steps(self, cfg, num_steps):
        start, end = cfg.sampling.sde_window
        if not end <= num_steps:
            raise ValueError(f"--sde-window {start}:{end} ends after the {num_steps} sampling steps")
        super().check_steps(cfg, num_steps)

    def timesteps(self, num_steps, fraction, *, seed, step, sample_id, window=None):
        """The window's steps: the SDE ran there and nowhere else."""
        return timesteps.in_window(window)

    def cost(self, num_steps, fraction=None, window=2):
        return Cost(min(window, num_steps))
