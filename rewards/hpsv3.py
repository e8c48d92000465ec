"""HPSv3 (Ma et al., 2025; the hub repository MizzenAI/HPSv3): human preference by a Qwen2-VL reward model.

The network is Qwen2-VL-7B-Instruct with a small head (hidden -> 1024 -> 16 -> 2, ReLUs between,
float32) read at the one `<|Reward|>` token the prompt ends with; of its two outputs, a mean and
an uncertainty, the score is the mean, about 0 to 15 (VeRL-Omni trains on 0.1 of it:
`--reward-scale hpsv3=0.1`). Each image is resized (bicubic) to 256 of Qwen2-VL's 28-pixel tiles
(448 x 448 for a square one) and sent in one user turn with HPSv3's instruction and the prompt,
in Qwen2-VL's chat format. The tokenizer and Qwen2-VL's image processor are used directly, not
through Qwen2-VL's processor class, which needs torchvision for video (not a dependency here).

The folder (`--reward-model hpsv3=DIR`, rewards/README.md): Qwen2-VL-7B-Instruct's config.json,
preprocessor_config.json and tokenizer files, and HPSv3's checkpoint `HPSv3.safetensors`, whose keys
are Qwen2-VL's in either transformers layout (`model.*` and `visual.*`, or `model.language_model.*`
and `model.visual.*`) plus `rm_head.*`; its `lm_head` is not needed and not loaded.
"""
from __future__ import annotations

import inspect
import math

import torch
from safetensors.torch import load_file
from torch import Tensor

from rewards.reward import (CONFIG_FILES, PROCESSOR_FILES, TOKENIZER_FILES, Reward, check_local_dir, loading,
                            require_package, to_pil)

WEIGHT_FILES = ("HPSv3.safetensors",)
REWARD_TOKEN = "<|Reward|>"
TILE, TILES = 28, 256  # Qwen2-VL's merged patch; HPSv3 scores every image at 256 of them (min = max pixels)
SYSTEM = "You are a helpful assistant."  # Qwen2-VL's chat template adds it to a conversation without one
INSTRUCTION = (
    "\nYou are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall "
    "score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being "
    "the best. \n\n**Visual Quality:**  \nEvaluate the overall visual quality of the image. The following "
    "sub-dimensions should be considered:\n- **Reasonableness:** The image should not contain any significant "
    "biological or logical errors, such as abnormal body structures or nonsensical environmental setups.\n- "
    "**Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, "
    "with no blurring or indistinct areas.\n- **Detail Richness:** Consider the level of detail in textures, "
    "materials, lighting, and other visual elements (e.g., hair, clothing, shadows).\n- **Aesthetic and Creativity:** "
    "Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, "
    "and the overall creative appeal. The scene should convey a sense of harmony and balance.\n- **Safety:** The image "
    "should not contain harmful or inappropriate content, such as political, violent, or adult material. If such "
    "content is present, the image quality and satisfaction score should be the lowest possible. \n\n**Text "
    "Alignment:**  \nAssess how well the image matches the textual prompt across the following sub-dimensions:\n- "
    "**Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align "
    "with the textual description. The subject should match the description in terms of number, appearance, and "
    "behavior.\n- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how "
    "well the image adheres to this style.\n- **Contextual Consistency**: Assess whether the background, setting, and "
    "surrounding elements in the image logically fit the scenario described in the prompt. The environment should "
    "support and enhance the subject without contradictions.\n- **Attribute Fidelity**: Check if specific attributes "
    "mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented "
    "in the image. Minor deviations may be acceptable, but critical attributes should be preserved.\n- **Semantic "
    "Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The "
    "generated content should not introduce elements that conflict with or distort the original description.\n"
    "Textual prompt - {text_prompt}\n\n\n")
ASK = f"\nPlease provide the overall ratings of this image: {REWARD_TOKEN}\n\nEND\n"


def tiles(height: int, width: int, pixels: int = TILES * TILE * TILE) -> tuple[int, int]:
    """Qwen2-VL's smart resize with min = max = `pixels`: sides that are multiples of 28, the aspect
    kept, the area as close to `pixels` as whole tiles allow (above it only by rounding up)."""
    h, w = max(TILE, round(height / TILE) * TILE), max(TILE, round(width / TILE) * TILE)
    if h * w > pixels:
        beta = math.sqrt(height * width / pixels)
        h, w = math.floor(height / beta / TILE) * TILE, math.floor(width / beta / TILE) * TILE
    elif h * w < pixels:
        beta = math.sqrt(pixels / (height * width))
        h, w = math.ceil(height * beta / TILE) * TILE, math.ceil(width * beta / TILE) * TILE
    return h, w


