"""Out-of-sample prediction of measured runs (docs/calibration.md, "Validation on measured runs").

Per-unit costs are fitted on ONE run folder (a `lab/bench.py` mode, or any training run with
traces) and then predict runs of other modes and topologies from their config.json alone:

- a generation forward of a micro-batch of b samples: s_gen x f_fwd(b), and a training forward of
  m transitions: s_train x f_train(m). The shapes f are straight lines fitted to a device profile
  of `lab/calibrate.py` (per forward, per sample); the run scales them (its per-forward
  seconds at its own micro-batch over the profile's), so contention and load at run time are in
  the scale, and the profile only says how cost grows with the batch;
- per fragment transferred, per optimizer update; publication as the trainers' send per generator
  rank plus the generators' install; the trainers' tail after publishing (checkpoint save,
  logging; the generators do not wait for it); and a fixed per-step overhead (what the run's
  measured period has beyond the simulated one).

The target's costs follow from its topology: fragment size and micro-batch, GAP stages (the
runtime's block partition over the profile's per-block costs and its schedule, whose waves of
fragments land together), TSP packing (parallel/tsp.py), trainer and replica counts; the
simulator runs its mode. Runs with more ranks than CPU cores time-share the cores: processor
sharing stretches their compute by the overlap the simulation itself shows (contention, not
parallel speed-up). The profile must time the run's kind of training (LoRA or full).
"""
from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from types import SimpleNamespace

from parallel.stepplan import plan_step
from parallel.trainer_intake import TrainingSpec
from rl import algorithms
from rl.sampler import SamplingConfig
from parallel.schedule import makespan_slots, partition_blocks
from parallel.tsp import pack
from lab.planning import costs as cm
from parallel.event_engine import Costs
from lab.planning.profile import DeviceProfile
from planner.simulator import simulate_run


@dataclass(frozen=True)
class UnitCosts:
    gen_scale: float
    """run seconds per profile second of a generation forward (decode and scoring folded in)"""
    train_scale: float
    """run seconds per profile second of a training forward + backward"""
    transfer_s: float
    update_s: float
    send_per_rank_s: float
    """the trainers' publication, per generator rank it goes to (sent to one rank after another)"""
    install_s: float
    """from the last send until the generators start the next step (they install at once)"""
    trainer_tail_s: float
    """trainer time after publishing before the next step's work (checkpoint save, logging)"""
    step_overhead_s: float
    cores: float
    """effective CPU cores under processor sharing (inf: no sharing, e.g. GPUs)"""
    fit_world: int
    source: str


def _trained(config: dict, num_steps: int) -> int:
    """The transitions a sample of the run trains at its first step, as its algorithm chooses them
    (rl/algorithms/: its sampler's window, its timesteps)."""
    s, rl = config["sampling"], config["rl"]
    rl = {"updates_per_rollout": 1, "update_split": "samples", **rl}  # a record older than the flags
    window = tuple(s["sde_window"]) if s.get("sde_window") else None
    flags = SimpleNamespace(sampling=SimpleNamespace(**{**s, "sde_window": window}), rl=SimpleNamespace(**rl),
                            seed=config.get("seed", 0))
    algorithm = algorithms.algorithm(rl.get("algorithm", algorithms.DEFAULT))
    sampling = algorithm.sampling(flags, SamplingConfig(16, 16, num_steps, sde_window=window))
    return len(TrainingSpec.of(flags, sampling).timesteps(0, 0))


def _run_shape(config: dict) -> dict:
    s, rl, t = config["sampling"], config["rl"], config["topology"]
    k = s["sample_steps"]
    return {"K": k, "trained": _trained(config, k), "group": rl["group_size"], "micro": rl["micro_batch"],
            "tsp": bool(t.get("tsp")), "train_micro": t.get("train_micro_batch") or rl["micro_batch"],
            "groups": rl["prompts_per_step"]}


def _fragment_samples(config: dict, world: int) -> list[int]:
    setup = cm.sim_setup(config, world)
    t, rl = config["topology"], config["rl"]
    plan = plan_step(0, seed=0, num_prompts=rl["prompts_per_step"], prompts_per_step=rl["prompts_per_step"],
                     group_size=rl["group_size"], micro_batch=rl["micro_batch"], num_replicas=setup.num_replicas,
                     num_trainers=setup.num_trainers, fragment_groups=t.get("fragment_groups") or None,
                     colocated=setup.mode == "colocated")
    return [len(f.sample_ids) for f in plan.fragments]


