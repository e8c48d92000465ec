"""Run by tests/test_tag_tcss.py under torchrun with 2 ranks: the generation of TAG's FSDP helper
(tag.GroupAssistant: a real fragment on rank 0, a throw-away chunk on rank 1, as in one round)
between two training forwards of a step leaves the accumulated gradients, the optimizer state
and the weights as they were, and the training after it accumulates bitwise as without it."""
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def _local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def main() -> None:
    from rl import sampler
    from config.cli import parse_config
    from models import load_model
    from models.lora import apply_lora
    from parallel.stepplan import plan_step
    from prompts.sets import load_prompts
    from rewards import RewardSet
    from parallel.tag import GroupAssistant
    from rollout import Generator
    from trainer import Trainer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = parse_config(["--preset", "tiny", "--lora-rank", "4", "--sample-steps", "3", "--height", "16", "--width", "16",
                        "--reward", "jpeg_compressibility", "--prompts-per-step", "2", "--group-size", "2",
                        "--micro-batch", "2", "--lr", "1e-3"])
    cfg.resolve_defaults()
    adapter = load_model(cfg.model.model, cfg.model.model_path, preset=cfg.model.preset, seed=cfg.seed)
    apply_lora(adapter.transformer, 4, None, cfg.optim.lora_targets, cfg.seed)
    sampling = sampler.SamplingConfig.for_adapter(adapter, height=16, width=16, num_steps=3, seed=cfg.seed)
    records = load_prompts(cfg.rl.prompts)
    trainer = Trainer(cfg, adapter, sampling, dist.group.WORLD, "fsdp")
    generator = Generator(adapter, sampling, RewardSet(cfg.rl.reward), records, seed=cfg.seed)
    plan = plan_step(0, seed=cfg.seed, num_prompts=len(records), prompts_per_step=2, group_size=2, micro_batch=2,
                     num_replicas=1, num_trainers=2, fragment_groups=1)
    assert len(plan.fragments) == 2 and all(len(f.chunks) == 1 for f in plan.fragments)
    results = []
    generator.generate(plan, plan.fragments, 0, None, results.append)
    first, second = (r.chunks[0] for r in results)
    for chunk in (first, second):  # tiny groups often score alike: set advantages that give a gradient
        chunk.advantages = torch.tensor([1.0, -1.0])
    trainer.current_step = 0
    trainer.train_chunk(first)
    trainer.finish_step()  # one update, so that the optimizer holds state

    helper = GroupAssistant(SimpleNamespace(topo=SimpleNamespace(num_replicas=1)), generator, None, 2, rank)
    helper.plan, helper.reward_std = plan, None

    def snapshot():
        grads = [_local(p.grad) for p in trainer.params]
        state = [_local(v) for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return grads, state, [_local(p) for p in trainer.params]

    trainer.train_chunk(first)
    before = snapshot()
    if rank == 0:
        result = helper._generate(1)  # the fragment of one round
        assert result.chunks[0].fragment == 1 and not result.chunks[0].latents.requires_grad
    else:
        generator.denoise_padding(plan.step)  # the same forwards, nothing kept
    after = snapshot()
    for what, a, b in zip(("gradient", "optimizer state", "weight"), before, after):
        assert len(a) == len(b) > 0, what
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"the helper generation changed a {what}"
    trainer.train_chunk(second)
    helped = [_local(p.grad) for p in trainer.params]

    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.train_chunk(first)
    trainer.train_chunk(second)
    plain = [_local(p.grad) for p in trainer.params]
    assert all(torch.equal(x, y) for x, y in zip(helped, plain)), "training after the helper accumulated differently"
    assert any(x.abs().sum() > 0 for x in plain)  # the comparison is between real gradients
    print(f"rank {rank}: helper generation left {len(plain)} gradients untouched", flush=True)


if __name__ == "__main__":
    from train_disagg import shutdown

    import traceback

    code = 1
    try:
        main()
        code = 0
    except BaseException:  # noqa: BLE001 - print it before os._exit
        traceback.print_exc()
    finally:
        shutdown(code)  # FSDP2 on gloo: end with barrier, destroy, flush, os._exit (docs/MODELS.md)
