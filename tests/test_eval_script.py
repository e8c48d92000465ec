"""scripts/eval.py: metrics and a grid for a base model and for a LoRA checkpoint."""
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _eval(out, *extra):
    cmd = [sys.executable, "-m", "scripts.eval", "--prompts",
           os.path.join(ROOT, "data", "shapes_eval.txt"), "--num-prompts", "4", "--height", "16", "--width", "16",
           "--sample-steps", "3", "--reward", "jpeg_compressibility", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())


def test_eval_base_and_checkpoint(tmp_path):
    from checkpointing.checkpoint import export_weights
    from checkpointing.manifest import write_atomic
    from models import load_model
    from models.lora import apply_lora

    base = _eval(tmp_path / "base")
    assert base["num_prompts"] == 4 and len(base["per_prompt"]) == 4
    assert set(base["summary"]) == {"eval/reward", "eval/jpeg_compressibility"}
    assert (tmp_path / "base" / "grid.png").is_file()

    adapter = load_model("flux")
    apply_lora(adapter.transformer, 4, None)
    weights = {n: torch.randn_like(p) * 0.5 for n, p in adapter.transformer.named_parameters() if p.requires_grad}
    write_atomic(str(tmp_path / "ckpt"), lambda tmp: export_weights(  # a checkpoint with its manifest, as a run writes it
        tmp, adapter, weights, lora=True, dtype=torch.bfloat16, lora_config=adapter.transformer.peft_config["default"]),
        {"step": 1})
    trained = _eval(tmp_path / "trained", "--checkpoint", str(tmp_path / "ckpt"))
    assert trained["per_prompt"] != base["per_prompt"]


def test_samples_per_prompt_repeat_each_prompt_with_its_own_seeds(tmp_path):
    base = _eval(tmp_path / "base")
    four = _eval(tmp_path / "x2", "--samples-per-prompt", "2")
    rows, first = four["per_prompt"], base["per_prompt"]
    assert four["num_prompts"] == 4 and four["samples_per_prompt"] == 2 and len(rows) == 8
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in first for _ in range(2)]
    assert rows[0] == first[0]  # sample id 0 either way: the same seed, the same image
    assert rows[0]["jpeg_compressibility"] != rows[1]["jpeg_compressibility"]  # same prompt, another seed


def test_eval_records_reject_bad_counts(tmp_path):
    import pytest

    from prompts.sets import eval_records

    path = tmp_path / "p.txt"
    path.write_text("a red circle\ntwo blue squares\n")
    assert [r.prompt for r in eval_records(str(path), None, 2)] == ["a red circle"] * 2 + ["two blue squares"] * 2
    with pytest.raises(ValueError, match="0 samples"):
        eval_records(str(path), 2, 0)
