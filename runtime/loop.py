"""The step loop of one rank (docs/DESIGN.md). Every step k:

  generators: install version k -> generate, decode, score the fragments of their replica ->
              send each fragment's training data to its trainers -> receive version k+1
  scorers:    score the fragments sent to them
  trainers:   receive (or, colocated, take) their work -> forward/backward each transition ->
              one optimizer update (one per part: --updates-per-rollout) -> publish version k+1
              to every generator
  all ranks:  put their step record on the store; the logging rank (the first trainer) logs them

Colocated mode runs both halves on every rank with no transfer and no publication. What each
phase does is in runtime/build.py (`Rank`), the roles and parallel/.
"""
from __future__ import annotations

import time

from config.schema import RunConfig
from config.validate import RunFacts
from runtime import autoplace
from runtime.build import build


def run(cfg: RunConfig, facts: RunFacts, rank: int) -> int:
    """One rank's run; returns its exit code (0 done, guard.EXIT_STOPPED after a signal). With
    --placement auto the run first measures the machine and chooses its placement, and may switch
    placement between steps (runtime/autoplace.py)."""
    auto = autoplace.start(cfg, facts, rank) if cfg.topology.placement == "auto" else None  # a collective
    if auto is not None:
        cfg, facts = auto.config()
    r = build(cfg, facts, rank, placement=auto.record() if auto is not None else None)
    try:
        if cfg.output.eval_every and r.start == 0:
            r.evaluate(0)  # the base model
        for step in range(r.start, cfg.rl.steps):
            if r.guard.stop_before(step):  # a signal on some rank: every rank stops before the same step
                break
            r.guard.set_timeouts(relaxed=_saves_or_evaluates(cfg, step) or _saves_or_evaluates(cfg, step - 1))
            plan = r.plan(step)
            r.guard.injected_fault(step)  # test hook only (DIGENRL_DEBUG_RAISE)
            started = time.time()
            gen_out, local = r.generate(plan)
            r.score(plan)
            train_stats, helped = r.train(plan, local)
            r.record(plan, started, gen_out + helped, train_stats)
            done = step + 1
            if saves_after(cfg, done):
                r.save(done)
            if cfg.output.eval_every and (done % cfg.output.eval_every == 0 or done == cfg.rl.steps):
                r.evaluate(done)
            if auto is not None and done < cfg.rl.steps:
                r = auto.after_step(r, step)  # the next trial's placement, or the fastest measured
        r.finish()
    except BaseException:
        r.close(failing=True)  # what it writes must not hide the error that ends the run (a full disk)
        raise
    r.close()
    return r.exit_code()


def saves_after(cfg: RunConfig, done: int) -> bool:
    """A checkpoint is written once `done` steps are done: every --save-every steps, and at the end."""
    return done == cfg.rl.steps or bool(cfg.output.save_every and done % cfg.output.save_every == 0)


def _saves_or_evaluates(cfg: RunConfig, step: int) -> bool:
    """Step `step` ends with a checkpoint or an evaluation (every rank knows the schedule)."""
    done, o = step + 1, cfg.output
    return saves_after(cfg, done) or bool(o.eval_every and done % o.eval_every == 0)
