"""Trainer options checked in process against the plain trainer: activation checkpointing, KL."""
import pytest
import torch


def _trainer_and_chunk(**overrides):
    from rl import sampler
    from config.schema import RunConfig
    from parallel.trainer_intake import TrainChunk
    from models import load_model
    from rollout import encode_batch
    from trainer import Trainer

    adapter = load_model("flux", preset="tiny", seed=0)
    cfg = RunConfig()
    cfg.optim.lora_rank = 0
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    sampling = sampler.SamplingConfig.for_adapter(adapter, height=16, width=16, num_steps=4)
    trainer = Trainer(cfg, adapter, sampling)
    cond, _ = encode_batch(adapter, ["a red circle", "two blue squares"], None, sampling)
    traj = sampler.denoise(adapter, cond, None, [0, 1], 0, sampling)
    chunk = TrainChunk(0, 0, 0, 0, torch.tensor([0, 1]), traj.latents, traj.log_probs, torch.tensor([1.0, -1.0]),
                       torch.ones(2, dtype=torch.bool), traj.sigmas, cond, None)
    return trainer, chunk


def _grads(trainer, chunk):
    trainer.train_chunk(chunk)
    return {n: p.grad.clone() for n, p in trainer.adapter.transformer.named_parameters() if p.grad is not None}


def test_activation_checkpointing_gives_the_same_gradients():
    plain = _grads(*_trainer_and_chunk())
    ckpt = _grads(*_trainer_and_chunk(**{"optim.grad_checkpointing": True}))
    assert plain.keys() == ckpt.keys() and len(plain) > 0
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-6, atol=1e-9, msg=name)


def test_kl_to_a_frozen_reference_is_zero_before_the_first_update():
    trainer, chunk = _trainer_and_chunk(**{"rl.beta": 0.04})
    trainer.train_chunk(chunk)
    assert trainer.sums["kl"] == 0.0  # the policy still equals its frozen copy
    assert trainer.sums["approx_kl"] == 0.0 and trainer.sums["clipfrac"] == 0.0


@pytest.mark.integration  # a torchrun world of 2
def test_sharded_trainers_keep_a_sharded_reference_and_train_with_fused_adamw(tmp_path):
    """tests/dist_scripts/sharded_trainers.py on 2 gloo ranks, full fine-tuning with beta > 0: the KL
    reference is a bf16 shard on each FSDP2 trainer (frozen, the initial weights, KL 0 before the
    first update); two FSDP2 trainers end with the lone trainer's weights, and fused AdamW (what the
    trainer runs, on CPU as on CUDA) with torch's default AdamW's, both within float32 rounding of
    the update."""
    import json

    from lab.launch import torchrun_module

    proc = torchrun_module(2, "tests.dist_scripts.sharded_trainers", [str(tmp_path)], timeout=600, check=False)
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) if (tmp_path / f"rank{r}.json").exists()
               else {"checks": {"missing": True}} for r in range(2)}
    assert proc.returncode == 0, f"{results}\n{proc.stderr[-3000:]}"
    for r in range(2):
        checks = results[r]["checks"]
        assert len(checks) == 15 and all(v is True for v in checks.values()), results[r]
