"""Payload P2P and verified weight publication: checksum and bucket-plan unit tests, plus one
3-rank gloo run of tests/dist_scripts/p2p_publish.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel.p2p import pack_payload, unpack_payload
from parallel.publish import checksum, plan_buckets, state_checksum

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "tests.dist_scripts.p2p_publish"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.complex64, torch.uint8])
def test_checksum_deterministic_and_sensitive(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3, generator=g)
    t = (x > 0) if dtype == torch.bool else (x * 100).to(dtype)
    assert checksum(t) == checksum(t.clone()) == checksum(t.t().contiguous().t())  # same values, other layout
    assert isinstance(checksum(t), int) and 0 <= checksum(t) < 2**61
    changed = t.clone()
    changed.view(torch.uint8).view(-1)[0] ^= 1  # one bit of one element
    assert checksum(changed) != checksum(t)
    flat = t.reshape(-1)
    swapped = flat.clone()
    i = next(k for k in range(1, flat.numel()) if not torch.equal(flat[k], flat[0]))
    swapped[0], swapped[i] = flat[i], flat[0]
    assert checksum(swapped) != checksum(t)


def test_checksum_edge_cases():
    assert checksum(torch.zeros(0)) == checksum(torch.zeros(0, 5))  # no bytes at all
    assert checksum(torch.zeros(3)) != checksum(torch.zeros(4))  # the byte length counts
    assert checksum(torch.tensor(1.5)) == checksum(torch.tensor([1.5]))
    # a slice whose storage offset is not 4-byte aligned
    base = torch.arange(11, dtype=torch.bfloat16)
    assert checksum(base[1:8]) == checksum(base[1:8].clone())
    # every position of a permutation matters
    x = torch.arange(1000, dtype=torch.float32)
    assert checksum(x) != checksum(x.flip(0))
    assert checksum(x) != checksum(torch.roll(x, 1))


def test_state_checksum_names_order_dtype():
    a, b = torch.ones(3), torch.arange(4.0)
    assert state_checksum({"a": a, "b": b}) == state_checksum({"b": b, "a": a})
    assert state_checksum({"a": a, "b": b}) != state_checksum({"a": b, "b": a})
    assert state_checksum({"a": a}) != state_checksum({"a": a.double()})
    assert state_checksum({"a": a}) != state_checksum({"a": a.reshape(3, 1)})


def test_plan_buckets():
    layout = [("a", "torch.float32", 100), ("b", "torch.bfloat16", 10), ("c", "torch.float32", 300),
              ("d", "torch.float32", 50), ("e", "torch.float32", 50), ("f", "torch.bool", 3)]
    buckets = plan_buckets(layout, bucket_bytes=1024)
    assert [b["names"] for b in buckets] == [["a"], ["c"], ["d", "e"], ["b"], ["f"]]
    assert [b["numel"] for b in buckets] == [100, 300, 100, 10, 3]
    assert [b["names"] for b in plan_buckets(layout, 64 << 20)] == [["a", "c", "d", "e"], ["b"], ["f"]]
    with pytest.raises(ValueError):
        plan_buckets(layout, 0)


def test_pack_unpack_payload_in_process():
    tensors = {"x": torch.randn(3, 4), "m": torch.tensor([True, False]), "c": torch.randn(2, dtype=torch.complex64),
               "h": torch.randn(5).half(), "e": torch.zeros(0, 2, dtype=torch.int64)}
    length, header_t, buffer = pack_payload(tensors, {"k": 1}, torch.device("cpu"))
    assert int(length.item()) == header_t.numel()
    header = json.loads(bytes(header_t.numpy().tobytes()))
    assert header["meta"] == {"k": 1} and all(s["offset"] % 16 == 0 for s in header["tensors"])
    out = unpack_payload(header, buffer, torch.device("cpu"))
    assert all(torch.equal(out[k], v) and out[k].dtype == v.dtype for k, v in tensors.items())
    assert pack_payload({}, None, torch.device("cpu"))[2] is None


def test_p2p_and_publication_across_ranks(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("DIGENRL_DEBUG_CORRUPT_PUBLISH", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
           "-m", SCRIPT, str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    results = {}
    for rank in range(3):
        path = tmp_path / f"rank{rank}.json"
        results[rank] = json.loads(path.read_text()) if path.exists() else {"missing": True}
    assert proc.returncode == 0, f"{results}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    expected = {
        0: {"comm_device_cpu", "payload_roundtrip", "several_buckets", "num_changed"},
        1: {"payload_received", "install_exact_v1", "install_exact_v2", "checksums_agree_v2",
            "receive_leaves_targets_v2", "other_params_untouched", "noop_detected", "corrupt_flip_detected"},
        2: {"empty_payload", "install_exact_v2", "other_params_untouched", "corrupt_skip_detected",
            "extra_name_detected", "wire_in_step"},
    }
    for rank, names in expected.items():
        assert names <= results[rank].keys(), (rank, results[rank])
        assert all(v is True for v in results[rank].values()), (rank, results[rank])
