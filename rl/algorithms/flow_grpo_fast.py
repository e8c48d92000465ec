"""Flow-GRPO-Fast (yifan123/flow_grpo scripts/train_sd3_fast.py, docs/ALGORITHMS.md "Flow-GRPO-Fast"):
the SDE only inside a window of steps, the ODE elsewhere, and only the window trained; Flow-GRPO's
loss and advantages otherwise. Its old spelling is `window`.

The window is fixed (--sde-window START:END) or, as Flow-GRPO-Fast draws it, of --sde-window-size N
steps starting at randint(LO, HI - N) (--sde-window-range LO:HI; flow_grpo/diffusers_patch/
sd3_pipeline_with_logprob_fast.py, `random.randint`, both ends included). Flow-GRPO draws one start
per sampling batch of a GPU from Python's global RNG; here one per group, keyed by (seed, step,
group), so every placement draws the same windows for the same samples. With K = 10, N = 3 and range
0:5 the SDE runs at steps 0..4 with frequencies 1/3, 2/3, 1, 2/3, 1/3 either way."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rl import timesteps
from rl.algorithms.algorithm import Algorithm, Cost, replace
from rl.algorithms.fields import flag, parse_pair
from rl.seeding import derive_seed


@dataclass(frozen=True)
class GroupWindow:
    """A window of `size` steps whose start is drawn per group from [low, high - size]."""

    size: int
    low: int
    high: int
    group_size: int
    seed: int = 0
    per_sample = True
    """the window depends on the sample (its group)"""

    def start(self, step: int, group: int) -> int:
        """randint(low, high - size) keyed by (seed, step, group)."""
        rng = np.random.default_rng(derive_seed(self.seed, step, group, "sde-window"))
        return int(rng.integers(self.low, self.high - self.size + 1))

    def window(self, step: int, sample_id: int | None = None) -> tuple[int, int]:
        if sample_id is None:
            raise ValueError("a window drawn per group needs the sample")
        start = self.start(step, sample_id // self.group_size)
        return start, start + self.size


@dataclass
class SamplingOptions:
    """Flow-GRPO-Fast's own flags of the [sampling] section (--sde-window, which Flow-DPPO reads too,
    is config/schema.py's)."""

    sde_window_size: int = flag(0, "Flow-GRPO-Fast: a window of N SDE steps whose start is drawn per group within "
                                   "--sde-window-range (its sde_window_size); 0 = none")
    sde_window_range: tuple | None = flag(None, "LO:HI: Flow-GRPO-Fast's window starts at randint(LO, HI - N), per "
                                                "group (its sde_window_range)",
                                          parse=lambda s: parse_pair(s, ":", int, "--sde-window-range"),
                                          metavar="LO:HI")


class FlowGRPOFast(Algorithm):
    name = "flow_grpo_fast"
    description = ("Flow-GRPO-Fast: SDE and training only inside --sde-window START:END, or a window of "
                   "--sde-window-size steps drawn per group within --sde-window-range")
    flags = {"sampling": SamplingOptions}
    options = ("sampling.sde_window",)
    std_mode = "global"

    def check_flags(self, cfg):
        s = cfg.sampling
        top = s.sample_steps
        if s.sde_window is not None:
            start, end = s.sde_window
            if not 0 <= start < end <= (top if top is not None else end):
                raise ValueError(f"--sde-window {start}:{end} must satisfy 0 <= START < END <= --sample-steps ({top})")
        if s.sde_window_size < 0:
            raise ValueError(f"--sde-window-size must be >= 0 (0: none), got {s.sde_window_size}")
        if s.sde_window_range is not None:
            low, high = s.sde_window_range
            if not 0 <= low < high or (top is not None and high > top):
                raise ValueError(f"--sde-window-range {low}:{high} must satisfy 0 <= LO < HI <= --sample-steps ({top})")
            if s.sde_window_size and low + s.sde_window_size > high:
                raise ValueError(f"--sde-window-size {s.sde_window_size} does not fit in --sde-window-range "
                                 f"{low}:{high}")

    def check(self, cfg):
        s = cfg.sampling
        drawn = s.sde_window_size > 0 or s.sde_window_range is not None
        if (s.sde_window is None) == (not drawn) or (drawn and not (s.sde_window_size and s.sde_window_range)):
            raise ValueError(f"--algorithm {self.name} needs --sde-window START:END, or --sde-window-size N with "
                             f"--sde-window-range LO:HI (a window drawn per group), not both")
        if drawn and s.ode_solver != "euler":
            raise ValueError(f"a window drawn per group takes Euler ODE steps (Flow-GRPO-Fast's); got --ode-solver "
                             f"{s.ode_solver}")

    def check_steps(self, cfg, num_steps):
        s = cfg.sampling
        start, end = s.sde_window if s.sde_window is not None else s.sde_window_range
        flag = "--sde-window" if s.sde_window is not None else "--sde-window-range"
        if not end <= num_steps:
            raise ValueError(f"{flag} {start}:{end} ends after the {num_steps} sampling steps")
        if cfg.rl.beta > 0 and s.sde_type == "cps" and end == num_steps:
            raise ValueError(f"--beta {cfg.rl.beta} with --sde-type cps trains the last step, whose std is 0, and the "
                             f"KL divides by it: end {flag} before step {num_steps - 1}")

    def sampling(self, cfg, sampling):
        """A window drawn per group (--sde-window-range), or the fixed one as it is."""
        s = cfg.sampling
        if s.sde_window_range is None:
            return sampling
        low, high = s.sde_window_range
        return replace(sampling, window_schedule=GroupWindow(s.sde_window_size, low, high, cfg.rl.group_size, cfg.seed))

    def timesteps(self, num_steps, fraction, *, seed, step, sample_id, window=None):
        """The window's steps: the SDE ran there and nowhere else."""
        return timesteps.in_window(window)

    def cost(self, num_steps, fraction=None, window=2):
        return Cost(min(window, num_steps))
