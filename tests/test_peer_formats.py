"""Weights in and out in the peers' formats (models/lora.py, checkpointing/export.py,
docs/peer-formats.md), checked with the peers' own calls: a peft folder as Flow-GRPO saves it
(`get_peft_model` + `save_pretrained`) and a diffusers LoRA file as DanceGRPO saves it
(`save_lora_weights`, its lora_config.json) start training (--init-lora) with the weights and the
scaling peft and diffusers give them; what does not fit the model is a ValueError naming it; a LoRA
checkpoint loads with `PeftModel.from_pretrained`, a full fine-tune's with
`<Family>Pipeline.from_pretrained` for every family."""
import json
import os

import pytest
import torch
from diffusers import FluxPipeline
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from checkpointing import runrecord
from checkpointing.checkpoint import load_trained_weights
from checkpointing.export import export_weights, write_lora
from config import preflight
from config.schema import RunConfig
from models import load_model, model_names
from models.lora import apply_lora, lora_targets, read_lora_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "assets", "shapes-flux")
FLOW_GRPO_TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                     "attn.to_out.0", "attn.to_q", "attn.to_v"]  # Flow-GRPO's scripts/train_sd3.py, its LoraConfig


def _randomize(module, seed):
    """Every LoRA weight drawn (lora_B starts at 0, which would hide a wrong copy or scale)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _lora(transformer) -> dict:
    """LoRA weights by module and matrix: 'transformer_blocks.0.attn.to_q.lora_A'."""
    return {n.replace("base_model.model.", "").rsplit(".", 2)[0]: p.detach()
            for n, p in transformer.named_parameters() if "lora_" in n}


def _flow_grpo_folder(path, rank=4, alpha=8):
    """A peft folder as Flow-GRPO writes it, and the peft model that wrote it."""
    peft_model = get_peft_model(load_model("flux", preset="tiny").transformer,
                                LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian",
                                           target_modules=FLOW_GRPO_TARGETS))
    _randomize(peft_model, 1)
    peft_model.save_pretrained(str(path))
    return str(path), peft_model


def _same_layer_output(ours, theirs, module="transformer_blocks.0.attn.to_q"):
    """One adapted layer computes the same in both models: the weights and the alpha / rank scaling."""
    layer = dict(ours.named_modules())[module]
    other = dict(theirs.named_modules())[module if module in dict(theirs.named_modules()) else
                                         "base_model.model." + module]
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(layer(x), other(x), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(layer(x), layer.base_layer(x), atol=1e-3)  # the LoRA moves it


def test_a_flow_grpo_peft_folder_starts_training_with_its_rank_alpha_targets_and_weights(tmp_path):
    folder, peft_model = _flow_grpo_folder(tmp_path / "lora")
    lora = read_lora_file(folder)
    assert (lora.rank, lora.alpha, lora.targets) == (4, 8.0, tuple(sorted(FLOW_GRPO_TARGETS)))

    cfg = RunConfig()  # the flags: --init-lora sets the run's LoRA shape, which config.json records
    cfg.optim.init_lora = folder
    cfg.resolve_defaults()
    assert (cfg.optim.lora_rank, cfg.optim.lora_alpha, cfg.optim.lora_targets) == (4, 8.0, lora.lora_targets())

    adapter = load_model("flux", preset="tiny")
    apply_lora(adapter.transformer, cfg.optim.lora_rank, cfg.optim.lora_alpha, cfg.optim.lora_targets, seed=7, init=lora)
    ours, theirs = _lora(adapter.transformer), _lora(peft_model)
    assert ours.keys() == theirs.keys() and len(ours) == 2 * len(lora.modules)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert all(p.requires_grad and p.dtype == torch.float32 for n, p in adapter.transformer.named_parameters()
               if "lora_" in n)
    _same_layer_output(adapter.transformer, peft_model)

    sampled = load_model("flux", preset="tiny")  # scripts/sample.py --checkpoint of a Flow-GRPO checkpoint's lora/
    load_trained_weights(sampled, folder)
    assert all(torch.equal(_lora(sampled.transformer)[k], theirs[k]) for k in theirs)


def test_a_diffusers_lora_file_starts_training_as_diffusers_and_dancegrpo_scale_it(tmp_path):
    source = load_model("flux", preset="tiny")
    apply_lora(source.transformer, 4, None, "attn")
    _randomize(source.transformer, 2)
    folder = tmp_path / "dance"
    FluxPipeline.save_lora_weights(str(folder), transformer_lora_layers=get_peft_model_state_dict(source.transformer))

    plain = read_lora_file(str(folder))  # no metadata: alpha = rank, as diffusers' loader takes it
    assert (plain.rank, plain.alpha) == (4, 4.0) and plain.prefix == "transformer."
    ours = load_model("flux", preset="tiny")
    apply_lora(ours.transformer, plain.rank, plain.alpha, plain.lora_targets(), init=plain)
    theirs = load_model("flux", preset="tiny")
    theirs.pipe.load_lora_weights(str(folder))  # diffusers' own loader
    _same_layer_output(ours.transformer, theirs.transformer)

    targets = lora_targets(load_model("flux", preset="tiny").transformer, "attn")
    (folder / "lora_config.json").write_text(json.dumps(  # DanceGRPO writes its rank and alpha beside the file
        {"step": 10, "lora_params": {"lora_rank": 4, "lora_alpha": 16, "target_modules": targets}}))
    dance = read_lora_file(str(folder / "pytorch_lora_weights.safetensors"))
    assert (dance.alpha, dance.targets) == (16.0, tuple(sorted(targets)))
    ours = load_model("flux", preset="tiny")
    apply_lora(ours.transformer, dance.rank, dance.alpha, dance.lora_targets(), init=dance)
    theirs.pipe.set_adapters(["default_0"], [16 / 4])  # DanceGRPO's alpha: diffusers' adapter scaled by alpha / rank
    _same_layer_output(ours.transformer, theirs.transformer)

    (folder / "lora_config.json").write_text(json.dumps({"lora_params": {"lora_rank": 4, "target_modules": ["to_q"]}}))
    with pytest.raises(ValueError, match=r"its targets \['to_q'\] do not name 18 layers it holds weights for"):
        apply_lora(load_model("flux", preset="tiny").transformer, 4, 4.0, "to_q", init=read_lora_file(str(folder)))


def test_a_lora_that_does_not_fit_is_a_clear_error_before_anything_trains(tmp_path):
    folder, _ = _flow_grpo_folder(tmp_path / "flux_lora")
    with pytest.raises(ValueError, match="are not linear layers of WanTransformer3DModel"):  # another model's LoRA
        lora = read_lora_file(folder)
        apply_lora(load_model("wan", preset="tiny").transformer, lora.rank, lora.alpha, "attn", init=lora)

    weights = load_file(os.path.join(folder, "adapter_model.safetensors"))
    key = "base_model.model.transformer_blocks.0.attn.to_q.lora_A.weight"
    resized = tmp_path / "resized"
    resized.mkdir()
    save_file({**weights, key: torch.zeros(4, 7)}, str(resized / "adapter_model.safetensors"))
    (resized / "adapter_config.json").write_text(open(os.path.join(folder, "adapter_config.json")).read())
    lora = read_lora_file(str(resized))
    with pytest.raises(ValueError, match=r"transformer_blocks.0.attn.to_q has lora_A \[4, 7\]"):
        apply_lora(load_model("flux", preset="tiny").transformer, 4, 8.0, lora.lora_targets(), init=lora)

    config = json.load(open(os.path.join(folder, "adapter_config.json")))
    for change, message in (({"use_dora": True}, "use_dora"), ({"rank_pattern": {"to_q": 8}}, "rank_pattern"),
                            ({"r": 8}, "its config says r=8, its weights have rank 4"),
                            ({"peft_type": "LOHA"}, "only LORA adapters")):
        (resized / "adapter_config.json").write_text(json.dumps({**config, **change}))
        save_file(weights, str(resized / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=message):
            read_lora_file(str(resized))
    os.remove(resized / "adapter_model.safetensors")
    torch.save(weights, resized / "adapter_model.bin")
    with pytest.raises(ValueError, match="a pickled adapter_model.bin is not read"):
        read_lora_file(str(resized))
    with pytest.raises(ValueError, match="no such file or folder"):
        read_lora_file(str(tmp_path / "nowhere"))
    cfg = RunConfig()
    cfg.optim.init_lora, cfg.optim.lora_rank = folder, 0
    with pytest.raises(ValueError, match="--lora-rank 0 means full fine-tuning"):
        cfg.resolve_defaults()


def test_a_lora_checkpoint_is_a_peft_folder_and_a_diffusers_lora_and_an_init_lora(tmp_path):
    trained = load_model("flux", preset="tiny")
    apply_lora(trained.transformer, 4, 8.0, "attn+ff")
    _randomize(trained.transformer, 3)
    weights = {n: p.detach() for n, p in trained.transformer.named_parameters() if "lora_" in n}
    folder = str(tmp_path / "step-1")
    os.makedirs(folder)
    write_lora(folder, trained, weights, trained.transformer.peft_config["default"])

    peft_model = PeftModel.from_pretrained(load_model("flux", preset="tiny").transformer, folder)  # Flow-GRPO's call
    assert all(torch.equal(_lora(peft_model)[k], w) for k, w in _lora(trained.transformer).items())
    _same_layer_output(trained.transformer, peft_model, "transformer_blocks.0.ff.net.2")
    diffusers = load_model("flux", preset="tiny")
    diffusers.pipe.load_lora_weights(folder)
    _same_layer_output(trained.transformer, diffusers.transformer)
    again = read_lora_file(folder)  # a checkpoint continues as another run's --init-lora
    assert (again.rank, again.alpha, again.lora_targets()) == (4, 8.0, ",".join(sorted(again.targets)))


@pytest.mark.parametrize("family", model_names())
def test_a_full_fine_tune_exports_a_pipeline_folder_each_familys_pipeline_loads(tmp_path, family):
    adapter = load_model(family, preset="tiny", seed=3)
    with torch.no_grad():
        trained = {n: p.detach() + 0.01 for n, p in adapter.transformer.named_parameters()}  # moved by training
    folder = str(tmp_path / "step-1")
    export_weights(folder, adapter, trained, lora=False, dtype=torch.float32,
                   model={"seed": 3, "model": {"model": family, "model_path": None, "preset": "tiny"}})
    pipe = adapter.pipeline_class.from_pretrained(folder)
    assert all(torch.equal(p, trained[n]) for n, p in pipe.transformer.named_parameters())
    base = dict(adapter.pipe.vae.named_parameters())  # the untouched components are the preset's
    assert all(torch.equal(p, base[n]) for n, p in pipe.vae.named_parameters())


def test_a_full_fine_tune_of_a_model_folder_links_its_components(tmp_path):
    adapter = load_model("flux", SHIPPED)
    trained = {n: p.detach() * 1.5 for n, p in adapter.transformer.named_parameters()}
    folder = str(tmp_path / "step-1")
    export_weights(folder, adapter, trained, lora=False, dtype=torch.bfloat16,
                   model={"seed": 0, "model": {"model": "flux", "model_path": SHIPPED, "preset": "auto"}})
    assert os.path.realpath(os.path.join(folder, "vae")) == os.path.realpath(os.path.join(SHIPPED, "vae"))
    assert not os.path.islink(os.path.join(folder, "transformer"))
    pipe = FluxPipeline.from_pretrained(folder)
    assert all(torch.equal(p, trained[n].to(torch.bfloat16).float()) for n, p in pipe.transformer.named_parameters())
    again = load_model("flux", folder)  # --model-path of the export: a further run starts from it
    assert again.defaults == adapter.defaults  # digenrl.json, the sampling defaults, came along


def test_wandb_is_checked_before_any_rank_waits(monkeypatch):
    cfg = RunConfig()
    cfg.output.wandb_tags = "a,b"
    with pytest.raises(ValueError, match="--wandb-tags without --wandb PROJECT"):
        preflight.check_wandb(cfg.output)
    cfg.output.wandb = "proj"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="--wandb proj: the wandb package is not installed"):
        preflight.check_wandb(cfg.output)
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name: object())
    preflight.check_wandb(cfg.output)
    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(ValueError, match="WANDB_MODE='ofline' is not a mode wandb knows"):
        preflight.check_wandb(cfg.output)


def test_a_resume_with_another_init_lora_is_refused(tmp_path):
    saved = {"optim": {"lora_rank": 4, "lora_alpha": 8.0, "lora_targets": "attn.to_q", "init_lora": str(tmp_path / "a")}}
    current = {"optim": {**saved["optim"], "init_lora": str(tmp_path / "b")}}
    assert runrecord.config_differences(saved, current) == [f"--init-lora {tmp_path / 'a'} (this run: {tmp_path / 'b'})"]
    assert runrecord.config_differences(saved, saved) == []
