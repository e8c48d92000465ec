"""DigenRL: disaggregated RL post-training of diffusion transformers, one torchrun SPMD job.

    torchrun --standalone --nproc_per_node 2 train_disagg.py [flags]     (see --help)

Config, distributed init, topology, the step loop that dispatches on role, clean shutdown.
Generators run rollout (rollout.Generator), trainers run training (trainer.Trainer); in colocated
mode every rank does both, one after the other (the Flow-GRPO / VeRL-Omni way).
"""
from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import runtime
from config import parse_config

def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv, __doc__.strip().splitlines()[0])
    cfg.resolve_defaults()
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    facts = cfg.validate(world)  # every user error, on every rank, before any rank waits
    use_cuda = torch.cuda.is_available() and cfg.model.device in ("auto", "cuda")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1 or not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo",
                                timeout=timedelta(seconds=cfg.topology.dist_timeout_s))
    runtime.run(cfg, facts, rank)
    return 0


def shutdown(code: int) -> None:
    """End every process the same way: barrier, destroy the process group, flush, os._exit.
    A plain interpreter exit after FSDP2 on gloo aborts intermittently (docs/MODELS.md)."""
    if dist.is_initialized():
        if code == 0:
            try:
                dist.barrier()  # sync point: every rank has finished its last step
            except Exception:  # noqa: BLE001 - a peer already failed; exit with our own code
                pass
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = 1
    try:
        code = main()
    except ValueError as e:
        # A user error: one clear line. Every rank raises it before any collective, so none hangs.
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except SystemExit as e:  # --help
        code = e.code if isinstance(e.code, int) else 0
    except BaseException:  # noqa: BLE001 - a failing rank exits at once; torchrun stops the others
        traceback.print_exc()
        code = 1
    finally:
        shutdown(code)
