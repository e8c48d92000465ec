"""Run metrics: one JSON line per `log` call in `<output_dir>/metrics.jsonl`, the same scalars
in TensorBoard (`<output_dir>/tb`), and image grids as PNG and in TensorBoard.

Only rank 0 creates an enabled logger; every other rank may hold a disabled one, whose methods
do nothing, so call sites need no rank checks. Keys are namespaced: `reward/mean`,
`train/loss`, `train/approx_kl`, `perf/step_s`, ...
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.tensorboard import SummaryWriter


def pad_to_largest(images: list[Tensor]) -> Tensor:
    """Images [C, H, W] of different sizes (prompts of several shapes) as one [B, C, H, W] batch:
    each centred on a black canvas of the largest height and width."""
    if not images:
        raise ValueError("image_grid got no images")
    h, w = max(int(i.shape[-2]) for i in images), max(int(i.shape[-1]) for i in images)
    out = torch.zeros(len(images), images[0].shape[0], h, w)
    for b, image in enumerate(images):
        y, x = (h - image.shape[-2]) // 2, (w - image.shape[-1]) // 2
        out[b, :, y:y + image.shape[-2], x:x + image.shape[-1]] = image.detach().float().cpu()
    return out


def image_grid(images: Tensor | list[Tensor], nrow: int = 8, padding: int = 2) -> Image.Image:
    """Tile images [B, 3, H, W] (or [B, 1, H, W]) with values in [0, 1] into one RGB image,
    `nrow` images per row, separated by `padding` black pixels. A list of [3, H, W] images of
    different sizes is padded to the largest first (`pad_to_largest`)."""
    if isinstance(images, (list, tuple)):
        images = pad_to_largest(list(images))
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"image_grid expects [B, 3, H, W] or [B, 1, H, W], got {list(images.shape)}")
    if images.shape[0] == 0:
        raise ValueError("image_grid got no images")
    if nrow < 1:
        raise ValueError(f"nrow must be at least 1, got {nrow}")
    images = images.detach().float().cpu()
    if images.shape[1] == 1:
        images = images.expand(-1, 3, -1, -1)
    b, _, h, w = images.shape
    ncol = min(nrow, b)
    nrows = math.ceil(b / ncol)
    grid = torch.zeros(3, nrows * (h + padding) + padding, ncol * (w + padding) + padding)
    for i in range(b):
        y = padding + (i // ncol) * (h + padding)
        x = padding + (i % ncol) * (w + padding)
        grid[:, y:y + h, x:x + w] = images[i]
    pixels = (grid.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous()  # (H, W, 3)
    return Image.fromarray(pixels.numpy())


def _to_float(value: Any) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric tensors must have one element, got shape {list(value.shape)}")
        return float(value.item())
    return float(value)


class MetricsLogger:
    """Writes scalars and image grids of a run under `output_dir`."""

    def __init__(self, output_dir: str | os.PathLike, enabled: bool = True):
        self.output_dir = os.fspath(output_dir)
        self.enabled = enabled
        self._jsonl = None
        self._writer = None
        if enabled:
            os.makedirs(self.output_dir, exist_ok=True)
            self._jsonl = open(os.path.join(self.output_dir, "metrics.jsonl"), "a")
            self._writer = SummaryWriter(log_dir=os.path.join(self.output_dir, "tb"))

    def log(self, step: int, scalars: dict[str, Any]) -> None:
        """Append {"step", "time", **scalars} (values as floats) to metrics.jsonl and TensorBoard."""
        if not self.enabled:
            return
        values = {key: _to_float(v) for key, v in scalars.items()}
        record = {"step": int(step), "time": time.time(), **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, v in values.items():
            self._writer.add_scalar(key, v, global_step=int(step))
        self._writer.flush()

    def log_images(self, step: int, tag: str, images: Tensor, captions: list[str] | None = None,
                   nrow: int = 8) -> str | None:
        """Write a grid of images [B, 3, H, W] in [0, 1] (or a list of [3, H, W]) to TensorBoard under `tag` and as
        `<output_dir>/<tag>/step-{step:06d}.png` (captions, one per line, beside it as .txt).
        Returns the PNG path (None when disabled)."""
        if not self.enabled:
            return None
        if captions is not None and len(captions) != len(images):
            raise ValueError(f"{len(captions)} captions for {len(images)} images")
        grid = image_grid(images, nrow)
        directory = os.path.join(self.output_dir, tag)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"step-{int(step):06d}.png")
        grid.save(path)
        pixels = torch.from_numpy(np.array(grid)).permute(2, 0, 1)  # (3, H, W) uint8
        self._writer.add_image(tag, pixels, global_step=int(step), dataformats="CHW")
        if captions is not None:
            with open(path[:-len(".png")] + ".txt", "w") as f:
                f.write("\n".join(captions) + "\n")
            text = "\n".join(f"{i}. {c}" for i, c in enumerate(captions))
            self._writer.add_text(f"{tag}/captions", text, global_step=int(step))
        self._writer.flush()
        return path

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.enabled = False

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (or of `<path>/metrics.jsonl` for a run directory)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


__all__ = ["MetricsLogger", "image_grid", "read_metrics"]
