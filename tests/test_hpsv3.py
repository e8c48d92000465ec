"""HPSv3 (rewards/hpsv3.py) on a tiny Qwen2-VL made offline (tests/tiny_hpsv3.py), against a reference
that follows VeRL-Omni's HPSv3 inferencer (verl_omni/utils/reward_score/hpsv3_reward.py): the
checkpoint loaded into transformers' Qwen2VLForConditionalGeneration with its key remapping, the
conversation made by Qwen2-VL's chat template, the head read at the <|Reward|> token."""
from __future__ import annotations

import inspect
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from rewards import RewardSet, reward_model_paths
from rewards.hpsv3 import ASK, INSTRUCTION, REWARD_TOKEN, reward_head, tiles
from rewards.reward import to_pil
from tiny_hpsv3 import build_hpsv3, tokenizer


TOKEN_TYPES = "mm_token_type_ids" in inspect.signature(Qwen2VLModel.forward).parameters


def reference(path: str, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    tok = tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    reward_id = tok.convert_tokens_to_ids(REWARD_TOKEN)
    config = Qwen2VLConfig.from_pretrained(path)
    config.text_config.vocab_size = len(tok)
    model = Qwen2VLForConditionalGeneration(config).eval()
    state = load_file(os.path.join(path, "HPSv3.safetensors"))
    remapped = {}
    for key, value in state.items():  # VeRL-Omni's _remap_state_dict
        if "visual" in key:
            remapped[key.replace("visual", "model.visual")] = value
        elif "model" in key:
            remapped[key.replace("model", "model.language_model")] = value
        elif not key.startswith("rm_head."):
            remapped[key] = value
    model.load_state_dict(remapped, strict=True)
    head = reward_head(32).eval()
    head.load_state_dict({k[len("rm_head."):]: v for k, v in state.items() if k.startswith("rm_head.")})
    processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    scores = []
    for image, prompt in zip(to_pil(images), prompts):
        height, width = tiles(image.height, image.width)
        image = image.resize((width, height), resample=3)
        vision = processor(images=[image], return_tensors="pt")
        message = [{"role": "user", "content": [{"type": "image"},
                                                {"type": "text", "text": INSTRUCTION.format(text_prompt=prompt) + ASK}]}]
        text = tok.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
        text = text.replace("<|image_pad|>", "<|image_pad|>" * (int(vision["image_grid_thw"].prod()) // 4))
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            types = {"mm_token_type_ids": (ids == config.image_token_id).long()} if TOKEN_TYPES else {}
            hidden = model.model(input_ids=ids, pixel_values=vision["pixel_values"],
                                 image_grid_thw=vision["image_grid_thw"], **types).last_hidden_state
            scores.append(head(hidden.float())[ids == reward_id][0, 0])
    return torch.stack(scores)


def test_hpsv3_scores_as_the_reference_inferencer(tmp_path):
    build_hpsv3(str(tmp_path))
    g = torch.Generator().manual_seed(0)
    images = torch.rand(3, 3, 40, 72, generator=g)  # not square, not tiles: resized to 256 tiles' area
    prompts = ["a red fox in the snow", "a city at night", "a red fox in the snow"]
    rs = RewardSet(["hpsv3"], model_paths=reward_model_paths([f"hpsv3={tmp_path}"]))
    got = rs.score(images, prompts)["hpsv3"]
    expected = reference(str(tmp_path), images, prompts)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert len(set(got.tolist())) == 3  # each image and prompt its own score
    assert tiles(40, 72) == (336, 616) and tiles(1024, 1024) == (448, 448)


def test_hpsv3_refuses_a_checkpoint_of_another_model(tmp_path):
    build_hpsv3(str(tmp_path))
    file = os.path.join(str(tmp_path), "HPSv3.safetensors")
    state = load_file(file)
    state["rm_head.5.weight"] = torch.zeros(3, 16)
    save_file(state, file)
    with pytest.raises(ValueError, match=r"is not an HPSv3 checkpoint of the folder's config.json: 0 tensors missing "
                                         r"\[\], 0 unexpected \[\], 1 of another shape \['rm_head.5.weight'\]"):
        RewardSet(["hpsv3"], model_paths=reward_model_paths([f"hpsv3={tmp_path}"]))
    os.remove(file)
    with pytest.raises(ValueError, match=r"missing: HPSv3 weights \(HPSv3.safetensors\)"):
        RewardSet(["hpsv3"], model_paths=reward_model_paths([f"hpsv3={tmp_path}"]))
