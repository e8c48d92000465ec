"""GPU memory: the one memory model (planner/memory.py) against the measurements of the roles' own
code at the released sizes (docs/memory/*.json, written by lab/measure_recipes.py), a measurement
at released size run again, the trackers' mechanics on small modules (lab/memory/fake_run.py,
lab/memory/trackers.py), the recipes' GPUs and the recipe check script."""
import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from config.validate import validate
from models.released import meta_adapter, parameter_counts
from planner import hardware
from planner import memory as model
from lab.memory import fake_run, measure
from runtime.budget import GiB, load_recipe, predict
from lab.memory.trackers import FSDPTracker, Replay, Tracker
from lab import measure_recipes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*_grpo", "*.toml")))
TOPOLOGIES = [os.path.join(ROOT, "recipes", "topology", f"{n}gpus.toml") for n in (8, 16, 32)]
RECORDS = sorted(glob.glob(os.path.join(ROOT, "docs", "memory", "*.json")))
TOLERANCE = 0.10


def _record_paths(record_file: str) -> tuple[str, str]:
    """(recipe, topology) of docs/memory/dance_grpo-flux_dev-8gpus.json."""
    name = os.path.basename(record_file)[:-len(".json")]
    system, rest = name.split("-", 1)
    recipe, topology = rest.rsplit("-", 1)
    return (os.path.join(ROOT, "recipes", system, f"{recipe}.toml"),
            os.path.join(ROOT, "recipes", "topology", f"{topology}.toml"))


@pytest.fixture(scope="module")
def adapters():
    cache = {}

    def get(release: str):
        if release not in cache:
            cache[release] = meta_adapter(release)
        return cache[release]
    return get


# ----- the model against the measurements --------------------------------------------------------
def test_every_recipe_is_measured_on_every_topology():
    assert sorted(_record_paths(r) for r in RECORDS) == sorted((r, t) for r in RECIPES for t in TOPOLOGIES)


def test_the_model_holds_every_measured_peak_within_10_percent(adapters):
    """Every role of every recipe and topology: its measured peak, and every phase above half of it,
    against the model."""
    for record_file in RECORDS:
        with open(record_file) as f:
            record = json.load(f)
        cfg, recipe, facts = load_recipe(list(_record_paths(record_file)))
        predicted = predict(cfg, facts, adapters(recipe["model_config"]))
        for row in record["roles"]:
            phases = predicted[row["role"]]
            top = row["measured_peak_gib"]
            assert model.peak(phases).tensors / GiB == pytest.approx(top, rel=TOLERANCE), (record_file, row["role"])
            for phase, got in row["phases"].items():
                if got["measured_gib"] is not None and got["measured_gib"] > top / 2:
                    assert phases[phase].tensors / GiB == pytest.approx(got["measured_gib"], rel=TOLERANCE), \
                        (record_file, row["role"], phase)


def test_a_recipe_measured_again_at_the_released_size():
    """Flow-GRPO FLUX.1-dev (LoRA on bf16 weights, 512 px, PickScore) measured on the code now, every
    role and phase (about 90 s here): what docs/memory holds, and a generator above its 22 GiB of
    bf16 weights."""
    paths = [os.path.join(ROOT, "recipes", "flow_grpo", "flux_dev.toml"), TOPOLOGIES[0]]
    cfg, recipe, facts = load_recipe(paths)
    got = measure.measure_run(cfg, facts, recipe["model_config"])
    with open(os.path.join(ROOT, "docs", "memory", "flow_grpo-flux_dev-8gpus.json")) as f:
        committed = {r["role"]: r for r in json.load(f)["roles"]}
    assert set(got) == set(committed)
    for role, memory in got.items():
        assert set(memory.phases) == set(committed[role]["phases"]), role
        for phase, measured in memory.phases.items():
            want = committed[role]["phases"][phase]
            assert measured["total"] / GiB == pytest.approx(want["measured_gib"], abs=0.02), (role, phase)
            for category, gib in want["categories"].items():
                assert measured[category] / GiB == pytest.approx(gib, abs=0.02), (role, phase, category)
    assert got["generator"].phases["fragment"]["parameters"] > 22.1 * GiB
    assert got["generator"].rises["velocity"] > 0 and got["generator"].rises["decode"] > 0