def _gen_profile_s(profile: DeviceProfile, shape: dict, samples: int, stages: int, wave: int = 1) -> float:
    """Profile seconds per fragment of `samples` samples on a replica of `stages`, which pipelines
    `wave` fragments together (the runtime's GAP schedule over all their micro-batches)."""
    sizes = [min(shape["micro"], samples - i) for i in range(0, samples, shape["micro"])]
    if stages == 1:
        return shape["K"] * sum(profile.forward_s(b) for b in sizes)
    b = max(sizes)
    blocks = profile.block_forward_s(b)
    ranges = partition_blocks(blocks, [1.0] * stages)
    slot = max(sum(blocks[a:z]) for a, z in ranges) + profile.outside_s(b) / 2
    return makespan_slots(stages, len(sizes) * wave, shape["K"]) * slot / wave


def _train_profile_s(profile: DeviceProfile, shape: dict, samples: int, trainers: int) -> float:
    """Profile seconds of one fragment's training, as the simulator counts it (per trainer: TSP
    wall time; without TSP the mean over trainers of the fragment's chunk work)."""
    if shape["tsp"]:
        transitions = [(i, t) for i in range(samples) for t in range(shape["trained"])]
        packing = pack([transitions], micro_batch=shape["train_micro"], num_trainers=trainers)
        per = [0.0] * trainers
        for mb in packing.micro_batches:
            per[mb.trainer] += profile.train_s(len(mb.transitions))
        return max(per)
    sizes = [min(shape["micro"], samples - i) for i in range(0, samples, shape["micro"])]
    return sum(shape["trained"] * profile.train_s(b) for b in sizes) / trainers



COMPUTE_CATS = ("generate", "train")


def stretch(span: tuple[float, float], busy: list[tuple[float, float, int]], cores: float) -> float:
    """Mean slow-down of a span under processor sharing: while k compute spans (its own included)
    run at once on `cores` effective cores, each progresses at min(1, cores / k)."""
    a, b = span
    cuts = sorted({a, b, *(x for s, e, _ in busy for x in (s, e) if a < x < b)})
    total = 0.0
    for lo, hi in zip(cuts, cuts[1:]):
        mid = (lo + hi) / 2
        k = sum(1 for s, e, _ in busy if s <= mid < e)
        total += (hi - lo) * max(1.0, k / cores)
    return total / (b - a) if b > a else 1.0


def _run_spans(run, steps) -> tuple[list, list, list]:
    """Compute spans of a measured run: all of them, and the generation and training ones of `steps`."""
    busy, gen, train = [], [], []
    for s in run.spans:
        if s.cat in COMPUTE_CATS and s.name != "tag_pad":
            busy.append((s.start_s, s.end_s, s.rank))
            if s.step in steps and s.fragment is not None:
                (gen if s.cat == "generate" else train).append(s)
    return busy, gen, train


def fit_cores(run, steps, grid=None) -> float:
    """Effective cores of a run: the processor-sharing C under which its generation spans (and its
    training spans) are most alike once their slow-down is taken out."""
    busy, gen, train = _run_spans(run, steps)
    grid = grid or [0.5 + 0.05 * i for i in range(71)]

    def spread(c):
        out = 0.0
        for spans in (gen, train):
            by_frag = {}
            for sp in spans:
                by_frag.setdefault((sp.step, sp.fragment, sp.rank), []).append((sp.start_s, sp.end_s))
            vals = [sum((e - a) / stretch((a, e), busy, c) for a, e in v) for v in by_frag.values()]
            if len(vals) > 1:
                m = statistics.mean(vals)
                out += statistics.pstdev(vals) / m if m > 0 else 0.0
        return out
    return min(grid, key=spread)


def _sim_stretch(events, cores: float) -> tuple[float, float]:
    """Mean slow-down of the simulated generation and training spans under processor sharing."""
    spans = [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, e["cat"]) for e in events
             if e.get("ph") == "X" and e["cat"] in COMPUTE_CATS]
    busy = [(a, b, 0) for a, b, _ in spans]
    out = []
    for cat in COMPUTE_CATS:
        mine = [(a, b) for a, b, c in spans if c == cat and b > a]
        w = sum(b - a for a, b in mine)
        out.append(sum((b - a) * stretch((a, b), busy, cores) for a, b in mine) / w if w else 1.0)
    return out[0], out[1]


