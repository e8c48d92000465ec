"""Rewards: rule behaviour, spec parsing, weighted combination, and every model reward's code path on a
random tiny model of the same transformers classes, saved in the documented folder layout."""
import os
import sys

import pytest
import torch

import rewards
from rewards import RewardSet, build_reward, parse_reward_spec, parse_reward_specs, reward_model_paths
from rewards.reward import MLPHead
from rewards.ocr import edit_distance, ocr_score, target_text
from tiny_hpsv3 import build_hpsv3


def noise(b=2, h=32, w=32, seed=0):
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


def flat(b=2, h=32, w=32, value=0.5):
    return torch.full((b, 3, h, w), value)


def colourful(b=2, h=32, w=32):
    """Red and blue vertical stripes on black: vivid, contrasted, sharp edges."""
    img = torch.zeros(b, 3, h, w)
    img[:, 0, :, 0::8] = 1.0
    img[:, 0, :, 1::8] = 1.0
    img[:, 2, :, 4::8] = 1.0
    img[:, 2, :, 5::8] = 1.0
    return img


PROMPTS = ["a red circle", 'a sign that says "hello"']


# ---------------------------------------------------------------- rule rewards

def test_jpeg_compressibility_prefers_flat_images():
    comp = build_reward("jpeg_compressibility")
    incomp = build_reward("jpeg_incompressibility")
    images = torch.cat([flat(1), noise(1)])  # (2, 3, 32, 32)
    c, i = comp(images, PROMPTS, [{}, {}]), incomp(images, PROMPTS, [{}, {}])
    assert c.dtype == torch.float32 and c.shape == (2,)
    assert c[0] > c[1]      # flat compresses better than noise
    assert i[1] > i[0]
    torch.testing.assert_close(i, -c)


def test_rule_aesthetic_prefers_colourful_contrast_over_gray():
    reward = build_reward("rule_aesthetic")
    s = reward(torch.cat([flat(1), colourful(1)]), PROMPTS, [{}, {}])
    assert s[0] == 0.0
    assert 0.5 < s[1] <= 1.0


def test_video_scores_average_frames():
    reward = build_reward("rule_aesthetic")
    video = torch.stack([flat(2), colourful(2), noise(2)], dim=2)  # (B, 3, F, H, W)
    frame_scores = torch.stack([reward(video[:, :, f], PROMPTS, None) for f in range(3)], dim=1)
    torch.testing.assert_close(reward(video, PROMPTS, [{}, {}]), frame_scores.mean(dim=1))


def test_bad_shapes_are_value_errors():
    reward = build_reward("jpeg_compressibility")
    with pytest.raises(ValueError, match="images must be"):
        reward(torch.rand(2, 4, 8, 8), PROMPTS, [{}, {}])
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        reward(noise(2), PROMPTS[:1], [{}])


# ---------------------------------------------------------------- specs, registry, combination

def test_parse_reward_spec():
    assert parse_reward_spec("jpeg_compressibility") == ("jpeg_compressibility", 1.0)
    assert parse_reward_spec("rule_aesthetic:0.25") == ("rule_aesthetic", 0.25)
    assert parse_reward_spec("pickscore:-2") == ("pickscore", -2.0)
    with pytest.raises(ValueError, match=r"unknown reward 'nope'.*jpeg_compressibility.*shapes"):
        parse_reward_spec("nope:1.0")
    with pytest.raises(ValueError, match=r"'rule_aesthetic:heavy'.*not a number"):
        parse_reward_spec("rule_aesthetic:heavy")
    with pytest.raises(ValueError, match="finite"):
        parse_reward_spec("rule_aesthetic:nan")
    with pytest.raises(ValueError, match="NAME"):
        parse_reward_spec(":1")


def test_registry_lists_every_reward():
    assert set(rewards.reward_names()) == {
        "shapes", "shapes_detector", "jpeg_compressibility", "jpeg_incompressibility", "rule_aesthetic",
        "pickscore", "clip_score", "hpsv2", "hpsv3", "laion_aesthetic", "image_reward", "ocr", "temporal_consistency"}
    with pytest.raises(ValueError, match="no weights"):
        build_reward("rule_aesthetic", model_path="/tmp")