def test_a_full_fine_tune_with_a_kl_term_holds_a_sharded_bf16_reference(adapters):
    """DanceGRPO FLUX.1-dev with beta 0.04 (full fine-tuning, 4 FSDP2 trainers), its first trainer
    measured (about 70 s here): the KL reference adds its bf16 quarter (5.5 GiB) to what the
    trainer holds at every phase, no float32 or unsharded copy at its load, and the model says so
    within 10%. Its load holds shards and one unit whole: less than the 44 GiB float32 model alone."""
    paths = [os.path.join(ROOT, "recipes", "dance_grpo", "flux_dev.toml"), TOPOLOGIES[0]]
    cfg, recipe, facts = load_recipe(paths)
    cfg.rl.beta = 0.04
    sent = measure.sent_by_generators(cfg, facts, recipe["model_config"])
    got, _ = measure.measure_trainer(cfg, facts, recipe["model_config"], facts.topology.trainer_ranks[0], sent)
    with open(os.path.join(ROOT, "docs", "memory", "dance_grpo-flux_dev-8gpus.json")) as f:
        without = next(r for r in json.load(f)["roles"] if r["role"] == "trainer")["phases"]
    quarter = 2 * parameter_counts("flux1_dev")["transformer"] / 4
    # The reference's sharded weights are booked as "other" from the start-up probe on (they are not
    # the trained module's parameters; at the load's peak they are counted as parameters), so each
    # phase's total is compared: without the reference (the committed record), plus its quarter.
    for phase in ("micro-batch", "optimizer step", "publication"):
        added = got.phases[phase]["total"] - without[phase]["measured_gib"] * GiB
        assert added == pytest.approx(quarter, rel=0.01), phase
    # At the load's peak it adds 0.954 of its quarter (0.255 GiB short), and never more: no float32 or
    # unsharded copy. The peak moves: without the reference it falls while FSDP2 shards the trained
    # model (trainer.py, a float32 unit held whole), with it while the reference is sharded
    # (`_make_reference`, a bf16 unit held whole beside every trained shard): seen by the tracker's
    # new peaks, read with their stacks. A single-stream block's 141.6M parameters at 2 bytes fewer
    # would be 0.264 GiB.
    added = got.phases["load"]["total"] - without["load"]["measured_gib"] * GiB
    assert 0.9 * quarter < added <= 1.01 * quarter
    assert got.phases["load"]["total"] < 8 * quarter  # shards, the text encoders: less than the float32 model alone
    predicted = predict(cfg, facts, adapters("flux1_dev"))["trainer"]
    for phase, measured in got.phases.items():
        assert predicted[phase].tensors == pytest.approx(measured["total"], rel=TOLERANCE), phase
    assert predicted["micro-batch"].items["reference copy"] == pytest.approx(quarter, rel=1e-6)


# ----- the recipes' GPUs ----------------------------------------------------------------------------
def test_recipes_name_80_gb_gpus_and_the_smallest_topology_that_fits(adapters):
    """Every recipe names an 80 GB GPU (the GPUs its source system ran on) and a GPU count at which
    every role fits it, measured (docs/memory) and as the model has it; a smaller topology that does
    not fit is named by its role and its largest items (DanceGRPO HunyuanVideo on 8 GPUs: a trainer's
    quarter of the float32 state beside the text encoders it evaluates with)."""
    every = {}
    for path in RECIPES:
        fits = every[os.path.relpath(path, os.path.join(ROOT, "recipes"))] = {}
        for topology in TOPOLOGIES:
            cfg, recipe, facts = load_recipe([path, topology])
            gpu = hardware.gpu(recipe["gpu"])
            assert gpu.memory_bytes == 80e9, path
            with open(os.path.join(ROOT, "docs", "memory", measure_recipes.out_name(path, topology))) as f:
                record = json.load(f)
            measured = all(row["measured_peak_gib"] <= record["usable_gib"] for row in record["roles"])
            peaks = [model.peak(phases) for phases in
                     predict(cfg, facts, adapters(recipe["model_config"]), gpu.memory_bytes).values()]
            assert measured == all(p.fits for p in peaks), (path, topology, [p.why() for p in peaks])
            fits[recipe["gpus"]] = measured
            if not measured:
                assert any(p.why().startswith("trainer at its micro-batch: ") and "optimizer" in p.why()
                           for p in peaks), (path, topology)
        own = load_recipe([path])[1]["gpus"]
        assert fits[own] and not any(ok for n, ok in fits.items() if n < own), (path, own, fits)
    assert every["dance_grpo/hunyuan_video.toml"] == {8: False, 16: True, 32: True}
    assert every["dance_grpo/flux_dev.toml"] == {8: True, 16: True, 32: True}


def test_the_model_names_what_does_not_fit(adapters):
    """DanceGRPO FLUX.1-dev on 8 GPUs of 40 GB: a trainer holds a quarter of the float32 weights,
    gradients and AdamW moments (44 GB) and does not fit; the model names them, largest first."""
    cfg, recipe, facts = load_recipe([os.path.join(ROOT, "recipes", "dance_grpo", "flux_dev.toml"), TOPOLOGIES[0]])
    roles = predict(cfg, facts, adapters("flux1_dev"), 40e9)
    trainer = model.peak(roles["trainer"])
    assert not trainer.fits and trainer.why().startswith(f"trainer at its {trainer.phase}: ")
    assert "optimizer 23.8" in trainer.why() and "weights fp32 11.9" in trainer.why()
    assert model.peak(roles["generator"]).items["DiT weights"] == pytest.approx(2 * 11.9e9, rel=0.01)  # bf16


