"""MixGRPO (arXiv 2507.21802; Tencent-Hunyuan/MixGRPO fastvideo/utils/grpo_states.py
at commit e5cdd6a, docs/ALGORITHMS.md "MixGRPO"): a sliding window, the denoising steps that run
the SDE and are trained move along the schedule as training proceeds; every other step is an ODE step.

MixGRPO keeps a start `cur` (0 at first) and after every training step counts it on: every
`interval` steps (iters_per_group) `cur` moves by `stride` (prog_overlap_step); past the last start
`K - 2` (max_timesteps = sampling_steps - 2) it rolls back to 0 (--roll_back, the default scripts)
or stays there (clamp). Step s trains range(cur, min(cur + size, K - 2)), taken before the count.
That is a closed form of s, so every rank and the planner compute a step's window alone:

    progressive:        cur(s) = (s // interval mod (last // stride + 1)) * stride   (stride 0: cur = 0)
    progressive-clamp:  cur(s) = min((s // interval) * stride, last)
    random:             cur(s) uniform in [0, last - size], seeded by (seed, s)  (MixGRPO's "random")

The window is empty when cur reaches K - 2 (MixGRPO trains nothing then and fails on it; here
`check_steps` refuses a run whose steps reach it). MixGRPO's decay and exp_decay strategies are not
implemented (no published script uses them). Advantages and loss are Flow-GRPO's clipped surrogate
on the window's transitions (train_grpo_flux.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rl import timesteps
from rl.algorithms.algorithm import Algorithm, Cost, replace
from rl.seeding import derive_seed

WINDOW_SCHEDULES = ("progressive", "progressive-clamp", "random")


@dataclass(frozen=True)
class WindowSchedule:
    """The SDE / training window of every step of a run of K denoising steps."""

    size: int
    """steps in the window (MixGRPO group_size: 4)"""
    stride: int
    """steps the window moves at each shift (prog_overlap_step: 1; 0 freezes it, MixGRPO-Flash*)"""
    interval: int
    """training steps between shifts (iters_per_group: 25 in MixGRPO, 20 in MixGRPO-Flash)"""
    num_steps: int
    """K, the denoising steps of a sample"""
    schedule: str = "progressive"
    seed: int = 0

    def __post_init__(self):
        if self.schedule not in WINDOW_SCHEDULES:
            raise ValueError(f"unknown --window-schedule {self.schedule!r}; choose one of {WINDOW_SCHEDULES}")
        if self.size < 1 or self.interval < 1 or self.stride < 0:
            raise ValueError(f"window size {self.size} and interval {self.interval} must be >= 1, stride "
                             f"{self.stride} >= 0")
        if self.last < 1:
            raise ValueError(f"a MixGRPO window needs at least 3 sampling steps (it trains steps before K - 2), "
                             f"got {self.num_steps}")

    @property
    def last(self) -> int:
        """MixGRPO's max_timesteps, K - 2: the window never reaches the last two steps."""
        return self.num_steps - 2

    def start(self, step: int) -> int:
        """The window's first denoising step at training step `step`."""
        if self.schedule == "random":
            rng = np.random.default_rng(derive_seed(self.seed, step, "window"))
            return int(rng.integers(0, max(0, self.last - self.size) + 1))
        shifts = step // self.interval
        if self.schedule == "progressive-clamp":
            return min(shifts * self.stride, self.last)
        if self.stride == 0:
            return 0
        return (shifts % (self.last // self.stride + 1)) * self.stride

    def window(self, step: int) -> tuple[int, int]:
        """(START, END): the steps START <= t < END run the SDE and are trained at training step `step`."""
        cur = self.start(step)
        return cur, max(cur, min(cur + self.size, self.last))

    def first_empty(self, steps: range) -> int | None:
        """The first training step of `steps` whose window is empty (None: there is none)."""
        return next((s for s in steps if self.window(s)[0] == self.window(s)[1]), None)


class MixGRPO(Algorithm):
    name = "mixgrpo"
    description = "MixGRPO: SDE and training only inside a window that slides along the steps (--window-*)"
    options = ("sampling.window_size", "sampling.window_stride", "sampling.window_interval",
               "sampling.window_schedule")

    def check_flags(self, cfg):
        s = cfg.sampling
        for flag, value, low in (("--window-size", s.window_size, 1), ("--window-stride", s.window_stride, 0),
                                 ("--window-interval", s.window_interval, 1)):
            if value < low:
                raise ValueError(f"{flag} must be >= {low}{' (0 = a fixed window)' if low == 0 else ''}, got {value}")
        if s.window_schedule not in WINDOW_SCHEDULES:
            raise ValueError(f"unknown --window-schedule {s.window_schedule!r}; choose one of {WINDOW_SCHEDULES}")

    def check_steps(self, cfg, num_steps):
        """The window exists (K >= 3) and no training step of the run has an empty one (MixGRPO
        reaches one at start K - 2 and trains nothing there). It never reaches the last step."""
        window = self.schedule(cfg, num_steps)
        empty = window.first_empty(range(cfg.rl.steps))
        if empty is not None:
            raise ValueError(f"the MixGRPO window is empty at step {empty} (it starts at step {window.start(empty)} "
                             f"of the {window.num_steps} sampling steps, and MixGRPO trains only steps before "
                             f"K - 2 = {window.last}): use fewer --steps, a larger --window-interval or more "
                             f"--sample-steps")

    @staticmethod
    def schedule(cfg, num_steps: int) -> WindowSchedule:
        """The run's sliding window over `num_steps` denoising steps (a ValueError for fewer than 3)."""
        s = cfg.sampling
        return WindowSchedule(s.window_size, s.window_stride, s.window_interval, num_steps, s.window_schedule, cfg.seed)

    def sampling(self, cfg, sampling):
        return replace(sampling, window_schedule=self.schedule(cfg, sampling.num_steps))

    def timesteps(self, num_steps, fraction, *, seed, step, sample_id, window=None):
        """The step's window: the SDE ran there and nowhere else."""
        return timesteps.in_window(window)

    def cost(self, num_steps, fraction=None, window=2):
        """The window's size (a sliding window trains as many steps as a fixed one until it shrinks
        before K - 2)."""
        return Cost(min(window, num_steps))
