"""The planner (docs/DESIGN.md 9, docs/calibration.md): every feasible plan of a cluster for one
workload, each predicted with the step simulator, ranked, with one recommended.

Plans:
- colocated (ours, built well): replicate (a bf16 rollout copy beside the training state), fsdp
  (generation gathers the shards every forward), sleepwake (rollout copy and training state take
  turns through host memory). Samples are split evenly over the GPUs (in proportion to speed on
  mixed pools) and training transitions are packed (TSP, after an exchange of the trajectories).
  They pay their real costs: gathers, host copies, refreshing the bf16 rollout copy from the
  training shards at the measured staging rate (`systems.sync_s`, ~5.6 GB/s), the memory of text
  encoders, VAE and reward models.
- disaggregated: G generator GPUs as replicas of S GAP stages, T trainer GPUs (FSDP, or HSDP over
  nodes) with TSP micro-batches of m transitions, fragments of F groups; simulator modes gap
  (streaming), tag (TAG with BTS), tcss (one step stale) and naive disagg for reference. With two
  GPU pools, generators go on one and trainers on the other.

The simulator runs the runtime's own policies: parallel/stepplan.py's fragment assignment,
parallel/schedule.py's stage partition and GAP schedule, parallel/tsp.py's packing, BTS.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallel.schedule import fragments_in_flight, makespan_slots, partition_blocks
from parallel.tsp import pack
from planner import phases as ph
from parallel.event_engine import Costs
from planner.hardware import GPU, LINK_LATENCY_S, Sharding, allgather_s, allreduce_s, p2p_bytes_s
from planner.hardware import busbw as hw_busbw
from lab.planning.mixed_shapes import colocated_phases, step_plan
from planner.memory import colocated_memory, generator_memory, max_micro_batch, trainer_memory
from planner.simulator import simulate_run
from planner.specs import block_flops, hidden_bytes, lora_params
from lab.planning.peer_systems import Prediction, Segment, lockstep
from lab.planning.peer_systems import sync_s as staging_s
from planner.workload import Workload, ceil_div

TRAIN_MICROS = (4, 8, 16, 32)
ROLLOUT_MICRO_MAX = 32
FRAGMENT_GROUPS = (1, 2, 4)
MODES = ("gap", "tag", "tcss")


@dataclass(frozen=True)
class Pool:
    gpu: GPU
    count: int


# ---------------------------------------------------------------------------------------------
# Colocated (ours)
# ---------------------------------------------------------------------------------------------

def colocated(wl: Workload, pools: list[Pool], variant: str, dispatch: str = "lpt") -> Prediction:
    """Our colocated mode on every GPU of `pools` (lockstep phases). On mixed pools a phase without
    collectives (replicated rollout, replicated LoRA training) splits its work by GPU speed; a phase
    of FSDP collectives runs every rank in lockstep, so it splits evenly and goes at the slowest GPU.
    A shape mix (`wl.shapes`) is planned by the runtime's dispatch (`dispatch`, lab/planning/mixed_shapes.py)."""
    gpus = [p.gpu for p in pools for _ in range(p.count)]
    n = len(gpus)
    slow = min(gpus, key=lambda g: g.peak_flops)
    speed = sum(g.peak_flops for g in gpus) / (n * slow.peak_flops)  # average speed in units of the slowest
    full = wl.finetune == "full"
    sharded_gen = variant == "fsdp"
    train_shard_on = full or variant != "replicate"
    per_gpu = ceil_div(wl.samples, n if sharded_gen else n * speed)
    trans = ceil_div(wl.transitions, n if train_shard_on else n * speed)
    shard = Sharding.fsdp(n)
    m_roll = min(wl.rollout_micro_batch, per_gpu)
    big = wl.largest()  # a shape mix: memory holds its largest shape
    fits_train = lambda m: colocated_memory(big, slow, num_gpus=n, variant=variant, rollout_micro=m_roll,
                                            train_micro=m, samples_per_gpu=per_gpu).fits
    m = max_micro_batch(fits_train, wl.train_micro_batch) or 1
    roll_kw = {"sharding": shard} if sharded_gen else {}
    train_shard = shard if train_shard_on else None
    why, knobs = [], {"variant": variant, "rollout_micro": m_roll, "train_micro": m, "dispatch": dispatch}
    if wl.shapes:
        # the runtime's default fragments (one per rank's share) or single groups, whichever balances better
        mix = min((colocated_phases(wl, gpus, slow, micro=m_roll, train_micro=m, train_sharding=train_shard,
                                    gen_sharding=shard if sharded_gen else None, speed_weighted=not sharded_gen,
                                    dispatch=dispatch, fragment_groups=f) for f in (None, 1)),
                  key=lambda x: (sharded_gen and len(set(x["chunk_counts"])) > 1, x["generate_s"] + x["score_s"]))
        gen, score, traj, train = mix["generate_s"], mix["score_s"], mix["trajectory_bytes"], mix["train_s"]
        knobs["fragment_groups"] = mix["fragment_groups"]
        if sharded_gen and len(set(mix["chunk_counts"])) > 1:
            why.append(f"FSDP generation needs equally many chunks on every rank, the plan gives {mix['chunk_counts']}")
    else:
        gen = ph.denoise_s(wl, slow, per_gpu, m_roll, **roll_kw)
        score = ph.decode_s(wl, slow, per_gpu) + ph.reward_s(wl, slow, per_gpu)
        traj = ph.trajectory_bytes(wl, per_gpu)
        train = ph.train_s(wl, slow, trans, m, sharding=train_shard, with_reference=True)
    steps = [("text encode", "score", ph.text_s(wl, slow, ceil_div(wl.prompts_per_step, n * speed))),
             ("rollout", "generate", gen), ("VAE decode + reward", "score", score)]
    steps.append(("TSP exchange of transitions", "comm", traj * (n - 1) / n / hw_busbw(slow, n)))
    steps.append(("train (TSP packed)", "train", train))
    grad = allreduce_s(slow, 4 * lora_params(wl.spec, wl.lora_rank), n) if train_shard is None else 0.0
    steps.append(("optimizer", "optimizer", wl.optimizer_steps * (ph.optimizer_s(wl, slow, n if full else 1) + grad)))
    if variant == "replicate" and full:
        steps.append(("stage bf16 rollout copy", "switch", staging_s(ph.weight_bytes(wl))))
    if variant == "sleepwake":
        state = (16 * wl.spec.params if full else 2 * wl.spec.params) / (n if full else 1)
        steps.append(("offload / restore training state", "switch", 2 * ph.host_copy_s(slow, state)))
        steps.append(("stage rollout copy", "switch", staging_s(ph.weight_bytes(wl))
                      if full else 2 * ph.host_copy_s(slow, ph.weight_bytes(wl))))
    mem = colocated_memory(big, slow, num_gpus=n, variant=variant, rollout_micro=m_roll, train_micro=m,
                           samples_per_gpu=per_gpu)
    label = f"colocated {variant}"
    p = lockstep("colocated", label, wl, slow, n, steps, mem, knobs, [])
    p.pools = [(pl.gpu, pl.count) for pl in pools]
    p.why_not += why
    if len(pools) > 1:
        p.notes.append("mixed GPUs: phases without collectives split by speed; FSDP phases run in lockstep at the "
                       "slowest GPU")
    return p


