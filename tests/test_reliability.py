"""Run safety in process: atomic checkpoints and their verification (run folders, locks and resumes:
tests/test_run_folders.py), safe loading (and a grep for unsafe loads and asserts), the non-finite
step guard, the size factors the up-front checks read without loading a model, and the guard's
timeouts and signals."""
import ast
import json
import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch

from checkpointing import manifest as checkpoint_files
from lab.launch import ROOT
from rl.nonfinite import RunAbort, SkipTracker


# ----- atomic checkpoints -------------------------------------------------------------------------
def _write(root, step, payload=b"weights" * 100):
    def files(tmp):
        Path(tmp, "weights.bin").write_bytes(payload)
        Path(tmp, "sub").mkdir()
        Path(tmp, "sub", "state.json").write_text(json.dumps({"step": step}))
    checkpoint_files.write_atomic(os.path.join(root, f"step-{step}"), files, {"step": step, "config": {}})


def test_a_checkpoint_is_complete_or_absent_and_a_torn_one_is_skipped_by_name(tmp_path):
    root = str(tmp_path)
    _write(root, 1)
    _write(root, 2)
    manifest = checkpoint_files.read_manifest(os.path.join(root, "step-2"))
    assert set(manifest["files"]) == {"weights.bin", os.path.join("sub", "state.json")}
    assert manifest["files"]["weights.bin"]["bytes"] == 700
    # a write killed before its manifest leaves a .tmp folder that nothing loads
    with pytest.raises(KeyboardInterrupt):
        checkpoint_files.write_atomic(os.path.join(root, "step-3"), lambda tmp: Path(tmp, "w").write_bytes(b"x"),
                                      {}, before_manifest=lambda tmp: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert os.path.isdir(os.path.join(root, "step-3.tmp")) and not os.path.exists(os.path.join(root, "step-3"))
    found = checkpoint_files.find_valid(root)
    assert found.step == 2 and found.skipped == [(os.path.join(root, "step-3.tmp"), "an unfinished write")]
    # a torn file (written in place and cut short), a flipped byte, a missing manifest: each is named
    with open(os.path.join(root, "step-2", "weights.bin"), "r+b") as f:
        f.truncate(10)
    found = checkpoint_files.find_valid(root)
    assert found.step == 1
    assert (os.path.join(root, "step-2"), "weights.bin has 10 bytes, the manifest says 700") in found.skipped
    data = bytearray(Path(root, "step-1", "weights.bin").read_bytes())
    data[5] ^= 1
    Path(root, "step-1", "weights.bin").write_bytes(bytes(data))
    os.remove(os.path.join(root, "step-3.tmp", "w"))
    found = checkpoint_files.find_valid(root)
    assert found.path is None
    assert "weights.bin does not match its SHA-256 in the manifest" in found.skipped_text()


def test_rewriting_a_step_replaces_it_whole(tmp_path):
    _write(str(tmp_path), 1, b"old")
    _write(str(tmp_path), 1, b"new!")
    assert Path(tmp_path, "step-1", "weights.bin").read_bytes() == b"new!"
    assert sorted(os.listdir(tmp_path)) == ["step-1"]


def test_prune_keeps_the_newest_and_the_pinned(tmp_path):
    for step in range(1, 7):
        _write(str(tmp_path), step)
    Path(tmp_path, "step-2", checkpoint_files.PIN_FILE).write_text("")
    removed = checkpoint_files.prune(str(tmp_path), keep=2)
    assert sorted(os.path.basename(p) for p in removed) == ["step-1", "step-3", "step-4"]
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-5", "step-6"]
    assert checkpoint_files.prune(str(tmp_path), keep=0) == []


# ----- safe loading, real checks --------------------------------------------------------------------
def _project_modules():
    out = subprocess.run(["git", "-C", ROOT, "ls-files", "*.py"], capture_output=True, text=True, check=True)
    return [Path(ROOT, p) for p in out.stdout.split() if not p.startswith("tests/")]


def test_no_unsafe_loads_and_no_asserts_in_project_code():
    problems = []
    for path in _project_modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Assert):
                problems.append(f"{where}: assert (python -O removes it)")
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                kwargs = {k.arg: k.value for k in node.keywords}
                if name.endswith("torch.load") or name == "load" and "weights_only" in kwargs:
                    value = kwargs.get("weights_only")
                    if not (isinstance(value, ast.Constant) and value.value is True):
                        problems.append(f"{where}: {ast.unparse(node)} without weights_only=True")
                if name in ("pickle.load", "pickle.loads", "np.load", "numpy.load") and not (
                        name.endswith("np.load") and "allow_pickle" not in kwargs):
                    problems.append(f"{where}: {ast.unparse(node)}")
    assert not problems, "\n".join(problems)