# ----- the trackers ---------------------------------------------------------------------------------
def _linear(run, n=256):
    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(n, n, bias=False), torch.nn.Linear(n, n, bias=False))
    return fake_run.fake_module(m, run.mode)


def test_trackers_book_parameters_gradients_optimizer_and_activations_exactly():
    n, rows = 256, 64
    w = n * n * 4  # one float32 weight matrix
    with fake_run.FakeRun() as run:
        m = _linear(run)
        opt = torch.optim.AdamW(m.parameters(), fused=True)  # as trainer.adamw makes it
        x = torch.empty(rows, n)
        tracker = Tracker()
        tracker.hold(run.mode, host=[x])
        with tracker:
            held = tracker.current()
            with tracker.window() as forward:
                loss = m(x).sum()
            with tracker.window() as step:
                loss.backward()
                opt.step()
            after = tracker.current()
    assert held["parameters"] == 2 * w and held["total"] == 2 * w  # the host input is not on the GPU
    assert forward["activations"] >= 2 * rows * n * 4  # the hidden layer (kept for the backward) and the output
    assert step["gradients"] == 2 * w and 4 * w <= after["optimizer"] <= 4 * w + 64  # two moments and a step count
    assert run.unknown_reads == 0


def test_fsdp_tracker_books_a_quarter_of_the_weights_on_four_ranks():
    n = 256
    with fake_run.fake_world(4, 1):
        mesh = DeviceMesh("cpu", list(range(4)))  # outside the fake run, as torchtitan builds it
        with fake_run.FakeRun() as run:
            m = _linear(run, n)
            for unit in m:
                fully_shard(unit, mesh=mesh)
            tracker = FSDPTracker(m)
            tracker.hold(run.mode)
            with tracker:
                with tracker.window() as peak:
                    m(torch.empty(8, n)).sum().backward()
                held = tracker.current()
    assert held["parameters"] == 2 * n * n * 4 / 4 and held["gradients"] == 2 * n * n * 4 / 4
    assert peak["parameters"] >= held["parameters"] + n * n * 4  # a unit gathered while it runs


def test_fake_run_computes_like_cuda_and_keeps_small_values():
    with fake_run.FakeRun() as run:
        x = torch.empty(4, 8)
        with fake_run.gpu_autocast(torch.device("cpu"), "auto"):
            y = torch.nn.functional.linear(x, torch.empty(8, 8))
            z = torch.nn.functional.layer_norm(y, (8,))
        sigma = torch.tensor([0.5, 0.25]) * torch.ones(2)
        assert (y.dtype, z.dtype) == (torch.bfloat16, torch.float32)  # CUDA autocast's policy, not the CPU's
        assert not bool((sigma == 0).all()) and sigma.tolist() == [0.5, 0.25]  # small values are real
        assert run.unknown_reads == 0 and float(y.sum()) == 1.0 and run.unknown_reads == 1


def test_a_fake_run_reads_lazy_modules_without_importing(monkeypatch):
    """A FakeRun patches `models.autocast` (and its kin) wherever a module imported it, reading each
    module's own dict: a lazy module whose missing attribute imports something absent (transformers
    5.17 without torchvision) is not asked for one."""
    import types

    import models

    lazy = types.ModuleType("lazy_stand_in")

    def missing(name):
        raise ModuleNotFoundError(f"No module named 'torchvision' (asked for {name})")

    lazy.__getattr__ = missing
    lazy.autocast = original = models.autocast
    monkeypatch.setitem(sys.modules, "lazy_stand_in", lazy)
    with fake_run.FakeRun():
        assert lazy.autocast is not original  # as on a GPU: patched where it was imported
    assert lazy.autocast is original


def test_a_fake_run_that_fails_to_start_leaves_nothing_behind(monkeypatch):
    """A FakeRun that fails after registering CUDA's autocast kernels takes them back (and every
    other patch), so CPU autocast casts as before and a later run starts."""
    import torch._subclasses.fake_tensor as fake_tensor

    def exp_dtype():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.exp(torch.ones(2, dtype=torch.bfloat16)).dtype

    def fail():
        raise RuntimeError("injected")

    limit = fake_tensor.CONSTANT_NUMEL_LIMIT
    monkeypatch.setattr(fake_run, "uncounted_propagation", fail)  # entered after the kernels
    with pytest.raises(RuntimeError, match="injected"):
        with fake_run.FakeRun():
            pass
    monkeypatch.undo()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::exp", "AutocastCPU")
    assert exp_dtype() == torch.bfloat16 and fake_tensor.CONSTANT_NUMEL_LIMIT == limit  # CPU autocast's own policy
    with fake_run.FakeRun():
        assert exp_dtype() == torch.float32  # CUDA's policy: exp in float32
    assert exp_dtype() == torch.bfloat16


