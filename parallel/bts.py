"""BTS, bubble-triggered TAG search (docs/DESIGN.md 5.4): at each idle window of a trainer, claim an
unstarted fragment only if the cost model predicts that the step ends sooner with the claim than
without it. A trainer that generates too much becomes the new bottleneck, so more TAG is not
always better. The search: predict the step's end with no further claim, and with n = 1, 2, ...
claims (one now by this trainer, the others first come, first served at the trainers' next idle
windows); claim one fragment now iff the best n beats no claim. The next idle window searches
again from the state it then sees, so the claims stop as soon as one more stops paying.

An FSDP2 trainer group cannot generate one trainer at a time (every forward is a collective of
the group): its trainers share their idle windows and generate together, up to one fragment each
(`claims_per_window`), so BTS predicts with all of them busy for the round.

The prediction is the simulator's (`simulator.predict_makespan`), run from the step's current
state with the costs that `CostTracker` learns from the run's own measurements.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parallel.event_engine import Costs, StepState, predict_makespan

DEFAULT_MARGIN = 0.01
"""A claim must shorten the predicted rest of the step by this fraction, so that measurement noise
does not flip decisions back and forth."""

MAX_CANDIDATES = 12
"""At most this many claim counts are predicted per decision (spread over 1..unclaimed)."""


@dataclass(frozen=True)
class Decision:
    claim: bool
    predicted_with_s: float
    """predicted end of the step if the deciding trainer claims now and the trainers claim
    `planned_claims - 1` more at their next idle windows: the best over the counts searched"""
    predicted_without_s: float
    """predicted end of the step if no trainer claims again"""
    planned_claims: int = 0
    """the claim count behind predicted_with_s (0 when nothing was left to claim)"""
    claims_now: int = 0
    """fragments to claim at this window: 1 for a trainer on its own, up to `claims_per_window`
    for a trainer group that generates together (0: no claim)"""

    @property
    def predicted_s(self) -> float:
        """The prediction of the branch taken."""
        return self.predicted_with_s if self.claim else self.predicted_without_s


def decide(state: StepState, costs: Costs, num_trainers: int, margin: float = DEFAULT_MARGIN,
           claims_per_window: int = 1, tcss: bool = False) -> Decision:
    """Claim now iff some number n >= 1 of claims (min(n, claims_per_window) now, the others by
    the trainers at their next idle windows) is predicted to end the step sooner than no claim
    at all, by at least `margin` of the time left without a claim. Searching n, not only n = 1, matters: with replicas of different
    speeds, the step's end is set by which replica generates the last fragment, so one claim often
    moves nothing while several move the end (a plateau that a one-claim test never crosses).
    The claims are taken a window at a time: the next idle window decides again, with the state
    it then sees.

    `claims_per_window` 1: a trainer on its own claims one fragment (replicated trainers). M > 1:
    the M trainers are one FSDP group whose idle windows are shared and which generates up to M
    fragments at once, one per trainer, all of them busy for the round (`predict_makespan`'s
    lockstep), so `claims_now` may be up to M.

    `tcss`: generators run one version ahead, so a fragment a trainer takes over lets its generator
    start the next step sooner. The end of this step alone would miss that (the trainers' own
    training sets it), so each count n is judged by the end of the next step, in which the
    trainers claim n fragments as well: the claims a steady state of n per step would make."""
    if claims_per_window < 1:
        raise ValueError(f"claims_per_window must be >= 1, got {claims_per_window}")
    if tcss and state.num_fragments is None:
        raise ValueError("a TCSS decision predicts the next step: the state must give num_fragments")
    without = predict_makespan(state, costs, num_trainers, 0, next_claims=0 if tcss else None)
    if not state.unclaimed:
        return Decision(False, without, without, 0)
    lockstep = claims_per_window > 1
    best, best_n = None, 0
    for n in _claim_counts(len(state.unclaimed)):
        now = min(n, claims_per_window)
        predicted = predict_makespan(state, costs, num_trainers, now, later_claims=n - now, lockstep=lockstep,
                                     next_claims=n if tcss else None)
        if best is None or predicted < best - 1e-12:
            best, best_n = predicted, n
    claim = best < without - margin * (without - state.now_s)
    return Decision(claim, best, without, best_n, min(best_n, claims_per_window) if claim else 0)


def _claim_counts(num_unclaimed: int) -> list[int]:
    """1..num_unclaimed, thinned to MAX_CANDIDATES roughly geometric values (always 1 and the max)."""
    if num_unclaimed <= MAX_CANDIDATES:
        return list(range(1, num_unclaimed + 1))
    ratio = num_unclaimed ** (1 / (MAX_CANDIDATES - 1))
    counts = {min(num_unclaimed, max(1, round(ratio ** i))) for i in range(MAX_CANDIDATES)}
    return sorted(counts | {num_unclaimed})


class CostTracker:
    """The costs of the run, learned from its measurements: an exponential moving average per
    quantity (the first measurement sets it; each later one moves it by `alpha`). Until a trainer
    has generated a fragment, its generation time is estimated as the replicas' mean times
    `trainer_ratio`; a replica not yet measured is assumed to be as fast as the measured mean.
    Shared between ranks as JSON through `to_dict` / `from_dict`."""

    QUANTITIES = ("trainer_fragment_s", "train_fragment_s", "transfer_s", "update_s", "publish_s")

    def __init__(self, num_replicas: int, alpha: float = 0.3, trainer_ratio: float = 1.0):
        if num_replicas < 1:
            raise ValueError(f"CostTracker needs at least one replica, got {num_replicas}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if trainer_ratio <= 0:
            raise ValueError(f"trainer_ratio must be positive, got {trainer_ratio}")
        self.num_replicas, self.alpha, self.trainer_ratio = num_replicas, alpha, trainer_ratio
        self.replica_fragment_s: list[float | None] = [None] * num_replicas
        self.values: dict[str, float | None] = dict.fromkeys(self.QUANTITIES)

    def _ema(self, old: float | None, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"a measured time cannot be negative: {seconds}")
        return seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds

    def observe_replica_fragment(self, replica: int, seconds: float) -> None:
        """Seconds replica `replica` took to generate, decode and score one fragment."""
        self.replica_fragment_s[replica] = self._ema(self.replica_fragment_s[replica], seconds)

    def _observe(self, name: str, seconds: float) -> None:
        self.values[name] = self._ema(self.values[name], seconds)

    def observe_trainer_fragment(self, seconds: float) -> None:
        """Seconds a trainer took to generate and score one fragment (TAG)."""
        self._observe("trainer_fragment_s", seconds)

    def observe_train_fragment(self, seconds: float) -> None:
        """Seconds one trainer spent on its share of one fragment (TSP: the group's wall time)."""
        self._observe("train_fragment_s", seconds)

    def observe_transfer(self, seconds: float) -> None:
        self._observe("transfer_s", seconds)

    def observe_update(self, seconds: float) -> None:
        self._observe("update_s", seconds)

    def observe_publish(self, seconds: float) -> None:
        self._observe("publish_s", seconds)

    @property
    def ready(self) -> bool:
        """Whether `costs()` can answer: some replica and the training have been measured."""
        return any(x is not None for x in self.replica_fragment_s) and self.values["train_fragment_s"] is not None

    def costs(self, chunks_per_fragment: int | None = None) -> Costs:
        if not self.ready:
            raise ValueError("CostTracker has no measurement yet of "
                             + ("replica generation" if all(x is None for x in self.replica_fragment_s)
                                else "training"))
        measured = [x for x in self.replica_fragment_s if x is not None]
        mean = sum(measured) / len(measured)
        v = self.values
        trainer = v["trainer_fragment_s"]
        return Costs(
            replica_fragment_s=[mean if x is None else x for x in self.replica_fragment_s],
            trainer_fragment_s=mean * self.trainer_ratio if trainer is None else trainer,
            train_fragment_s=v["train_fragment_s"],
            transfer_s=v["transfer_s"] or 0.0, update_s=v["update_s"] or 0.0, publish_s=v["publish_s"] or 0.0,
            chunks_per_fragment=chunks_per_fragment,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"num_replicas": self.num_replicas, "alpha": self.alpha, "trainer_ratio": self.trainer_ratio,
                "replica_fragment_s": list(self.replica_fragment_s), **self.values}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostTracker":
        tracker = cls(d["num_replicas"], d["alpha"], d["trainer_ratio"])
        tracker.replica_fragment_s = list(d["replica_fragment_s"])
        tracker.values = {name: d.get(name) for name in cls.QUANTITIES}
        return tracker


__all__ = ["CostTracker", "DEFAULT_MARGIN", "Decision", "MAX_CANDIDATES", "decide"]