def test_spec_validation_fails_before_building():
    with pytest.raises(ValueError, match="more than once"):
        parse_reward_specs(["rule_aesthetic", "rule_aesthetic:2"])
    with pytest.raises(ValueError, match="--reward-model pickscore=DIR"):
        RewardSet(["rule_aesthetic", "pickscore"])  # no model path: nothing is built
    with pytest.raises(ValueError, match="not a model reward"):
        parse_reward_specs(["rule_aesthetic"], {"rule_aesthetic": "/x"})
    with pytest.raises(ValueError, match="no reward"):
        RewardSet([])


def test_reward_model_paths():
    paths = reward_model_paths(["pickscore=/w/pick", "ocr=/w/trocr=v2"])
    assert paths == {"pickscore": "/w/pick", "ocr": "/w/trocr=v2"}
    for bad, match in [("pickscore", "NAME=DIR"), ("=/x", "NAME=DIR"), ("shapes=/x", "not a model reward"),
                       ("nope=/x", "not a model reward")]:
        with pytest.raises(ValueError, match=match):
            reward_model_paths([bad])
    with pytest.raises(ValueError, match="twice"):
        reward_model_paths(["ocr=/a", "ocr=/b"])


def test_reward_set_combine_is_weighted_sum():
    rs = RewardSet(["jpeg_compressibility:0.5", "rule_aesthetic:2"])
    assert rs.names == ["jpeg_compressibility", "rule_aesthetic"] and rs.weights == [0.5, 2.0]
    images = torch.cat([flat(1), colourful(1)])
    scores = rs.score(images, PROMPTS, [{}, {}])
    assert set(scores) == {"jpeg_compressibility", "rule_aesthetic"}
    torch.testing.assert_close(rs.combine(scores),
                               0.5 * scores["jpeg_compressibility"] + 2.0 * scores["rule_aesthetic"])
    with pytest.raises(ValueError, match="scores for"):
        rs.combine({"jpeg_compressibility": scores["jpeg_compressibility"]})


# ---------------------------------------------------------------- OCR rule

def test_ocr_rule():
    assert edit_distance("kitten", "sitting") == 3
    assert target_text('a neon sign that says "Open Late"', {}) == "Open Late"
    assert target_text("a poster", {"text": "SALE"}) == "SALE"
    with pytest.raises(ValueError, match="no target text"):
        target_text("a poster", {})
    assert ocr_score("OPEN LATE now", "open late") == 1.0
    assert ocr_score("", "abcd") == 0.0
    assert ocr_score("abcx", "abcd") == 0.75


# ---------------------------------------------------------------- model rewards on tiny random models

def _clip_folder(path, processor_subdir=False, image_size=32):
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from models.tiny_text import clip_tokenizer
    tok = clip_tokenizer()
    torch.manual_seed(0)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=tok.model_max_length, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=image_size, patch_size=16)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(path)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                            crop_size={"height": image_size, "width": image_size})
    proc_path = os.path.join(path, "processor") if processor_subdir else path
    CLIPProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(proc_path)
    image_processor.save_pretrained(proc_path)


def _head(path, input_size, name="head.safetensors"):
    from safetensors.torch import save_file
    torch.manual_seed(1)
    state = {k: v.contiguous() for k, v in MLPHead(input_size).state_dict().items()}
    if name.endswith(".safetensors"):
        save_file(state, os.path.join(path, name))
    else:
        torch.save(state, os.path.join(path, name))


def build_pickscore(path):
    _clip_folder(path, processor_subdir=True)  # PickScore layout: processor files from the base CLIP


def build_clip(path):
    _clip_folder(path)


def build_laion_aesthetic(path):
    _clip_folder(path)
    _head(path, 16, "sac+logos+ava1-l14-linearMSE.pth")  # the original file name, a torch pickle


