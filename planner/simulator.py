"""A discrete-event simulator of DigenRL steps (docs/DESIGN.md, the simulator): a topology, a mode and per-action
costs in, the step makespans, the bubble fraction and the same Chrome trace the runtime writes out
(pid = rank, cat in generate/optimizer/train/comm/publish, args step and fragment).

Ranks follow the runtime's topology: replica r is ranks [r*S, (r+1)*S) (S = stages_per_replica),
the trainers come next; colocated runs have one rank per replica, each also a trainer.

The model (each choice is the simplest that keeps the mechanisms' effects):
- A replica generates one fragment at a time (generation, decode and score as one action of
  `Costs.replica_fragment_s[r]`; a replica of S stages is one resource whose fragment time already
  includes the pipeline's fill and drain, and its span is drawn on each of its S ranks). A replica
  of S stages whose fragments have fewer than S micro-batches pipelines `wave` fragments together,
  as the runtime's GAP schedule keeps S micro-batches in flight: they land together at the wave's
  end. Sends are asynchronous: a fragment lands at every trainer `transfer_s` after its generation
  ends, and the replica goes on at once.
- Who generates what: `gap`, `disagg` and `colocated` use the static plan the runtime uses,
  `plan.assign_fragments` with `plan_speeds` (default equal speeds, as the runtime plans today);
  `tag` (and `tcss` with a tag policy) claim dynamically: every idle replica, in replica order,
  claims the lowest unclaimed fragment of its step, as the runtime's atomic counter hands them out.
- Training: each trainer trains its shares of the landed fragments one at a time, in arrival order
  (ties: lower fragment). With TSP (`chunks_per_fragment` None) every trainer takes a share of
  `train_fragment_s` of every fragment. Without TSP a fragment is `k` chunks of
  `train_fragment_s * M / k` each, and chunk c of the step goes to trainer c mod M (round-robin in
  step order, as `plan.plan_step` places them). Trainers do not wait on each other inside a
  fragment (the FSDP collectives of a forward are not modelled).
- The optimizer update (`update_s`) starts when every trainer has trained its last share: the sync
  point of all trainers. Publication (`publish_s`) follows on the trainers; on-policy generators
  wait for it, so it is drawn on them too. Then the trainers spend `trainer_tail_s` (checkpoint,
  logging) before their next step's work; the generators go on. The step ends when the publication ends (colocated: when
  the update ends; it has no transfer and no publication).
- `naive` disagg: each replica generates its whole share of the batch (the fragments the static
  plan gives it) as one fragment, and trainers train it once it lands.
- TAG: a trainer opens an idle window whenever it is free and has no landed share to train (at the
  start of a step, or after its last ready share) while fragments of its step are unclaimed. In
  each window the tag policy is asked once whether to claim the lowest unclaimed fragment; a
  claimed fragment takes `trainer_fragment_s` on that trainer and then lands like any other (also
  at that trainer only after `transfer_s`). At one instant, replicas claim before trainers.
- TCSS: a replica may start step k+1 (with version k) as soon as it has no work left in step k,
  but never step k+2 before version k+1 is published (staleness <= 1). Trainers train step k+1
  only after step k's publication.

Times are seconds from the start of the run (the first step starts at 0).
"""
from __future__ import annotations

from parallel.stepplan import assign_fragments
from parallel import bts
from parallel.event_engine import Costs, Policy, SimResult, StepState, _colocated, _Engine, predict_makespan

MODES = ("colocated", "disagg", "gap", "tag", "tcss")
TAG_POLICIES = ("never", "always", "bts")

__all__ = ["MODES", "TAG_POLICIES", "Costs", "Policy", "SimResult", "StepState", "predict_makespan", "simulate_run",
           "simulate_step"]


def simulate_step(mode: str, num_fragments: int, costs: Costs, num_trainers: int,
                  tag_policy: str | Policy | None = None, *, stages_per_replica: int = 1,
                  plan_speeds: list[float] | None = None, owners: list[int] | None = None) -> SimResult:
    """One step; see `simulate_run`."""
    return simulate_run(mode, 1, num_fragments, costs, num_trainers, tag_policy,
                        stages_per_replica=stages_per_replica, plan_speeds=plan_speeds, owners=owners)


