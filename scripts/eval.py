"""Evaluate a model or a training checkpoint on a prompt set with the ODE sampler and fixed seeds.

    python -m scripts.eval --model-path assets/shapes-flux --prompts data/shapes_eval.txt --out eval/base
    python -m scripts.eval --model-path assets/shapes-flux --checkpoint runs/default/checkpoints/step-20 \\
        --prompts data/shapes_eval.txt --out eval/step-20

Writes OUT/metrics.json (mean of every reward, and per-prompt scores) and OUT/grid.png (videos: a
frame strip, and the animated grid OUT/grid.gif), so runs can be compared before and after training.
"""
from __future__ import annotations

import argparse
import json
import os

from checkpointing.checkpoint import load_trained_weights, verify_checkpoint
from config import cli
from prompts import resolutions
from rl import sampler
from runtime.evaluation import evaluate, summarize
from prompts.sets import eval_records
from telemetry.metrics import LOGGED_IMAGES, thumbnails, write_grid
from models import adapter_class, load_model, model_names, resolve_device
from rewards import (RewardSet, check_reward_options, check_user_rewards, judge_paths, parse_reward_spec,
                     reward_model_paths, reward_scales)
from config.schema import default_eval_scorers, eval_scorers
from config.validate import check_scorers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--model", default="flux", help=f"model family, one of {model_names()}")
    p.add_argument("--model-path", default=None, help="local diffusers folder (default: the tiny preset)")
    p.add_argument("--checkpoint", default=None, help="a checkpoints/step-N folder of a training run, or its ema/")
    p.add_argument("--prompts", required=True, help="prompt file (.txt or .jsonl)")
    p.add_argument("--num-prompts", type=int, default=None, help="evaluate only the first N prompts")
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="images per prompt, each with its own fixed seed (GenEval: 4)")
    p.add_argument("--reward", action="append", default=None,
                   help="NAME[:WEIGHT], module:function[:WEIGHT] or [PROTOCOL+]http://HOST:PORT/NAME[:WEIGHT], "
                        "repeatable (default shapes; rewards/README.md)")
    p.add_argument("--reward-model", action="append", default=[], help="NAME=DIR for model-based rewards")
    p.add_argument("--reward-scale", action="append", default=[], help="NAME=FACTOR: a reward's unit (a peer's)")
    p.add_argument("--reward-judge", action="append", default=[], help="NAME=FILE: an openai+http:// judge's file")
    p.add_argument("--eval-scorer", action="append", default=[],
                   help="NAME, repeatable: reported as eval/NAME outside eval/reward (default: shapes_detector "
                        "with the shapes reward; none: no scorer)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--num-frames", type=int, default=None)
    p.add_argument("--sample-steps", type=int, default=None, help="ODE steps (default: the model's)")
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--cfg-scale", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", required=True, help="output folder for metrics.json and grid.png")
    args = p.parse_args(argv)

    if args.checkpoint:
        verify_checkpoint(args.checkpoint)  # its bytes are those its run wrote, before any model loads
    records = eval_records(args.prompts, args.num_prompts, args.samples_per_prompt)
    specs, model_paths = args.reward or ["shapes:1.0"], reward_model_paths(args.reward_model)
    scorer_specs = args.eval_scorer or default_eval_scorers(specs)
    check_scorers(scorer_specs, [parse_reward_spec(s)[0] for s in specs], model_paths)
    scored = [*specs, *eval_scorers(scorer_specs)]
    options = dict(model_paths=model_paths, judges=judge_paths(args.reward_judge), scales=reward_scales(args.reward_scale))
    check_reward_options([parse_reward_spec(s)[0] for s in scored], options["judges"], options["scales"], scored)
    check_user_rewards(scored, video=adapter_class(args.model).video)
    rewards = RewardSet(specs, **options)
    scorers = RewardSet(eval_scorers(scorer_specs), **options) if eval_scorers(scorer_specs) else None
    adapter = load_model(args.model, args.model_path, device=resolve_device(args.device))
    if args.checkpoint:
        load_trained_weights(adapter, args.checkpoint)
    cfg = sampler.SamplingConfig.for_adapter(adapter, height=args.height, width=args.width,
                                             num_steps=args.sample_steps, guidance=args.guidance,
                                             cfg_scale=args.cfg_scale, seed=args.seed, num_frames=args.num_frames)
    resolutions.check_shapes(adapter, records, cfg, args.prompts)  # prompts of their own shape: each must fit the model
    scores, images = evaluate(adapter, cfg, records, rewards, batch_size=args.batch_size, keep_images=LOGGED_IMAGES,
                              thumbnail=thumbnails, progress=True, scorers=scorers)
    os.makedirs(args.out, exist_ok=True)
    default = resolutions.default_shape(cfg)
    summary = summarize(scores, [resolutions.shape_name(resolutions.record_shape(r, default)) for r in records])
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        per_image = [{"prompt": r.prompt, **{k: v[i] for k, v in scores.items()}} for i, r in enumerate(records)]
        json.dump({"summary": summary, "model_path": args.model_path, "checkpoint": args.checkpoint,
                   "num_prompts": len(records) // args.samples_per_prompt,
                   "samples_per_prompt": args.samples_per_prompt, "per_prompt": per_image},
                  f, indent=1)
    write_grid(thumbnails(images), os.path.join(args.out, "grid"))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    cli.run(main)
