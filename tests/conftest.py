"""Test environment: every test runs offline (no hub downloads) and without tokenizer threads."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from config import preflight

# One thread per test process: the tiny models are dominated by Python overhead, and with several
# processes on 2 cores extra threads only contend (torchrun subprocesses set OMP_NUM_THREADS=1).
torch.set_num_threads(1)


@pytest.fixture
def no_model_folder(monkeypatch):
    """Recipes name weights folders this machine does not have (/w/model): the preflight's folder,
    size and reward-folder checks are left out; tests/test_bad_inputs.py covers them."""
    monkeypatch.setattr(preflight, "check_model", lambda cfg, prompts=(): None)
    monkeypatch.setattr(preflight, "check_reward_models", lambda cfg: None)
