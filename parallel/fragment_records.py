"""What the end of a step reads on the store: each scored fragment's facts (its samples' rewards,
group-centred rewards and which it trains), put by the rank that scored it, read by every trainer
once the step's last fragment is scored (rl/advantages.py `step_end`). The store carries them, not
a collective, so a generator never waits for a trainer and TAG, TCSS and scorer ranks need nothing
more: whoever completes a fragment puts its facts."""
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


def end_step(trainer, plan, store, template, *, seed: int, tracer) -> StepEnd:
    """A trainer at the end of step `plan.step` (runtime/steps.py `trainer_step`): read every fragment's
    facts, train again what they say (streaming only: a whole-step fragment applied it all when it
    was scored) and return the policy term's scale and the step's metrics. `seed` is the run's (the
    keys of what a re-admission draws); `tracer` times the phase."""
    step, whole = plan.step, len(plan.fragments) == 1
    with tracer.span("step_end", "train", step):
        end = step_end(trainer.rule, gather(store, step, len(plan.fragments)), whole_step=whole, seed=seed,
                       step=step)
        if not whole:
            end.metrics["train/late_forwards"] = float(trainer.train_again(end, template))
    return end
