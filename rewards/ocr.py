"""OCR reward (Flow-GRPO's text-rendering reward) with a TrOCR recogniser from a local folder.

reward = 1 - min(edit_distance(recognised, target), len(target)) / len(target), after removing spaces
and lower-casing both strings; 1 when the target occurs anywhere in the recognised text. The target
is metadata["text"] when present, else the first double-quoted span of the prompt
(`a sign that says "OPEN"` -> OPEN), as Flow-GRPO's OCR prompt set writes it.

Flow-GRPO recognises with PaddleOCR (detection + recognition). This reward uses transformers'
TrOCR (VisionEncoderDecoderModel + TrOCRProcessor), so it needs no extra package; TrOCR reads one
line of text from the whole image, which suits the short single-line targets of that prompt set."""
from __future__ import annotations

import re

import torch

from rewards.reward import CONFIG_FILES, PROCESSOR_FILES, TOKENIZER_FILES, WEIGHT_FILES, Reward, check_local_dir, loading, require_package, to_pil

_QUOTED = re.compile(r'"([^"]+)"|\u201c([^\u201d]+)\u201d')


def target_text(prompt: str, metadata: dict) -> str:
    """The text the image should show: metadata["text"], else the first quoted span of the prompt."""
    if metadata.get("text"):
        return str(metadata["text"])
    match = _QUOTED.search(prompt)
    if match is None:
        raise ValueError(f"reward 'ocr': no target text for prompt {prompt!r}; give it as metadata "
                         f"\"text\" in a jsonl prompt file or in double quotes in the prompt")
    return match.group(1) or match.group(2)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions all cost 1)."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_score(recognised: str, target: str) -> float:
    """Flow-GRPO's OcrScorer rule on one (recognised, target) pair."""
    recognised = recognised.replace(" ", "").lower()
    target = target.replace(" ", "").lower()
    if not target:
        raise ValueError("reward 'ocr': the target text is empty")
    distance = 0 if target in recognised else min(edit_distance(recognised, target), len(target))
    return 1.0 - distance / len(target)


class OcrReward(Reward):
    name = "ocr"
    batch_size = 16

    def __init__(self, device: str | torch.device = "cpu", model_path: str | None = None,
                 dtype: torch.dtype = torch.float32, max_new_tokens: int = 32):
        path = check_local_dir(self.name, model_path, {
            "config": CONFIG_FILES, "weights": WEIGHT_FILES, "image processor": PROCESSOR_FILES,
            "tokenizer": TOKENIZER_FILES,
        })
        transformers = require_package(self.name, "transformers")
        self.device, self.dtype, self.max_new_tokens = torch.device(device), dtype, max_new_tokens
        self.model = loading(self.name, path, "TrOCR model", transformers.VisionEncoderDecoderModel.from_pretrained,
                             path, local_files_only=True, dtype=dtype).to(self.device).eval().requires_grad_(False)
        self.processor = loading(self.name, path, "TrOCR processor", transformers.TrOCRProcessor.from_pretrained,
                                 path, local_files_only=True)

    def recognise(self, images) -> list[str]:
        pixels = self.processor(images=to_pil(images), return_tensors="pt")["pixel_values"]
        ids = self.model.generate(pixel_values=pixels.to(self.device, self.dtype), max_new_tokens=self.max_new_tokens)
        return self.processor.batch_decode(ids, skip_special_tokens=True)

    def score_images(self, images, prompts, metadata):
        targets = [target_text(p, m) for p, m in zip(prompts, metadata)]  # before the model runs: fail fast
        return torch.tensor([ocr_score(r, t) for r, t in zip(self.recognise(images), targets)], dtype=torch.float32)