def test_trainer_state_loads_safely_and_a_crafted_file_is_rejected(tmp_path):
    params = [torch.nn.Parameter(torch.randn(3, 2))]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999))
    params[0].grad = torch.randn(3, 2)
    opt.step()
    state = {"optimizer": opt.state_dict(), "num_updates": 1, "running_std": {"n": 2, "mean": 0.1, "m2": 0.3},
             "torch_rng": torch.get_rng_state(), "step": 1, "skips": SkipTracker(3).state_dict(),
             "std_history": {0: 0.25, 1: None}}
    torch.save(state, tmp_path / "trainer_state.pt")
    back = torch.load(tmp_path / "trainer_state.pt", map_location="cpu", weights_only=True)
    assert back["std_history"] == {0: 0.25, 1: None} and back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    with open(tmp_path / "crafted.pt", "wb") as f:
        pickle.dump({"optimizer": Payload()}, f)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "crafted.pt", map_location="cpu", weights_only=True)
    assert not (tmp_path / "pwned").exists()


# ----- nothing non-finite reaches the weights -------------------------------------------------------
def test_skip_tracker_counts_and_stops_after_n_in_a_row():
    t = SkipTracker(2)
    assert not t.record(0, []) and t.record(1, ["loss"]) and not t.record(2, [])
    assert t.total == 1 and t.in_row == []
    assert t.record(3, ["gradients"])
    with pytest.raises(RunAbort, match="non-finite gradients, loss in 2 steps in a row \\(steps 3, 4\\)"):
        t.record(4, ["loss"])
    assert SkipTracker.nonfinite({"a": 1.0, "b": float("nan"), "c": float("-inf")}) == ["b", "c"]


def test_a_step_with_non_finite_advantages_is_skipped_before_the_update_and_the_ema():
    from test_trainer import _trainer_and_chunk

    trainer, chunk = _trainer_and_chunk(**{"optim.ema_decay": 0.9, "optim.max_skipped_steps": 2})
    before = {n: p.detach().clone() for n, p in trainer.adapter.transformer.named_parameters()}
    ema = [e.clone() for e in trainer.ema]
    chunk.advantages = torch.tensor([float("nan"), 1.0])
    trainer.current_step = 0
    trainer.train(chunk)
    stats = trainer.finish_step()
    assert stats["train/skipped_steps"] == 1.0 and trainer.num_updates == 0 and not trainer.optimizer.state
    assert all(torch.equal(before[n], p) for n, p in trainer.adapter.transformer.named_parameters())
    assert all(torch.equal(a, b) for a, b in zip(ema, trainer.ema))
    assert all(p.grad is None for p in trainer.params)
    chunk.advantages = torch.tensor([1.0, -1.0])
    trainer.current_step = 1
    trainer.train(chunk)
    assert trainer.finish_step()["train/skipped_steps"] == 1.0 and trainer.num_updates == 1
    for step in (2, 3):
        chunk.advantages = torch.tensor([float("inf"), -1.0])
        trainer.current_step = step
        trainer.train(chunk)
        if step == 3:
            with pytest.raises(RunAbort, match="advantages \\(non-finite rewards\\).*steps 2, 3"):
                trainer.finish_step()
        else:
            trainer.finish_step()


# ----- sizes checked without loading a model ---------------------------------------------------------
def test_size_factors_without_weights_match_the_loaded_models():
    from models import adapter_class, load_model

    for family in ("flux", "wan", "qwen_image", "hunyuan_video", "sd3"):
        cls = adapter_class(family)
        adapter = load_model(family, preset="tiny")
        from_configs = cls.geometry(dict(adapter.transformer.config), dict(adapter.pipe.vae.config))
        assert adapter.own_geometry() == from_configs == cls.geometry_presets["tiny"], family
        if adapter.defaults.shift == "dynamic":  # the tokens its timestep shift reads, without weights
            for h, w in ((16, 16), (64, 32), (4096, 16)):
                assert cls.image_tokens(from_configs, h, w) == adapter.image_seq_len(adapter.latent_shape(h, w)), family
    shipped = os.path.join(ROOT, "assets", "shapes-flux")
    configs = [json.loads(Path(shipped, c, "config.json").read_text()) for c in ("transformer", "vae")]
    assert adapter_class("flux").geometry(*configs) == load_model("flux", shipped).own_geometry()


