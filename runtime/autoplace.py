"""--placement auto (docs/placement.md): the run chooses its placement for the machine it is on, and
checks the choice against measured steps.

At start-up every rank loads the whole model (as a colocated rank holds it) and measures one chunk's
generation (encoding, K denoising steps, decoding, scoring) and a training forward and backward at
the run's shapes and at a quarter of its transitions (a forward's fixed cost apart from theirs);
rank 0 measures the link to every other rank (runtime/probe.py). The planner (planner/candidates.py)
ranks every placement this world size allows from those numbers, the run's
memory budget refusing what does not fit (runtime/budget.py; on a GPU without --memory-budget-gb,
the device's memory), and the run builds the fastest.

Every placement trains the same weights, so the choice can be checked by running: the placements
predicted within --placement-margin of the best (up to --placement-trials of them) each run
--placement-trial-steps steps, the runner-ups first and the predicted best last. A trial's steps
after its first are measured (a step's period; in trials of one step, that step from its own start,
so that the switch before it does not count), and the run keeps the placement of the fastest median
unless what it saves over the steps left is less than a switch costs (`decide`). Where the ranks
time-share a CPU's cores, which the prediction does not model, the best placement of the other
family (colocated against disaggregated) is tried too, whatever its prediction, and a
disaggregated one last. A switch
between two steps saves the run state, tears the roles down and builds the next placement from that
checkpoint, in this process: the state an exact resume restores, so the weights after N steps are a
fixed placement's; a placement built again (the switch back to the fastest) keeps the speeds its
ranks measured the first time. Every decision and switch is said on rank 0 and written into
config.json's run record ("placement").
"""
from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist

from checkpointing import checkpoint
from checkpointing import folder
from config.schema import RunConfig
from config.validate import RunFacts, probe_config, tail_assist_refusal, with_placement
from models import autocast, resolve_dtype
from parallel import store_keys as keys
from parallel.topology import ProcessGroups, Topology
from parallel.trainer_intake import TrainingSpec
from planner import candidates as planner
from runtime import budget, guard, probe
from runtime.build import Rank, build
from runtime.context import make_context