# ---------------------------------------------------------------------------------------------
# Disaggregated
# ---------------------------------------------------------------------------------------------

def stage_fraction(wl: Workload, stages: int) -> float:
    """Share of a forward's FLOPs on the slowest stage of the runtime's block partition."""
    costs = block_flops(wl.spec, wl.n_img, wl.n_txt)
    ranges = partition_blocks(costs, [1.0] * stages)
    return max(sum(costs[a:b]) for a, b in ranges) / sum(costs)


def gen_wave(stages: int, samples: int, micro: int) -> int:
    """Fragments of `samples` a replica of `stages` pipelines together (parallel/schedule.py)."""
    return fragments_in_flight(stages, len(ph.split(samples, micro)))


def replica_fragment_s(wl: Workload, g: GPU, stages: int, samples: int, micro: int, prompts: int) -> float:
    """One fragment on one replica: the pipelined denoising (its share of a wave of `gen_wave`
    fragments), then decode, scoring and the prompts' text encoding (last and first stage; not
    overlapped with the pipeline)."""
    aux = ph.decode_s(wl, g, samples) + ph.reward_s(wl, g, samples) + ph.text_s(wl, g, prompts)
    if stages == 1:
        return ph.denoise_s(wl, g, samples, micro) + aux
    sizes = ph.split(samples, micro)
    wave = gen_wave(stages, samples, micro)
    frac = stage_fraction(wl, stages)
    slot = max(frac * ph.rollout_forward_s(wl, g, b) for b in sizes)
    hop = hidden_bytes(wl.spec, wl.n_img, wl.n_txt) * wl.branches * max(sizes) / p2p_bytes_s(g, stages <= g.gpus_per_node)
    return makespan_slots(stages, len(sizes) * wave, wl.sampling_steps) * (slot + hop + LINK_LATENCY_S) / wave + aux


