"""Faults injected into runs under torchrun, and exact resume in every mode.

- kill -9 of a generator or of a trainer: every other rank exits within 60 s, naming the dead
  rank by role;
- SIGTERM on one rank: every rank finishes the same steps, a checkpoint is written, the run exits
  within --stop-grace-s, and resuming from it is bitwise equal to an uninterrupted run (disagg +
  TSP);
- a kill in the middle of a checkpoint write, plus a torn checkpoint: the resume skips both by
  name, loads the previous checkpoint and ends bitwise equal (colocated);
- resume is bitwise equal to the uninterrupted run with TAG and with TCSS (and, in test_runtime,
  for plain disaggregation).
"""
import os
import shutil
import signal
import time

import pytest
import torch

from checkpointing import files as checkpoint_files
from checkpointing.checkpoint import KILL_ENV
from runtime.launch import TINY, alive, torchrun, torchrun_background, trained_weights, worker_pids
from telemetry.metrics import read_metrics
from traced import assert_nccl_ok, traced

BASE = [*TINY, "--lora-rank", "4", "--log-images-every", "0"]
FOUR = [a if a != "2" or TINY[i - 1] != "--prompts-per-step" else "4" for i, a in enumerate(TINY)]
FOUR += ["--lora-rank", "4", "--log-images-every", "0", "--fragment-groups", "1"]  # 4 fragments of one group


def _bitwise(a, b, what):
    assert a.keys() == b.keys(), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs by {(a[name] - b[name]).abs().max()}"


def _rows(run):
    return [r for r in read_metrics(str(run)) if "train/loss" in r]