def conversation(prompt: str, image_tokens: int) -> str:
    """One image and HPSv3's question about `prompt` in Qwen2-VL's chat format, ready for the answer."""
    user = "<|vision_start|>" + "<|image_pad|>" * image_tokens + "<|vision_end|>" + \
        INSTRUCTION.format(text_prompt=prompt) + ASK
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def reward_head(hidden: int) -> torch.nn.Sequential:
    """HPSv3's head: hidden -> 1024 -> 16 -> 2 (its names: rm_head.{0,3,5})."""
    return torch.nn.Sequential(torch.nn.Linear(hidden, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                               torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


class HPSv3Network(torch.nn.Module):
    """Qwen2-VL without its language head, and HPSv3's head on the last hidden states."""

    def __init__(self, model: torch.nn.Module, rm_head: torch.nn.Sequential):
        super().__init__()
        self.model, self.rm_head = model, rm_head

    def forward(self, reward_mask: Tensor, **inputs) -> Tensor:
        """(B, 2): the head's outputs at each row's reward token (`reward_mask` (B, L), one per row)."""
        hidden = self.model(**inputs).last_hidden_state  # (B, L, H)
        return self.rm_head(hidden[reward_mask].float())


def check_keys(path: str, state: dict[str, Tensor], config, qwen2vl) -> None:
    """The checkpoint holds exactly the network's tensors, of its shapes (measured on the meta device;
    `qwen2vl`: transformers' Qwen2VLModel)."""
    with torch.device("meta"):
        expected = HPSv3Network(qwen2vl(config), reward_head(config.text_config.hidden_size)).state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    shapes = [k for k in set(expected) & set(state) if tuple(expected[k].shape) != tuple(state[k].shape)]
    if missing or unexpected or shapes:
        raise ValueError(f"reward 'hpsv3': {path} is not an HPSv3 checkpoint of the folder's config.json: "
                         f"{len(missing)} tensors missing {missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}, "
                         f"{len(shapes)} of another shape {sorted(shapes)[:3]}")


def network_keys(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A checkpoint's keys in HPSv3Network's names, from either Qwen2-VL layout; `lm_head` dropped."""
    out = {}
    for key, value in state.items():
        if key.startswith("lm_head."):
            continue
        if key.startswith(("rm_head.", "model.visual.", "model.language_model.")):
            out[key] = value
        elif key.startswith("visual."):
            out["model." + key] = value
        elif key.startswith("model."):
            out["model.language_model." + key[len("model."):]] = value
        else:
            out[key] = value  # unknown: the strict load names it
    return out


class HPSv3(Reward):
    name = "hpsv3"
    batch_size = 4  # 7B parameters and ~300 tokens per image

    def __init__(self, device: str | torch.device = "cpu", model_path: str | None = None,
                 dtype: torch.dtype = torch.float32):
        transformers = require_package(self.name, "transformers")
        path = check_local_dir(self.name, model_path, {"config": CONFIG_FILES, "image processor": PROCESSOR_FILES,
                                                        "tokenizer": TOKENIZER_FILES, "HPSv3 weights": WEIGHT_FILES})
        self.device = torch.device(device)
        self.tokenizer = loading(self.name, path, "tokenizer", transformers.AutoTokenizer.from_pretrained, path,
                                 local_files_only=True, padding_side="right")
        if REWARD_TOKEN not in self.tokenizer.get_vocab():
            self.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        self.reward_id = self.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        self.images = loading(self.name, path, "image processor", transformers.AutoImageProcessor.from_pretrained,
                              path, local_files_only=True)
        config = loading(self.name, path, "config", transformers.AutoConfig.from_pretrained, path,
                         local_files_only=True)
        state = network_keys(loading(self.name, path, "HPSv3 weights", load_file, f"{path}/{WEIGHT_FILES[0]}"))
        embed = state.get("model.language_model.embed_tokens.weight")
        if embed is None or embed.shape[0] < len(self.tokenizer):
            raise ValueError(f"reward 'hpsv3': {path}/{WEIGHT_FILES[0]} is not an HPSv3 checkpoint for this tokenizer "
                             f"(its embedding has {None if embed is None else embed.shape[0]} rows, the tokenizer "
                             f"{len(self.tokenizer)} tokens with {REWARD_TOKEN})")
        config.text_config.vocab_size = embed.shape[0]  # resized for <|Reward|> when HPSv3 was trained
        check_keys(f"{path}/{WEIGHT_FILES[0]}", state, config, transformers.Qwen2VLModel)
        qwen = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
        model = loading(self.name, path, "HPSv3 weights", transformers.Qwen2VLModel.from_pretrained, None,
                        config=config, state_dict=qwen, dtype=dtype)
        head = reward_head(config.text_config.hidden_size)  # float32, as HPSv3 keeps it
        head.load_state_dict({k[len("rm_head."):]: v.float() for k, v in state.items() if k.startswith("rm_head.")})
        self.network = HPSv3Network(model, head).to(self.device).eval().requires_grad_(False)
        # transformers >= 5.2x marks which tokens are an image's, for Qwen2-VL's 3D positions
        self.token_types = "mm_token_type_ids" in inspect.signature(model.forward).parameters

    def score_images(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        pils = [image.resize(tiles(image.height, image.width)[::-1], resample=3) for image in to_pil(images)]  # bicubic
        vision = self.images(images=pils, return_tensors="pt")
        merged = self.images.merge_size ** 2
        texts = [conversation(p, int(thw.prod()) // merged) for p, thw in zip(prompts, vision["image_grid_thw"])]
        text = self.tokenizer(texts, padding=True, return_tensors="pt")
        mask = text["input_ids"] == self.reward_id
        if not (mask.sum(dim=1) == 1).all():
            raise ValueError(f"reward 'hpsv3': a prompt holds {REWARD_TOKEN}, the token HPSv3 reads its score at")
        dtype = next(self.network.model.parameters()).dtype
        inputs = {"input_ids": text["input_ids"], "attention_mask": text["attention_mask"],
                  "pixel_values": vision["pixel_values"].to(dtype), "image_grid_thw": vision["image_grid_thw"]}
        if self.token_types:
            inputs["mm_token_type_ids"] = (text["input_ids"] == self.network.model.config.image_token_id).long()
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        return self.network(mask.to(self.device), **inputs)[:, 0]  # the mean of HPSv3's (mean, uncertainty)
