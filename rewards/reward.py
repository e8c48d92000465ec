"""What every reward shares: the call signature, video frames, batching, local weight folders.

A reward is called as `reward(images, prompts, metadata) -> Tensor[B]` (float32, CPU):
images are floats in [0, 1], shaped (B, 3, H, W) or, for video, (B, 3, F, H, W); prompts is a
list of B strings; metadata a list of B dicts (free per-prompt fields from a jsonl prompt file).
Subclasses implement `score_images` on plain (N, 3, H, W) images; this base class turns video into
frames (an image reward scores every frame and averages over frames), splits large batches into
chunks of `batch_size` and returns the documented dtype and device."""
from __future__ import annotations

import importlib
import os
from typing import Sequence

import numpy as np
import torch
from PIL import Image
from torch import Tensor


class Reward:
    """Base class of all rewards. `name` is the registry name, used in error messages."""

    name: str = "reward"
    batch_size: int | None = None  # None: score the whole batch in one call

    def score_images(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        """images (N, 3, H, W) in [0, 1] -> scores (N,)."""
        raise NotImplementedError

    @classmethod
    def check_prompt(cls, prompt: str) -> None:
        """ValueError if this reward cannot score `prompt` (checked for every prompt before a run
        loads anything). Most rewards score any prompt."""

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        prompts = list(prompts)
        metadata = [{} for _ in prompts] if metadata is None else list(metadata)
        if images.dim() not in (4, 5) or images.shape[1] != 3:
            raise ValueError(f"reward {self.name!r}: images must be (B, 3, H, W) or (B, 3, F, H, W), "
                             f"got {tuple(images.shape)}")
        batch = images.shape[0]
        if batch == 0:
            return torch.zeros(0)
        if len(prompts) != batch or len(metadata) != batch:
            raise ValueError(f"reward {self.name!r}: {batch} images but {len(prompts)} prompts and "
                             f"{len(metadata)} metadata entries")
        num_frames = 1
        if images.dim() == 5:
            num_frames = images.shape[2]
            images = images.permute(0, 2, 1, 3, 4).flatten(0, 1)  # (B*F, 3, H, W), frames of a video adjacent
            prompts = [p for p in prompts for _ in range(num_frames)]
            metadata = [m for m in metadata for _ in range(num_frames)]
        images = images.float().clamp(0, 1)
        step = self.batch_size or len(prompts)
        scores = [
            self.score_images(images[i:i + step], prompts[i:i + step], metadata[i:i + step]).float().cpu()
            for i in range(0, len(prompts), step)
        ]
        return torch.cat(scores).reshape(batch, num_frames).mean(dim=1)  # (B,)


def to_uint8_hwc(images: Tensor) -> np.ndarray:
    """(N, 3, H, W) floats in [0, 1] -> (N, H, W, 3) uint8, rounded as the reference reward code does."""
    return (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def to_pil(images: Tensor) -> list[Image.Image]:
    """(N, 3, H, W) floats in [0, 1] -> RGB PIL images. Model rewards feed these to their own processors:
    the processors' PIL path needs no torchvision and matches how the reward models were evaluated."""
    return [Image.fromarray(a) for a in to_uint8_hwc(images)]


def require_package(reward: str, module: str, pip_name: str | None = None):
    """Import an optional dependency or raise an ImportError that names the pip package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"reward {reward!r} needs the optional package {pip_name or module!r}: "
                          f"pip install {pip_name or module}") from e


# Files a transformers folder may hold, by role; a role is present when any one of its names exists.
CONFIG_FILES = ("config.json",)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt")


def check_local_dir(reward: str, path: str | os.PathLike | None, required: dict[str, Sequence[str]]) -> str:
    """Fail early, naming the reward, the folder and the missing files, before any weights load.
    `required` maps a role ("weights") to the file names that can fill it."""
    if path is None or str(path) == "":
        raise ValueError(f"reward {reward!r} loads its weights from a local folder: give one with "
                         f"--reward-model {reward}=DIR (see rewards/README.md)")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"reward {reward!r}: model folder {path!r} does not exist (see rewards/README.md)")
    missing = [f"{role} ({' or '.join(names)})" for role, names in required.items()
               if not any(os.path.exists(os.path.join(path, n)) for n in names)]
    if missing:
        raise ValueError(f"reward {reward!r}: model folder {path!r} is incomplete, missing: {'; '.join(missing)} "
                         f"(see rewards/README.md)")
    return path


def find_file(path: str, names: Sequence[str]) -> str | None:
    for n in names:
        if os.path.exists(os.path.join(path, n)):
            return os.path.join(path, n)
    return None


def load_state_dict(file: str) -> dict[str, Tensor]:
    """A safetensors file or a torch pickle of tensors (loaded with weights_only, so no code runs)."""
    if file.endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(file)
    state = torch.load(file, map_location="cpu", weights_only=True)
    return state.get("state_dict", state)


def loading(reward: str, path: str, what: str, fn, *args, **kwargs):
    """Call a `from_pretrained`-style loader; re-raise its failures as a ValueError naming the reward."""
    try:
        return fn(*args, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ValueError(f"reward {reward!r}: could not load the {what} from {path!r}: {e}") from e


class MLPHead(torch.nn.Module):
    """The improved-aesthetic-predictor MLP (LAION aesthetic v2), reused by ImageReward on its BLIP
    features. No activations between the linear layers, exactly as in both original codebases;
    the dropouts are inactive in eval mode but keep the `layers.{0,2,4,6,7}` parameter names."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(input_size, 1024), torch.nn.Dropout(0.2),
            torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
            torch.nn.Linear(64, 16),
            torch.nn.Linear(16, 1),
        )

    def forward(self, x: Tensor) -> Tensor:  # (N, input_size) -> (N,)
        return self.layers(x).squeeze(-1)


HEAD_FILES = ("head.safetensors", "head.pt", "head.pth")


def load_mlp_head(reward: str, path: str, extra_names: Sequence[str] = ()) -> MLPHead:
    """Load an MLPHead from `path`/head.{safetensors,pt,pth} (or one of `extra_names`), keys `layers.*`."""
    file = find_file(path, (*HEAD_FILES, *extra_names))
    if file is None:
        raise ValueError(f"reward {reward!r}: model folder {path!r} has no MLP head file "
                         f"({' or '.join((*HEAD_FILES, *extra_names))}); see rewards/README.md")
    state = loading(reward, path, "MLP head", load_state_dict, file)
    head = MLPHead(state["layers.0.weight"].shape[1] if "layers.0.weight" in state else 768)
    loading(reward, path, "MLP head", head.load_state_dict, state)
    return head.eval()