def _publication(run, setup: cm.SimSetup, steps) -> tuple[float, float]:
    """(send, tail): the mean of the trainers' `publish` spans (colocated: 0, nothing is sent), and
    the mean time from the end of a trainer's step (its publication; colocated: its update) to its
    first span of the next step (what the runtime does in between: checkpoint, logging, planning),
    over the steps used that have a next step."""
    trainers = setup.topology.trainer_ranks
    colocated = setup.mode == "colocated"
    sends, tails = [], []
    for k in sorted(steps):
        pub = [sp for sp in run.of(trainers, step=k) if sp.cat in ("optimizer", "publish")]
        nxt = [sp.start_s for sp in run.of(trainers, step=k + 1) if sp.cat != "eval"]
        if not colocated:
            sends += [sp.end_s - sp.start_s for sp in pub if sp.name == "publish"]
        if pub and nxt:
            tails.append(max(0.0, min(nxt) - max(sp.end_s for sp in pub)))
    return (statistics.mean(sends) if sends else 0.0), (statistics.mean(tails) if tails else 0.0)


def _finetune(config: dict) -> str:
    return "lora" if (config.get("optim") or {}).get("lora_rank", 0) else "full"


def fit_unit_costs(run_dir: str, profile: DeviceProfile, skip: int = 1, cores: float | None = None) -> UnitCosts:
    """Per-unit costs from one run folder (its traces and metrics). `cores`: the effective cores of
    processor sharing (None: fitted on the run itself; float("inf") for GPUs, which do not share)."""
    run = cm.load_run(run_dir)
    setup = cm.sim_setup(run.config, run.world_size)
    if setup.stages_per_replica != 1:
        raise ValueError("fit per-unit costs on a run with one-stage replicas (its fragments time one rank each); "
                         f"{run_dir} is {setup.label}")
    if _finetune(run.config) != profile.finetune.split(":")[0]:
        raise ValueError(f"the profile timed {profile.finetune} training, the run {run_dir} trains "
                         f"{_finetune(run.config)}: measure a profile with lab/calibrate.py "
                         f"{'--lora-rank R' if _finetune(run.config) == 'lora' else 'without --lora-rank'}")
    steps = set(cm.used_steps(run, skip))
    c = fit_cores(run, steps) if cores is None else cores
    busy, gen, train = _run_spans(run, steps)
    shape = _run_shape(run.config)
    n = int(statistics.median(_fragment_samples(run.config, run.world_size)))

    def alone(spans, per):
        frags = {}
        for sp in spans:
            frags.setdefault((sp.step, sp.fragment), 0.0)
            frags[(sp.step, sp.fragment)] += (sp.end_s - sp.start_s) / stretch((sp.start_s, sp.end_s), busy, c)
        return statistics.median(v / per for v in frags.values())
    gen_scale = alone(gen, 1) / _gen_profile_s(profile, shape, n, 1)
    train_scale = alone(train, setup.num_trainers) / _train_profile_s(profile, shape, n, setup.num_trainers)
    measured = cm.measure_costs(run, setup, skip)
    send, tail = _publication(run, setup, steps)
    units = UnitCosts(gen_scale, train_scale, measured.transfer_s, measured.update_s,
                      send / len(setup.topology.generator_ranks), max(0.0, measured.publish_s - send), tail, 0.0, c,
                      run.world_size, os.path.basename(os.path.normpath(run_dir)))
    predicted = simulate_config(run.config, run.world_size, units, profile, len(run.steps), skip)
    overhead = (cm.measured_step_metrics(run, skip)["step_s"] or 0.0) - predicted["step_s"]
    return UnitCosts(**{**units.__dict__, "step_overhead_s": max(0.0, overhead)})