def test_replayed_calls_book_the_first_calls_working_set():
    with fake_run.FakeRun() as run:
        m = _linear(run)
        tracker = Tracker()
        tracker.hold(run.mode)
        replay = Replay(tracker)
        call = replay.wrap(m, name="forward")
        with tracker, torch.no_grad():
            with tracker.window() as first:
                a = call(torch.empty(64, 256))
            with tracker.window() as again:
                b = call(torch.empty(64, 256))
    assert (replay.runs, replay.replays) == (1, 1) and a.shape == b.shape
    assert again["total"] - again["activations"] == first["total"] - first["activations"]
    assert again["activations"] >= first["activations"] and replay.rises["forward"] > 0


# ----- the script -----------------------------------------------------------------------------------
@pytest.mark.parametrize("gpu,code", [("h100", 0), ("l40s", 1)])
def test_check_recipe_reports_each_role_and_exits_1_when_one_does_not_fit(tmp_path, gpu, code):
    """DanceGRPO FLUX.1-dev fits the 80 GB H100s it names; on 48 GB L40S its trainer does not, and
    the script says which role, at which phase, with which categories."""
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "scripts.check_recipe",
                           os.path.join(ROOT, "recipes", "dance_grpo", "flux_dev.toml"), "--gpu", gpu,
                           "--predict-only", "--json", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == code, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["gpu"] == gpu
    roles = {r["role"]: r for r in report["roles"]}
    assert set(roles) == {"generator", "trainer"}
    for r in roles.values():
        assert {"role", "phase", "measured_peak_gib", "predicted_peak_gib", "categories"} <= set(r)
        assert set(r["categories"]) == set(model.CATEGORIES)
    misfits = [r for r in roles.values() if r["predicted_peak_gib"] > report["usable_gib"]]
    assert [r["role"] for r in misfits] == ([] if code == 0 else ["trainer"])
    for r in misfits:
        assert f"does not fit: a {r['role']} needs {r['predicted_peak_gib']:.1f} GiB at its {r['phase']}" in done.stdout


def test_tcss_generators_hold_an_idle_copy_of_the_version(adapters):
    """TCSS: a generator receives version k into an idle copy while it samples with k - 1, so its
    fragment and publication phases hold one more copy of the published weights (DanceGRPO
    FLUX.1-dev: the bf16 DiT, 22.2 GiB; measured with a config of `tcss = true` after the recipe:
    generator 58.2 GiB at its fragment, the model 58.1). The start-up probe runs before any
    publication."""
    paths = [os.path.join(ROOT, "recipes", "dance_grpo", "flux_dev.toml"), TOPOLOGIES[0]]
    cfg, recipe, facts = load_recipe(paths)
    plain = predict(cfg, facts, adapters("flux1_dev"))["generator"]
    cfg.topology.tcss = True
    tcss = predict(cfg, validate(cfg, recipe["gpus"], released="flux1_dev"), adapters("flux1_dev"))["generator"]
    copy = 2 * parameter_counts("flux1_dev")["transformer"]
    for phase in ("fragment", "publication"):
        assert tcss[phase].tensors - plain[phase].tensors == pytest.approx(copy, rel=1e-6), phase
    assert tcss["start-up probe"].tensors == plain["start-up probe"].tensors
    assert tcss["fragment"].tensors / GiB == pytest.approx(58.2, rel=0.02)


def test_the_measured_training_batch_carries_the_fields_the_rollout_records():
    """An algorithm whose loss reads a recorded step field (Flow-DPPO: the rollout's means) is measured
    on a batch that carries it, latent-shaped, and nothing else is added for one that records none."""
    from lab.memory.fake_parts import Sent, transition_batch
    from rl import sampler

    sent = Sent({"prompt_embeds": ((7, 16), torch.float32)}, None, (4, 2, 2))
    sigmas = torch.linspace(1, 0, 5)
    for record, want in (((), {}), (("mean", "std"), {"mean": (4, 4, 2, 2), "std": (4,)})):
        cfg = sampler.SamplingConfig(16, 16, 4, record=record)
        batch = transition_batch(sent, cfg, sigmas, 1, rows=4)
        assert {k: tuple(v.shape) for k, v in batch.steps.items()} == want
