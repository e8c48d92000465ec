"""lab/pretrain_tiny.py: the caption-noise and fade streams, and a two-stage run (from scratch,
then --init-from in place with caption noise and fade) whose folder loads and whose model card
records both commands."""
import json
import os
import subprocess
import sys

import numpy as np

from rewards import shapes_world

from lab import pretrain_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _scores(n: int = 400, **noise: float) -> np.ndarray:
    """Evaluator scores of n training pairs, each image for its own caption."""
    data = pretrain_tiny.SceneStream(os.path.join(ROOT, "data", "shapes_train.txt"), seed=0)
    x, captions = data.batch(n, **noise)
    pixels = ((x.permute(0, 2, 3, 1).numpy() + 1) * 127.5).round().astype(np.uint8)
    return np.array([shapes_world.evaluate(img, c)[0] for img, c in zip(pixels, captions)])


def test_caption_noise_replaces_about_that_fraction_of_captions():
    assert (_scores() == 1.0).all()
    assert 0.4 <= (_scores(caption_noise=0.5) < 1.0).mean() <= 0.6  # a redrawn prompt can match by chance (rarely)


def test_fade_hides_about_that_fraction_of_images_from_the_evaluator():
    scores = _scores(fade=0.8)
    assert set(np.unique(scores)) == {0.0, 1.0}  # a faded image shows nothing, the others everything asked
    assert 0.75 <= (scores == 0.0).mean() <= 0.85


def _pretrain(out, *extra: str) -> None:
    args = ["--out", str(out), "--threads", "1", "--steps", "2", "--batch-size", "2", "--vae-steps", "2",
            "--vae-batch-size", "2", "--eval-every", "2", "--num-eval", "2", "--eval-steps", "2", "--width", "32",
            "--text-width", "16", "--num-double-blocks", "1", "--num-single-blocks", "1", *extra]
    proc = subprocess.run([sys.executable, "-m", "lab.pretrain_tiny", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_init_from_continues_a_model_in_place_and_the_card_records_both_stages(tmp_path):
    from models import load_model

    folder = tmp_path / "model"
    _pretrain(folder)
    base = load_model("flux", str(folder))
    vae0, t0 = ({k: v.clone() for k, v in m.state_dict().items()} for m in (base.pipe.vae, base.transformer))
    del base  # its tensors may map the files the second stage overwrites
    # in place, as the shipped model's second stage is made
    _pretrain(folder, "--init-from", str(folder), "--caption-noise", "0.5", "--fade", "0.5")
    with open(folder / "training.json") as f:
        summary = json.load(f)
    assert summary["init"]["args"]["caption_noise"] == 0.0 and summary["args"]["caption_noise"] == 0.5
    assert summary["init"]["args"]["fade"] == 0.0 and summary["args"]["fade"] == 0.5
    card = (folder / "README.md").read_text()
    assert summary["init"]["command"] in card and summary["command"] in card
    assert "caption noise 0.5" in card and "fade 0.5" in card
    adapter = load_model("flux", str(folder))
    assert adapter.defaults.height == 32
    # the autoencoder is kept, the transformer continued
    vae = adapter.pipe.vae.state_dict()
    assert all((vae[k] == vae0[k]).all() for k in vae0)
    t = adapter.transformer.state_dict()
    assert any(not (t[k] == t0[k]).all() for k in t0)
