"""scripts/eval.py: metrics and a grid for a base model and for a LoRA checkpoint."""
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _eval(out, *extra):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "eval.py"), "--prompts",
           os.path.join(ROOT, "data", "shapes_eval.txt"), "--num-prompts", "4", "--height", "16", "--width", "16",
           "--sample-steps", "3", "--reward", "jpeg_compressibility", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())


def test_eval_base_and_checkpoint(tmp_path):
    from checkpoint import save_weights
    from models import load_model
    from models.lora import apply_lora

    base = _eval(tmp_path / "base")
    assert base["num_prompts"] == 4 and len(base["per_prompt"]) == 4
    assert set(base["summary"]) == {"eval/reward", "eval/jpeg_compressibility"}
    assert (tmp_path / "base" / "grid.png").is_file()

    adapter = load_model("flux")
    apply_lora(adapter.transformer, 4, None)
    weights = {n: torch.randn_like(p) * 0.5 for n, p in adapter.transformer.named_parameters() if p.requires_grad}
    save_weights(str(tmp_path / "ckpt"), adapter, weights, lora=True,
                 lora_config=adapter.transformer.peft_config["default"])
    trained = _eval(tmp_path / "trained", "--checkpoint", str(tmp_path / "ckpt"))
    assert trained["per_prompt"] != base["per_prompt"]
