"""Checks that follow the bytes (docs/reliability.md): the digest of a model folder that a run records
and a resume compares (changed weights under the same path refused, the same bytes under another
path accepted with a note), --prompt-embeds against the run's text encoders, and scripts.eval and
scripts.sample against a checkpoint's manifest. tests/test_bad_inputs.py runs the refusals through
the real entry point on every rank."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpointing import digests
from checkpointing import manifest as checkpoint_files
from checkpointing import folder as run_folders
from checkpointing.checkpoint import verify_checkpoint
from config.schema import NOT_CARRIED, RunConfig
from prompts import embeds
from lab.launch import ROOT

SHIPPED = os.path.join(ROOT, "assets", "shapes-flux")
TRANSFORMER = os.path.join("transformer", "diffusion_pytorch_model.safetensors")
ENCODER = os.path.join("text_encoder_2", "model.safetensors")


def _copy(tmp_path, name):
    shutil.copytree(SHIPPED, tmp_path / name)
    return tmp_path / name


def noise(path, names=None, scale=1e-2):
    """Add noise to the tensors `names` (every floating tensor when None) of a safetensors file."""
    tensors = load_file(path)
    g = torch.Generator().manual_seed(0)
    for n in names or [n for n, t in tensors.items() if t.is_floating_point()]:
        tensors[n] = tensors[n] + (scale * torch.randn(tensors[n].shape, generator=g)).to(tensors[n].dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def test_the_digest_names_changed_weights_and_sees_through_a_move(tmp_path):
    """Any tensor with noise, a config changed: named by file; the folder moved: the same digest.
    What the sampling misses (docs/reliability.md): a byte between a big tensor's windows."""
    model = _copy(tmp_path, "M")
    before = digests.folder_digest(str(model))
    assert TRANSFORMER in before["files"] and "README.md" not in before["files"]
    os.rename(model, tmp_path / "M2")
    model = tmp_path / "M2"
    assert digests.differences(before, digests.folder_digest(str(model))) == []
    path = str(model / TRANSFORMER)
    assert os.path.getsize(path) > digests.WHOLE  # sampled, not hashed whole
    tensors = load_file(path)
    big = max(tensors, key=lambda n: tensors[n].numel() * tensors[n].element_size())
    smallest = min(tensors, key=lambda n: tensors[n].numel())
    for name in (big, smallest):
        shutil.copy(os.path.join(SHIPPED, TRANSFORMER), path)
        noise(path, [name])
        assert digests.differences(before, digests.folder_digest(str(model))) == [f"{TRANSFORMER} changed"], name
    shutil.copy(os.path.join(SHIPPED, TRANSFORMER), path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        begin, end = json.loads(f.read(n))[big]["data_offsets"]
    assert end - begin >= 4 * digests.WINDOW
    with open(path, "r+b") as f:  # one byte a quarter into the biggest tensor: between its windows
        f.seek(8 + n + begin + (end - begin) // 4)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    assert digests.differences(before, digests.folder_digest(str(model))) == []
    config = model / "transformer" / "config.json"
    config.write_text(config.read_text().replace('"num_layers"', ' "num_layers"'))
    assert digests.differences(before, digests.folder_digest(str(model))) == [
        os.path.join("transformer", "config.json") + " changed"]


def _run(folder, model, digest):
    """A run trained on `model` (its record holds `digest`) with a checkpoint at step 2."""
    cfg = _resume_cfg(folder, model)
    config = {**cfg.describe(), "run": {"id": "run-a", "prompts_sha256": "p" * 64, "model_digest": digest,
                                        "resumes": []}}
    checkpoint_files.write_atomic(str(folder / "checkpoints" / "step-2"),
                                  lambda tmp: open(os.path.join(tmp, "w"), "w").write("weights"),
                                  {"step": 2, "config": config})
    (folder / "config.json").write_text(json.dumps(config))


def _resume_cfg(run, model, anyway=False):
    cfg = RunConfig()
    cfg.model.model_path, cfg.optim.lora_rank, cfg.rl.steps = str(model), 4, 4
    cfg.output.output_dir, cfg.output.resume, cfg.output.resume_anyway = str(run), str(run), anyway
    return cfg


def _check(run, model, anyway=False):
    return run_folders.check(_resume_cfg(run, model, anyway), "p" * 64, NOT_CARRIED,
                             digests.folder_digest(str(model)))


def test_a_resume_follows_the_model_bytes_not_the_path(tmp_path):
    """Changed weights under the same path: refused, naming the file, --resume-anyway or not. The
    same bytes moved (`mv M M2`, then --model-path M2): accepted with a note, recorded as a change
    of --model-path. A checkpoint without a digest (an older run): the path decides, as before."""
    model, run = _copy(tmp_path, "M"), tmp_path / "run"
    run.mkdir()
    _run(run, model, digests.folder_digest(str(model)))
    point = _check(run, model)
    assert point.step == 2 and not point.notes and not point.anyway
    moved = tmp_path / "M2"
    os.rename(model, moved)
    point = _check(run, moved)
    assert point.notes == (f"--model-path {moved} holds the bytes the checkpoint was trained on, in {model} then "
                           f"(a moved or copied folder): going on",) and not point.anyway
    said = []
    record = run_folders.prepare(_resume_cfg(run, moved), point, {"prompts_sha256": "p" * 64}, say=said.append)
    assert record["resumes"][-1]["changed"]["model.model_path"] == [str(model), str(moved)]
    assert f"resume: {point.notes[0]}" in said
    noise(str(moved / TRANSFORMER))
    for anyway in (False, True):
        with pytest.raises(ValueError, match=f"the checkpoint was trained with other base model bytes: {TRANSFORMER} "
                                             f"changed in --model-path {moved} since the checkpoint; these change"):
            _check(run, moved, anyway)
    old = tmp_path / "old"
    old.mkdir()
    _run(old, model, None)
    with pytest.raises(ValueError, match=f"--model-path {model} \\(this run: {moved}\\)"):
        _check(old, moved)


def test_prompt_embeds_of_another_encoder_are_refused(tmp_path):
    """The file records its encoder and dimensions; another model of the family is refused whether
    its dimensions differ (the tiny preset: 32 wide, the shipped model's T5 64) or not (the shipped
    model's text encoder with noise); the same bytes moved are accepted."""
    from scripts import encode_prompts

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    model, out = _copy(tmp_path, "M"), tmp_path / "m.safetensors"
    assert encode_prompts.main(["--model-path", str(model), "--prompts", str(prompts), "--out", str(out)]) == 0
    header = embeds.read_header(str(out))
    assert header["dims"]["prompt_embeds"][-1] == 64 and header["encoder"]["model_path"] == str(model)
    assert set(header["encoder"]["digest"]["files"]) >= {ENCODER, os.path.join("tokenizer", "tokenizer.json")}
    assert TRANSFORMER not in header["encoder"]["digest"]["files"]
    wanted = ["", "a red circle"]
    embeds.check(str(out), "flux", wanted, embeds.encoder_record(str(model), "tiny", 0))
    os.rename(model, tmp_path / "M2")
    embeds.check(str(out), "flux", wanted, embeds.encoder_record(str(tmp_path / "M2"), "tiny", 0))
    other = _copy(tmp_path, "M3")
    noise(str(other / ENCODER))
    with pytest.raises(ValueError, match=f"was encoded by the text encoders of {model} \\(prompt_embeds .*x64, "
                                         f"pooled 32\\), not by the text encoders of {other}, the run's; {ENCODER} "
                                         f"changed: encode the prompts again"):
        embeds.check(str(out), "flux", wanted, embeds.encoder_record(str(other), "tiny", 0))
    with pytest.raises(ValueError, match="not by the tiny preset with seed 0, the run's"):
        embeds.check(str(out), "flux", wanted, embeds.encoder_record(None, "tiny", 0))


def _checkpoint(folder):
    def write(tmp):
        os.makedirs(os.path.join(tmp, "ema"))
        for rel in ("pytorch_lora_weights.safetensors", os.path.join("ema", "pytorch_lora_weights.safetensors")):
            save_file({"w": torch.arange(64.0)}, os.path.join(tmp, rel))
    checkpoint_files.write_atomic(str(folder), write, {"step": 1})
    return folder


def test_eval_and_sample_verify_the_checkpoint_as_resume_does(tmp_path):
    """Values overwritten in place (the same size): refused by scripts.eval and scripts.sample,
    naming the file, before any model loads; a truncated file: one line, no traceback."""
    from scripts import eval as eval_script
    from scripts import sample as sample_script

    ckpt = _checkpoint(tmp_path / "step-1")
    assert verify_checkpoint(str(ckpt))["step"] == 1 and verify_checkpoint(str(ckpt / "ema"))["step"] == 1
    weights = ckpt / "pytorch_lora_weights.safetensors"
    save_file({"w": torch.arange(64.0) + 1}, str(weights))
    checkpoint_files._VERIFIED.clear()
    common = ["--prompts", os.path.join(ROOT, "data", "shapes_eval.txt")]
    with pytest.raises(ValueError, match="pytorch_lora_weights.safetensors does not match its SHA-256 in the manifest"):
        eval_script.main([*common, "--out", str(tmp_path / "e"), "--checkpoint", str(ckpt)])
    with pytest.raises(ValueError, match="pytorch_lora_weights.safetensors does not match its SHA-256"):
        sample_script.main([*common, "--out-dir", str(tmp_path / "s"), "--checkpoint", str(ckpt / "ema")])
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(100)
    proc = subprocess.run([sys.executable, "-m", "scripts.eval", *common, "--out", str(tmp_path / "e"), "--checkpoint",
                           str(ckpt)], cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = (f"error: --checkpoint {str(ckpt)!r}: pytorch_lora_weights.safetensors has 100 bytes, the manifest says "
            f"{size}; a checkpoint whose bytes are not those its run wrote is not read (another checkpoints/step-N "
            f"folder of the run, or its ema/)")
    assert proc.stderr.strip().splitlines()[-1] == line
    assert not (tmp_path / "e").exists() and not (tmp_path / "s").exists()
