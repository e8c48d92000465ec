"""Run metrics: one JSON line per `log` call in `<output_dir>/metrics.jsonl`, the same scalars
in TensorBoard (`<output_dir>/tb`) and, with --wandb, in Weights & Biases (telemetry/wandb_sink.py),
and image grids as PNG, in TensorBoard and in wandb. Videos are written as an animated GIF grid and
a PNG frame strip; TensorBoard gets the video when moviepy (which its `add_video` needs) is
installed, else the frame strip; wandb gets the GIF.

Only rank 0 creates an enabled logger; every other rank may hold a disabled one, whose methods
do nothing, so call sites need no rank checks. Keys are namespaced: `reward/mean`,
`train/loss`, `train/approx_kl`, `perf/step_s`, ...
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor
from torch.utils.tensorboard import SummaryWriter

from telemetry.wandb_sink import WandbOptions, WandbSink


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


THUMBNAIL_PX = 256
LOGGED_IMAGES, LOGGED_VIDEOS, LOGGED_FRAMES = 64, 8, 16
"""A logged grid shows at most LOGGED_IMAGES images, or LOGGED_VIDEOS videos of LOGGED_FRAMES frames,
at most THUMBNAIL_PX pixels a side: what the runtime sends to the logging rank."""


def thumbnails(images: Tensor, limit: int = LOGGED_IMAGES) -> Tensor:
    """What a logged grid shows: the first `limit` images [B, 3, H, W] (videos [B, 3, F, H, W]: at most
    LOGGED_VIDEOS, LOGGED_FRAMES evenly spaced frames), scaled down to at most THUMBNAIL_PX a side."""
    video = images.dim() == 5
    images = images[:min(limit, LOGGED_VIDEOS) if video else limit]
    if video:
        frames = images.shape[2]
        images = images[:, :, torch.linspace(0, frames - 1, min(frames, LOGGED_FRAMES)).round().long().unique()]
    size = max(images.shape[-2:])
    if size <= THUMBNAIL_PX or images.shape[0] == 0:
        return images
    flat = images.transpose(1, 2).flatten(0, 1) if video else images  # video: (B * F, 3, H, W)
    flat = F.interpolate(flat.float(), scale_factor=THUMBNAIL_PX / size, mode="bilinear", antialias=True)
    return flat.unflatten(0, (images.shape[0], -1)).transpose(1, 2) if video else flat


def frame_strip(videos: Tensor, max_frames: int = 8, padding: int = 2) -> Image.Image:
    """Videos [B, 3, F, H, W] in [0, 1] as one image: a row per video, `max_frames` evenly spaced frames
    (first and last included) left to right."""
    if videos.dim() != 5 or videos.shape[1] != 3:
        raise ValueError(f"frame_strip expects videos [B, 3, F, H, W], got {list(videos.shape)}")
    frames = videos.shape[2]
    picked = torch.linspace(0, frames - 1, min(frames, max_frames)).round().long().unique()
    strip = videos[:, :, picked].permute(0, 2, 1, 3, 4).flatten(0, 1)  # (B * n, 3, H, W), a video's frames adjacent
    return image_grid(strip, nrow=len(picked), padding=padding)


def video_grid(videos: Tensor, nrow: int = 8, padding: int = 2) -> list[Image.Image]:
    """Videos [B, 3, F, H, W] in [0, 1] -> F grid images (image_grid of every video's frame f)."""
    if videos.dim() != 5 or videos.shape[1] != 3:
        raise ValueError(f"video_grid expects videos [B, 3, F, H, W], got {list(videos.shape)}")
    return [image_grid(videos[:, :, f], nrow, padding) for f in range(videos.shape[2])]


def write_grid(images: Tensor | list[Tensor], path_stem: str, nrow: int = 8, fps: int = 8) -> str:
    """Images [B, 3, H, W] (or a list of [3, H, W] of mixed sizes) -> `path_stem`.png (image_grid);
    videos [B, 3, F, H, W] -> `path_stem`.gif (the grid, animated) and `path_stem`.png (frame_strip).
    Returns the PNG's path."""
    os.makedirs(os.path.dirname(os.path.abspath(path_stem)), exist_ok=True)
    if isinstance(images, Tensor) and images.dim() == 5:
        frames = video_grid(images, nrow)
        frames[0].save(path_stem + ".gif", save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
        frame_strip(images).save(path_stem + ".png")
    else:
        image_grid(images, nrow).save(path_stem + ".png")
    return path_stem + ".png"


def _to_float(value: Any) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric tensors must have one element, got shape {list(value.shape)}")
        return float(value.item())
    return float(value)


class MetricsLogger:
    """Writes scalars and image grids of a run under `output_dir`."""

    def __init__(self, output_dir: str | os.PathLike, enabled: bool = True, purge_step: int | None = None,
                 wandb: WandbOptions | None = None, config: dict | None = None):
        """`purge_step`: a run resumed at that step; TensorBoard hides the earlier run's events from it on.
        `wandb`: also log to this wandb project, with `config` as the run's config."""
        self.output_dir = os.fspath(output_dir)
        self.enabled = enabled
        self._jsonl = None
        self._writer = None
        self._wandb = None
        if enabled:
            os.makedirs(self.output_dir, exist_ok=True)
            self._jsonl = open(os.path.join(self.output_dir, "metrics.jsonl"), "a")
            self._writer = SummaryWriter(log_dir=os.path.join(self.output_dir, "tb"), purge_step=purge_step)
            if wandb is not None:
                self._wandb = WandbSink(wandb, self.output_dir, config or {})

    def log(self, step: int, scalars: dict[str, Any]) -> None:
        """Append {"step", "time", **scalars} (values as floats) to metrics.jsonl and TensorBoard."""
        if not self.enabled:
            return
        values = {key: _to_float(v) for key, v in scalars.items()}
        record = {"step": int(step), "time": time.time(), **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self.log_tensorboard(step, values)
        if self._wandb is not None:
            self._wandb.log(int(step), values)

    def log_tensorboard(self, step: int, scalars: dict[str, Any]) -> None:
        """The scalars to TensorBoard only (rows metrics.jsonl already holds, after a purge)."""
        if not self.enabled:
            return
        for key, v in scalars.items():
            self._writer.add_scalar(key, _to_float(v), global_step=int(step))
        self._writer.flush()

    def log_images(self, step: int, tag: str, images: Tensor, captions: list[str] | None = None,
                   nrow: int = 8, fps: int = 8) -> str | None:
        """Write a grid of images [B, 3, H, W] (or videos [B, 3, F, H, W]) in [0, 1] to TensorBoard under
        `tag` and as `<output_dir>/<tag>/step-{step:06d}.png` (videos: also `.gif`, `write_grid`;
        captions, one per line, beside it as .txt). Returns the PNG path (None when disabled)."""
        if not self.enabled:
            return None
        if captions is not None and len(captions) != len(images):
            raise ValueError(f"{len(captions)} captions for {len(images)} images")
        path = write_grid(images, os.path.join(self.output_dir, tag, f"step-{int(step):06d}"), nrow, fps)
        if isinstance(images, Tensor) and images.dim() == 5 and importlib.util.find_spec("moviepy") is not None:
            video = (images.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
            self._writer.add_video(tag, video.permute(0, 2, 1, 3, 4), global_step=int(step), fps=fps)  # (B, F, 3, H, W)
        else:
            with Image.open(path) as grid:
                pixels = torch.from_numpy(np.array(grid.convert("RGB"))).permute(2, 0, 1)  # (3, H, W) uint8
            self._writer.add_image(tag, pixels, global_step=int(step), dataformats="CHW")
        if captions is not None:
            with open(path[:-len(".png")] + ".txt", "w") as f:
                f.write("\n".join(captions) + "\n")
            text = "\n".join(f"{i}. {c}" for i, c in enumerate(captions))
            self._writer.add_text(f"{tag}/captions", text, global_step=int(step))
        self._writer.flush()
        if self._wandb is not None:
            video = isinstance(images, Tensor) and images.dim() == 5
            self._wandb.images(int(step), tag, path, path[:-len(".png")] + ".gif" if video else None, captions)
        return path

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
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


__all__ = ["MetricsLogger", "frame_strip", "image_grid", "read_metrics", "thumbnails", "video_grid", "write_grid"]