def test_a_timestep_shift_that_overflows_or_saturates_is_refused():
    """FLUX's dynamic shift mu grows with the image tokens: 65536 x 65536 overflows exp(mu) in
    diffusers (OverflowError), 4096 x 4096 of the tiny preset overflows float32 (NaN sigmas), and
    2048 x 1024 saturates every sigma but the last at 1 (steps of zero length); 1024 x 512 is sound."""
    from models import adapter_class
    from rl.sampler import check_schedule

    config = dict(adapter_class("flux").scheduler().config)
    tokens = lambda h, w: adapter_class("flux").image_tokens({"vae": 2}, h, w)  # noqa: E731 - the tiny preset's
    check_schedule(config, 3, tokens(1024, 512))
    with pytest.raises(ValueError, match=r"saturates the sigmas \[1, 1, 1, 0\] in float32, so steps have zero"):
        check_schedule(config, 3, tokens(2048, 1024))
    with pytest.raises(ValueError, match=r"overflows float32 at 1048576 image tokens .*sigmas \[nan, nan, nan, 0\]"):
        check_schedule(config, 3, tokens(4096, 4096))
    with pytest.raises(ValueError, match=r"its timestep shift overflows at 268435456 image tokens \(mu = 4.544e\+04"):
        check_schedule(config, 3, tokens(65536, 65536))


