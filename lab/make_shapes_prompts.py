"""Write the shapes-world prompt sets: data/shapes_train.txt, the held-out data/shapes_eval.txt,
data/shapes_objects.txt (the 18 single-object prompts without a position, for quick probes) and
data/shapes_mixed.jsonl (training prompts with their own image size, for mixed-cost runs).

The grammar (rewards/shapes_world.py) has exactly 1800 distinct prompts. One sixth of every template kind
(one object, two, three, a pair of different objects), drawn with a fixed seed, is held out for
evaluation (300 prompts); the train set is the other 1500. Re-running gives the same files.

    python -m lab.make_shapes_prompts [--out-dir data] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from rewards import shapes_world

EVAL_FRACTION_DENOMINATOR = 6  # 1/6 of each kind held out
MIXED_SIZES = (16, 32, 48, 48)  # shapes_mixed.jsonl: 1:1:2 of 16x16, 32x32 and 48x48, in turn
MIXED_PROMPTS = 400


def mixed_shapes(train: list[str]) -> list[dict]:
    """The first MIXED_PROMPTS training prompts, each with its own square size from MIXED_SIZES in
    turn: multiples of the shipped model's factor 4 (VAE 2 x 2x2 packing), 144 tokens at 48x48
    against 16 at 16x16."""
    return [{"prompt": p, "height": MIXED_SIZES[i % len(MIXED_SIZES)], "width": MIXED_SIZES[i % len(MIXED_SIZES)]}
            for i, p in enumerate(train[:MIXED_PROMPTS])]


def split_prompts(seed: int = 0) -> tuple[list[str], list[str]]:
    rng = np.random.default_rng(seed)
    train, held_out = [], []
    for kind in shapes_world.KINDS:
        prompts = [shapes_world.spec_to_prompt(s) for s in shapes_world.all_specs() if s.kind == kind]
        order = rng.permutation(len(prompts))
        num_eval = len(prompts) // EVAL_FRACTION_DENOMINATOR
        held_out += [prompts[i] for i in order[:num_eval]]
        train += [prompts[i] for i in order[num_eval:]]
    # Interleave kinds so that any prefix of a file is a mix of templates.
    train = [train[i] for i in rng.permutation(len(train))]
    held_out = [held_out[i] for i in rng.permutation(len(held_out))]
    return train, held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="data")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train, held_out = split_prompts(args.seed)
    shared = set(train) & set(held_out)
    if shared:  # held-out prompts must never be trained on
        raise SystemExit(f"error: {len(shared)} prompts are in both splits, e.g. {sorted(shared)[:3]}")
    os.makedirs(args.out_dir, exist_ok=True)
    objects = [shapes_world.spec_to_prompt(s) for s in shapes_world.all_specs()
               if s.kind == "one" and s.position is None]
    for name, prompts in (("shapes_train.txt", train), ("shapes_eval.txt", held_out), ("shapes_objects.txt", objects)):
        path = os.path.join(args.out_dir, name)
        with open(path, "w") as f:
            f.write("\n".join(prompts) + "\n")
        print(f"wrote {len(prompts)} prompts to {path}")
    mixed = mixed_shapes(train)
    path = os.path.join(args.out_dir, "shapes_mixed.jsonl")
    with open(path, "w") as f:
        f.write("".join(json.dumps(record) + "\n" for record in mixed))
    print(f"wrote {len(mixed)} prompts to {path}")


if __name__ == "__main__":
    main()