def build_image_reward(path):
    from transformers import BertTokenizer, BlipConfig, BlipForImageTextRetrieval
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz\"",
             *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz\"")]
    tok = BertTokenizer(vocab={t: i for i, t in enumerate(vocab)})
    tok.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    torch.manual_seed(0)
    config = BlipConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, encoder_hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=40,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, sep_token_id=tok.sep_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16),
        image_text_hidden_size=16)
    BlipForImageTextRetrieval(config).save_pretrained(path)
    tok.save_pretrained(path)
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(path)
    _head(path, 32)


def build_ocr(path):
    from transformers import (TrOCRConfig, TrOCRProcessor, ViTConfig, VisionEncoderDecoderConfig,
                              VisionEncoderDecoderModel)
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    from models.tiny_text import byte_bpe_tokenizer
    tok = byte_bpe_tokenizer(["<s>", "</s>", "<pad>", "<unk>"], bos_token="<s>", eos_token="</s>",
                             pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    encoder = ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        image_size=32, patch_size=16)
    decoder = TrOCRConfig(vocab_size=len(tok), d_model=32, decoder_layers=1, decoder_attention_heads=2,
                          decoder_ffn_dim=64, max_position_embeddings=64, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          decoder_start_token_id=tok.bos_token_id)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = (
        tok.bos_token_id, tok.pad_token_id, tok.eos_token_id)
    model = VisionEncoderDecoderModel(config)
    model.generation_config.decoder_start_token_id = tok.bos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    image_processor = ViTImageProcessorPil(size={"height": 32, "width": 32})
    TrOCRProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(path)
    image_processor.save_pretrained(path)


BUILDERS = {
    "pickscore": build_pickscore,
    "clip_score": build_clip,
    "hpsv2": build_clip,  # a transformers CLIPModel folder, as for clip_score
    "laion_aesthetic": build_laion_aesthetic,
    "image_reward": build_image_reward,
    "ocr": build_ocr,
    "hpsv3": build_hpsv3,  # tests/tiny_hpsv3.py; its reference test: tests/test_hpsv3.py
}


def test_every_model_reward_has_a_tiny_test():
    assert set(BUILDERS) == set(rewards.MODEL_REWARDS)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_model_reward_on_tiny_model(name, tmp_path):
    BUILDERS[name](str(tmp_path))
    rs = RewardSet([f"{name}:0.5"], model_paths=reward_model_paths([f"{name}={tmp_path}"]))
    images = torch.stack([noise(1, 40, 48)[0], colourful(1, 40, 48)[0]])  # not square: resize + crop path
    scores = rs.score(images, PROMPTS, [{"text": "hi"}, {}])[name]
    assert scores.shape == (2,) and scores.dtype == torch.float32 and scores.device.type == "cpu"
    assert torch.isfinite(scores).all()
    torch.testing.assert_close(rs.combine({name: scores}), 0.5 * scores)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_model_reward_missing_weights(name, tmp_path):
    with pytest.raises(ValueError, match=f"reward '{name}'.*--reward-model {name}=DIR"):
        build_reward(name, model_path=None)
    missing = tmp_path / "absent"
    with pytest.raises(ValueError, match=f"reward '{name}'.*{missing}.*does not exist"):
        build_reward(name, model_path=str(missing))
    with pytest.raises(ValueError, match=f"reward '{name}'.*incomplete.*config.json"):
        build_reward(name, model_path=str(tmp_path))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_model_reward_missing_package_names_it(name, tmp_path, monkeypatch):
    for f in ("config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json"):
        (tmp_path / f).write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ImportError, match=f"reward '{name}'.*pip install transformers"):
        build_reward(name, model_path=str(tmp_path))


def test_laion_aesthetic_without_head_is_a_clear_error(tmp_path):
    _clip_folder(str(tmp_path))
    with pytest.raises(ValueError, match="laion_aesthetic.*no MLP head file.*sac\\+logos"):
        build_reward("laion_aesthetic", model_path=str(tmp_path))


# ---------------------------------------------------------------- converters from the original checkpoints

