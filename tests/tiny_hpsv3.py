"""A tiny HPSv3 folder, made offline (rewards/hpsv3.py): a byte-level tokenizer with Qwen2-VL's special
tokens and chat template, Qwen2-VL's image processor, a 2-layer Qwen2-VL config, and an
`HPSv3.safetensors` of random weights in the checkpoint's own layout (`model.*`, `visual.*`,
`lm_head.*`, `rm_head.*`), its embedding resized for `<|Reward|>` as HPSv3's training does."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL-7B-Instruct's chat template (its tokenizer_config.json), model data the reference applies
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    backend = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_hpsv3(path: str, seed: int = 0) -> None:
    tok = tokenizer()
    tok.save_pretrained(path)  # the base model's tokenizer: without <|Reward|>, which the reward adds
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 1280).save_pretrained(path)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"))
    config.save_pretrained(path)
    torch.manual_seed(seed)
    config.text_config.vocab_size = len(tok) + 1  # + <|Reward|>
    model = Qwen2VLForConditionalGeneration(config)
    state = {}
    for key, value in model.state_dict().items():  # the checkpoint's layout: transformers 4's names
        if key.startswith("model.visual."):
            key = key[len("model."):]
        elif key.startswith("model.language_model."):
            key = "model." + key[len("model.language_model."):]
        state[key] = value.clone()
    head = torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                               torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    state.update({f"rm_head.{k}": v for k, v in head.state_dict().items()})
    save_file(state, os.path.join(path, "HPSv3.safetensors"))
    with open(os.path.join(path, "README.txt"), "w") as f:
        json.dump({"tiny": "random weights for tests"}, f)