def _wait_rows(run, n, proc, log, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early ({proc.returncode}):\n{log.read_text()[-4000:]}")
        if (run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {timeout} s:\n{log.read_text()[-4000:]}")


def _end(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this test started
        proc.wait()


@pytest.mark.parametrize("victim,named", [(0, "generator rank 0 (replica 0) stopped answering"),
                                          (1, "trainer rank 1 stopped answering")], ids=["generator", "trainer"])
def test_kill_9_is_named_by_every_rank_and_all_exit_within_60_s(tmp_path, victim, named):
    run, log = tmp_path / "run", tmp_path / "log"
    proc = torchrun_background(2, [*BASE, "--steps", "500", "--save-every", "1000", "--output-dir", str(run)],
                               str(log))
    try:
        _wait_rows(run, 1, proc, log)
        pids = worker_pids(proc.pid)
        assert set(pids) == {0, 1}, pids
        start = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        survivor = pids[1 - victim]
        while alive(survivor) and time.monotonic() - start < 90:
            time.sleep(0.1)
        exit_s = time.monotonic() - start
        proc.wait(timeout=90)
    finally:
        _end(proc)
    text = log.read_text()
    assert exit_s < 60, f"the survivor took {exit_s:.1f} s\n{text[-3000:]}"
    assert named in text and f"rank {1 - victim}" in text, text[-3000:]
    assert proc.returncode != 0


def test_sigterm_on_one_rank_writes_a_checkpoint_and_resume_is_bitwise(tmp_path):
    """SIGTERM reaches only the generator; both ranks finish the same steps, the trainer writes
    the checkpoint; resuming to one more step equals a run that was never interrupted."""
    args = [*BASE, "--tsp", "--train-micro-batch", "3"]
    stopped, log = tmp_path / "stopped", tmp_path / "log"
    proc = torchrun_background(2, [*args, "--steps", "500", "--save-every", "1000", "--output-dir", str(stopped)],
                               str(log))
    try:
        _wait_rows(stopped, 1, proc, log)
        pids = worker_pids(proc.pid)
        start = time.monotonic()
        os.kill(pids[0], signal.SIGTERM)
        proc.wait(timeout=60)
        exit_s = time.monotonic() - start
    finally:
        _end(proc)
    text = log.read_text()
    assert exit_s < 25, f"{exit_s:.1f} s\n{text[-3000:]}"  # --stop-grace-s
    assert text.count("exitcode  : 4") == 2, text[-3000:]  # both ranks: stopped after a checkpoint
    found = checkpoint_files.find_valid(str(stopped / "checkpoints"))
    steps = found.step
    assert steps >= 1 and [r["step"] for r in _rows(stopped)] == list(range(steps))
    torchrun(2, [*args, "--steps", str(steps + 1), "--resume", str(stopped), "--output-dir", str(stopped)])
    torchrun(2, [*args, "--steps", str(steps + 1), "--output-dir", str(tmp_path / "straight")])
    _bitwise(trained_weights(str(tmp_path / "straight"), steps + 1), trained_weights(str(stopped), steps + 1),
             "SIGTERM and resume")
    assert [r["step"] for r in _rows(stopped)] == list(range(steps + 1))  # every step once


def test_a_kill_during_a_checkpoint_write_and_a_torn_checkpoint_are_skipped_by_name(tmp_path):
    """Colocated: the writer dies in the middle of checkpoint 2 (a .tmp folder stays); a torn
    step-2 (as an in-place writer would leave it) sits beside it. The resume names both, loads
    step-1 and ends bitwise equal to the uninterrupted run."""
    args = [*BASE, "--mode", "colocated", "--steps", "3", "--save-every", "1"]
    torchrun(2, [*args, "--output-dir", str(tmp_path / "straight")])
    run = tmp_path / "run"
    killed = torchrun(2, [*args, "--output-dir", str(run)], env={KILL_ENV: "2"}, check=False)
    assert killed.returncode != 0
    ckpts = run / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["step-1", "step-2.tmp"], killed.stderr[-3000:]
    shutil.copytree(ckpts / "step-1", ckpts / "step-2")
    weights = ckpts / "step-2" / "pytorch_lora_weights.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    resumed = torchrun(2, [*args, "--resume", str(run), "--output-dir", str(run)])
    said = resumed.stderr
    assert f"skipped {ckpts / 'step-2'}: pytorch_lora_weights.safetensors has" in said, said[-3000:]
    assert f"skipped {ckpts / 'step-2.tmp'}: an unfinished write" in said
    assert f"continuing from {ckpts / 'step-1'} (step 1)" in said
    _bitwise(trained_weights(str(tmp_path / "straight"), 3), trained_weights(str(run), 3), "kill in write")
    assert [r["step"] for r in _rows(run)] == [0, 1, 2]


@pytest.mark.parametrize("mode", ["tag", "tcss"])
def test_resume_is_bitwise_equal_to_the_uninterrupted_run(tmp_path, mode):
    """The run saved at every step; a copy cut back to step 1 resumes to the end. TCSS (3 steps):
    step 1 is generated with version 0 (the checkpoint's stale version) and version 1 is sent
    again, as in the uninterrupted run; the running std of the last steps comes back too."""
    nproc, steps, extra = {"tag": (3, 2, ["--generators", "1", "--trainers", "2", "--tag", "--debug-slow-rank", "0:4"]),
                           "tcss": (2, 3, ["--tcss", "--std-mode", "running"])}[mode]
    args = [*FOUR, *extra, "--steps", str(steps)]
    straight, run = tmp_path / "straight", tmp_path / "run"
    torchrun(nproc, [*args, "--save-every", "1", "--keep-checkpoints", "0", "--output-dir", str(straight)])
    shutil.copytree(straight, run)
    for step in range(2, steps + 1):
        shutil.rmtree(run / "checkpoints" / f"step-{step}")
    torchrun(nproc, [*args, "--resume", str(run), "--output-dir", str(run)], env=traced(run))
    assert_nccl_ok(run, ["data.to", "publish"])  # with TCSS version N is sent again at the start
    _bitwise(trained_weights(str(straight), steps), trained_weights(str(run), steps), mode)
    keys = ("step", "reward/mean", "train/loss", "train/staleness_mean", "train/num_transitions")
    assert [[r[k] for k in keys] for r in _rows(run)] == [[r[k] for k in keys] for r in _rows(straight)]
    if mode == "tcss":
        assert [r["train/staleness_mean"] for r in _rows(run)] == [0.0, 1.0, 1.0]