def train_fragment_s(wl: Workload, g: GPU, trainers: int, samples: int, micro: int, shard: Sharding) -> float:
    """Wall seconds of one fragment's training over the trainer group, packed by tsp.pack; every
    micro-batch (partial ones too) pays a whole gather."""
    transitions = [(i, t) for i in range(samples) for t in range(wl.trained_timesteps)]
    packing = pack([transitions], micro_batch=micro, num_trainers=trainers)
    per, by_size = [0.0] * trainers, {}
    for mb in packing.micro_batches:
        size = len(mb.transitions)
        if size not in by_size:
            by_size[size] = ph.train_micro_batch_s(wl, g, size, sharding=shard, with_reference=True)
        per[mb.trainer] += by_size[size]
    return max(per)


def publish_s(wl: Workload, gen: GPU, trn: GPU, generators: int, stages: int, trainers: int, same_pool: bool,
              link_bytes_s: float | None = None) -> float:
    """As the runtime publishes: every trainer gathers the full tensors (for full fine-tuning at the
    measured staging rate of FSDP shards into full bf16 tensors, `systems.sync_s`, the same price a
    colocated plan pays to refresh its rollout copy), trainer 0 encodes them with the workload's
    codec (`ph.encode_s`), then sends each generator rank the wire bytes of its stage
    (`ph.publish_wire_bytes`, as the runtime counts them), one generator after the other. With a
    cross-site link (`link_bytes_s`) every send crosses it."""
    bytes_ = ph.publish_bytes(wl)
    wire = ph.publish_wire_bytes(wl)
    gather = staging_s(bytes_) if wl.finetune == "full" else allgather_s(trn, bytes_, trainers)
    per_node = trn.gpus_per_node
    t0 = generators  # trainer 0's rank
    send = 0.0
    for r in range(generators):
        same_node = same_pool and r // per_node == t0 // per_node
        bw = p2p_bytes_s(trn, True) if same_node else min(gen.nic_bytes_s, trn.nic_bytes_s)
        bw = min(bw, link_bytes_s) if link_bytes_s else bw
        send += wire / stages / bw + LINK_LATENCY_S
    return gather + ph.encode_s(wl, trn) + send + 2 * bytes_ / trn.hbm_bytes_s  # checksums on both sides


def _fragments(wl: Workload, ggpu: GPU, stages: int, groups: int, micro: int, replicas: int, trainers: int,
               speeds: list[float] | None, dispatch: str) -> list[tuple[tuple, int, int]] | None:
    """A shape mix's fragments in the runtime's plan order: (shape, groups, replica) each, from
    `parallel.plan.plan_step` with each shape's predicted seconds per sample. None: one shape."""
    if not wl.shapes:
        return None
    g = wl.group_size
    sample_s = {k: replica_fragment_s(wl.at(k), ggpu, stages, g, micro, 1) / g for k in set(wl.group_keys())}
    plan = step_plan(wl, sample_s, num_replicas=replicas, num_trainers=trainers, micro=micro,
                     fragment_groups=groups, speeds=speeds, dispatch=dispatch)
    return [(f.shape, len(f.groups), f.replica) for f in plan.fragments]


