"""The shapes-world reward: the GenEval-like evaluator of `shapes_world` on generated images."""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

import shapes_world


@lru_cache(maxsize=4096)
def _spec(prompt: str) -> shapes_world.Spec:
    return shapes_world.parse_prompt(prompt)


class ShapesReward:
    """Score in [0, 1] of each image for its prompt (color, shape, count and position checks).

    Images of another size are resized (area average) to the world's 32x32 first, so the evaluator's
    pixel thresholds keep their meaning. Prompts outside the grammar raise ValueError naming them.
    """

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)  # the evaluator runs on the CPU whatever the device

    def __call__(self, images: Tensor, prompts: list[str], metadata=None) -> Tensor:
        """images: float in [0, 1], (B, 3, H, W), or video (B, 3, F, H, W) scored as the frame mean."""
        if images.dim() == 5:
            b, c, f, h, w = images.shape
            frames = images.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
            scores = self(frames, [p for p in prompts for _ in range(f)], metadata)
            return scores.view(b, f).mean(1)
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"ShapesReward expects images (B, 3, H, W) or (B, 3, F, H, W), got {tuple(images.shape)}")
        if len(prompts) != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
        specs = [_spec(p) for p in prompts]
        images = images.detach().float().cpu()
        if images.shape[-2:] != (shapes_world.SIZE, shapes_world.SIZE):
            images = F.interpolate(images, size=(shapes_world.SIZE, shapes_world.SIZE), mode="area")
        pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()  # (B, H, W, 3)
        scores = [shapes_world.evaluate(np.ascontiguousarray(img), spec)[0] for img, spec in zip(pixels, specs)]
        return torch.tensor(scores, dtype=torch.float32)
