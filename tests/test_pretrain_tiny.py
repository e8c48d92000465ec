"""scripts/pretrain_tiny.py: the caption-noise stream, and a two-stage run (from scratch, then
--init-from with caption noise) whose folder loads and whose model card records both commands."""
import json
import os
import subprocess
import sys

import numpy as np

import shapes_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import pretrain_tiny  # noqa: E402


def _mismatched(p: float, n: int = 400) -> float:
    """Fraction of pairs whose image does not score 1 for its own caption."""
    data = pretrain_tiny.SceneStream(os.path.join(ROOT, "data", "shapes_train.txt"), seed=0)
    x, captions = data.batch(n, caption_noise=p)
    pixels = ((x.permute(0, 2, 3, 1).numpy() + 1) * 127.5).round().astype(np.uint8)
    return float(np.mean([shapes_world.evaluate(img, c)[0] < 1.0 for img, c in zip(pixels, captions)]))


def test_caption_noise_replaces_about_that_fraction_of_captions():
    assert _mismatched(0.0) == 0.0
    assert 0.4 <= _mismatched(0.5) <= 0.6  # a redrawn prompt can match the scene by chance (rarely)


def _pretrain(out, *extra: str) -> None:
    args = ["--out", str(out), "--threads", "1", "--steps", "2", "--batch-size", "2", "--vae-steps", "2",
            "--vae-batch-size", "2", "--eval-every", "2", "--num-eval", "2", "--eval-steps", "2", "--width", "32",
            "--text-width", "16", "--num-double-blocks", "1", "--num-single-blocks", "1", *extra]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "pretrain_tiny.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_init_from_continues_a_model_and_the_card_records_both_stages(tmp_path):
    from models import load_model

    _pretrain(tmp_path / "base")
    _pretrain(tmp_path / "noisy", "--init-from", str(tmp_path / "base"), "--caption-noise", "0.5")
    with open(tmp_path / "noisy" / "training.json") as f:
        summary = json.load(f)
    assert summary["init"]["args"]["caption_noise"] == 0.0 and summary["args"]["caption_noise"] == 0.5
    card = (tmp_path / "noisy" / "README.md").read_text()
    assert summary["init"]["command"] in card and summary["command"] in card and "caption noise 0.5" in card
    adapter = load_model("flux", str(tmp_path / "noisy"))
    assert adapter.defaults.height == 32
    # the autoencoder is kept, the transformer continued
    base = load_model("flux", str(tmp_path / "base"))
    vae, vae0 = adapter.pipe.vae.state_dict(), base.pipe.vae.state_dict()
    assert all((vae[k] == vae0[k]).all() for k in vae0)
    t, t0 = adapter.transformer.state_dict(), base.transformer.state_dict()
    assert any(not (t[k] == t0[k]).all() for k in t0)
