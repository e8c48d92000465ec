"""FSDP2 trainers' KL reference and their fused AdamW, across 2 gloo ranks.

Run: torchrun --standalone --nproc_per_node 2 -m tests.dist_scripts.sharded_trainers OUT_DIR
Both ranks are FSDP2 trainers of the tiny FLUX (full fine-tuning, beta > 0), and each also builds
the same trainer alone (replicated, this process only) as the reference:
- bf16 compute: the KL reference is sharded as the weights are (a DTensor shard on each rank), in
  bf16, frozen; before any update its velocity is the trained model's (KL exactly 0), and after an
  update it still holds the initial weights.
- float32: both ranks train the same transitions for 2 steps, so the FSDP2 pair must end with the
  lone trainer's weights; each with the trainer's fused AdamW and with torch's default (foreach),
  whose weights must agree up to float32 rounding, relative to the update.
Each rank writes OUT_DIR/rank{r}.json: its checks and the measured differences; exit 0 only if all
checks passed.
"""
from __future__ import annotations

import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from config.schema import RunConfig
from models import load_model
from parallel.fsdp import full_tensor
from parallel.trainer_intake import TrainChunk
from rl import sampler
from trainer import Trainer, adamw
from tests.dist_scripts.rank_report import finish

STEPS = 2
TOLERANCE = 1e-5
"""|a - b| / |a - initial|: two runs' weights apart, in units of the update. Fused and foreach AdamW
(and a gradient norm summed from shards) round float32 otherwise: a few ulps of a weight, about 6e-7
of the update here (lr 1e-3), a twentieth of this."""


def _config(dtype: str) -> RunConfig:
    cfg = RunConfig()
    cfg.model.dtype, cfg.optim.lora_rank, cfg.optim.lr, cfg.rl.beta = dtype, 0, 1e-3, 0.04
    cfg.rl.clip_range = 1e-2  # the second step's ratios move; the KL term is what this script checks
    return cfg


def _trainer(dtype: str, group=None, fused: bool = True) -> Trainer:
    adapter = load_model("flux", preset="tiny", seed=0)
    sampling = sampler.SamplingConfig.for_adapter(adapter, height=16, width=16, num_steps=4)
    trainer = Trainer(_config(dtype), adapter, sampling, group, "fsdp" if group is not None else "replicate")
    if not fused:
        trainer.optimizer = adamw(trainer.params, trainer.cfg, trainer.device, fused=None)
    return trainer


def _chunk(trainer: Trainer) -> TrainChunk:
    """One chunk of two samples from a seeded rollout of the initial weights, the same on every rank."""
    adapter, sampling = trainer.adapter, trainer.sampling
    cond = adapter.encode_prompts(["a red circle", "two blue squares"])
    with torch.no_grad():
        traj = sampler.denoise(adapter, cond, None, [0, 1], 0, sampling)
    return TrainChunk(0, 0, 0, 0, torch.tensor([0, 1]), traj.latents, traj.log_probs, torch.tensor([1.0, -1.0]),
                      torch.ones(2, dtype=torch.bool), traj.sigmas, cond, None)


def _train(trainer: Trainer, chunk: TrainChunk) -> list[dict]:
    stats = []
    for step in range(STEPS):
        trainer.current_step = step
        trainer.begin_step()
        trainer.train_chunk(chunk)
        stats.append({**trainer.sums, **trainer.finish_step()})
    return stats


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p.detach()).double() for n, p in trainer.adapter.transformer.named_parameters()}


def _difference(a: dict, b: dict, initial: dict) -> float:
    """|a - b| / |a - initial| over all weights: two runs' distance in units of the update."""
    num = sum(((a[n] - b[n]) ** 2).sum() for n in a) ** 0.5
    den = sum(((a[n] - initial[n]) ** 2).sum() for n in a) ** 0.5
    return float(num / den)


def reference_checks(group, checks: dict, figures: dict) -> None:
    trainer = _trainer("bfloat16", group)
    initial = {n: p.detach().to(torch.bfloat16) for n, p in load_model("flux", preset="tiny", seed=0)
               .transformer.named_parameters()}
    ref = list(trainer.reference.transformer.named_parameters())
    checks["reference_is_sharded"] = all(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for _, p in ref)
    checks["reference_is_bf16_and_frozen"] = all(p.dtype == torch.bfloat16 and not p.requires_grad for _, p in ref)
    checks["reference_holds_the_initial_weights"] = all(torch.equal(full_tensor(p), initial[n]) for n, p in ref)
    stats = _train(trainer, _chunk(trainer))
    figures["bf16_kl"] = [s["kl"] for s in stats]
    checks["kl_is_zero_before_the_first_update"] = stats[0]["kl"] == 0.0 < stats[1]["kl"]
    checks["reference_still_initial_after_updates"] = all(
        torch.equal(full_tensor(p), initial[n]) for n, p in trainer.reference.transformer.named_parameters())


def optimizer_checks(group, checks: dict, figures: dict) -> None:
    initial = {n: p.detach().double() for n, p in load_model("flux", preset="tiny", seed=0)
               .transformer.named_parameters()}
    runs = {}
    for name, sharded, fused in (("alone", False, True), ("alone_default", False, False), ("fsdp", True, True),
                                 ("fsdp_default", True, False)):
        trainer = _trainer("float32", group if sharded else None, fused)
        checks[f"{name}_optimizer_is_{'fused' if fused else 'default'}"] = \
            bool(trainer.optimizer.defaults["fused"]) == fused
        stats = _train(trainer, _chunk(trainer))
        runs[name] = _weights(trainer)
        figures[f"{name}_kl"] = [s["kl"] for s in stats]
    figures["update_norm"] = float(sum(((runs["alone"][n] - initial[n]) ** 2).sum() for n in initial) ** 0.5)
    for a, b in (("fsdp", "alone"), ("fsdp_default", "alone_default"), ("alone", "alone_default"),
                 ("fsdp", "fsdp_default")):
        figures[f"{a}_vs_{b}"] = _difference(runs[a], runs[b], initial)
        checks[f"{a}_equals_{b}"] = figures[f"{a}_vs_{b}"] < TOLERANCE
    checks["weights_moved"] = figures["update_norm"] > 1e-3
    checks["kl_term_trained"] = figures["alone_kl"][1] > 0


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    checks: dict = {}
    figures: dict = {}
    try:
        reference_checks(dist.group.WORLD, checks, figures)
        optimizer_checks(dist.group.WORLD, checks, figures)
    except Exception:  # noqa: BLE001 - reported in the rank's file
        checks["exception"] = traceback.format_exc()
    finish(out_dir, rank, checks, {"checks": checks, "figures": figures})


if __name__ == "__main__":
    main()
