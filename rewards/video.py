"""Video rewards: scores of a whole video (B, 3, F, H, W), beyond an image reward's mean over frames
(which every image reward gives on video: rewards/reward.py)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from rewards.reward import Reward


class TemporalConsistency(Reward):
    """1 - the mean absolute difference of consecutive frames, over pixels and channels of values in
    [0, 1]: 1 for a still video, lower the more it flickers or jumps. It is VBench's temporal-flickering
    score (mean absolute difference of consecutive frames, (255 - d) / 255 on 8-bit frames) on [0, 1]
    values. A still video scores best, so weigh it against a reward of what the frames show."""

    name = "temporal_consistency"

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = device  # unused: a difference of frames on the CPU

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        if images.dim() != 5 or images.shape[1] != 3 or images.shape[2] < 2:
            raise ValueError(f"reward {self.name!r} scores videos (B, 3, F, H, W) of at least 2 frames, got "
                             f"{tuple(images.shape)}")
        if len(prompts) != images.shape[0] or (metadata is not None and len(metadata) != images.shape[0]):
            raise ValueError(f"reward {self.name!r}: {images.shape[0]} videos but {len(prompts)} prompts")
        x = images.detach().float().clamp(0, 1).cpu()
        return 1 - (x[:, :, 1:] - x[:, :, :-1]).abs().flatten(1).mean(dim=1)  # (B,)
