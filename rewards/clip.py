"""CLIP-family rewards on transformers' CLIPModel, each from a local folder (layouts: rewards/README.md).

- pickscore:       logit_scale.exp() * cos(image, text), as the PickScore reference code (about 18-24).
- clip_score:      cos(image, text) in [-1, 1]; torchmetrics' CLIPScore is 100 * max(cos, 0).
- hpsv2:           cos(image, text) of the HPSv2 fine-tuned ViT-H-14, HPSv2's own score (about 0.2-0.3).
- laion_aesthetic: the LAION improved-aesthetic-predictor MLP on the L2-normalised CLIP ViT-L/14
                   image embedding (about 1-10).

The model folder is a transformers CLIP folder. Its processor and tokenizer files may also sit in a
`processor/` sub-folder (PickScore ships its weights without them; they come from the base CLIP)."""
from __future__ import annotations

import os

import torch
from torch import Tensor

from rewards.reward import CONFIG_FILES, PROCESSOR_FILES, TOKENIZER_FILES, WEIGHT_FILES, Reward, check_local_dir, load_mlp_head, loading, require_package, to_pil


def processor_dir(path: str) -> str:
    sub = os.path.join(path, "processor")
    return sub if os.path.isdir(sub) else path


class _ClipReward(Reward):
    """Loads a CLIPModel + CLIPProcessor and embeds (image, prompt) pairs; subclasses turn the
    normalised embeddings into a score."""

    batch_size = 32

    def __init__(self, device: str | torch.device = "cpu", model_path: str | None = None,
                 dtype: torch.dtype = torch.float32):
        path = check_local_dir(self.name, model_path, {"config": CONFIG_FILES, "weights": WEIGHT_FILES})
        proc_path = check_local_dir(self.name, processor_dir(path),
                                    {"image processor": PROCESSOR_FILES, "tokenizer": TOKENIZER_FILES})
        transformers = require_package(self.name, "transformers")
        self.device, self.dtype = torch.device(device), dtype
        self.model = loading(self.name, path, "CLIP model", transformers.CLIPModel.from_pretrained, path,
                             local_files_only=True, dtype=dtype).to(self.device).eval().requires_grad_(False)
        self.processor = loading(self.name, proc_path, "CLIP processor", transformers.CLIPProcessor.from_pretrained,
                                 proc_path, local_files_only=True)
        self.max_text_length = self.model.config.text_config.max_position_embeddings

    def embed(self, images: Tensor, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """-> (image_embeds (N, D), text_embeds (N, D)), both L2-normalised by CLIPModel."""
        inputs = self.processor(text=prompts, images=to_pil(images), return_tensors="pt", padding=True,
                                truncation=True, max_length=self.max_text_length).to(self.device)
        out = self.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                         pixel_values=inputs["pixel_values"].to(self.dtype))
        return out.image_embeds.float(), out.text_embeds.float()

    def cosine(self, images: Tensor, prompts: list[str]) -> Tensor:
        image, text = self.embed(images, prompts)
        return (image * text).sum(dim=-1)  # (N,)


class PickScore(_ClipReward):
    """PickScore v1 (Kirstain et al. 2023). Flow-GRPO logs it divided by 26; use weight 1/26 for that scale."""

    name = "pickscore"

    def score_images(self, images, prompts, metadata):
        return self.model.logit_scale.exp().float() * self.cosine(images, prompts)


class ClipScore(_ClipReward):
    """Cosine similarity of image and prompt (CLIPScore / 100, without CLIPScore's clamp at 0)."""

    name = "clip_score"

    def score_images(self, images, prompts, metadata):
        return self.cosine(images, prompts)


class HPSv2(_ClipReward):
    """HPSv2 / HPSv2.1 (Wu et al. 2023): an open_clip ViT-H-14 fine-tuned on human preferences, loaded
    from a transformers-format conversion of its weights; the score is the image-text cosine."""

    name = "hpsv2"

    def score_images(self, images, prompts, metadata):
        return self.cosine(images, prompts)


LAION_HEAD_FILES = ("sac+logos+ava1-l14-linearMSE.pth",)


class LaionAesthetic(Reward):
    """LAION aesthetic predictor v2 (improved-aesthetic-predictor, as DDPO's aesthetic reward): CLIP
    image embedding, L2-normalised, into the MLP head. The prompt is not used."""

    name = "laion_aesthetic"
    batch_size = 32

    def __init__(self, device: str | torch.device = "cpu", model_path: str | None = None,
                 dtype: torch.dtype = torch.float32):
        path = check_local_dir(self.name, model_path, {"config": CONFIG_FILES, "weights": WEIGHT_FILES})
        proc_path = check_local_dir(self.name, processor_dir(path), {"image processor": PROCESSOR_FILES})
        transformers = require_package(self.name, "transformers")
        self.device, self.dtype = torch.device(device), dtype
        self.model = loading(self.name, path, "CLIP model", transformers.CLIPModel.from_pretrained, path,
                             local_files_only=True, dtype=dtype).to(self.device).eval().requires_grad_(False)
        self.image_processor = loading(self.name, proc_path, "image processor",
                                       transformers.AutoImageProcessor.from_pretrained, proc_path,
                                       local_files_only=True)
        self.head = load_mlp_head(self.name, path, LAION_HEAD_FILES).to(self.device)

    def score_images(self, images, prompts, metadata):
        pixels = self.image_processor(to_pil(images), return_tensors="pt")["pixel_values"]
        embeds = self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype)).pooler_output  # (N, D)
        embeds = embeds.float()
        return self.head(torch.nn.functional.normalize(embeds, dim=-1))
