"""Checkpoints that scale (checkpointing/checkpoint.py): the run state is written in shards by every trainer rank
and resumes bitwise under FSDP; the export is diffusers' layout in --export-dtype, one file per
trainer rank for a full fine-tune in a pipeline folder `FluxPipeline.from_pretrained` loads; the EMA
is exported in diffusers' LoRA naming and loads with `load_lora_weights`."""
import json
import os
import shutil

import torch
from safetensors import safe_open

from lab.launch import TINY, torchrun, trained_weights

from checkpointing import checkpoint, export


def _state(run: str, step: int, prefix: str) -> dict:
    return checkpoint.read_state(checkpoint.checkpoint_dir(run, step), prefix)


def test_the_export_plan_splits_in_order_into_files_of_about_equal_bytes():
    tensors = {f"w{i}": torch.empty(n) for i, n in enumerate([10, 10, 10, 10, 40, 10, 10])}
    plan = export._file_plan(tensors, 4)
    assert list(plan.values()) == sorted(plan.values())  # names stay in order
    assert set(plan.values()) == set(range(max(plan.values()) + 1))  # no empty file in between
    per_file = [sum(tensors[n].numel() for n in plan if plan[n] == f) for f in set(plan.values())]
    assert max(per_file) <= 40 + 10 and len(per_file) >= 3
    one = export._file_plan({"huge": torch.empty(100), "tiny": torch.empty(1)}, 4)
    assert sorted(set(one.values())) == [0, 1] or sorted(set(one.values())) == [0]


def test_fsdp_state_is_written_in_shards_and_resumes_bitwise_with_the_ema_and_optimizer(tmp_path):
    """Full fine-tuning with an EMA, colocated FSDP2 over 2 trainer ranks: no rank writes a whole
    weight, the export is two diffusers files in bfloat16 that from_pretrained loads, and a run cut
    back to step 1 resumes to the uninterrupted run's weights, EMA and AdamW state bit for bit."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    args = [*TINY, "--mode", "colocated", "--colocated-sharding", "fsdp", "--lora-rank", "0", "--ema-decay", "0.9",
            "--steps", "2", "--save-every", "1"]
    straight = tmp_path / "straight"
    torchrun(2, [*args, "--output-dir", str(straight)])
    last = checkpoint.checkpoint_dir(str(straight), 2)  # the last step: its update moved the weights

    # state/: one shard file per trainer rank, each holding half the rows of a sharded weight
    files = sorted(f for f in os.listdir(os.path.join(last, "state")) if f.endswith(".safetensors"))
    assert len(files) == 2, files
    whole = _state(str(straight), 2, "model.")
    name = max(whole, key=lambda n: whole[n].shape[0] if whole[n].dim() else 0)
    for f in files:
        with safe_open(os.path.join(last, "state", f), framework="pt") as st:
            rows = st.get_slice(f"model.{name}").get_shape()[0]
            assert rows == whole[name].shape[0] // 2, (f, rows, whole[name].shape)

    # the export: transformer/ in bfloat16, one file per rank + index.json, loadable by diffusers
    sub = os.path.join(last, "transformer")
    index = json.load(open(os.path.join(sub, "diffusion_pytorch_model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) == 2 and set(index["weight_map"]) == set(whole)
    model = FluxTransformer2DModel.from_pretrained(last, subfolder="transformer")
    ema = _state(str(straight), 2, "ema.")
    ema_model = FluxTransformer2DModel.from_pretrained(os.path.join(last, "ema"), subfolder="transformer")
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), whole[n].to(torch.bfloat16).float()), n
    pipe = FluxPipeline.from_pretrained(last)  # a pipeline folder (checkpointing/export.py), as diffusers loads one
    assert all(torch.equal(p, whole[n].to(torch.bfloat16).float()) for n, p in pipe.transformer.named_parameters())
    assert FluxPipeline.from_pretrained(os.path.join(last, "ema")).vae is not None
    assert any(not torch.equal(ema[n], whole[n]) for n in whole)  # the EMA lags the weights
    for n, p in ema_model.named_parameters():
        assert torch.equal(p.detach(), ema[n].to(torch.bfloat16).float()), n

    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-2")
    torchrun(2, [*args, "--resume", str(resumed), "--output-dir", str(resumed)])
    for prefix in ("model.", "ema.", "optim."):
        a, b = _state(str(straight), 2, prefix), _state(str(resumed), 2, prefix)
        assert a.keys() == b.keys() and a
        for n in a:
            assert torch.equal(a[n], b[n]), f"{prefix}{n}"
    assert not torch.equal(_state(str(straight), 1, "optim.")[f"{name}.exp_avg"],
                           _state(str(straight), 2, "optim.")[f"{name}.exp_avg"])


def test_the_lora_ema_loads_in_diffusers_and_changes_the_image(tmp_path):
    from models import load_model

    run = tmp_path / "run"
    torchrun(2, [*TINY, "--lora-rank", "4", "--ema-decay", "0.9", "--steps", "2", "--output-dir", str(run),
                 "--export-dtype", "float32"])
    folder = os.path.join(checkpoint.checkpoint_dir(str(run), 2), "ema")  # step 1's groups may all tie
    with safe_open(os.path.join(folder, checkpoint.LORA_FILE), framework="pt") as st:
        names = list(st.keys())
    assert names and all(n.startswith("transformer.") and ".default" not in n for n in names)  # diffusers naming

    adapter = load_model("flux", preset="tiny", seed=0)
    pipe = adapter.pipe
    pipe.set_progress_bar_config(disable=True)

    def image():
        return pipe("a red circle", num_inference_steps=3, height=16, width=16, guidance_scale=1.0,
                    generator=torch.Generator().manual_seed(0), output_type="pt").images

    before = image()
    pipe.load_lora_weights(folder)
    after = image()
    assert not torch.equal(before, after)
    ema = _state(str(run), 2, "ema.")
    loaded = {n.replace(".default_0.", ".default."): p.detach()  # diffusers names the loaded adapter default_0
              for n, p in adapter.transformer.named_parameters() if "lora_" in n}
    assert loaded.keys() == ema.keys()
    for n in ema:
        assert torch.equal(loaded[n], ema[n]), n  # float32 export: the EMA exactly as trained
    assert any(not torch.equal(ema[n], w) for n, w in trained_weights(str(run), 2).items())

    # the same folder through the project's sampling loader (scripts/sample.py --checkpoint DIR/ema)
    other = load_model("flux", preset="tiny", seed=0)
    checkpoint.load_trained_weights(other, folder)
    other.pipe.set_progress_bar_config(disable=True)
    again = other.pipe("a red circle", num_inference_steps=3, height=16, width=16, guidance_scale=1.0,
                       generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert torch.equal(after, again)
