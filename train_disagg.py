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

from config import RunConfig, parse_config
from parallel.topology import SHARDINGS, Topology

SHIPPED_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "shapes-flux")
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def resolve_defaults(cfg: RunConfig) -> None:
    """Fill the embedded default: the shipped shapes model, the shapes prompt sets, the shapes reward."""
    if cfg.model.preset not in ("auto", "tiny", "mid"):
        raise ValueError(f"unknown --preset {cfg.model.preset!r}; choose auto, tiny or mid")
    if cfg.model.model_path is None and cfg.model.preset == "auto":
        if cfg.model.model == "flux" and os.path.isdir(SHIPPED_MODEL):
            cfg.model.model_path = SHIPPED_MODEL
        else:
            cfg.model.preset = "tiny"
    if cfg.rl.prompts is None:
        cfg.rl.prompts = os.path.join(DATA_DIR, "shapes_train.txt")
    if cfg.output.eval_prompts is None:
        cfg.output.eval_prompts = os.path.join(DATA_DIR, "shapes_eval.txt")
    if not cfg.rl.reward:
        cfg.rl.reward = ["shapes:1.0"]


def validate(cfg: RunConfig, topo: Topology) -> None:
    """User errors, raised on every rank before any rank waits on another."""
    from algorithm import ALGORITHMS
    from rewards import parse_reward_specs, reward_model_paths

    rl, t = cfg.rl, cfg.topology
    for name, value in (("--steps", rl.steps), ("--prompts-per-step", rl.prompts_per_step),
                        ("--group-size", rl.group_size), ("--micro-batch", rl.micro_batch),
                        ("--eval-num-prompts", cfg.output.eval_num_prompts),
                        ("--eval-samples-per-prompt", cfg.output.eval_samples_per_prompt)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if rl.group_size < 2:
        raise ValueError(f"--group-size must be >= 2 for group-relative advantages, got {rl.group_size}")
    if rl.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown --algorithm {rl.algorithm!r}; choose one of {ALGORITHMS}")
    if rl.std_mode not in ("group", "running"):
        raise ValueError(f"unknown --std-mode {rl.std_mode!r}; choose group or running")
    if not 0 < rl.timestep_fraction <= 1:
        raise ValueError(f"--timestep-fraction must be in (0, 1], got {rl.timestep_fraction}")
    for name, value in (("--colocated-sharding", t.colocated_sharding), ("--train-sharding", t.train_sharding)):
        if value not in SHARDINGS:
            raise ValueError(f"unknown {name} {value!r}; choose one of {SHARDINGS}")
    if t.tag and topo.mode != "disagg":
        raise ValueError(f"--tag needs --mode disagg (got {topo.mode}): colocated ranks all generate already")
    if t.tcss and topo.mode != "disagg":
        raise ValueError("--tcss needs --mode disagg (colocated ranks are never stale)")
    if cfg.sampling.sde_window and rl.algorithm != "window":
        raise ValueError(f"--sde-window {cfg.sampling.sde_window} samples ODE steps outside the window, which have no "
                         f"log-probability to train: use --algorithm window (got {rl.algorithm!r})")
    parse_reward_specs(rl.reward, reward_model_paths(rl.reward_model))
    o = cfg.output
    if o.eval_every:
        from evaluation import eval_records

        eval_records(o.eval_prompts, o.eval_num_prompts, o.eval_samples_per_prompt)  # a missing file raises here
    if cfg.output.resume:
        from checkpoint import latest_checkpoint

        if latest_checkpoint(cfg.output.resume) is None:
            raise ValueError(f"--resume {cfg.output.resume!r} holds no complete checkpoint (checkpoints/step-N/state.json)")
    if t.train_micro_batch is not None and t.train_micro_batch < 1:
        raise ValueError(f"--train-micro-batch must be >= 1, got {t.train_micro_batch}")
    if cfg.optim.lora_rank < 0:
        raise ValueError(f"--lora-rank must be >= 0, got {cfg.optim.lora_rank}")


def check_fsdp_balance(plan, topo: Topology, trainer, shard: str) -> int:
    """FSDP ranks run collectives inside every forward, so they must run equally many: returns
    the forward count every trainer pads to. Colocated FSDP generation needs equal chunk counts."""
    if shard != "fsdp":
        return 0
    counts = trainer.planned_forwards(plan, len(topo.trainer_ranks))
    if topo.mode == "colocated":
        gen = [sum(len(f.chunks) for f in plan.fragments if f.replica == r) for r in range(topo.num_replicas)]
        if len(set(gen)) > 1:
            raise ValueError(f"--colocated-sharding fsdp needs every rank to generate equally many chunks, got {gen} "
                             f"(choose --prompts-per-step, --group-size and --micro-batch so they divide evenly)")
    if min(counts) == 0:
        what = "transition (TSP)" if trainer.cfg.topology.tsp else "chunk"
        raise ValueError(f"--train-sharding fsdp: trainer(s) {[i for i, c in enumerate(counts) if c == 0]} get no "
                         f"{what}; use more samples per step or a smaller --micro-batch")
    return max(counts)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv, __doc__.strip().splitlines()[0])
    resolve_defaults(cfg)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    t = cfg.topology
    topo = Topology.build(world, t.mode, t.generators, t.trainers, t.scorers, t.gap_stages)
    validate(cfg, topo)
    use_cuda = torch.cuda.is_available() and cfg.model.device in ("auto", "cuda")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1 or not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=t.dist_timeout_s))
    from runtime import run

    run(cfg, topo, rank)
    return 0


def shutdown(code: int) -> None:
    """End every process the same way: barrier, destroy the process group, flush, os._exit.
    A plain interpreter exit after FSDP2 on gloo aborts intermittently (DIFFUSERS_FACTS.md)."""
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