def measure(cfg: RunConfig, facts: RunFacts, rank: int) -> tuple[planner.Machine, planner.Workload, object]:
    """The start-up probe on every rank (sync points: the conditioning, the link, the sharded
    forwards, the gather): (the machine, the run's workload, this rank's probe context, whose
    model, sharded by then, the planner's memory check reads)."""
    pcfg = probe_config(cfg)
    ctx, _ = make_context(pcfg, facts, rank, ProcessGroups(trainers=dist.group.WORLD))
    s, a = ctx.sampling, ctx.adapter
    rows = facts.train_micro_batch if facts.tsp else cfg.rl.micro_batch
    amp = lambda: autocast(ctx.device, cfg.model.dtype)  # noqa: E731
    cond = a.encode_prompts([""] * rows)
    few = max(1, rows // 4)  # a second size: a forward's fixed cost apart from its transitions'

    def speeds(chunks: int, repeats: int) -> dict[str, float]:
        """One pass: a chunk (the fastest of `chunks`), a denoising forward and training forwards of
        `rows` and `few` rows (each the fastest of `repeats`)."""
        out = dict(zip(("chunk_s", "sample_bytes"), probe.probe_generation(ctx, chunks)))
        out.update(probe.probe_speed(a, s, rows, ctx.slowdown, amp, cond=cond, repeats=repeats))
        if few < rows:
            out["few_s"] = probe.probe_speed(a, s, few, ctx.slowdown, amp, generation=False, repeats=repeats)["train_s"]
        return out

    # Twice, the link's measurement between, each quantity the fastest of both passes: another
    # process busy on one rank's core for a second of the probe must not make that rank look slow
    # (one rank measured 1.3x slower in a single pass, and auto ranked a split first where the
    # colocated placement was the fastest).
    first = speeds(2, 3)  # the first of each pays one-off costs
    link, latency = probe.probe_link(rank, facts.topology.world_size, ctx.device)  # sync point
    again = speeds(1, 1)
    best = {k: min(first[k], again[k]) for k in first}  # (the bytes are the same in both)
    chunk_s, sample_bytes = best["chunk_s"], best["sample_bytes"]
    whole = {k: best[k] for k in ("generate_s", "train_s")}
    forward_s, row_s = probe.forward_and_row_s(rows, best["train_s"], few, best.get("few_s"))
    row_s *= 2 if s.cfg_scale != 1.0 else 1  # with CFG a transition trains both branches
    workload = _workload(cfg, facts, ctx, sample_bytes)  # the model's sizes, read before it is sharded
    compute, weights = resolve_dtype(cfg.model.dtype, ctx.device), next(a.transformer.parameters()).dtype
    sharded = probe.probe_sharding(a, s, rows, ctx.slowdown, amp, cond,  # sync points: every forward gathers
                                   compute if compute != weights else None)
    everyone = [None] * facts.topology.world_size
    dist.all_gather_object(everyone, (chunk_s, row_s, sample_bytes, whole, sharded, forward_s))  # sync point
    # In lockstep every sharded forward takes the slowest rank's time: what sharding adds is the
    # slowest sharded forward over the slowest whole one (docs/placement.md, the probe).
    added = {k: max(0.0, max(e[4][k] for e in everyone) - max(e[3][k] for e in everyone))
             for k in ("generate_s", "train_s")}
    machine = planner.Machine([e[0] for e in everyone], [e[1] for e in everyone], link, latency,
                              gather_s=added["generate_s"], train_gather_s=added["train_s"],
                              forward_s=[e[5] for e in everyone])
    return machine, dataclasses.replace(workload, sample_bytes=max(e[2] for e in everyone)), ctx


def _workload(cfg: RunConfig, facts: RunFacts, ctx, sample_bytes: float) -> planner.Workload:
    """The run's step in the sizes the planner's costs follow from."""
    rl, a = cfg.rl, ctx.adapter
    spec = TrainingSpec.of(cfg, ctx.sampling)
    trained = sum(len(spec.timesteps(0, i)) for i in range(rl.group_size)) / rl.group_size
    compute = resolve_dtype(cfg.model.dtype, ctx.device).itemsize
    params = dict(a.transformer.named_parameters())
    trained_numel = sum(p.numel() for n, p in params.items() if ".lora_" in n) if facts.lora else \
        sum(p.numel() for p in params.values())
    weights = sum(p.numel() * p.element_size() for p in params.values())
    return planner.Workload(rl.prompts_per_step, rl.group_size, rl.micro_batch, facts.num_prompts, cfg.seed,
                            cfg.topology.fragment_groups or None, ctx.sampling.num_steps, trained, sample_bytes,
                            trained_numel * compute, trained_numel * 4, weights, facts.tsp,
                            facts.train_micro_batch if facts.tsp else rl.micro_batch, len(a.blocks),
                            len(budget.fsdp_units(a.transformer)))


def placed(cfg: RunConfig, p: planner.Placement) -> RunConfig:
    """The run's config with placement `p`'s flags (--placement stays auto)."""
    out = dataclasses.replace(cfg, topology=dataclasses.replace(cfg.topology))
    t = out.topology
    t.mode, t.generators, t.trainers, t.scorers, t.gap_stages = p.mode, p.generators, p.trainers, 0, p.gap_stages
    t.tag, t.tcss, t.tail_assist = p.tag, p.tcss, p.tail_assist
    if p.mode == "colocated":
        t.colocated_sharding = p.sharding
    else:
        t.train_sharding = p.sharding
    t.fragment_split = p.fragment_split if p.fragment_split != "auto" else cfg.topology.fragment_split
    return out


def refusal(cfg: RunConfig, facts: RunFacts, adapter, p: planner.Placement) -> str | None:
    """Why placement `p` cannot run (its memory over the budget; on a GPU without
    --memory-budget-gb, over the device's memory), or None."""
    c = placed(cfg, p)
    if c.topology.memory_budget_gb is None and adapter.device.type == "cuda":
        c.topology.memory_budget_gb = torch.cuda.get_device_properties(adapter.device).total_memory / 1e9
    try:
        budget.check_budget(c, with_placement(c, facts), adapter)
    except ValueError as e:
        return f"{p.label()}: {e}"
    return None


def trial_order(ranked: list[dict], max_trials: int, margin: float, families: bool = False) -> list[int]:
    """Which of the `ranked` placements (best predicted first) to try, in the order tried: the
    runner-ups first, the predicted best (0) last (the last tried is kept without a switch back
    when it measures fastest); [] for no trials. Those predicted within `margin` of the best,
    `max_trials` in all (the best included), the best of the other family (colocated against
    disaggregated) among them if it is within the margin, unless `families`. `families`: the
    prediction cannot rank a colocated placement against a disaggregated one on this machine
    (`unmodeled`): there a split runs faster than predicted (the cores of its idle ranks go to the
    busy ones), while a colocated placement keeps every rank busy, as the probe did, and runs as
    predicted or slower. So against a colocated best the best split is tried too, whatever its
    prediction, before any other runner-up, and last (the last tried is kept without a switch
    back); against a split predicted best a colocated placement can only lose, and is tried only
    within the margin."""
    best = ranked[0]["predicted_step_s"]
    if best is None or max_trials < 2:
        return []
    near = [i for i in range(1, len(ranked)) if ranked[i]["predicted_step_s"] <= best * (1 + margin)]
    # The other family's best comes first: within the margin, because one family's placements share
    # most of their phases and their predictions err alike, more than a colocated and a split one
    # do (docs/placement.md: trials), so one trial of each checks more than two of one family; where
    # ranks share cores (`families`), the best split against a colocated best, whatever its prediction.
    colocated = lambda i: ranked[i]["placement"]["mode"] == "colocated"  # noqa: E731
    pool = (range(1, len(ranked)) if colocated(0) else ()) if families else near
    other = next((i for i in pool if colocated(i) != colocated(0)), None)
    if other is not None:
        near = [other, *[i for i in near if i != other]]
    near = sorted(near[:max_trials - 1])
    order = [*reversed(near), 0] if near else []
    if families and other is not None:
        order = [i for i in order if i != other] + [other]
    return order


def shared_cores(device: torch.device, local_ranks: int) -> str | None:
    """Why the prediction cannot rank colocated against disaggregated placements here, or None: on a
    CPU whose ranks time-share its cores, a colocated placement keeps every rank busy at once while a
    split leaves ranks idle whose cores the busy ones then use, and the step simulator gives each
    rank a device of its own."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = torch.get_num_threads()
    if device.type != "cpu" or local_ranks * threads <= cores:
        return None
    return f"{local_ranks} ranks of {threads} thread{'s' * (threads > 1)} time-share {cores} cores"


class AutoPlacement:
    """--placement auto's state: the ranked placements, the trials, what each measured."""

    def __init__(self, cfg: RunConfig, facts: RunFacts, ranked: list[dict], refused: list[str], machine: dict,
                 unmodeled: str | None, first_step: int):
        t = cfg.topology
        self.cfg, self.facts, self.ranked, self.refused, self.machine = cfg, facts, ranked, refused, machine
        self.unmodeled = unmodeled
        room = cfg.rl.steps - first_step - 1  # the trials must leave a step to run the one kept
        self.trials = trial_order(ranked, min(t.placement_trials, room // t.placement_trial_steps),
                                  t.placement_margin, unmodeled is not None)
        self.tried = list(self.trials)  # the trials planned (self.trials empties once decided)
        self.current = self.trials[0] if self.trials else 0
        self.steps_in, self.measured, self.switches = 0, {}, []  # measured: each trial's steps (seconds)
        self.decision: dict | None = None  # after the trials: the fastest, what it would save, a switch's cost
        self.speeds: dict[int, list] = {}  # each placement's speed probes, once built (a switch back reuses them)

    def placement(self, i: int | None = None) -> planner.Placement:
        return planner.Placement(**self.ranked[self.current if i is None else i]["placement"])

    def config(self, i: int | None = None) -> tuple[RunConfig, RunFacts]:
        cfg = placed(self.cfg, self.placement(i))
        return cfg, with_placement(cfg, self.facts)

    def record(self) -> dict:
        """What config.json's run record says of the choice."""
        def show(i):
            return {k: v for k, v in self.ranked[i].items() if k != "placement"}
        return {"mode": "auto", "chosen": show(0), "runner_up": show(1) if len(self.ranked) > 1 else None,
                "running": show(self.current), "ranked": [show(i) for i in range(len(self.ranked))],
                "refused": self.refused, "probe": self.machine, "unmodeled": self.unmodeled,
                "trials": [show(i) for i in self.tried],
                "measured_step_s": self._measured_by_label(),
                "trial_steps_s": {self.ranked[i]["label"]: s for i, s in self.measured.items()},
                "decision": self.decision, "switches": self.switches}

    def after_step(self, r: Rank, step: int) -> Rank:
        """At the end of a trial: the next trial's placement, or after the last the one `decide` keeps
        (rank waits: every rank reads the logging rank's decision). Returns the rank to go on with."""
        if not self.trials:
            return r
        self.steps_in += 1
        steps = self.cfg.topology.placement_trial_steps
        if r.log.logging and (self.steps_in > 1 or steps == 1):
            # The loop's period; a placement's first step (measured only in trials of one step)
            # counts from its own start, not the switch before it.
            first = self.steps_in == 1
            self.measured.setdefault(self.current, []).append(
                r.log.last_span_s if first else r.log.last_scalars["perf/step_s"])
        if r.log.logging and self.steps_in == 1 and self.switches and self.switches[-1]["after_step"] == step - 1:
            # the period of the step after a switch: the switch, then the step (its warm-up included)
            self.switches[-1]["first_step_s"] = r.log.last_scalars["perf/step_s"]
        if self.steps_in < steps:
            return r
        key = keys.placement_decision(step)
        if r.log.logging:
            into = self.switches[-1] if self.switches and self.switches[-1]["after_step"] == step - steps else None
            if into is not None and "first_step_s" in into:  # what the switch into this trial cost
                into["cost_s"] = max(0.0, into["first_step_s"] - _estimate(self.measured[self.current]))
            k = self.trials.index(self.current)
            if k + 1 < len(self.trials):
                nxt, why = self.trials[k + 1], None
            else:
                nxt, why = decide(self.measured, self.current, self.cfg.rl.steps - step - 1,
                                  [s.get("cost_s", s["switch_s"]) for s in self.switches])
            if r.guard.stopping:  # a signal: the run stops before the next step, in this placement
                nxt = self.current
            r.store.put(key, {"next": nxt, "measured": self.measured, "why": why,  # every rank follows this one
                              "switches": self.switches})
        if r.versions is not None:
            # A generator first takes this step's publication: the trainers (the logging rank among
            # them) finish their step only once it is received (a send completes at its receive).
            r.versions.take_publication(step + 1, step + 1)
        decision = r.store.get(key)  # rank wait: the logging rank measured the trial's last step
        self.measured = {int(i): s for i, s in decision["measured"].items()}
        self.switches = decision["switches"]  # the record holds what decided: the logging rank's times
        nxt, last = decision["next"], self.trials.index(self.current) == len(self.trials) - 1
        if decision["why"] is not None:
            self.decision = {**decision["why"], "kept": self.ranked[nxt]["label"],
                             "fastest": self.ranked[decision["why"]["fastest"]]["label"]}
        if last or nxt == self.current:
            self.trials = []  # decided (or stopping): no more trials
        if nxt == self.current:
            _say(r, f"placement: keeping {self.ranked[nxt]['label']} ({self._times()}{self._why()})")
            _write_record(r, self.record())
            return r
        return self._switch(r, nxt, step + 1)

    def _times(self) -> str:
        return "; ".join(f"{self.ranked[i]['label']} measured {_estimate(s):.3g} s/step"
                         f"{f' (median of {len(s)})' if len(s) > 1 else ''}" for i, s in self.measured.items())

    def _why(self) -> str:
        d = self.decision
        if d is None or d["fastest"] == d["kept"]:
            return ""
        return (f"; {d['fastest']} would save {d['gain_s']:.3g} s over the {d['remaining_steps']} steps left, "
                f"less than a switch, {d['switch_s']:.3g} s")

    def _switch(self, r: Rank, nxt: int, done: int) -> Rank:
        self.speeds[self.current] = r.speeds
        frm, self.current, self.steps_in, probed = self.current, nxt, 0, nxt not in self.speeds
        _say(r, f"placement: switching after step {done - 1} from {self.ranked[frm]['label']} to "
                f"{self.ranked[nxt]['label']} (predicted {self.ranked[nxt]['predicted_step_s']:.3g} s/step; "
                f"{self._times()})")
        start = time.perf_counter()
        cfg, facts = self.config()
        new = switch(r, cfg, facts, done, self.record(), self.speeds.get(nxt))
        self.switches.append({"after_step": done - 1, "from": self.ranked[frm]["label"],
                              "to": self.ranked[nxt]["label"], "measured_step_s": self._measured_by_label(),
                              "switch_s": time.perf_counter() - start, "probed": probed})
        _write_record(new, self.record())
        return new

    def _measured_by_label(self) -> dict:
        return {self.ranked[i]["label"]: _estimate(s) for i, s in self.measured.items()}


def _estimate(steps: list[float]) -> float:
    """A trial's step time: the median of its measured steps."""
    return statistics.median(steps)


def decide(measured: dict[int, list[float]], current: int, remaining: int, switches_s: list[float]) -> tuple[int, dict]:
    """After the last trial: the placement to run the `remaining` steps in (an index of `measured`,
    each placement's measured trial steps) and why. The fastest measured (median step), unless it
    is not `current` and what it saves over the remaining steps is less than a switch costs (the
    mean of the run's switches so far, `switches_s`: each the period of the step after the switch
    over its placement's median step, so a checkpoint, a teardown, a build and the first step's
    excess over a steady one, its warm-up and under TCSS the overlap it refills): then the run
    stays where it is."""
    fastest = min(measured, key=lambda i: _estimate(measured[i]))
    gain = (_estimate(measured[current]) - _estimate(measured[fastest])) * remaining
    switch = statistics.fmean(switches_s) if switches_s else 0.0
    keep = fastest if fastest == current or gain > switch else current
    return keep, {"fastest": fastest, "gain_s": gain, "switch_s": switch, "remaining_steps": remaining}


def start(cfg: RunConfig, facts: RunFacts, rank: int) -> AutoPlacement:
    """Measure the machine, rank the placements, choose (a collective: every rank calls it, and
    every rank gets rank 0's ranking)."""
    world = facts.topology.world_size
    allow_stale = cfg.topology.placement_stale
    machine = workload = ctx = None
    if world > 1:
        machine, workload, ctx = measure(cfg, facts, rank)
    out = [None]
    if rank == 0:
        split = placed(cfg, planner.Placement("disagg", 1, world - 1)) if world > 1 else None
        assist = split is not None and tail_assist_refusal(split, Topology.build(world, "disagg", 1, world - 1)) is None
        options = planner.candidates(world, machine, allow_stale=allow_stale,
                                     blocks=workload.blocks if workload else 1, tail_assist=assist)
        verdicts = [(p, refusal(cfg, facts, ctx.adapter, p) if ctx is not None else None) for p in options]
        fits, refused = [p for p, why in verdicts if why is None], [why for _, why in verdicts if why]
        preds = planner.rank(fits, workload, machine) if machine else [planner.Prediction(fits[0], None)]
        if not preds:
            raise ValueError(f"--placement auto: no placement fits: {'; '.join(refused)}")
        ranked = [{**p.to_dict(), "placement": dataclasses.asdict(p.placement)} for p in preds]
        shared = shared_cores(ctx.adapter.device, int(os.environ.get("LOCAL_WORLD_SIZE", world))) if ctx else None
        out = [(ranked, refused, dataclasses.asdict(machine) if machine else None, shared)]
    dist.broadcast_object_list(out, src=0)  # sync point: rank 0's ranking, the same on every rank
    del ctx
    _free()
    auto = AutoPlacement(cfg, facts, *out[0], first_step=facts.resume.step if facts.resume else 0)
    if rank == 0:
        guard.say(_choice_line(auto))
    return auto


def _choice_line(auto: AutoPlacement) -> str:
    """The run's first line: what it runs and why."""
    best, ranked = auto.ranked[0], auto.ranked
    if best["predicted_step_s"] is None:
        return f"placement: {best['label']} (one rank: the only placement)"
    others = ", ".join(f"{x['label']} {x['predicted_step_s']:.3g}" for x in ranked[1:4])
    line = (f"placement: {best['label']}, the fastest of {len(ranked)} placements for this machine "
            f"(predicted {best['predicted_step_s']:.3g} s/step; then {others} s/step")
    line += f"; {len(auto.refused)} refused by memory)" if auto.refused else ")"
    if auto.trials:
        line += (f"; trying {', '.join(ranked[i]['label'] for i in auto.trials)} for "
                 f"{auto.cfg.topology.placement_trial_steps} steps each first")
        if auto.unmodeled:
            line += f" ({auto.unmodeled}, which the prediction does not model)"
    return line


def switch(r: Rank, cfg: RunConfig, facts: RunFacts, done: int, record: dict, speeds: list | None = None) -> Rank:
    """Rebuild rank `r` as placement (cfg, facts) after `done` steps, from the run's own state: the
    trainers checkpoint it (unless step `done` saved it), the placement's traffic settles, and the
    new roles resume from that checkpoint as an exact resume does. `speeds`: the placement's speed
    probes if the run built it before (its ranks hold the same roles; not measured again). A
    collective."""
    if r.saved != done:
        r.save(done)  # every trainer writes its shards (a collective over the trainers)
    r.settle(done)
    if r.log.logging:  # the next step's period counts from this one's end, across the switch
        r.store.put(keys.previous_end(done), r.log.previous_end)
    dist.barrier()  # sync point: this placement's traffic is over and its checkpoint written
    path = checkpoint.checkpoint_dir(r.cfg.output.output_dir, done)
    point = folder.ResumePoint(path, done, (), True, {}, os.path.isfile(os.path.join(path, checkpoint.STALE_FILE)),
                               {})
    r.release()
    _free()
    new = build(cfg, dataclasses.replace(facts, resume=point), r.ctx.rank, previous=r, placement=record,
                speeds=speeds)
    if new.log.logging:
        new.log.previous_end = new.store.get(keys.previous_end(done))
    return new


def _free() -> None:
    """Drop what a released model or probe left (host and device memory) before the next loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _say(r: Rank, line: str) -> None:
    """Said by the logging rank: its progress bar is the one drawn, and tqdm moves only its own."""
    if r.log.logging:
        guard.say(line)


def _write_record(r: Rank, record: dict) -> None:
    """config.json's run record with the placement's record, on every rank's Rank (rank 0 writes)."""
    r.run = {**r.run, "placement": record}
    if r.ctx.rank == 0:
        r.cfg.save(os.path.join(r.cfg.output.output_dir, "config.json"), r.run)


__all__ = ["AutoPlacement", "decide", "measure", "placed", "refusal", "start", "switch"]
