"""Rule rewards: no weights, cheap, deterministic."""
from __future__ import annotations

import io

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from rewards.reward import Reward, to_uint8_hwc


def jpeg_size_kb(images: Tensor, quality: int = 95) -> Tensor:
    """(N, 3, H, W) in [0, 1] -> (N,) JPEG file size in kB (1000 bytes) at `quality`, as DDPO / Flow-GRPO."""
    sizes = []
    for array in to_uint8_hwc(images):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegCompressibility(Reward):
    """Negative JPEG size in kB at quality 95: rewards images that compress well (flat, smooth)."""

    name = "jpeg_compressibility"

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = device  # unused: PIL encodes on the CPU

    def score_images(self, images, prompts, metadata):
        return -jpeg_size_kb(images)


class JpegIncompressibility(JpegCompressibility):
    """Positive JPEG size in kB at quality 95: rewards detail and texture."""

    name = "jpeg_incompressibility"

    def score_images(self, images, prompts, metadata):
        return jpeg_size_kb(images)


# Scales of the three rule_aesthetic terms: the raw value at which a term reaches tanh(1) = 0.76.
COLORFULNESS_SCALE = 60.0  # Hasler-Susstrunk M on 0-255 values; their table: 45 "averagely", 59 "quite" colourful
CONTRAST_SCALE = 0.2       # RMS contrast (std of luma in [0, 1]); a uniform random image has 0.29
SHARPNESS_SCALE = 0.05     # mean |4-neighbour Laplacian| of luma in [0, 1], per pixel at native resolution


def colorfulness(images: Tensor) -> Tensor:
    """Hasler & Susstrunk (2003) colourfulness M of (N, 3, H, W) images in [0, 1], on the 0-255 scale:
    rg = R - G, yb = (R + G) / 2 - B, M = sqrt(std_rg^2 + std_yb^2) + 0.3 sqrt(mean_rg^2 + mean_yb^2)."""
    r, g, b = (images * 255).unbind(dim=1)  # each (N, H, W)
    rg = (r - g).flatten(1)
    yb = (0.5 * (r + g) - b).flatten(1)
    std = (rg.var(dim=1, unbiased=False) + yb.var(dim=1, unbiased=False)).sqrt()
    mean = (rg.mean(dim=1) ** 2 + yb.mean(dim=1) ** 2).sqrt()
    return std + 0.3 * mean


def luma(images: Tensor) -> Tensor:
    """(N, 3, H, W) -> (N, 1, H, W) Rec. 601 luma."""
    weights = images.new_tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
    return (images * weights).sum(dim=1, keepdim=True)


def sharpness(images: Tensor) -> Tensor:
    """Mean absolute 4-neighbour Laplacian of the luma; replicate padding so borders add no edges."""
    y = F.pad(luma(images), (1, 1, 1, 1), mode="replicate")
    kernel = images.new_tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]]).view(1, 1, 3, 3)
    return F.conv2d(y, kernel).abs().flatten(1).mean(dim=1)


class RuleAesthetic(Reward):
    """A weight-free stand-in for an aesthetic score: the mean of three saturating terms,
    tanh(colourfulness / 60), tanh(RMS contrast / 0.2) and tanh(sharpness / 0.05), each in [0, 1).
    A flat gray image scores 0; a vivid, contrasted, crisp image approaches 1. Like any rule reward it
    can be gamed (pure colour noise scores high), so pair it with a prompt-following reward."""

    name = "rule_aesthetic"

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = device

    def score_images(self, images, prompts, metadata):
        images = images.to(self.device)
        terms = torch.stack([
            torch.tanh(colorfulness(images) / COLORFULNESS_SCALE),
            torch.tanh(luma(images).flatten(1).std(dim=1, unbiased=False) / CONTRAST_SCALE),
            torch.tanh(sharpness(images) / SHARPNESS_SCALE),
        ])  # (3, N)
        return terms.mean(dim=0)
