"""Train the shapes-world detector behind the `shapes_detector` scorer (rewards/shapes_detector.py).

    python -m lab.train_shapes_detector --out assets/shapes-detector

The training data is the world's ground truth only: random scenes (half of them drawn for random
grammar prompts, half random sets of 0-3 objects; more than half of all confined to an image half),
rendered with each object's colour faded at random (an object below half its colour is absent, as
`shapes_world.fade` defines it), three in five passed through the shipped model's autoencoder (so
the detector knows its blur), half blurred, pixel noise and a small colour cast. Nothing of the
`shapes` reward's evaluator is used.
Labels: per (colour, shape) class and quadrant, the number of objects whose centroid lies there.

Writes OUT/model.safetensors, OUT/config.json (architecture and every setting) and OUT/README.md with
the held-out figures: exact count maps on fresh scenes, the strict rule on renders of the 64
evaluation prompts (crisp, autoencoded, faded) and the agreement with the `shapes` evaluator on the
shipped model's own samples.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from safetensors.torch import save_file

from models import load_model
from rewards import shapes_world
from rewards.shapes import ShapesReward
from rewards.shapes_detector import CLASSES, WEIGHTS_FILE, DetectorNet, correct, quadrant_counts
from rl.sampler import SamplingConfig
from rollout import sample_images
from runtime.evaluation import EVAL_STEP

ABSENT_WEIGHTS = (0.2, 0.5)  # colour weight of a faded, absent object (the shipped model's last stage: 0.30-0.45)
PRESENT_WEIGHTS = (0.5, 1.0)  # colour weight of a visible one, when not at full colour
BLURS = (0.5, 0.8, 1.1)  # Gaussian blur sigmas (pixels), each on a sixth of the images


def random_scene(rng: np.random.Generator) -> shapes_world.Scene:
    if rng.random() < 0.5:
        return shapes_world.sample_scene(rng)
    n = int(rng.choice(4, p=[0.1, 0.3, 0.3, 0.3]))
    objects = tuple(shapes_world.ObjectSpec(shapes_world.COLORS[rng.integers(6)], shapes_world.SHAPES[rng.integers(3)])
                    for _ in range(n))
    position = (None, *shapes_world.POSITIONS)[rng.choice(5, p=[0.6, 0.1, 0.1, 0.1, 0.1])] if n else None
    return shapes_world.sample_scene(rng, shapes_world.Spec(objects, position))


def render_faded(scene: shapes_world.Scene, weights: list[float]) -> np.ndarray:
    """`shapes_world.render` with object i's colour at weight[i] of its difference from the background."""
    image = np.empty((scene.height, scene.width, 3), dtype=np.float32)
    image[:] = shapes_world.BACKGROUND
    background = np.array(shapes_world.BACKGROUND, dtype=np.float32)
    for o, w in zip(scene.objects, weights):
        colour = background + w * (np.array(shapes_world.PALETTE[o.color], dtype=np.float32) - background)
        image[o.y:o.y + o.size, o.x:o.x + o.size][shapes_world.shape_mask(o.shape, o.size)] = colour
    return np.round(image).astype(np.uint8)


def object_weights(rng: np.random.Generator, n: int) -> list[float]:
    if rng.random() < 0.15:  # the whole image faded, as the shipped model's last stage drew
        return [float(rng.uniform(*ABSENT_WEIGHTS))] * n
    return [float(rng.uniform(*ABSENT_WEIGHTS)) if rng.random() < 0.1
            else 1.0 if rng.random() < 0.5 else float(rng.uniform(*PRESENT_WEIGHTS)) for _ in range(n)]


def load_vae(model_path: str):
    return AutoencoderKL.from_pretrained(os.path.join(model_path, "vae"), local_files_only=True).eval()


