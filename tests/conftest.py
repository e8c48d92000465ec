"""Test environment: every test runs offline (no hub downloads) and without tokenizer threads."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

# One thread per test process: the tiny models are dominated by Python overhead, and with several
# processes on 2 cores extra threads only contend (torchrun subprocesses set OMP_NUM_THREADS=1).
torch.set_num_threads(1)


import subprocess

import pytest

INTEGRATION = {
    "test_autoplace", "test_bad_inputs", "test_bench", "test_gpu_check", "test_checkpoints", "test_comm_check", "test_compress", "test_default_run",
    "test_device_sync", "test_eval_script", "test_faults", "test_families", "test_gap", "test_global_std",
    "test_group_creation",
    "test_heterogeneous", "test_lean_roles", "test_memory", "test_merge_traces", "test_mixed_shapes",
    "test_model_bytes", "test_multinode", "test_new_algorithms_runs", "test_p2p_publish", "test_peer_formats_runs",
    "test_peer_protocols", "test_pretrain_tiny", "test_reliability",
    "test_remote_reward", "test_reward_server", "test_run_folders", "test_runtime", "test_tag_tcss",
    "test_tail_assist_runs", "test_tsp",
}
"""Test modules of the integration tier: they start processes (torchrun worlds, servers, scripts).
Every other test is in the fast tier (`pytest -m fast`, under 2 minutes on 2 cores), unless marked
`@pytest.mark.integration` itself for its time."""

ALLOWED_IN_FAST = ("git",)
"""programs a fast test may run (the architecture test lists the tracked files with git)"""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in INTEGRATION:
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.fast)


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request, monkeypatch):
    """A fast test that starts a process fails, naming the program: it belongs in the integration
    tier (INTEGRATION above), so that the fast tier stays fast and needs no process group."""
    if request.node.get_closest_marker("fast") is None:
        yield
        return
    popen = subprocess.Popen.__init__

    def guarded(self, args, *a, **k):
        program = str(args if isinstance(args, (str, bytes)) else args[0])
        if os.path.basename(program.split()[0]) not in ALLOWED_IN_FAST:
            raise RuntimeError(f"a fast-tier test started {program!r}: add its module to tests/conftest.py "
                               f"INTEGRATION or mark it @pytest.mark.integration")
        popen(self, args, *a, **k)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
    yield
