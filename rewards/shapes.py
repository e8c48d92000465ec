"""The shapes-world reward: the GenEval-like evaluator of `shapes_world` on generated images."""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

from rewards import shapes_world
from rewards.reward import Reward, to_uint8_hwc


@lru_cache(maxsize=4096)
def _spec(prompt: str) -> shapes_world.Spec:
    return shapes_world.parse_prompt(prompt)


class ShapesReward(Reward):
    """Score in [0, 1] of each image for its prompt: the color, shape, count and position checks of
    `shapes_world.evaluate`. Images of another size are resized (area average) to the world's 32x32
    first, so the evaluator's pixel thresholds keep their meaning. A prompt outside the grammar
    raises ValueError naming it."""

    name = "shapes"

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)  # simple image processing: it runs on the CPU whatever the device

    @classmethod
    def check_prompt(cls, prompt: str) -> None:
        _spec(prompt)

    def score_images(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        specs = [_spec(p) for p in prompts]
        images = images.detach().float().cpu()  # (N, 3, H, W)
        if images.shape[-2:] != (shapes_world.SIZE, shapes_world.SIZE):
            images = F.interpolate(images, size=(shapes_world.SIZE, shapes_world.SIZE), mode="area")
        pixels = to_uint8_hwc(images)  # (N, 32, 32, 3)
        return torch.tensor([shapes_world.evaluate(img, spec)[0] for img, spec in zip(pixels, specs)],
                            dtype=torch.float32)
