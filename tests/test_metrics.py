"""MetricsLogger: jsonl, TensorBoard events and PNG image grids."""
from __future__ import annotations

import glob
import os

import pytest
import torch
from PIL import Image

from telemetry.metrics import MetricsLogger, image_grid, read_metrics


def test_logger_writes_jsonl_tensorboard_and_png(tmp_path):
    with MetricsLogger(tmp_path / "run") as logger:
        logger.log(0, {"reward/mean": torch.tensor(0.5), "train/loss": 1, "perf/step_s": 2.5})
        logger.log(1, {"reward/mean": 0.75})
        images = torch.rand(5, 3, 8, 6)
        path = logger.log_images(1, "samples", images, captions=[f"prompt {i}" for i in range(5)], nrow=3)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["reward/mean"] == 0.5 and records[0]["train/loss"] == 1.0 and records[1]["reward/mean"] == 0.75
    assert all(isinstance(v, float) for k, v in records[0].items() if k != "step")
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == records
    assert glob.glob(str(tmp_path / "run" / "tb" / "events.out.tfevents.*"))
    assert path == str(tmp_path / "run" / "samples" / "step-000001.png")
    with Image.open(path) as img:
        assert img.mode == "RGB" and img.size == (3 * (6 + 2) + 2, 2 * (8 + 2) + 2)
    assert (tmp_path / "run" / "samples" / "step-000001.txt").read_text().splitlines()[4] == "prompt 4"

    with MetricsLogger(tmp_path / "run") as logger:  # a resumed run appends
        logger.log(2, {"reward/mean": 1.0})
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2]


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "off", enabled=False)
    logger.log(0, {"x": 1.0})
    assert logger.log_images(0, "samples", torch.rand(1, 3, 4, 4)) is None
    logger.close()
    assert not os.path.exists(tmp_path / "off")


def test_image_grid_pixels():
    images = torch.zeros(2, 3, 2, 2)
    images[1] = 1.0
    grid = image_grid(images, nrow=2, padding=1)
    assert grid.size == (7, 4)
    assert grid.getpixel((1, 1)) == (0, 0, 0) and grid.getpixel((4, 1)) == (255, 255, 255)
    assert image_grid(torch.rand(3, 1, 4, 4), nrow=8).size == (3 * 6 + 2, 6 + 2)
    with pytest.raises(ValueError):
        image_grid(torch.rand(3, 4, 4))