@torch.no_grad()
def roundtrip(vae, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(N, 3, 32, 32) in [0, 1] through the autoencoder (a posterior sample, as a generated latent is
    never exactly the mode)."""
    out = []
    for lo in range(0, len(images), 512):
        posterior = vae.encode(images[lo:lo + 512] * 2 - 1).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        out.append(((vae.decode(z).sample + 1) / 2).clamp(0, 1))
    return torch.cat(out)


def blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    """A separable Gaussian blur of (N, 3, H, W) images, edges replicated."""
    taps = torch.arange(-2, 3, dtype=torch.float32)
    kernel = torch.exp(-taps ** 2 / (2 * sigma ** 2))
    kernel = (kernel / kernel.sum()).repeat(3, 1, 1)  # (3, 1, 5)
    x = F.pad(images, (2, 2, 2, 2), mode="replicate")
    x = F.conv2d(x, kernel[:, :, None, :], groups=3)
    return F.conv2d(x, kernel[:, :, :, None], groups=3)


def make_data(n: int, seed: int, vae, vae_share: float = 0.6) -> tuple[torch.Tensor, torch.Tensor]:
    """n images (N, 3, 32, 32) in [0, 1] and their (N, 18, 4) count maps."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    images, labels = [], []
    for _ in range(n):
        scene = random_scene(rng)
        weights = object_weights(rng, len(scene.objects))
        images.append(render_faded(scene, weights))
        visible = tuple(o for o, w in zip(scene.objects, weights) if w >= 0.5)
        labels.append(quadrant_counts(shapes_world.Scene(visible, scene.position, scene.height, scene.width)))
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255
    through = torch.from_numpy(rng.random(n) < vae_share)
    x[through] = roundtrip(vae, x[through], generator)
    which = torch.randint(2 * len(BLURS), (n,), generator=generator)
    for i, sigma in enumerate(BLURS):
        x[which == i] = blur(x[which == i], sigma)
    x = x + torch.randn(x.shape, generator=generator) * torch.rand(n, 1, 1, 1, generator=generator) * 0.03
    x = x + (torch.rand(n, 3, 1, 1, generator=generator) - 0.5) * 0.06  # a small colour cast
    return x.clamp(0, 1), torch.stack(labels)


def train(net: DetectorNet, x: torch.Tensor, y: torch.Tensor, steps: int, batch: int, lr: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    net.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + np.cos(np.pi * step / steps))
        idx = torch.randint(len(x), (batch,), generator=generator)
        labels = y[idx]
        logits = net(x[idx])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}", flush=True)
    net.eval()


