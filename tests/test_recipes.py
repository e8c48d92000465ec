"""Recipes and config files (--config): TOML and config.json loading, flags over files, clear errors;
the published settings each recipe carries; the released configs of the paper's models on the meta
device (parameter counts, blocks, the embed / blocks / head split at full scale). Whether each recipe
fits its GPUs: tests/test_memory.py."""
import glob
import importlib.metadata
import json
import os

import pytest
import torch

from config.schema import FULL_LR, LORA_LR, RunConfig
from config.cli import build_parser, load_config_files, parse_config
from models.released import meta_adapter, parameter_counts, released_names
from planner.released_specs import MODELS as PLANNER_MODELS
from rewards import reward_url
from rl.conditioning import Conditioning


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*_grpo", "*.toml")))
TOPOLOGIES = [os.path.join(ROOT, "recipes", "topology", f"{n}gpus.toml") for n in (8, 16, 32)]
PROMPTS = os.path.join(ROOT, "data", "shapes_train.txt")


SERVED = "http://reward-host:8000/ocr"  # what a recipe that needs --reward is given here


def _loaded(*paths: str) -> tuple[RunConfig, dict]:
    cfg, recipe = load_config_files(list(paths))
    if "--reward" in recipe.get("needs", {}):
        cfg.rl.reward = [SERVED]
    cfg.rl.reward_model = [f"{spec.split(':')[0]}=/weights/reward" for spec in cfg.rl.reward if not reward_url(spec)]
    cfg.rl.prompts = cfg.output.eval_prompts = PROMPTS
    cfg.model.model_path = "/w/model"  # stand-ins for what a recipe needs: nothing is loaded
    cfg.resolve_defaults()
    return cfg, recipe


# ----- config files --------------------------------------------------------------------------------
def test_flags_override_the_recipe_and_later_files_override_earlier(tmp_path):
    recipe = os.path.join(ROOT, "recipes", "flow_grpo", "flux_dev.toml")
    cfg = parse_config(["--config", recipe, "--model-path", "/w/flux", "--prompts", PROMPTS, "--eval-prompts",
                        PROMPTS, "--reward-model", "pickscore=/w/ps", "--steps", "3", "--reward", "shapes",
                        "--no-grad-checkpointing"])
    assert cfg.rl.steps == 3 and cfg.rl.reward == ["shapes"] and cfg.optim.grad_checkpointing is False
    assert cfg.rl.group_size == 24 and cfg.sampling.sample_steps == 6 and cfg.optim.adam_betas == (0.9, 0.999)
    assert cfg.model.model_path == "/w/flux" and cfg.rl.reward_model == ["pickscore=/w/ps"]
    both, recipe_table = load_config_files([recipe, TOPOLOGIES[1]])
    assert (both.topology.generators, both.topology.trainers, recipe_table["gpus"]) == (8, 8, 16)
    assert both.rl.group_size == 24 and recipe_table["name"] == "flow_grpo/flux_dev"
    assert "--config FILE" in build_parser("DigenRL").format_help()


def test_a_recipe_names_what_it_needs():
    recipe = os.path.join(ROOT, "recipes", "dance_grpo", "hunyuan_video.toml")
    with pytest.raises(ValueError, match="recipe 'dance_grpo/hunyuan_video' needs --model-path: a local diffusers "
                                         "folder of hunyuanvideo-community/HunyuanVideo"):
        parse_config(["--config", recipe])


