"""Check a recipe without weights or GPUs: its config validates on the GPU count it names, and the
memory estimate of each role (runtime/memory.py) fits the GPU kind it names.

    python -m scripts.check_recipe recipes/flow_grpo/flux_dev.toml
    python -m scripts.check_recipe recipes/dance_grpo/hunyuan_video.toml --config recipes/topology/32gpus.toml

Exit 0 when it fits; 2 (with the reason) when not.
"""
from __future__ import annotations

import argparse
import os


from config import cli
from config.schema import DATA_DIR
from config.validate import validate
from config.cli import load_config_files
from runtime.memory import GPU_MEMORY, USABLE, GiB, check_fits, model_shape


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("recipe", help="a recipe (.toml)")
    p.add_argument("--config", action="append", default=[], help="more config files after the recipe (a topology)")
    p.add_argument("--gpu", default=None, help=f"check on this GPU kind instead of the recipe's: {sorted(GPU_MEMORY)}")
    args = p.parse_args(argv)
    cfg, recipe = load_config_files([args.recipe, *args.config])
    for key in ("model_config", "gpu", "gpus"):
        if key not in recipe:
            raise ValueError(f"{args.recipe!r} has no recipe.{key}: not a recipe")
    # Stand-ins for what the recipe needs from the user: nothing is loaded.
    cfg.rl.reward_model = [f"{spec.split(':')[0]}=/weights" for spec in cfg.rl.reward]
    cfg.rl.prompts = cfg.output.eval_prompts = os.path.join(DATA_DIR, "shapes_train.txt")
    cfg.resolve_defaults()
    facts = validate(cfg, recipe["gpus"], weights=False)
    gpu = args.gpu or recipe["gpu"]
    shape = model_shape(recipe["model_config"], cfg)
    topo = facts.topology
    print(f"{recipe.get('name', args.recipe)}: {recipe['gpus']} x {gpu} ({USABLE * GPU_MEMORY[gpu] / GiB:.1f} GiB "
          f"usable each), {len(topo.generator_ranks)} generators + {topo.num_trainers} trainers "
          f"({facts.train_sharding}), {'LoRA rank ' + str(cfg.optim.lora_rank) if facts.lora else 'full fine-tuning'}")
    print(f"  transformer {shape.params['transformer'] / 1e9:.2f}B parameters, {shape.tokens} tokens per sample")
    need = check_fits(cfg, facts, shape, gpu)
    for role, nbytes in need.items():
        print(f"  {role}: about {nbytes / GiB:.1f} GiB")
    return 0


if __name__ == "__main__":
    cli.run(main)