@torch.no_grad()
def predict(net: DetectorNet, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([net(x[lo:lo + 1024]).argmax(-1) for lo in range(0, len(x), 1024)])


@torch.no_grad()
def prompt_checks(net: DetectorNet, vae, prompts: list[str], seed: int) -> dict[str, float]:
    """The strict rule on one render of each prompt: crisp, through the autoencoder, and faded to
    colour weight 0.35 (every object absent: no prompt can be correct)."""
    rng = np.random.default_rng(seed)
    specs = [shapes_world.parse_prompt(p) for p in prompts]
    scenes = [shapes_world.render(shapes_world.sample_scene(rng, s)) for s in specs]
    crisp = torch.from_numpy(np.stack(scenes)).permute(0, 3, 1, 2).float() / 255
    faded = torch.from_numpy(np.stack([shapes_world.fade(s, 0.35) for s in scenes])).permute(0, 3, 1, 2).float() / 255
    out = {}
    for name, x in (("crisp", crisp), ("autoencoded", roundtrip(vae, crisp, torch.Generator().manual_seed(seed))),
                    ("faded 0.35", faded)):
        out[name] = float(np.mean([correct(c, s) for c, s in zip(predict(net, x), specs)]))
    return out


def agreement(net: DetectorNet, model_path: str, prompts: list[str]) -> dict[str, float]:
    """On the shipped model's ODE samples (image j with the evaluation's seed j): the scorer's mean, the
    `shapes` evaluator's mean, and how often the scorer calls an image correct when the evaluator gives
    it full marks and when it does not."""
    adapter = load_model("flux", model_path)
    cfg = SamplingConfig.for_adapter(adapter, noise_level=0.0, seed=0)
    _, images = sample_images(adapter, prompts, cfg, step=EVAL_STEP, sample_ids=list(range(len(prompts))),
                              batch_size=64)
    rule = ShapesReward()(images, prompts)
    ours = torch.tensor([float(correct(c, shapes_world.parse_prompt(p)))
                         for c, p in zip(predict(net, images.float()), prompts)])
    full = rule >= 0.999
    return {"images": len(prompts), "shapes_detector": float(ours.mean()), "shapes": float(rule.mean()),
            "evaluator full marks": float(full.float().mean()),
            "correct | full marks": float(ours[full].mean()) if full.any() else float("nan"),
            "correct | not full marks": float(ours[~full].mean()) if (~full).any() else float("nan")}


def card(args, report: dict, data_s: float, train_s: float) -> str:
    checks, samples = report["64 evaluation prompts, strict rule"], report["shipped model samples"]
    return f"""# shapes-detector: the independent scorer of the shapes world

The weights of the `shapes_detector` scorer (rewards/shapes_detector.py): a {sum(
        p.numel() for p in DetectorNet(args.width, args.hidden).parameters()) / 1e3:.0f}k-parameter
convolutional network that predicts, for each (colour, shape) class and image quadrant, how many
objects lie there; an image is correct when it holds exactly what its prompt asks for (GenEval's
rule). It learned from rendered scenes only (lab/train_shapes_detector.py), never from the
`shapes` evaluator, which it checks.

```
python -m lab.train_shapes_detector --out {args.out} --train-images {args.train_images} --steps {args.steps}
```

{args.train_images} training images ({data_s / 60:.1f} minutes to make), {args.steps} steps of {args.batch_size}
({train_s / 60:.1f} minutes on this 2-core CPU, {args.threads} torch threads); every setting is in config.json.

## Held-out figures

- Fresh scenes of another seed ({report["held-out scenes"]}, made as the training data): the whole count map
  exact {report["count maps exact"]:.3f}, every class's count exact {report["class counts exact"]:.3f}.
- One render of each of the first 64 evaluation prompts, strict rule: crisp {checks["crisp"]:.3f},
  through the autoencoder {checks["autoencoded"]:.3f}, faded to colour weight 0.35 {checks["faded 0.35"]:.3f}
  (every object absent, so 0 is right).
- The shipped model's ODE samples of the first {samples["images"]} evaluation prompts (seed j for prompt j):
  this scorer {samples["shapes_detector"]:.3f}, the `shapes` evaluator {samples["shapes"]:.3f}; of the images the
  evaluator gives full marks ({samples["evaluator full marks"]:.3f} of all), this scorer calls
  {samples["correct | full marks"]:.2f} correct, of the others {samples["correct | not full marks"]:.3f}.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--out", default="assets/shapes-detector")
    p.add_argument("--model-path", default="assets/shapes-flux", help="whose autoencoder the data passes through")
    p.add_argument("--train-images", type=int, default=120000)
    p.add_argument("--val-images", type=int, default=4000)
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-prompts", default="data/shapes_eval.txt")
    p.add_argument("--agreement-prompts", type=int, default=256, help="shipped-model samples compared with `shapes`")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    start = time.time()
    vae = load_vae(args.model_path)
    x, y = make_data(args.train_images, args.seed, vae)
    xv, yv = make_data(args.val_images, args.seed + 1, vae)
    data_s = time.time() - start
    print(f"data: {len(x)} + {len(xv)} images in {data_s:.0f} s", flush=True)
    net = DetectorNet(args.width, args.hidden)
    train(net, x, y, args.steps, args.batch_size, args.lr, args.seed)
    train_s = time.time() - start - data_s

    pred = predict(net, xv)
    with open(args.eval_prompts) as f:
        prompts = [line.strip() for line in f if line.strip()]
    report = {
        "held-out scenes": len(xv),
        "count maps exact": float((pred == yv).flatten(1).all(1).float().mean()),
        "class counts exact": float((pred.sum(2) == yv.sum(2)).all(1).float().mean()),
        "64 evaluation prompts, strict rule": prompt_checks(net, vae, prompts[:64], args.seed + 2),
        "shipped model samples": agreement(net, args.model_path, prompts[:args.agreement_prompts]),
    }
    print(json.dumps(report, indent=1))
    os.makedirs(args.out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, os.path.join(args.out, WEIGHTS_FILE))
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "threads")}
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({"width": args.width, "hidden": args.hidden, "classes": [list(c) for c in CLASSES],
                   "training": settings, "report": report,
                   "minutes": {"data": round(data_s / 60, 1), "training": round(train_s / 60, 1)}}, f, indent=1)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(card(args, report, data_s, train_s))
    print(f"wrote {args.out} ({(time.time() - start) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
