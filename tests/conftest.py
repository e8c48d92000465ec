"""Test environment: every test runs offline (no hub downloads) and without tokenizer threads."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

# One thread per test process: the tiny models are dominated by Python overhead, and with several
# processes on 2 cores extra threads only contend (torchrun subprocesses set OMP_NUM_THREADS=1).
torch.set_num_threads(1)