def _to_open_clip(state):
    """transformers CLIPModel keys -> open_clip keys, written from open_clip's module names."""
    out = {}
    for key, value in state.items():
        if key.endswith("position_ids"):
            continue
        tower = "visual." if key.startswith("vision_model.") else ""
        key = key.replace("vision_model.", "").replace("text_model.", "")
        if ".self_attn.q_proj." in key:
            kind = key.rsplit(".", 1)[1]
            base = key.split(".self_attn.")[0]
            fused = torch.cat([state[f"{'vision_model' if tower else 'text_model'}.{base}.self_attn.{p}_proj.{kind}"]
                               for p in "qkv"])
            key, value = f"{base}.attn.in_proj_{kind}", fused
        elif ".self_attn.k_proj." in key or ".self_attn.v_proj." in key:
            continue
        for old, new in [("encoder.layers.", "transformer.resblocks."), ("layer_norm1", "ln_1"),
                         ("layer_norm2", "ln_2"),
                         ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj"), ("self_attn.out_proj", "attn.out_proj"),
                         ("embeddings.token_embedding.weight", "token_embedding.weight"),
                         ("embeddings.class_embedding", "class_embedding"),
                         ("embeddings.patch_embedding.weight", "conv1.weight"), ("pre_layrnorm", "ln_pre"),
                         ("post_layernorm", "ln_post"), ("final_layer_norm", "ln_final")]:
            key = key.replace(old, new)
        if key == "embeddings.position_embedding.weight":
            key = "positional_embedding"
        elif key == "text_projection.weight":
            key, value = "text_projection", value.t()
        elif key == "visual_projection.weight":
            tower, key, value = "visual.", "proj", value.t()
        out[tower + key] = value.clone()
    return out


def test_convert_hpsv2_matches_the_source_model(tmp_path):
    from rewards.convert import convert_hpsv2
    source, base, out = (str(tmp_path / n) for n in ("source", "base", "out"))
    _clip_folder(source)
    _clip_folder(base)
    from transformers import CLIPModel
    reference = CLIPModel.from_pretrained(source)
    perturbed = CLIPModel.from_pretrained(base)
    with torch.no_grad():  # the base must differ from the source so that the test sees the conversion
        for p in perturbed.parameters():
            p.add_(0.5)
    perturbed.save_pretrained(base)
    torch.save({"state_dict": _to_open_clip(reference.state_dict())}, tmp_path / "HPS_v2.1_compressed.pt")
    convert_hpsv2(str(tmp_path / "HPS_v2.1_compressed.pt"), base, out)
    images = torch.stack([noise(1)[0], colourful(1)[0]])
    torch.testing.assert_close(build_reward("hpsv2", model_path=out)(images, PROMPTS),
                               build_reward("clip_score", model_path=source)(images, PROMPTS))


def test_convert_image_reward_matches_the_source_model(tmp_path):
    from safetensors.torch import load_file
    from transformers import BlipForImageTextRetrieval

    from rewards.convert import convert_image_reward
    source, out = str(tmp_path / "source"), str(tmp_path / "out")
    build_image_reward(source)
    blip = BlipForImageTextRetrieval.from_pretrained(source).state_dict()
    original = {f"mlp.{k}": v for k, v in load_file(os.path.join(source, "head.safetensors")).items()}
    vit = [("embeddings.class_embedding", "cls_token"), ("embeddings.position_embedding", "pos_embed"),
           ("embeddings.patch_embedding.", "patch_embed.proj."), ("encoder.layers.", "blocks."),
           ("layer_norm1", "norm1"), ("layer_norm2", "norm2"), ("self_attn.qkv", "attn.qkv"),
           ("self_attn.projection", "attn.proj"), ("post_layernorm", "norm")]
    for key, value in blip.items():
        if key.startswith("itm_head."):
            continue  # ImageReward's BLIP has no ITM head
        if key.startswith("vision_model."):
            key = key.removeprefix("vision_model.")
            for old, new in vit:
                key = key.replace(old, new)
            key = "visual_encoder." + key
        original[f"blip.{key}"] = value
    torch.save(original, tmp_path / "ImageReward.pt")
    convert_image_reward(str(tmp_path / "ImageReward.pt"), source, out, vision_heads=2, text_heads=2)
    images = torch.stack([noise(1)[0], colourful(1)[0]])
    torch.testing.assert_close(build_reward("image_reward", model_path=out)(images, PROMPTS),
                               build_reward("image_reward", model_path=source)(images, PROMPTS))
