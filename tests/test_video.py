"""Video end to end, in process: grids of videos (GIF and frame strip) in the logger and TensorBoard,
thumbnails that travel to the logging rank, per-frame image rewards and the temporal-consistency
reward, and the config check that a video reward needs a video model."""
import glob

import pytest
import torch
from PIL import Image

from config.validate import validate
from config.cli import parse_config
from telemetry.metrics import LOGGED_FRAMES, LOGGED_VIDEOS, THUMBNAIL_PX, MetricsLogger, frame_strip, image_grid, thumbnails
from telemetry.metrics import video_grid
from models import adapter_class, model_names
from rewards import RewardSet, build_reward


def _video(b=3, f=5, h=6, w=4):
    g = torch.Generator().manual_seed(0)
    return torch.rand(b, 3, f, h, w, generator=g)


def test_frame_strip_and_video_grid_pixels():
    videos = torch.zeros(2, 3, 9, 2, 2)
    videos[1, :, -1] = 1.0  # the second video's last frame is white
    strip = frame_strip(videos, max_frames=3, padding=1)  # frames 0, 4, 8 of each video, a row per video
    assert strip.size == (3 * 3 + 1, 2 * 3 + 1)
    assert strip.getpixel((7, 4)) == (255, 255, 255) and strip.getpixel((7, 1)) == (0, 0, 0)
    assert strip.getpixel((1, 4)) == (0, 0, 0)
    frames = video_grid(videos, nrow=2, padding=1)
    assert len(frames) == 9 and frames[-1].getpixel((4, 1)) == (255, 255, 255)
    assert frames[0].getpixel((4, 1)) == (0, 0, 0)
    with pytest.raises(ValueError, match=r"frame_strip expects videos \[B, 3, F, H, W\], got \[2, 3, 4, 4\]"):
        frame_strip(torch.rand(2, 3, 4, 4))


def test_logger_writes_videos_as_gif_and_strip(tmp_path):
    videos = _video()
    with MetricsLogger(tmp_path / "run") as logger:
        path = logger.log_images(3, "samples", videos, captions=["a", "b", "c"], nrow=2)
    assert path == str(tmp_path / "run" / "samples" / "step-000003.png")
    with Image.open(tmp_path / "run" / "samples" / "step-000003.gif") as gif:
        assert gif.n_frames == 5 and gif.size == image_grid(videos[:, :, 0], nrow=2).size
    with Image.open(path) as strip:
        assert strip.size == frame_strip(videos).size
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(glob.glob(str(tmp_path / "run" / "tb"))[0])
    events.Reload()
    assert "samples" in events.Tags()["images"]  # moviepy absent: the frame strip stands in for the video


def test_thumbnails_bound_what_travels():
    images = torch.rand(20, 3, 2 * THUMBNAIL_PX, THUMBNAIL_PX)
    small = thumbnails(images, 16)
    assert small.shape == (16, 3, THUMBNAIL_PX, THUMBNAIL_PX // 2)
    videos = torch.rand(10, 3, 33, 2 * THUMBNAIL_PX, 8)
    small = thumbnails(videos, 16)
    assert small.shape == (LOGGED_VIDEOS, 3, LOGGED_FRAMES, THUMBNAIL_PX, 4)
    torch.testing.assert_close(small[:, :, 0], thumbnails(videos[:LOGGED_VIDEOS, :, 0], 16))  # first frame kept
    assert thumbnails(torch.rand(2, 3, 5, 8, 8), 16).shape == (2, 3, 5, 8, 8)  # already small: untouched


@pytest.mark.parametrize("name", ["jpeg_compressibility", "rule_aesthetic"])
def test_image_rewards_score_a_video_as_the_mean_of_its_frames(name):
    reward = build_reward(name)
    videos = _video(b=2, f=4, h=16, w=16)
    per_frame = torch.stack([reward(videos[:, :, f], ["x", "y"]) for f in range(4)], dim=1)  # (B, F)
    torch.testing.assert_close(reward(videos, ["x", "y"]), per_frame.mean(dim=1))


def test_temporal_consistency():
    reward = build_reward("temporal_consistency")
    still = torch.rand(1, 3, 1, 8, 8).expand(1, 3, 6, 8, 8)
    flicker = torch.zeros(1, 3, 6, 8, 8)
    flicker[:, :, 1::2] = 1.0  # black and white frames in turn
    ramp = torch.linspace(0, 1, 6).view(1, 1, 6, 1, 1).expand(1, 3, 6, 8, 8)  # brightens by 0.2 a frame
    scores = reward(torch.cat([still, flicker, ramp]), ["a", "b", "c"])
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.0, 0.8]))
    with pytest.raises(ValueError, match=r"scores videos \(B, 3, F, H, W\) of at least 2 frames, got \(2, 3, 8, 8\)"):
        reward(torch.rand(2, 3, 8, 8), ["a", "b"])
    combined = RewardSet(["temporal_consistency:0.5", "jpeg_compressibility:0"]).score_combined(ramp, ["c"])
    torch.testing.assert_close(combined["combined"], torch.tensor([0.4]))


def test_a_video_reward_needs_a_video_model():
    assert [n for n in model_names() if adapter_class(n).video] == ["hunyuan_video", "wan"]
    assert all(adapter_class(n).video == (adapter_class(n).defaults.num_frames is not None) for n in model_names())
    cfg = parse_config(["--preset", "tiny", "--reward", "temporal_consistency"])
    cfg.resolve_defaults()
    with pytest.raises(ValueError, match=r"reward\(s\) \['temporal_consistency'\] score videos; 'flux' makes images"):
        validate(cfg, 2)
    cfg.model.model = "wan"
    validate(cfg, 2)
