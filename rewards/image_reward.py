"""ImageReward (Xu et al. 2023) on transformers' BLIP classes, from a local folder.

ImageReward encodes the prompt with BLIP's BERT text encoder, cross-attending to the ViT-L image
tokens; the [CLS] feature goes through an MLP (the aesthetic-predictor shape) and the result is
standardised with the constants of the reference code. BLIP's `visual_encoder` and `text_encoder`
are transformers' `BlipForImageTextRetrieval.vision_model` and `.text_encoder`.

Folder (rewards/README.md): a `BlipForImageTextRetrieval` folder (config.json, model.safetensors)
holding ImageReward's BLIP weights, its tokenizer (BERT uncased with [DEC] / [ENC] added), an image
processor config (ImageReward resizes the short side to 224 bicubic, centre-crops 224 and normalises
with the OpenAI CLIP mean / std), and `head.safetensors` with the MLP's `layers.*` tensors."""
from __future__ import annotations

import torch

from rewards.reward import CONFIG_FILES, PROCESSOR_FILES, TOKENIZER_FILES, WEIGHT_FILES, Reward, check_local_dir, load_mlp_head, loading, require_package, to_pil

# Reference ImageReward.score(): rewards = (mlp(features) - mean) / std.
IMAGE_REWARD_MEAN = 0.16717362830052426
IMAGE_REWARD_STD = 1.0333394966054072
TEXT_MAX_LENGTH = 35  # the reference tokenizes with padding="max_length", max_length=35


class ImageReward(Reward):
    name = "image_reward"
    batch_size = 32

    def __init__(self, device: str | torch.device = "cpu", model_path: str | None = None,
                 dtype: torch.dtype = torch.float32):
        path = check_local_dir(self.name, model_path, {
            "config": CONFIG_FILES, "weights": WEIGHT_FILES, "image processor": PROCESSOR_FILES,
            "tokenizer": TOKENIZER_FILES,
        })
        transformers = require_package(self.name, "transformers")
        self.device, self.dtype = torch.device(device), dtype
        blip = loading(self.name, path, "BLIP model", transformers.BlipForImageTextRetrieval.from_pretrained, path,
                       local_files_only=True, dtype=dtype)
        # Keep the two towers ImageReward uses; the ITM / contrastive heads are not part of it.
        self.vision_model = blip.vision_model.to(self.device).eval().requires_grad_(False)
        self.text_encoder = blip.text_encoder.to(self.device).eval().requires_grad_(False)
        self.tokenizer = loading(self.name, path, "tokenizer", transformers.AutoTokenizer.from_pretrained, path,
                                 local_files_only=True)
        self.image_processor = loading(self.name, path, "image processor",
                                       transformers.AutoImageProcessor.from_pretrained, path, local_files_only=True)
        self.head = load_mlp_head(self.name, path).to(self.device)

    def score_images(self, images, prompts, metadata):
        text = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=TEXT_MAX_LENGTH,
                              return_tensors="pt").to(self.device)
        pixels = self.image_processor(to_pil(images), return_tensors="pt")["pixel_values"]
        pixels = pixels.to(self.device, self.dtype)
        image_embeds = self.vision_model(pixel_values=pixels).last_hidden_state  # (N, 1+P, Dv)
        image_mask = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
        text_out = self.text_encoder(input_ids=text["input_ids"], attention_mask=text["attention_mask"],
                                     encoder_hidden_states=image_embeds, encoder_attention_mask=image_mask)
        features = text_out.last_hidden_state[:, 0, :].float()  # (N, Dt), the [CLS] token
        return (self.head(features) - IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD
