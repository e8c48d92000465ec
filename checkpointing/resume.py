"""What a run carries across a checkpoint besides the weights and the optimizer (checkpointing/checkpoint.py
writes the files), so that a resumed run repeats the uninterrupted one bitwise in every mode:

- the version each rank starts from: trainers hold version N; with --tcss the generators hold
  N-1 (the checkpoint's stale.safetensors), since the uninterrupted run generates step N with it;
- the running reward std of the last two steps (with --tcss, step k's advantages read the std of
  the steps before k-1, which the logging rank publishes on the store);
- the skipped-step counters of the non-finite check (rl/nonfinite.py);
- with --tcss, the trainers send version N to the generators again at the start, as the
  uninterrupted run did after step N-1, and keep it as the next checkpoint's stale version.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from checkpointing import checkpoint
from parallel import checksums, publish
from parallel import store_keys as keys


@dataclass
class Start:
    step: int = 0  # the first step this run trains
    version: int = 0  # the policy version this rank holds
    std_history: dict = field(default_factory=dict)  # step -> running std after it (logging rank)


def restore(facts, rank: int, adapter, trainer, running, store) -> Start:
    """Install the checkpoint of --resume on this rank (every rank calls it)."""
    point = facts.resume
    if point is None:
        return Start()
    stale = facts.tcss and facts.topology.is_generator(rank) and point.has_stale
    state = checkpoint.restore_run_state(point.path, adapter, trainer, running, use_stale=stale)
    step = int(state["step"])
    if trainer is not None and "skips" in state:
        trainer.skips.load_state_dict(state["skips"])
    history = {int(k): v for k, v in state.get("std_history", {}).items()}
    if rank == facts.log_rank:
        for k, v in history.items():
            store.put(keys.running_std(k), v)  # what the uninterrupted run's logging rank had published
    return Start(step, step - 1 if stale else step, history)


def residual(facts) -> dict | None:
    """The lossy publication codec's residual to go on from: a resumed run's (whole tensors), else
    None (zero)."""
    if facts.resume is None:
        return None
    return checkpoint.read_state(facts.resume.path, checkpoint.RESIDUAL, missing_ok=True) or None


def extra_state(trainer, std_history: dict, done: int) -> dict:
    """trainer_state.pt's entries beyond the optimizer's: skipped steps, the std of the last steps."""
    return {"skips": trainer.skips.state_dict(),
            "std_history": {k: std_history[k] for k in (done - 1, done - 2) if k in std_history}}


def publish_start(facts, rank: int, trainer, publisher: publish.WeightPublisher, publish_names: dict,
                  start: int, generators_stale: bool, store, group=None) -> None:
    """TCSS trainers: keep version `start` (the stale version of checkpoint start+1) and, when the
    generators resumed one version behind, send it to them on `group` (ProcessGroups.publish; a
    collective under FSDP)."""
    names = sorted({n for group in publish_names.values() for n in group})
    out = trainer.current_version(names)  # as the generators hold it (under FSDP a collective)
    publisher.keep_version(out, names, start)
    by_dst = {g: publish_names[g] for g in facts.topology.generator_ranks}
    if rank != facts.topology.trainer_ranks[0]:
        if generators_stale:
            publisher.follow_all(out, by_dst)
        return
    if generators_stale:
        store.put(keys.version_published(start), 1)
        publisher.publish_all(out, by_dst, start, group=group)


def check_same_weights(adapter, names: list[str], version: int, dtype=None, tensors: dict | None = None) -> None:
    """Every rank holding the same version holds the same weights (same checkpoint, same seeded
    LoRA init; TCSS generators resume one version behind the trainers), compared as the generators
    hold them: in the compute dtype `dtype` (trainers keep float32; FSDP trainers checksum their
    shards, a collective over the trainers). `tensors`: the weights this rank samples with when
    they are not its parameters (a DiffusionNFT trainer: the old policy, sharded like them)."""
    if tensors is None:
        params = dict(adapter.transformer.named_parameters())
        tensors = {n: params[n] for n in names}
    sums = checksums.checksums_of(tensors, dtype)
    local = (version, checksums.combine_checksums(tensors, sums, dtype))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)  # sync point
    by_version: dict[int, set] = {}
    for v, c in everyone:
        by_version.setdefault(v, set()).add(c)
    if any(len(c) > 1 for c in by_version.values()):
        raise RuntimeError(f"ranks start from different weights: (version, checksum) by rank {everyone}")
