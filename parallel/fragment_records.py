"""What the end of a step reads on the store: each scored fragment's facts (its samples' rewards,
group-centred rewards and which it trains), put by the rank that scored it, read by every trainer
once the step's last fragment is scored (rl/advantages.py `step_end`), before the step's first
optimizer update. The store carries them, not a collective, so a generator never waits for a
trainer and TAG, TCSS and scorer ranks need nothing more: whoever completes a fragment puts its
facts."""
from __future__ import annotations

from parallel import store_keys as keys
from rl.advantages import StepEnd, step_end


def publish(store, step: int, fragment: int, facts: dict) -> None:
    store.put(keys.fragment_record(step, fragment), facts)


def gather(store, step: int, num_fragments: int) -> list[dict]:
    """Every fragment's facts in fragment order; waits for the ones not yet scored."""
    return [store.get(keys.fragment_record(step, f)) for f in range(num_fragments)]  # rank wait: the step's last fragment scored


def clear(store, step: int, num_fragments: int) -> None:
    """Delete a step's facts (one trainer, once every trainer has read them)."""
    for f in range(num_fragments):
        store.delete(keys.fragment_record(step, f))


def read_end(trainer, plan, store, *, seed: int, tracer) -> StepEnd:
    """A trainer at the end of its share of step `plan.step` (runtime/steps.py `trainer_step`), before
    the step's first optimizer update: every fragment's facts, read once the last is scored, and
    what they decide (the policy term's scale, the samples trained again, the step's metrics).
    `seed` is the run's (the keys of what a re-admission draws); `tracer` times the phase."""
    step, whole = plan.step, len(plan.fragments) == 1
    with tracer.span("step_end", "train", step):
        end = step_end(trainer.rule, gather(store, step, len(plan.fragments)), whole_step=whole, seed=seed,
                       step=step)
    if not whole:
        end.metrics["train/late_forwards"] = 0.0
    return end


def train_end(trainer, plan, end: StepEnd, template, part: int, *, tracer) -> None:
    """Before the step's update `part`: train again what the step's end says of that update's samples
    (streaming only: a whole-step fragment applied it all when it was scored)."""
    if len(plan.fragments) == 1:
        return
    with tracer.span("step_end", "train", plan.step, part=part):
        end.metrics["train/late_forwards"] += float(trainer.train_again(end, template, part))