def test_tensorboard_shows_every_step_once_after_a_resume(tmp_path):
    """The resumed logger purges the first run's events from the checkpoint's step on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from telemetry.metrics import MetricsLogger

    with MetricsLogger(tmp_path) as first:
        for step in range(5):
            first.log(step, {"reward/mean": float(step)})
    with MetricsLogger(tmp_path, purge_step=2) as resumed:
        for step in range(2, 4):
            resumed.log(step, {"reward/mean": 10.0 + step})
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]


def test_timeouts_follow_the_slowest_step():
    """5 x the slowest step, at least 60 s (above --dist-timeout-s for long steps: a video step may
    take longer), and 60 s beyond --reward-timeout-s when a reward service scores; before the first
    step --dist-timeout-s or 5 x the predicted step, whichever is longer, and never below that
    reward floor; when relaxed, never below --dist-timeout-s."""
    from parallel import p2p
    from parallel.topology import Topology
    from runtime.guard import RunGuard, timeout_floor_s

    class Store:
        timeouts = []

        def clone(self):
            return self

        def set_timeout(self, seconds):
            self.timeouts.append(seconds)

    store = Store()
    guard = RunGuard(Topology.build(2), 0, store, heartbeat_timeout_s=30, stop_grace_s=25, dist_timeout_s=600,
                     groups=[], start_step=0)
    try:
        guard.set_timeouts(relaxed=False)
        assert store.timeouts == []  # no step measured yet: --dist-timeout-s
        guard.step_done(3.0)
        guard.set_timeouts(relaxed=False)
        guard.step_done(40.0)
        guard.set_timeouts(relaxed=False)
        guard.set_timeouts(relaxed=True)
        guard.step_done(500.0)
        guard.set_timeouts(relaxed=False)
        assert store.timeouts == [60.0, 200.0, 600.0, 2500.0]
        first = RunGuard(Topology.build(2), 0, store, heartbeat_timeout_s=30, stop_grace_s=25, dist_timeout_s=600,
                         groups=[], start_step=0)
        first.expect_step(50.0)
        first.set_timeouts(relaxed=False)  # 5 x 50 s: not below --dist-timeout-s before a step is measured
        first.expect_step(300.0)
        first.set_timeouts(relaxed=False)
        assert store.timeouts[4:] == [1500.0]
        served = RunGuard(Topology.build(2), 0, store, heartbeat_timeout_s=30, stop_grace_s=25, dist_timeout_s=60,
                          groups=[], start_step=0, reward_timeout_s=90.0)
        served.set_timeouts(relaxed=False)  # before the first step too: not --dist-timeout-s 60 alone
        assert served.timeout_s == 150.0
        served.step_done(3.0)
        served.set_timeouts(relaxed=False)  # a fragment may wait 90 s for a reward service's scores
        assert store.timeouts[5:] == [150.0] and timeout_floor_s(90.0, remote=False) == 60.0
        short = RunGuard(Topology.build(2), 0, store, heartbeat_timeout_s=30, stop_grace_s=25, dist_timeout_s=20,
                         groups=[], start_step=0)
        short.set_timeouts(relaxed=False)  # no service scores: --dist-timeout-s stands before the first step
        assert store.timeouts[6:] == []
    finally:
        p2p.configure(timeout_s=600)


class _Store:
    """The StepStore calls the guard makes, in a dict (one connection for all)."""

    def __init__(self):
        self.data = {}

    def clone(self):
        return self

    def set_timeout(self, seconds):
        pass

    def put(self, key, obj):
        self.data[key] = json.loads(json.dumps(obj))

    def get_if_set(self, key):
        return self.data.get(key)

    def ready(self, key):
        return key in self.data

    def add(self, key, amount=1):
        self.data[key] = self.data.get(key, 0) + amount
        return self.data[key]


def _guard(rank=0, store=None):
    from parallel.topology import Topology
    from runtime.guard import RunGuard

    return RunGuard(Topology.build(2), rank, store or _Store(), heartbeat_timeout_s=30, stop_grace_s=25,
                    dist_timeout_s=600, groups=[], start_step=0)


def test_a_failing_rank_reports_its_own_error_first_and_peers_print_it():
    """Its own exception: published at once (no silence diagnosed); a peer whose connection then
    breaks prints that report, not a silent rank; silence needs several beats and a margin."""
    from parallel.p2p import PeerError
    from runtime.guard import EXIT_ABORT, EXIT_ERROR

    store = _Store()
    trainer = _guard(1, store)
    trainer.step = 3
    code, line, traceback = trainer.explain(RuntimeError("value cannot be converted to type float without overflow"))
    fault = "trainer rank 1 failed at step 3: RuntimeError: value cannot be converted to type float without overflow"
    assert (code, line, traceback) == (EXIT_ERROR, f"error: {fault}", True)
    assert store.data["guard/fault"] == {"line": fault, "code": EXIT_ERROR}
    generator = _guard(0, store)
    generator.step = 3
    code, line, traceback = generator.explain(PeerError(1, "receive from trainer rank 1 failed: Connection closed"))
    assert code == EXIT_ABORT and line.startswith(f"error: {fault}; generator rank 0 (replica 0) stopped at step 3")
    assert not traceback and "stopped answering" not in line
    assert generator.silence_window_s >= 3 * generator.interval


def test_a_second_signal_within_2_s_is_the_same_request_and_later_exits_at_once(monkeypatch):
    """SLURM and Ctrl-C signal every rank and torchrun forwards its copy: one request arrives twice."""
    import signal
    from types import SimpleNamespace

    from runtime import guard as guard_module

    clock, died = [100.0], []
    monkeypatch.setattr(guard_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    guard = _guard()
    monkeypatch.setattr(guard, "_die", lambda code, line: died.append((code, line)))
    guard._on_signals(bytes([signal.SIGTERM]))
    clock[0] += 0.3
    guard._on_signals(bytes([signal.SIGTERM]))
    clock[0] += 1.6
    guard._on_signals(bytes([signal.SIGINT]))
    assert guard.signal_name == "SIGTERM" and died == []
    clock[0] += 0.2
    guard._on_signals(bytes([signal.SIGINT]))
    assert died == [(130, "error: generator rank 0 (replica 0): a second SIGINT, 2.1 s after the first: exiting now "
                          "(code 130), without a checkpoint")]


def test_a_rank_diagnosing_a_dead_peer_keeps_beating_so_the_dead_one_is_blamed(monkeypatch):
    """kill -9 of a scorer: torchrun SIGTERMs the survivors at once, so their watchers blame a peer
    silent for 5 s (a stop is under way), while the generator, whose receive from the scorer broke,
    waits out the silence window (5 s) before it reports. Its last beat came 0.8 s before the
    scorer's: were it to stop beating while it diagnoses, the trainer would find it silent first
    and blame it (issue 39: every survivor named "generator rank 0" 3 times in 3). It beats on."""
    import threading
    import time

    from parallel.p2p import PeerError
    from parallel.topology import Topology
    from runtime.guard import RunGuard

    store, topo = _Store(), Topology.build(3, scorers=1)
    generator, trainer = (RunGuard(topo, r, store, heartbeat_timeout_s=30, stop_grace_s=25, dist_timeout_s=600,
                                   groups=[], start_step=0) for r in (0, 1))
    generator.step = trainer.step = 2
    blamed, done = [], threading.Event()
    monkeypatch.setattr(trainer, "_die", lambda code, line: blamed.append(line))
    trainer._stop_since = time.monotonic()  # torchrun's SIGTERM: a stop is under way

    def watch():  # the trainer's heartbeat thread, watching its peers
        while not done.is_set():
            trainer._beat()
            trainer._watch()
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    generator._beat()  # the generator's last beat before the fault
    watcher.start()
    time.sleep(0.8)
    store.put("guard/hb/2", "9 2 step")  # the scorer's last beat; kill -9 now, and the generator's receive breaks
    beating = threading.Thread(target=generator._loop, daemon=True)  # its heartbeat thread
    beating.start()
    try:
        code, line, _ = generator.explain(PeerError(2, "receive from scorer rank 2 failed: Connection closed by peer"))
    finally:
        done.set()
        generator._done.set()
        watcher.join(5)
        beating.join(5)
    assert all("scorer rank 2 stopped answering" in b for b in blamed), blamed
    assert store.data["guard/fault"]["line"].startswith("scorer rank 2 stopped answering at step 2"), store.data
    assert line.startswith("error: scorer rank 2 stopped answering at step 2") and code == 3, line
