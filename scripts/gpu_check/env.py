"""The env section: what the machine is (GPU, driver, torch, CUDA, NCCL, bf16 and TF32 support) and
the versions the check ran with."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess

import torch

PACKAGES = ("torch", "transformers", "diffusers", "peft", "accelerate", "huggingface_hub", "safetensors", "numpy")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi; torch reports only the CUDA driver API's)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _nccl() -> str:
    v = torch.cuda.nccl.version()  # (major, minor, patch); an int on old torch
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def run(device: torch.device) -> dict:
    out = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "versions": {p: _version(p) for p in PACKAGES},
           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "device": device.type}
    if device.type != "cuda":
        return out
    props = torch.cuda.get_device_properties(device)
    major, minor = torch.cuda.get_device_capability(device)
    out.update(gpu=torch.cuda.get_device_name(device), capability=f"{major}.{minor}",
               multiprocessors=props.multi_processor_count, memory_gib=props.total_memory / 1024 ** 3,
               driver=_driver(), nccl=_nccl(),
               bf16_supported=torch.cuda.is_bf16_supported(),
               tf32_supported=major >= 8,  # TF32 tensor cores: Ampere (8.0) and later
               tf32_matmul_allowed=torch.backends.cuda.matmul.allow_tf32,
               float32_matmul_precision=torch.get_float32_matmul_precision(),
               flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled())
    return out


__all__ = ["run"]
