"""Nothing non-finite reaches the weights (docs/reliability.md).

The trainers check every step before `optimizer.step()` and before the EMA update: the received
advantages (non-finite rewards make them so), the loss and statistics sums, and the gradient norm,
all reduced over the trainer group so that every trainer takes the same decision. A step with a
non-finite value is skipped (no update, no EMA, gradients dropped) and counted
(train/skipped_steps); after --max-skipped-steps such steps in a row the run stops with RunAbort,
naming what went non-finite at which steps.
"""
from __future__ import annotations

import math


class RunAbort(RuntimeError):
    """The run stops on a condition it detected itself; train_disagg prints the message as one
    line and exits with code 3 (runguard.EXIT_ABORT)."""


class SkipTracker:
    """Counts skipped steps; raises RunAbort after `max_in_row` in a row."""

    def __init__(self, max_in_row: int):
        self.max_in_row = max_in_row
        self.total = 0
        self.in_row: list[tuple[int, list[str]]] = []  # (step, what) of the current run of skips

    @staticmethod
    def nonfinite(values: dict[str, float]) -> list[str]:
        """The names whose value is NaN or infinite."""
        return [name for name, v in values.items() if not math.isfinite(v)]

    def record(self, step: int, bad: list[str]) -> bool:
        """Record step `step`'s check; True if the step must be skipped."""
        if not bad:
            self.in_row = []
            return False
        self.total += 1
        self.in_row.append((step, bad))
        if len(self.in_row) >= self.max_in_row:
            steps = ", ".join(str(s) for s, _ in self.in_row)
            what = sorted({w for _, ws in self.in_row for w in ws})
            raise RunAbort(f"non-finite {', '.join(what)} in {len(self.in_row)} steps in a row (steps {steps}); "
                           f"every one was skipped, none reached the weights; stopping (--max-skipped-steps "
                           f"{self.max_in_row})")
        return True

    def state_dict(self) -> dict:
        return {"total": self.total, "in_row": [[s, list(w)] for s, w in self.in_row]}

    def load_state_dict(self, state: dict) -> None:
        self.total = int(state["total"])
        self.in_row = [(int(s), list(w)) for s, w in state["in_row"]]