def disagg_plan(wl: Workload, gen: Pool, trn: Pool, generators: int, trainers: int, stages: int, groups: int,
                mode: str, same_pool: bool, hsdp: bool = False, naive: bool = False, extra: int = 0,
                link_bytes_s: float | None = None, dispatch: str = "lpt") -> Prediction:
    """One disaggregated plan, simulated. `extra`: GPUs of the trainer pool that generate too (two
    pools only), as replicas of the same stage count; replicas of different speeds are planned by
    speed (plan_step's replica_speeds). `link_bytes_s`: the pools sit in two sites joined by a link
    of this bandwidth, which trajectories and publications cross. A shape mix is dispatched by the
    runtime's `dispatch` policy, every fragment costed at its own shape."""
    if link_bytes_s and (same_pool or extra):
        raise ValueError("a cross-site link joins two pools: generators in one site, trainers in the other "
                         "(no shared pool, no extra generators beside the trainers)")
    ggpu, tgpu = gen.gpu, trn.gpu
    replicas = generators // stages
    frag_samples = groups * wl.group_size
    shard = Sharding.hsdp(trainers, min(trainers, tgpu.gpus_per_node)) if hsdp else Sharding.fsdp(trainers)
    big = wl.largest()  # a shape mix: memory holds its largest shape
    why = []
    micro = max_micro_batch(lambda b: generator_memory(big, ggpu, stages=stages, stage=stages - 1, micro=b,
                                                       fragment_samples=frag_samples).fits,
                            min(ROLLOUT_MICRO_MAX, frag_samples))
    gmem = generator_memory(big, ggpu, stages=stages, stage=stages - 1, micro=max(micro, 1), fragment_samples=frag_samples)
    g0mem = generator_memory(big, ggpu, stages=stages, stage=0, micro=max(micro, 1), fragment_samples=frag_samples)
    if not micro or not g0mem.fits:
        why.append((gmem if not gmem.fits else g0mem).why())
    if extra:
        xmem = generator_memory(big, trn.gpu, stages=stages, stage=0, micro=max(micro, 1), fragment_samples=frag_samples)
        if not xmem.fits:
            why.append(xmem.why())
    buffered = 2 * ceil_div(frag_samples, trainers)
    tag = mode == "tag"
    m = max_micro_batch(lambda b: trainer_memory(big, tgpu, shard=shard.shard, micro=b, buffered_samples=buffered,
                                                 generates=tag).fits, wl.train_micro_batch)
    tmem = trainer_memory(big, tgpu, shard=shard.shard, micro=max(m, 1), buffered_samples=buffered, generates=tag)
    if not m:
        why.append(tmem.why())
    micro, m = max(micro, 1), max(m, 1)
    link = p2p_bytes_s(ggpu, True) if same_pool and generators + trainers <= ggpu.gpus_per_node else min(
        ggpu.nic_bytes_s, tgpu.nic_bytes_s)
    link = min(link, link_bytes_s) if link_bytes_s else link

    def costs_of(w: Workload, n_groups: int) -> tuple[float, float, float, float]:
        """(replica, trainer generation, training, transfer) seconds of one fragment of `n_groups` groups."""
        samples = n_groups * w.group_size
        trainer_gen = (ph.denoise_s(w, tgpu, samples, micro, sharding=shard if w.finetune == "full" else None)
                       + ph.decode_s(w, tgpu, samples) + ph.reward_s(w, tgpu, samples) + ph.text_s(w, tgpu, n_groups))
        return (replica_fragment_s(w, ggpu, stages, samples, micro, n_groups), trainer_gen,
                train_fragment_s(w, tgpu, trainers, samples, m, shard), ph.trajectory_bytes(w, samples) / link + 1e-3)

    num_replicas = replicas + extra // stages
    speeds = None
    if extra and wl.shapes:
        x_s = replica_fragment_s(big, tgpu, stages, frag_samples, micro, groups)
        g_s = replica_fragment_s(big, ggpu, stages, frag_samples, micro, groups)
        speeds = [1 / g_s] * replicas + [1 / x_s] * (extra // stages)
    frags = _fragments(wl, ggpu, stages, groups, micro, num_replicas, trainers, speeds, dispatch)
    owners = scales = None
    if frags is None:
        num_fragments = ceil_div(wl.prompts_per_step, groups)
        rep, trainer_gen, train, transfer = costs_of(wl, groups)
    else:  # a shape mix: fragment 0's costs, the others as factors of them
        num_fragments, owners = len(frags), [r for *_, r in frags]
        unique = {}
        for key, n, _ in frags:
            if (key, n) not in unique:
                unique[(key, n)] = costs_of(wl.at(key), n)
        per = [unique[(key, n)] for key, n, _ in frags]
        rep, trainer_gen, train, transfer = per[0]
        scales = {"gen_scale": [p[0] / rep for p in per], "train_scale": [p[2] / train for p in per],
                  "transfer_scale": [p[3] / transfer for p in per]}
    grad = allreduce_s(tgpu, 4 * lora_params(wl.spec, wl.lora_rank), trainers) if wl.finetune == "lora" else 0.0
    update = wl.optimizer_steps * (ph.optimizer_s(wl, tgpu, shard.shard) + grad)
    pub = publish_s(wl, ggpu, tgpu, generators, stages, trainers, same_pool, link_bytes_s)
    reps = [rep] * replicas
    if extra:
        first = wl.at(frags[0][0]) if frags else wl
        reps += [replica_fragment_s(first, tgpu, stages, frags[0][1] * wl.group_size if frags else frag_samples,
                                    micro, frags[0][1] if frags else groups)] * (extra // stages)
        pub = publish_s(wl, ggpu, tgpu, generators + extra, stages, trainers, False)
    costs = Costs(reps, trainer_gen, train, transfer_s=transfer, update_s=update, publish_s=pub,
                  held_fraction=wl.held_fraction, **(scales or {}))
    sim_mode = "disagg" if naive else {"gap": "gap", "tag": "tag", "tcss": "tcss"}[mode]
    steps = 4 if mode == "tcss" else 1
    res = simulate_run(sim_mode, steps, num_fragments, costs, trainers, "bts" if tag else None,
                       stages_per_replica=stages, plan_speeds=[1 / r for r in reps] if extra else None, owners=owners,
                       wave=gen_wave(stages, frag_samples, micro))
    step_s = res.steady_step_s
    crossing = 0.0
    if link_bytes_s:  # the link carries every trajectory and every publication of a step
        crossing = (sum(ph.trajectory_bytes(wl.at(k), wl.group_size) for k in wl.group_keys())
                    + generators / stages * ph.publish_wire_bytes(wl)) / link_bytes_s
        step_s = max(step_s, crossing)
    label = (f"{'naive ' if naive else ''}{mode} G={generators}{'x' + ggpu.key if not same_pool else ''}"
             f"{f'+{extra}x{tgpu.key}' if extra else ''} "
             f"T={trainers}{'x' + tgpu.key if not same_pool else ''}"
             f"{f' S={stages}' if stages > 1 else ''} F={groups} m={m}{' hsdp' if hsdp else ''}")
    pred = Prediction("digenrl", label, wl, [(ggpu, generators), (tgpu, trainers + extra)] if not same_pool
                      else [(ggpu, generators + trainers)], step_s, res.bubble_fraction,
                      {"generator": g0mem if g0mem.total > gmem.total else gmem, "trainer": tmem},
                      _segments(res.events, replicas * stages, steps - 1 if steps > 1 else 0),
                      {"mode": "naive" if naive else mode, "generators": generators, "trainers": trainers,
                       "stages": stages, "fragment_groups": groups, "rollout_micro": micro, "train_micro": m,
                       "hsdp": hsdp, "extra_generators": extra, "stale": mode == "tcss", "costs": costs.to_dict(),
                       "generator_gpu": ggpu.key, "same_pool": same_pool, "dispatch": dispatch,
                       "link_bytes_s": link_bytes_s, "owners": owners, "link_busy_s": crossing},
                      [], why)
    if mode == "tcss":
        pred.notes.append("TCSS: generators run one version stale (staleness <= 1)")
    if tag:
        pred.notes.append(f"TAG: trainers generated {res.fragments_by_trainers} fragment(s)")
    if link_bytes_s:
        pred.notes.append(f"cross-site link {8 * link_bytes_s / 1e9:g} Gb/s, publication {wl.publish_compression}: "
                          f"{pub:.1f} s per version, the link busy {crossing:.1f} s per step")
    return pred


def _segments(events: list[dict], generator_ranks: int, step: int) -> list[Segment]:
    kinds = {"generate": "generate", "train": "train", "optimizer": "optimizer", "publish": "switch", "comm": "comm"}
    out = []
    for e in events:
        if e.get("ph") != "X" or e["args"].get("step") != step:
            continue
        lane = f"{'generator' if e['pid'] < generator_ranks else 'trainer'} {e['pid']}"
        out.append(Segment(lane, e["name"], kinds.get(e["cat"], "other"), e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
    return out


# ---------------------------------------------------------------------------------------------
# Enumeration, ranking, recommendation
# ---------------------------------------------------------------------------------------------

def _min_stages(wl: Workload, g: GPU, frag_samples: int) -> int:
    for s in (1, 2, 4, 8):
        if all(generator_memory(wl, g, stages=s, stage=i, micro=1, fragment_samples=frag_samples).fits
               for i in (0, s - 1)):
            return s
    return 0


def with_reward_service(p: Prediction, wl: Workload, g: GPU) -> Prediction:
    """A plan whose rewards a service on `wl.reward_gpus` GPUs of type `g` scores: the service
    scores each fragment while the generators denoise the next (the runtime lags scores by one
    fragment), so the step is the plan's own (no reward on any rank) or the service's whole step of
    scoring if that is longer, plus the last fragment's scoring, which nothing overlaps (one group
    per reward GPU, the smallest fragment). The reward GPUs join the plan's pools: they count in
    its cost and its MFU."""
    per_gpu = ceil_div(wl.samples, wl.reward_gpus)
    service = ph.reward_s(wl, g, per_gpu, served=True)
    tail = ph.reward_s(wl, g, wl.group_size, served=True)
    p.step_s = max(p.step_s, service) + tail
    p.pools = p.pools + [(g, wl.reward_gpus)]
    p.notes = p.notes + [f"rewards served on {wl.reward_gpus} x {g.key}: {service:.1f} s of scoring per step, "
                         f"{tail:.1f} s after the last fragment"]
    return p


def enumerate_plans(wl: Workload, pools: list[Pool], *, modes: tuple[str, ...] = MODES, top_k: int = 4,
                    max_generator_counts: int = 12, link_bytes_s: float | None = None,
                    dispatch: str = "lpt") -> tuple[list[Prediction], list[str]]:
    """Every plan of `pools` (one or two pools): colocated variants, then disaggregated splits in
    streaming mode; the `top_k` fastest streaming plans are also simulated with TAG and TCSS.
    `link_bytes_s`: the two pools sit in two sites joined by a link of this bandwidth (no colocated
    plan spans it; generators on one side, trainers on the other). `dispatch`: the runtime's
    fragment dispatch for a shape mix. Returns (feasible predictions, reasons for what was excluded)."""
    out, excluded = [], []
    if link_bytes_s and len(pools) != 2:
        raise ValueError("a cross-site link joins two GPU pools (one site each)")
    for variant in ("replicate", "fsdp", "sleepwake"):
        if link_bytes_s:
            excluded.append(f"colocated {variant}: a colocated plan does not span two sites")
            continue
        p = colocated(wl, pools, variant, dispatch)
        (out if p.feasible else excluded).append(p if p.feasible else f"{p.label}: {'; '.join(p.why_not)}")
    pairs = []
    if len(pools) == 1:
        pairs = [(pools[0], pools[0], True)]
    else:
        pairs = [(pools[0], pools[1], False), (pools[1], pools[0], False)]
    streaming = []
    for gen, trn, same in pairs:
        total = gen.count if same else None
        groups_options = [f for f in FRAGMENT_GROUPS if wl.prompts_per_step % f == 0] or [1]
        s_min = _min_stages(wl, gen.gpu, groups_options[0] * wl.group_size)
        if not s_min:
            excluded.append(f"generators on {gen.gpu.key}: the DiT does not fit 8 GAP stages")
            continue
        for stages in sorted({s_min, 2 * s_min} & {1, 2, 4, 8}):
            counts = (range(stages, total, stages) if same else [gen.count - gen.count % stages])
            counts = _thin([c for c in counts if c > 0], max_generator_counts)
            extras = [0] if same or link_bytes_s else _thin(list(range(0, trn.count, stages)), 6)
            for g_count, extra in ((c, x) for c in counts for x in extras):
                t_count = ((total - g_count) if same else trn.count) - extra
                if t_count < 1:
                    continue
                for groups in groups_options:
                    can_hsdp = (t_count > trn.gpu.gpus_per_node and t_count % trn.gpu.gpus_per_node == 0
                                and wl.finetune == "full")
                    for hsdp in ((False, True) if can_hsdp else (False,)):
                        p = disagg_plan(wl, gen, trn, g_count, t_count, stages, groups, "gap", same, hsdp,
                                        extra=extra, link_bytes_s=link_bytes_s, dispatch=dispatch)
                        if p.feasible:
                            streaming.append((gen, trn, same, p))
                        else:
                            excluded.append(f"{p.label}: {'; '.join(p.why_not)}")
    streaming.sort(key=lambda x: x[3].step_s)
    out += [p for *_, p in streaming]
    for i, (gen, trn, same, p) in enumerate(streaming[:top_k]):
        k = p.knobs
        if i == 0:  # naive disaggregation of the best split, for reference
            naive = disagg_plan(wl, gen, trn, k["generators"], k["trainers"], k["stages"],
                                k["fragment_groups"], "gap", same, k["hsdp"], naive=True, extra=k["extra_generators"],
                                link_bytes_s=link_bytes_s, dispatch=dispatch)
            if naive.feasible:
                out.append(naive)
        for mode in modes:
            if mode == "gap":
                continue
            q = disagg_plan(wl, gen, trn, k["generators"], k["trainers"], k["stages"], k["fragment_groups"], mode,
                            same, k["hsdp"], extra=k["extra_generators"], link_bytes_s=link_bytes_s, dispatch=dispatch)
            if q.feasible:
                out.append(q)
            else:
                excluded.append(f"{q.label}: {'; '.join(q.why_not)}")
    if wl.reward_gpus:
        out = [with_reward_service(p, wl, pools[0].gpu) for p in out]
    out.sort(key=lambda p: p.step_s)
    return out, excluded


def _thin(values: list[int], limit: int) -> list[int]:
    """At most `limit` values spread over the list (always the first and the last)."""
    if len(values) <= limit:
        return values
    idx = {round(i * (len(values) - 1) / (limit - 1)) for i in range(limit)}
    return [values[i] for i in sorted(idx)]


def repredict(pred: Prediction, pools: list[Pool], **changes) -> Prediction:
    """`pred`'s plan predicted again with some of its settings changed (`dispatch`, `link_bytes_s`
    or the workload `wl`), e.g. the recommended plan under round-robin dispatch."""
    wl, k = changes.pop("wl", pred.workload), pred.knobs
    if pred.system == "colocated":
        return colocated(wl, pools, k["variant"], changes.get("dispatch", k["dispatch"]))
    by_key = {p.gpu.key: p for p in pools}
    gen = by_key[k["generator_gpu"]]
    trn = gen if k["same_pool"] else next(p for p in pools if p is not gen)
    mode = "gap" if k["mode"] == "naive" else k["mode"]
    return disagg_plan(wl, gen, trn, k["generators"], k["trainers"], k["stages"], k["fragment_groups"], mode,
                       k["same_pool"], k["hsdp"], naive=k["mode"] == "naive", extra=k["extra_generators"],
                       link_bytes_s=changes.get("link_bytes_s", k["link_bytes_s"]),
                       dispatch=changes.get("dispatch", k["dispatch"]))


def best_colocated(preds: list[Prediction]) -> Prediction | None:
    col = [p for p in preds if p.system == "colocated" and p.feasible]
    return min(col, key=lambda p: p.step_s) if col else None


def recommend(preds: list[Prediction], allow_stale: bool = False) -> Prediction:
    """The fastest feasible plan (on-policy unless `allow_stale`). The best colocated plan is
    always a candidate, so the recommendation is never predicted slower than it."""
    ok = [p for p in preds if p.feasible and (allow_stale or not p.knobs.get("stale"))]
    if not ok:
        raise ValueError("no feasible plan: every candidate runs out of memory (see the exclusions)")
    return min(ok, key=lambda p: p.step_s)


__all__ = ["Pool", "best_colocated", "colocated", "disagg_plan", "enumerate_plans", "publish_s", "recommend",
           "replica_fragment_s", "repredict", "stage_fraction", "train_fragment_s"]
