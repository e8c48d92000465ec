"""A learned scorer of the shapes world, independent of the `shapes` reward: a small convolutional
detector trained on rendered scenes (lab/train_shapes_detector.py) and GenEval's strict rule.

The `shapes` reward finds objects by nearest palette colour and connected components and gives
partial credit. This scorer shares neither: a network trained only on the world's ground truth
(rendered scenes, some passed through the shipped model's autoencoder, objects faded at random,
pixel noise) predicts, for each of the 18 (colour, shape) classes and each image quadrant, how many
objects of the class have their centroid there (0 to 3). An image is correct (1) when it holds
exactly the objects its prompt asks for, nothing else, and, with a position phrase, all of them in
the named half; otherwise 0. The mean over held-out prompts is GenEval's score: the fraction of
correct images. An object faded below half its colour is absent, as the world defines it
(`shapes_world.fade`). Evaluate with it (`--eval-scorer shapes_detector`); it is not meant to be
trained on.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from rewards import shapes_world
from rewards.reward import Reward

CLASSES = tuple((c, s) for c in shapes_world.COLORS for s in shapes_world.SHAPES)  # 18
QUADRANTS = 4  # index 2 * (bottom) + (right): centroid row/column >= half the image
MAX_COUNT = 3  # counts 0..3 per class and quadrant
DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "shapes-detector")
WEIGHTS_FILE = "model.safetensors"
# The quadrants in each half the position phrases name.
HALF = {"left": (0, 2), "right": (1, 3), "top": (0, 1), "bottom": (2, 3)}


class DetectorNet(nn.Module):
    """(N, 3, 32, 32) images in [0, 1] -> (N, 18, 4, 4) logits: class x quadrant x count. Three
    strided convolutions keep a 4x4 map, so the head still sees where things are."""

    def __init__(self, width: int = 32, hidden: int = 128):
        super().__init__()
        self.width, self.hidden = width, hidden
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.GELU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.GELU(),
            nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1), nn.GELU(),
            nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1), nn.GELU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * width * 16, hidden), nn.GELU(),
                                  nn.Linear(hidden, len(CLASSES) * QUADRANTS * (MAX_COUNT + 1)))

    def forward(self, images: Tensor) -> Tensor:
        x = self.features(images * 2 - 1)
        return self.head(x).view(-1, len(CLASSES), QUADRANTS, MAX_COUNT + 1)


def quadrant_counts(scene: shapes_world.Scene) -> Tensor:
    """The ground truth of a rendered scene: (18, 4) objects of each class whose mask centroid lies in
    each quadrant (pixel centres at i + 0.5, as the world measures positions)."""
    counts = torch.zeros(len(CLASSES), QUADRANTS, dtype=torch.long)
    for o in scene.objects:
        rows, cols = torch.nonzero(torch.from_numpy(shapes_world.shape_mask(o.shape, o.size)), as_tuple=True)
        cx = o.x + cols.double().mean().item() + 0.5
        cy = o.y + rows.double().mean().item() + 0.5
        counts[CLASSES.index((o.color, o.shape)), 2 * (cy >= scene.height / 2) + (cx >= scene.width / 2)] += 1
    return counts


def correct(counts: Tensor, spec: shapes_world.Spec) -> bool:
    """GenEval's rule on (18, 4) counts: exactly the asked objects and nothing else, all in the named
    half when the prompt names one."""
    asked = torch.zeros(len(CLASSES), dtype=torch.long)
    for o in spec.objects:
        asked[CLASSES.index((o.color, o.shape))] += o.count
    if not torch.equal(counts.sum(1), asked):
        return False
    if spec.position is None:
        return True
    inside = counts[:, list(HALF[spec.position])].sum(1)
    return bool(torch.equal(inside, asked))


@lru_cache(maxsize=4096)
def _spec(prompt: str) -> shapes_world.Spec:
    return shapes_world.parse_prompt(prompt)


def load_detector(path: str = DEFAULT_DIR, device: str | torch.device = "cpu") -> DetectorNet:
    config_file, weights = os.path.join(path, "config.json"), os.path.join(path, WEIGHTS_FILE)
    if not (os.path.isfile(config_file) and os.path.isfile(weights)):
        raise ValueError(f"shapes detector folder {path!r} lacks config.json or {WEIGHTS_FILE} "
                         f"(python -m lab.train_shapes_detector writes them)")
    with open(config_file) as f:
        config = json.load(f)
    net = DetectorNet(config["width"], config["hidden"])
    net.load_state_dict(load_file(weights))
    return net.to(device).eval()


class ShapesDetector(Reward):
    """1 when the detector finds exactly what the prompt asks for (see the module), else 0. The
    weights are the project's own (assets/shapes-detector); images of another size are resized
    (area average) to the world's 32x32 first."""

    name = "shapes_detector"
    batch_size = 256

    def __init__(self, device: str | torch.device = "cpu", path: str = DEFAULT_DIR):
        self.device = torch.device(device)
        self.net = load_detector(path, self.device)

    @classmethod
    def check_prompt(cls, prompt: str) -> None:
        _spec(prompt)

    def counts(self, images: Tensor) -> Tensor:
        """(N, 3, H, W) in [0, 1] -> (N, 18, 4) predicted counts."""
        images = images.float().to(self.device)
        if images.shape[-2:] != (shapes_world.SIZE, shapes_world.SIZE):
            images = F.interpolate(images, size=(shapes_world.SIZE, shapes_world.SIZE), mode="area")
        return self.net(images).argmax(-1).cpu()

    def score_images(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        counts = self.counts(images)
        return torch.tensor([float(correct(c, _spec(p))) for c, p in zip(counts, prompts)])