@pytest.mark.parametrize("name,text,message", [
    ("a.toml", '[rl]\nsteps = "50"\n', "rl.steps = '50': expected int"),
    ("a.toml", "[rl]\ngroup_size = true\n", "rl.group_size = True: expected int"),
    ("a.toml", "[rll]\nsteps = 5\n", "config has no section 'rll'"),
    ("a.toml", "[rl]\nstepz = 5\n", "config section 'rl' has no field(s) ['stepz']"),
    ("a.toml", '[optim]\nadam_betas = [0.9]\n', "--adam-betas [0.9]: expected two values"),
    ("a.toml", '[rl]\nreward = "shapes"\n', "rl.reward = 'shapes': expected a list of strings"),
    ("a.toml", "[rl\nsteps = 5\n", "Expected ']'"),
    ("a.toml", "[recipe]\ngpu_count = 8\n", "[recipe] has no key 'gpu_count'"),
    ("a.toml", '[recipe.needs]\n"--weights" = "x"\n', "recipe.needs names unknown flag(s) ['--weights']"),
    ("a.yaml", "rl: {}\n", "expected a .toml recipe or a .json config"),
    ("a.json", '{"rl": {"steps": 2.5}}', "rl.steps = 2.5: expected int"),
])
def test_bad_config_files_name_the_file_and_the_value(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        parse_config(["--config", str(path)])
    assert str(path) in str(e.value) and message in str(e.value)
    with pytest.raises(ValueError, match="no such file"):
        parse_config(["--config", str(tmp_path / "missing.toml")])


def test_lr_default_follows_the_fine_tuning_kind():
    def lr(*argv):
        cfg = parse_config(["--preset", "tiny", *argv])
        cfg.resolve_defaults()
        return cfg.optim.lr

    assert (lr(), lr("--lora-rank", "0"), lr("--lora-rank", "0", "--lr", "2e-5")) == (LORA_LR, FULL_LR, 2e-5)
    assert (LORA_LR, FULL_LR) == (3e-4, 1e-5)


def test_config_json_records_provenance_and_reads_back(tmp_path):
    cfg = parse_config(["--preset", "tiny", "--sde-window", "0:2", "--algorithm", "flow_grpo_fast", "--steps", "7"])
    cfg.resolve_defaults()
    cfg.save(str(tmp_path / "config.json"))
    written = json.loads((tmp_path / "config.json").read_text())
    prov = written["provenance"]
    assert prov["commit"] is None or len(prov["commit"]) == 40
    assert prov["packages"]["torch"] == importlib.metadata.version("torch") and prov["packages"]["python"]
    again, recipe = load_config_files([str(tmp_path / "config.json")])
    assert again == cfg and recipe == {}
    relaunched = parse_config(["--config", str(tmp_path / "config.json"), "--output-dir", str(tmp_path / "b")])
    assert relaunched.rl.steps == 7 and relaunched.sampling.sde_window == (0, 2)
    assert relaunched.output.output_dir == str(tmp_path / "b")


# ----- recipes: the published settings ------------------------------------------------------------
PUBLISHED = {  # (sources in each file's [recipe]): size, frames, K, sampler, noise, guidance, CFG, G, LoRA, lr, beta
    "flow_grpo/flux_dev.toml": (512, 512, None, 6, "sde", 0.9, 3.5, None, 24, 32, 3e-4, 0.0),
    "flow_grpo/sd35_medium.toml": (512, 512, None, 10, "sde", 0.7, None, 4.5, 24, 32, 3e-4, 0.01),
    "flow_grpo/qwen_image.toml": (512, 512, None, 10, "sde", 1.2, None, 4.0, 16, 64, 3e-4, 0.0),
    "flow_grpo/wan2_1_t2v_14b.toml": (240, 416, 33, 20, "sde", 0.7, None, 4.5, 4, 32, 1e-4, 0.004),
    "flow_grpo/wan2_1_t2v_1_3b.toml": (240, 416, 33, 20, "sde", 0.7, None, 4.5, 4, 32, 1e-4, 0.004),
    "flow_grpo/sd35_medium_ocr_http.toml": (512, 512, None, 10, "sde", 0.7, None, 4.5, 24, 32, 3e-4, 0.04),
    "dance_grpo/flux_dev.toml": (720, 720, None, 16, "dance", 0.3, 3.5, None, 12, 0, 1e-5, 0.0),
    "dance_grpo/hunyuan_video.toml": (480, 480, 53, 16, "dance", 0.25, 6.0, None, 24, 0, 1e-5, 0.0),
}


def test_recipes_carry_the_published_settings():
    assert sorted(os.path.relpath(p, os.path.join(ROOT, "recipes")) for p in RECIPES) == sorted(PUBLISHED)
    for rel, expected in PUBLISHED.items():
        cfg, recipe = _loaded(os.path.join(ROOT, "recipes", rel))
        served = "--reward" in recipe["needs"]  # the reward is a service's URL, not a weights folder
        assert set(recipe["needs"]) == {"--model-path", "--reward" if served else "--reward-model", "--prompts",
                                        "--eval-prompts"}, rel
        reward_models = [flag for r in cfg.rl.reward_model for flag in ("--reward-model", r)]
        if served:
            reward_models = ["--reward", SERVED]
            assert cfg.rl.reward == [SERVED] and not cfg.rl.reward_model, rel
        given = parse_config(["--config", os.path.join(ROOT, "recipes", rel), "--model-path", "/w/model",
                              "--prompts", PROMPTS, "--eval-prompts", PROMPTS, *reward_models])
        given.resolve_defaults()
        assert given == cfg, rel  # what the recipe needs is all it lacks
        s, rl, o = cfg.sampling, cfg.rl, cfg.optim
        got = (s.height, s.width, s.num_frames, s.sample_steps, s.sde_type, s.noise_level, s.guidance, s.cfg_scale,
               rl.group_size, o.lora_rank, o.lr, rl.beta)
        assert got == expected, rel
        assert rl.algorithm == ("dance_grpo" if rel.startswith("dance") else "flow_grpo_fast" if "qwen" in rel else "flow_grpo")
        assert rl.timestep_fraction == (0.6 if rel.startswith("dance") else 0.99), rel
        assert o.lr == (FULL_LR if o.lora_rank == 0 else o.lr) and recipe["source"] and recipe["model_config"]


# ----- released configs on the meta device ---------------------------------------------------------
# Transformer parameters of the released models (the paper's four; docs/MODELS.md).
PARAMS = {"flux1_dev": 11.90e9, "wan2_1_t2v_14b": 14.29e9, "qwen_image": 20.43e9, "hunyuan_video": 12.82e9}
BLOCKS = {"flux1_dev": 19 + 38, "flux1_schnell": 19 + 38, "wan2_1_t2v_14b": 40, "wan2_1_t2v_1_3b": 30,
          "qwen_image": 60, "hunyuan_video": 20 + 40, "sd3_5_medium": 24, "sd3_5_large": 38}


@pytest.fixture(scope="module")
def adapters():
    return {name: meta_adapter(name) for name in released_names()}


@pytest.fixture(scope="module")
def counts():
    return {name: parameter_counts(name) for name in released_names()}


def test_released_parameter_counts(counts):
    assert sorted(released_names()) == sorted(BLOCKS)
    for name, expected in PARAMS.items():
        assert counts[name]["transformer"] == pytest.approx(expected, rel=0.01), name
    assert counts["flux1_dev"]["text_encoder_2"] == pytest.approx(4.76e9, rel=0.01)  # T5-XXL encoder


def test_the_planners_specs_count_the_released_models_parameters(counts):
    """planner/released_specs.py derives each spec from the same JSON with formulas, without torch: its
    transformer and text-encoder counts equal the meta-device modules' exactly, its VAEs (a table)
    within 0.01%, and every released config has a spec."""
    assert sorted(PLANNER_MODELS) == sorted(released_names())
    for name, spec in PLANNER_MODELS.items():
        assert spec.params == counts[name]["transformer"], name
        encoders = [counts[name][k] for k in ("text_encoder", "text_encoder_2", "text_encoder_3") if k in counts[name]]
        assert [e.params for e in spec.text_encoders] == encoders, name
        assert spec.vae.params == pytest.approx(counts[name]["vae"], rel=1e-4), name
        assert spec.num_blocks == BLOCKS[name], name


def _meta_conditioning(adapter) -> Conditioning:
    meta = torch.device("meta")
    config = adapter.transformer.config
    text = adapter.max_sequence_length + (77 if adapter.family == "sd3" else 0)
    width = {"qwen_image": config.get("joint_attention_dim"), "wan": config.get("text_dim"),
             "hunyuan_video": config.get("text_embed_dim")}.get(adapter.family, config.get("joint_attention_dim"))
    tensors = {"prompt_embeds": torch.empty(1, text, width, device=meta)}
    if adapter.family in ("flux", "sd3", "hunyuan_video"):
        tensors["pooled"] = torch.empty(1, config.pooled_projection_dim, device=meta)
    if adapter.family == "qwen_image":
        tensors["prompt_mask"] = torch.ones(1, text, dtype=torch.long)  # on CPU: read to decide on masking
    if adapter.family == "hunyuan_video":
        tensors["mask"] = torch.ones(1, text, dtype=torch.long, device=meta)
    return Conditioning(tensors)


def _block_kinds(blocks) -> list[int]:
    """The first block of each structure (class and submodule names) and the last block: blocks of one
    structure compute alike, so these cover every kind of block (and SD3's text-less last block)."""
    seen, picked = set(), []
    for i, block in enumerate(blocks):
        kind = (type(block).__name__, tuple(n for n, _ in block.named_modules()))
        if kind not in seen or i == len(blocks) - 1:
            seen.add(kind)
            picked.append(i)
    return picked


def test_split_runs_the_released_transformers_on_meta(adapters):
    """embed -> blocks -> head at the family's full default size: the blocks are the transformer's
    block lists in order, shapes agree end to end through a block of every kind, and every module
    with parameters outside the skipped blocks runs."""
    for name, adapter in adapters.items():
        tr = adapter.transformer
        lists = [getattr(tr, a) for a in ("transformer_blocks", "single_transformer_blocks", "blocks")
                 if hasattr(tr, a)]
        assert adapter.blocks == [b for blocks in lists for b in blocks] and len(adapter.blocks) == BLOCKS[name]
        d = adapter.defaults
        shape = adapter.latent_shape(d.height, d.width, d.num_frames)
        picked = _block_kinds(adapter.blocks)
        ran = set()
        hooks = [m.register_forward_hook(lambda mod, i, o: ran.add(id(mod))) for m in tr.modules()]
        try:
            state = adapter.embed(torch.empty(1, *shape, device="meta"), torch.empty(1, device="meta"),
                                  _meta_conditioning(adapter))
            for i in picked:
                state = adapter.run_block(i, state)
            velocity = adapter.head(state)
        finally:
            for h in hooks:
                h.remove()
        assert tuple(velocity.shape) == (1, *shape), name
        skipped = {id(m) for i, b in enumerate(adapter.blocks) if i not in picked for m in b.modules()}
        idle = [n for n, m in tr.named_modules() if n and id(m) not in ran | skipped
                and any(True for _ in m.parameters(False))]
        assert not idle, (name, idle)


def test_precision_per_component():
    """--dtype is the compute dtype (auto: bf16 on CUDA, float32 on CPU): every component loads in it
    except a full fine-tune's trained transformer (float32 master weights); LoRA weights stay float32
    on a bf16 base."""
    from models import load_model, model_dtypes
    from models.lora import apply_lora

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert set(model_dtypes("auto", cpu).values()) == {torch.float32}
    assert model_dtypes("auto", cuda) == {"transformer": torch.float32, "default": torch.bfloat16}
    assert model_dtypes("auto", cuda, master=False) == {"transformer": torch.bfloat16, "default": torch.bfloat16}
    assert model_dtypes("bfloat16", cpu, master=False)["transformer"] == torch.bfloat16  # the CPU bf16 tests
    assert set(model_dtypes("float32", cuda).values()) == {torch.float32}
    adapter = load_model("flux", preset="tiny", dtype=model_dtypes("bfloat16", cpu, master=False))
    dtypes = {n: next(m.parameters()).dtype for n, m in adapter.pipe.components.items()
              if isinstance(m, torch.nn.Module)}
    assert set(dtypes.values()) == {torch.bfloat16} and len(dtypes) == 4
    apply_lora(adapter.transformer, 4, None)
    trained = [p for p in adapter.transformer.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    x = torch.randn(1, *adapter.latent_shape(16, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        v = adapter.velocity(x, torch.tensor([0.5]), adapter.encode_prompts(["a red circle"]))
    v.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trained)
