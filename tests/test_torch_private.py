"""torch's private APIs (parallel/torchapi.py): a torch without one says so in one line naming the
API and the installed torch, and the feature degrades (the all-gather count, the trace's
functional collectives) or stops with that line (what cannot work without it)."""
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from parallel import commhooks, fsdp, torchapi
from lab.memory.fake_run import fake_world
from telemetry import commtrace


def test_a_missing_private_api_is_one_line_naming_it_and_the_torch():
    with pytest.raises(torchapi.MissingTorchAPI) as e:
        torchapi.require("the feature", "torch.no_such_module.thing", "torch._C._nn._parse_to", "torch.nn.nope")
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"the feature: torch {torch.__version__} has no ")
    assert "torch.no_such_module.thing, torch.nn.nope" in text and "_parse_to" not in text  # only the missing
    assert torchapi.require("f", "torch._C._nn._parse_to") is torch._C._nn._parse_to
    with pytest.raises(torchapi.MissingTorchAPI, match=r"torch\.Tensor\._nope"):
        torchapi.attribute(torch.zeros(1), "_nope", "the feature")


def _units(world: int):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    mesh = DeviceMesh("cpu", list(range(world)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return model, mesh


def test_the_allgather_count_is_off_with_a_warning_when_fsdp2_keeps_its_state_elsewhere(monkeypatch):
    """count_allgathers wraps each unit's unshard through FSDP2's private state; without it the
    count is off (no unshard wrapped, train/num_allgathers reads 0), said once, not a crash."""
    monkeypatch.setattr(torchapi, "_warned", set())
    with fake_world(2, 0):
        model, _ = _units(2)
        fsdp.count_allgathers(model, None, lambda: None)
        assert all("unshard" in vars(g) for g in fsdp.param_groups(model, "f", "c"))  # wrapped
        model, _ = _units(2)
        monkeypatch.delattr(FSDPModule, "_get_fsdp_state")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fsdp.count_allgathers(model, None, lambda: None)
        texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(texts) == 1 and f"torch {torch.__version__} has no FSDPModule._get_fsdp_state()" in texts[0]
        assert "train/num_allgathers reads 0" in texts[0]
        with pytest.raises(torchapi.MissingTorchAPI, match="the memory measurement"):
            fsdp.param_groups(model, "the memory measurement")  # a feature that needs it stops, naming it


def test_functional_collectives_resolve_their_group_publicly_or_go_unrecorded(tmp_path, monkeypatch):
    """DTensor names a functional collective's group by (mesh, dim): resolved with public APIs
    (torch 2.11 has no funcol._resolve_group) and recorded. A group name this process did not see
    created needs torch's private resolver; without it the collective runs unrecorded, said once."""
    monkeypatch.setattr(torchapi, "_warned", set())
    monkeypatch.setenv(commtrace.ENV, str(tmp_path))
    commtrace.reset()
    calls = []

    def all_reduce(tensor, reduceOp, group, tag=""):
        calls.append(group)
        return tensor

    recorded = commhooks._wrap(all_reduce, "functional.all_reduce", functional=True)
    try:
        with fake_world(2, 0):
            mesh = DeviceMesh("cpu", [0, 1])
            recorded(torch.zeros(2), "sum", (mesh, 0))
            monkeypatch.delattr(torch._C._distributed_c10d, "_resolve_process_group")  # torch's own kept its import
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                recorded(torch.zeros(2), "sum", "no-such-group")
    finally:
        commtrace.reset()
    assert len(calls) == 2  # both ran
    lines = (tmp_path / "rank0.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"name":"functional.all_reduce"' in lines[0] and '"members":[0,1]' in lines[0]
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("torch._C._distributed_c10d._resolve_process_group" in t and torch.__version__ in t for t in texts)
    assert any("go unrecorded" in t for t in texts)


@pytest.mark.parametrize("rows", [8, 7, 2, 0])
def test_local_part_offsets_equal_torchs_own(rows):
    """The first flat index of a rank's FSDP2 shard, from public APIs, is what torch's private
    compute_local_shape_and_global_offset says, for even, uneven and empty shards."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    for rank in range(4):
        with fake_world(4, rank):
            mesh = DeviceMesh("cpu", [0, 1, 2, 3])
            size, start = Shard.local_shard_size_and_offset(rows, 4, rank)
            t = DTensor.from_local(torch.zeros(size, 3), mesh, [Shard(0)], run_check=False, shape=(rows, 3),
                                   stride=(3, 1))
            _, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
            local, first = fsdp.local_part(t)
            assert local.shape == (size, 3) and first == offset[0] * 3, (rows, rank)
