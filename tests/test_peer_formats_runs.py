"""The peers' formats in a run (docs/peer-formats.md), two recorded runs serving every check:
--init-lora of a Flow-GRPO peft folder starts every rank from it (the generators' first version
included: the first update is on-policy, ratio == 1) and trains the same weights disaggregated and
colocated; the LoRA checkpoint loads with `PeftModel.from_pretrained` as the weights trained; and
--wandb with WANDB_MODE=offline writes the run's metrics, config and sample grid under DIR/wandb/.
"""
import glob
import importlib.util
import json
import math
import os
import struct

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from checkpointing.checkpoint import checkpoint_dir
from lab.launch import TINY, torchrun, trained_weights
from models import load_model
from telemetry.metrics import read_metrics
from weights import assert_same_weights

HAVE_WANDB = importlib.util.find_spec("wandb") is not None
LR = 1e-3  # TINY's --lr: AdamW's first update moves each weight by at most this (plus its weight decay)
WANDB = ["--wandb", "digenrl-test", "--wandb-run-name", "init-lora", "--wandb-tags", "test,peft"]


def _flow_grpo_folder(path) -> dict:
    """A peft folder as Flow-GRPO saves one (random weights: lora_B far from its zero start)."""
    model = get_peft_model(load_model("flux", preset="tiny").transformer,
                           LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                      target_modules=["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(path))
    return {n.replace("base_model.model.", ""): p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peer")
    init = _flow_grpo_folder(tmp / "flow_grpo_lora")
    args = [*TINY, "--init-lora", str(tmp / "flow_grpo_lora"), "--steps", "1", "--save-every", "1",
            "--export-dtype", "float32"]
    if not HAVE_WANDB and os.environ.get("CI"):
        raise AssertionError("CI installs requirements.lock, which pins wandb: --wandb's test must run there")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", **{k: str(tmp / "wandb-home") for k in
                                                                 ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}}
    out = {}
    for name, placement in (("disagg", ["--generators", "1", "--trainers", "1"] + (WANDB if HAVE_WANDB else [])),
                            ("colocated", ["--mode", "colocated"])):
        out[name] = str(tmp / name)
        torchrun(2, [*args, *placement, "--output-dir", out[name]], env=env)
    return init, out


def test_init_lora_starts_every_rank_from_the_file_and_every_placement_trains_the_same(runs):
    init, out = runs
    weights = {name: trained_weights(folder, 1) for name, folder in out.items()}
    assert_same_weights(weights["colocated"], weights["disagg"], "disagg vs colocated from --init-lora")
    trained = weights["disagg"]
    assert trained.keys() == init.keys()
    for name, w in trained.items():  # one AdamW update from the file's weights, not from a fresh LoRA
        bound = LR * (1 + 1e-4 * init[name].abs()) * (1 + 1e-5)
        assert ((w - init[name]).abs() <= bound).all(), name
    assert any(not torch.equal(trained[n], init[n]) for n in init)
    assert min(init[n].abs().max().item() for n in init if "lora_B" in n) > 10 * LR  # a fresh lora_B would be ~0
    for name, folder in out.items():  # the generators sampled with the same adapters the trainers trained
        (row,) = read_metrics(folder)
        assert row["train/ratio"] == 1.0 and row["train/approx_kl"] == 0.0, (name, row)
    assert read_metrics(out["disagg"])[0]["reward/mean"] == pytest.approx(read_metrics(out["colocated"])[0]["reward/mean"])
    config = json.load(open(os.path.join(out["disagg"], "config.json")))["optim"]
    assert (config["lora_rank"], config["lora_alpha"], config["lora_targets"]) == \
        (4, 8.0, "attn.to_k,attn.to_out.0,attn.to_q,attn.to_v")


def test_the_lora_checkpoint_loads_with_peft_as_trained(runs):
    _, out = runs
    step = checkpoint_dir(out["disagg"], 1)
    model = PeftModel.from_pretrained(load_model("flux", preset="tiny").transformer, step)  # Flow-GRPO's call
    loaded = {n.replace("base_model.model.", ""): p.detach() for n, p in model.named_parameters() if "lora_" in n}
    trained = trained_weights(out["disagg"], 1)
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[n], trained[n]) for n in trained)  # --export-dtype float32: exactly


def _records(path: str) -> list:
    """The records of an offline wandb run file: a LevelDB-style log (blocks of 32 KiB, 7-byte
    headers: CRC, length, type FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4) after a 7-byte ':W&B' header,
    each record a protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:8]
    block, pos, parts, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # the zero padding at a block's end
            pos += block - pos % block
            continue
        parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
            parts = b""
    return out


@pytest.mark.skipif(not HAVE_WANDB, reason="wandb is optional; CI installs it (requirements.lock) and runs this")
def test_wandb_offline_holds_every_metric_the_config_and_the_sample_grid(runs):
    _, out = runs
    (path,) = glob.glob(os.path.join(out["disagg"], "wandb", "offline-run-*", "run-*.wandb"))
    records = _records(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, list(run.tags)) == ("digenrl-test", "init-lora", ["test", "peft"])
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    config.update({item.key: json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "config"
                   for item in r.config.update})
    assert config["optim"]["init_lora"].endswith("flow_grpo_lora") and config["run"]["id"]
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in r.history.item}
            history.setdefault(row["_step"], {}).update(row)
    for row in read_metrics(out["disagg"]):
        logged = history[row["step"]]
        for key, value in row.items():
            if key not in ("step", "time"):
                assert logged[key] == value or (math.isnan(value) and math.isnan(logged[key])), key
    assert history[0]["samples/_type"] == "image-file"
    assert os.path.isfile(os.path.join(os.path.dirname(path), "files", history[0]["samples/path"]))
