"""DigenRL: disaggregated RL post-training of diffusion transformers, one torchrun SPMD job.

    torchrun --standalone --nproc_per_node 2 train_disagg.py [flags]     (see --help)

Config, distributed init, topology, the step loop that dispatches on role, clean shutdown.
Generators run rollout (rollout.Generator), trainers run training (trainer.Trainer); in colocated
mode every rank does both, one after the other (the Flow-GRPO / VeRL-Omni way).
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from checkpointing import lock
from parallel.store import launch_id
from runtime import guard
from runtime import loop as runtime
from config.cli import parse_config
from config.validate import validate


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv, __doc__.strip().splitlines()[0])
    cfg.resolve_defaults()
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    lock.set_launch(launch_id())  # this launch's own id, never the launcher's: which run folder lock is ours
    facts = validate(cfg, world)  # every user error, on every rank, before anything loads or any rank waits
    if rank == 0:  # the run folder is this run's from here on, until the process ends (checkpointing/lock.py)
        guard.at_exit(lock.release)
        note = lock.acquire(cfg.output.output_dir)
        if note:
            guard.say(note)
    use_cuda = torch.cuda.is_available() and cfg.model.device in ("auto", "cuda")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else None
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 or not dist.is_initialized():
        # device_id: NCCL communicators are made when each group is (new groups split the world's),
        # and a group's sends and receives run on its own; lazily, the first send between two ranks
        # would wait for the other's first operation with it (docs/communication.md).
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device,
                                timeout=timedelta(seconds=cfg.topology.dist_timeout_s))
    return runtime.run(cfg, facts, rank)


def shutdown(code: int) -> None:
    """End every process the same way: barrier, destroy the process group, flush, os._exit.
    A plain interpreter exit after FSDP2 on gloo aborts intermittently (docs/MODELS.md)."""
    run_guard = guard.active()
    if dist.is_initialized():
        if code in (guard.EXIT_OK, guard.EXIT_STOPPED):
            try:
                dist.barrier()  # sync point: every rank has finished its last step
            except Exception as e:  # noqa: BLE001 - a peer failed at the very end: not a clean exit
                cause = run_guard.diagnose() if run_guard is not None else None
                guard.say(f"error: {cause or guard.first_line(e)}; the final barrier failed")
                code = guard.EXIT_ABORT
        if run_guard is not None:
            run_guard.finish(code)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    guard.run_exit_hooks()  # rank 0: the run folder's lock
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def quiet_unless_alone(line: str, wait_s: float = 2.0) -> None:
    """Rank 0 prints a user error found before the run starts; the other ranks found the same and
    wait quietly for torchrun's SIGTERM (which follows rank 0's exit), then exit with the same code.
    A rank still here after `wait_s` failed alone and prints its own line."""
    signal.signal(signal.SIGTERM, lambda signum, frame: shutdown(guard.EXIT_USER))
    time.sleep(wait_s)


def cli(argv: list[str] | None = None) -> None:
    """Run, print at most one line for a known failure, and exit with a documented code
    (runtime/guard.py; docs/reliability.md)."""
    code = guard.EXIT_ERROR
    try:
        code = main(argv)
    except SystemExit as e:  # --help, or argparse's own error (2)
        code = e.code if isinstance(e.code, int) else 0
    except BaseException as e:  # noqa: BLE001 - every failure ends here, by one path
        run_guard = guard.active()
        if run_guard is not None:  # the run had started: diagnose, and tell the other ranks
            code, line, show_traceback = run_guard.explain(e)
        elif isinstance(e, ValueError):  # before any rank waits: the same user error on every rank
            code, line, show_traceback = guard.EXIT_USER, f"error: {e}", False
        elif isinstance(e, KeyboardInterrupt):  # Ctrl-C before the run started: nothing to save
            code, line, show_traceback = 128 + signal.SIGINT, "error: interrupted before the run started", False
        else:
            code, line, show_traceback = guard.EXIT_ERROR, f"error: {guard.first_line(e)}", True
        if show_traceback:
            traceback.print_exc()
        guard.write_error_file(line)  # torchrun's summary shows it as the root cause
        if code == guard.EXIT_USER and run_guard is None and os.environ.get("RANK", "0") != "0":
            quiet_unless_alone(line)  # rank 0 says it for all
        guard.say(line)
    finally:
        shutdown(code)


if __name__ == "__main__":
    cli()