def target_costs(config: dict, world: int, units: UnitCosts, profile: DeviceProfile) -> tuple[cm.SimSetup, Costs]:
    """A run's costs when each action runs alone (no processor sharing)."""
    setup = cm.sim_setup(config, world)
    shape = _run_shape(config)
    n = _fragment_samples(config, world)[0]
    rep = units.gen_scale * _gen_profile_s(profile, shape, n, setup.stages_per_replica, setup.gen_wave)
    train = units.train_scale * _train_profile_s(profile, shape, n, setup.num_trainers)
    colocated = setup.mode == "colocated"
    ranks = len(setup.topology.generator_ranks)
    publish = 0.0 if colocated else units.send_per_rank_s * ranks + units.install_s + units.step_overhead_s
    # colocated: no publication; checkpoint and logging hold every rank
    update = units.update_s + (units.trainer_tail_s + units.step_overhead_s if colocated else 0.0)
    reps = [rep] * setup.num_replicas
    slow = (config.get("output") or {}).get("debug_slow_rank")
    if slow:  # --debug-slow-rank R:FACTOR: the runtime sleeps so that rank R generates FACTOR x slower
        r = setup.topology.replica_of(int(slow[0])) if not colocated else int(slow[0])
        if r is not None and r < len(reps):
            reps[r] *= float(slow[1])
    return setup, Costs(reps, rep, train, transfer_s=0.0 if colocated else units.transfer_s,
                        update_s=update, publish_s=publish, trainer_tail_s=0.0 if colocated else units.trainer_tail_s,
                        chunks_per_fragment=setup.chunks_per_fragment)


def simulate_config(config: dict, world: int, units: UnitCosts, profile: DeviceProfile, num_steps: int,
                    skip: int = 1, iterations: int = 8) -> dict:
    """Simulate a run's config with processor sharing: the costs of its actions are stretched by
    the slow-down the simulated overlap implies, to a fixed point."""
    setup, alone = target_costs(config, world, units, profile)
    fg = ft = 1.0
    for _ in range(iterations if math.isfinite(units.cores) else 1):
        costs = Costs([x * fg for x in alone.replica_fragment_s], alone.trainer_fragment_s * fg,
                      alone.train_fragment_s * ft, alone.transfer_s, alone.update_s, alone.publish_s,
                      alone.chunks_per_fragment, trainer_tail_s=alone.trainer_tail_s)
        result = simulate_run(setup.mode, num_steps, setup.num_fragments, costs, setup.num_trainers,
                              setup.tag_policy, stages_per_replica=setup.stages_per_replica, wave=setup.gen_wave)
        if not math.isfinite(units.cores):
            break
        sg, st = _sim_stretch(result.events, units.cores)
        fg, ft = 0.5 * (fg + sg), 0.5 * (ft + st)
    return cm.predicted_step_metrics(result, setup, costs, skip)


def predict_run(run_dir: str, units: UnitCosts, profile: DeviceProfile, skip: int = 1) -> dict:
    """Predicted against measured step time of a run folder, from its config only."""
    run = cm.load_run(run_dir)
    predicted = simulate_config(run.config, run.world_size, units, profile, max(len(run.steps), 2), skip)
    measured = cm.measured_step_metrics(run, skip)
    err = cm.relative_error(predicted["step_s"], measured["step_s"])
    return {"run": os.path.basename(os.path.normpath(run_dir)), "world_size": run.world_size,
            "mode": cm.sim_setup(run.config, run.world_size).label,
            "predicted_step_s": predicted["step_s"], "measured_step_s": measured["step_s"],
            "rel_error": err, "contention": run.world_size > (os.cpu_count() or 1),
            "in_sample": os.path.basename(os.path.normpath(run_dir)) == units.source}


def predict_ratios(baseline_dir: str, run_dirs: list[str], profile: DeviceProfile, skip: int = 1) -> dict[str, dict]:
    """The planner's throughput ratio of each run over a baseline doing the same work per step
    (a bench scenario): per-unit costs are fitted on the baseline's folder alone, then every run,
    the baseline included, is predicted from its config. run dir -> {predicted_step_s,
    predicted_ratio}; the runs' measurements play no part."""
    units = fit_unit_costs(baseline_dir, profile, skip)
    predicted = {d: predict_run(d, units, profile, skip)["predicted_step_s"] for d in dict.fromkeys([baseline_dir,
                                                                                                     *run_dirs])}
    base = predicted[baseline_dir]
    return {d: {"predicted_step_s": s, "predicted_ratio": base / s if s > 0 else None} for d, s in predicted.items()}


__all__ = ["UnitCosts", "fit_unit_costs", "predict_ratios", "predict_run", "simulate_config", "target_costs"]