def simulate_run(mode: str, num_steps: int, num_fragments: int, costs: Costs, num_trainers: int,
                 tag_policy: str | Policy | None = None, *, stages_per_replica: int = 1,
                 plan_speeds: list[float] | None = None, owners: list[int] | None = None,
                 wave: int = 1) -> SimResult:
    """`num_steps` steps of `num_fragments` fragments each (mode "disagg" merges each replica's
    fragments into one, numbered in replica order). `tag_policy` turns TAG on: "never" (replicas
    claim dynamically, trainers never), "always", "bts" (`bts.decide`) or a callable(state, costs,
    num_trainers) -> bool or Decision; the default of mode "tag" is "bts", mode "tcss" takes one
    optionally, the other modes none. `plan_speeds`: the replica speeds given to the static plan
    (default equal, as the runtime plans). `owners`: the static plan itself, fragment -> replica
    (the runtime's `plan.plan_step` for fragments of different shapes, whose per-fragment times
    are `costs.gen_scale` etc.); it replaces `plan_speeds`. `wave`: fragments a replica of several
    stages pipelines together (`SimSetup.gen_wave`; each takes its `replica_fragment_s`, and they
    land together)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {list(MODES)}")
    if num_steps < 1 or num_fragments < 1 or num_trainers < 1 or stages_per_replica < 1 or wave < 1:
        raise ValueError(f"need >= 1 step, fragment, trainer, stage and fragment per wave: got {num_steps}, "
                         f"{num_fragments}, {num_trainers}, {stages_per_replica}, {wave}")
    if mode == "tag" and tag_policy is None:
        tag_policy = "bts"
    if tag_policy is not None and mode not in ("tag", "tcss"):
        raise ValueError(f"a tag policy needs mode 'tag' or 'tcss', got mode {mode!r}")
    if isinstance(tag_policy, str) and tag_policy not in TAG_POLICIES:
        raise ValueError(f"unknown tag policy {tag_policy!r}; known: {list(TAG_POLICIES)}")
    if plan_speeds is not None and len(plan_speeds) != costs.num_replicas:
        raise ValueError(f"plan_speeds has {len(plan_speeds)} entries for {costs.num_replicas} replica(s)")
    for name in ("gen_scale", "train_scale", "transfer_scale"):
        if getattr(costs, name) is not None and len(getattr(costs, name)) != num_fragments:
            raise ValueError(f"costs.{name} has {len(getattr(costs, name))} entries for {num_fragments} fragment(s)")
    if owners is None:
        owners = assign_fragments(num_fragments, plan_speeds or [1.0] * costs.num_replicas)
    elif len(owners) != num_fragments or not all(0 <= r < costs.num_replicas for r in owners):
        raise ValueError(f"owners {owners} must name a replica of {costs.num_replicas} for each of "
                         f"{num_fragments} fragment(s)")
    if mode == "colocated":
        if stages_per_replica != 1:
            raise ValueError(f"colocated ranks each hold the whole model: stages_per_replica must be 1, "
                             f"got {stages_per_replica}")
        return _colocated(num_steps, owners, costs, num_trainers)
    units, weights = [1] * num_fragments, None
    if mode == "disagg":  # one fragment per replica holding its whole share
        mine = [[f for f in range(num_fragments) if owners[f] == r] for r in range(costs.num_replicas)]
        owners = [r for r in range(costs.num_replicas) if mine[r]]
        units = [len(mine[r]) for r in owners]
        weights = [(sum(costs.scale("gen_scale", f) for f in mine[r]), sum(costs.scale("train_scale", f) for f in mine[r]),
                    sum(costs.scale("transfer_scale", f) for f in mine[r]) / len(mine[r])) for r in owners]
    dynamic = tag_policy is not None
    engine = _Engine(costs, num_trainers, num_steps, units, None if dynamic else owners,
                     policy=_resolve(tag_policy, mode == "tcss"), tcss=mode == "tcss", stages=stages_per_replica,
                     record=True,
                     weights=weights, wave=wave)
    engine.run()
    return engine.result()


def _resolve(policy: str | Policy | None, tcss: bool = False) -> Policy | None:
    if policy is None or policy == "never":
        return None
    if policy == "always":
        return lambda state, costs, num_trainers: True
    if policy == "bts":  # under TCSS, BTS judges a claim by the end of the next step, as the runtime's does
        return (lambda state, costs, num_trainers: bts.decide(state, costs, num_trainers, tcss=True)) if tcss \
            else bts.decide
    return policy
