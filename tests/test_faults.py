"""Faults injected into runs under torchrun, and exact resume in every mode.

- kill -9 of a generator, of a trainer, of a scorer or of torchrun itself: every other process
  exits within 60 s, naming the dead one by role (torchrun: in one line per worker, with no
  traceback);
- an exception raised by a generator, a trainer or a scorer: every rank's line names that rank
  and its exception, and no rank is blamed as silent;
- --overwrite of a live run is refused to a launch with the same rdzv id, through a bind mount of
  its folder, naming the host and pid that hold it, and the live run goes on untouched (the
  second-signal rule: tests/test_reliability.py);
- a disk that fills during a checkpoint is named (ENOSPC, the folder, its free space), and the run
  continues from the previous checkpoint once there is room;
- SIGTERM on one rank: every rank finishes the same steps, a checkpoint is written, the run exits
  within --stop-grace-s, and resuming from it is bitwise equal to an uninterrupted run (disagg +
  TSP);
- a kill in the middle of a checkpoint write, plus a torn checkpoint: the resume skips both by
  name, loads the previous checkpoint and ends bitwise equal (colocated);
- resume is bitwise equal to the uninterrupted run with TAG and with TCSS (and, in test_runtime,
  for plain disaggregation).
Every resume here is `--resume DIR --output-dir DIR` and at most --steps: the run's config comes from
its checkpoint (issue 32).
"""
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest
import torch

from checkpointing import manifest as checkpoint_files
from checkpointing.checkpoint import KILL_ENV
from checkpointing.lock import LOCK
from forked import run_cases
from lab.launch import TINY, alive, rendezvous, torchrun, torchrun_background, trained_weights, worker_pids
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
                                          (1, "trainer rank 1 stopped answering"),
                                          (2, "scorer rank 2 stopped answering"),
                                          ("torchrun", "is gone, and the rendezvous store with it")],
                         ids=["generator", "trainer", "scorer", "torchrun"])
def test_kill_9_is_named_by_every_rank_and_all_exit_within_60_s(tmp_path, victim, named):
    """The scorer (1 + 1 + 1 ranks): torchrun SIGTERMs the survivors at once, and the generator,
    whose receive from it broke, diagnoses while the trainer watches with a stop's 5 s limit."""
    run, log = tmp_path / "run", tmp_path / "log"
    world, extra = (3, ["--scorers", "1"]) if victim == 2 else (2, [])
    proc = torchrun_background(world, [*BASE, *extra, "--steps", "500", "--save-every", "1000", "--output-dir",
                                       str(run)], str(log))
    try:
        _wait_rows(run, 2 if victim == 2 else 1, proc, log)
        pids = worker_pids(proc.pid)
        assert set(pids) == set(range(world)), pids
        start = time.monotonic()
        os.kill(proc.pid if victim == "torchrun" else pids[victim], signal.SIGKILL)
        survivors = [p for r, p in pids.items() if r != victim]
        while any(alive(p) for p in survivors) and time.monotonic() - start < 90:
            time.sleep(0.1)
        exit_s = time.monotonic() - start
        proc.wait(timeout=90)
    finally:
        _end(proc)
    text = log.read_text()
    assert exit_s < 60, f"the survivors took {exit_s:.1f} s\n{text[-3000:]}"
    if victim == "torchrun":  # each worker: one line naming torchrun's death, nothing else
        lines = [line for line in text.splitlines() if line.startswith("error:")]
        assert len(lines) == 2 and all(f"error: torchrun (pid {proc.pid}) {named}" in line for line in lines), text
        assert {"generator rank 0 (replica 0) stops", "trainer rank 1 stops"} == \
            {line.split(": ", 2)[2].split(" at step")[0] for line in lines}, lines
        assert "Traceback" not in text, text[-3000:]  # (torch's C++ store client may log a receive it had in flight)
        assert not (run / LOCK).exists()  # rank 0 released the folder on its way out
    elif victim == 2:  # every survivor names the scorer, none another rank
        lines = [line[line.index("error: "):] for line in text.splitlines() if "error: " in line]
        assert len(lines) >= 2 and all(line.startswith(f"error: {named}") for line in lines), text[-3000:]
    else:
        assert named in text and f"rank {1 - victim}" in text, text[-3000:]
    assert proc.returncode != 0


@pytest.fixture(scope="module")
def injected(tmp_path_factory):
    """One exception injected into each role at step 1 (DIGENRL_DEBUG_RAISE), the three runs forked
    side by side (tests/forked.py), every rank's exit code and stderr on its own."""
    tmp = tmp_path_factory.mktemp("injected")
    roles = {"generator": (2, [], 0), "trainer": (2, [], 1), "scorer": (3, ["--scorers", "1"], 2)}
    table = [{"name": role, "world": world, "env": {"DIGENRL_DEBUG_RAISE": f"{rank}:1"},
              "argv": [*BASE, *extra, "--steps", "4", "--output-dir", str(tmp / role)]}
             for role, (world, extra, rank) in roles.items()]
    return run_cases(table, limit=120), {role: rank for role, (_, _, rank) in roles.items()}


@pytest.mark.parametrize("role", ["generator", "trainer", "scorer"])
def test_an_exception_on_any_role_is_that_ranks_on_every_rank(injected, role):
    """The failing rank prints its traceback and its line (exit 1); every other rank prints the same
    rank, role, step and exception (exit 3); no rank calls another silent."""
    results, failing = injected
    ranks = results[role]["ranks"]
    who = {"generator": "generator rank 0 (replica 0)", "trainer": "trainer rank 1", "scorer": "scorer rank 2"}[role]
    fault = f"{who} failed at step 1: RuntimeError: injected fault (DIGENRL_DEBUG_RAISE={failing[role]}:1)"
    for r in ranks:
        lines = [line for line in r["stderr"].splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and lines[0].startswith(f"error: {fault}"), (r["rank"], r["stderr"][-3000:])
        assert "stopped answering" not in r["stderr"], r["stderr"][-3000:]
        mine = r["rank"] == failing[role]
        assert r["code"] == (1 if mine else 3) and ("Traceback" in r["stderr"]) == mine, (r["rank"], r["code"])
        assert r["seconds"] < 60


def test_a_live_runs_folder_is_refused_to_a_launch_of_the_same_rdzv_id_and_the_run_goes_on(tmp_path):
    """While a run trains, a second torchrun with the same c10d rdzv id (every launch of a SLURM
    allocation has one: scripts/slurm/launch.sh) and --overwrite into the run's folder through
    another name of it (a bind mount; a symlink where mounting is refused) is refused, naming the
    host and pid holding it, and the live run goes on with every byte it wrote; stopped by SIGTERM
    to torchrun, it saves a checkpoint and its lock leaves with it."""
    run, log, alias = tmp_path / "run", tmp_path / "log", tmp_path / "alias"
    proc = torchrun_background(2, [*BASE, "--steps", "500", "--save-every", "1", "--keep-checkpoints", "0",
                                   "--output-dir", str(run)], str(log), rdzv=rendezvous("samejob"))
    mounted = False
    try:
        _wait_rows(run, 2, proc, log)
        alias.mkdir()
        mounted = subprocess.run(["mount", "--bind", str(run), str(alias)], capture_output=True).returncode == 0
        if not mounted:
            alias.rmdir()
            alias.symlink_to(run)
        pids = worker_pids(proc.pid)
        rows = (run / "metrics.jsonl").read_text()
        saved = checkpoint_files.find_valid(str(run / "checkpoints"))
        began = time.monotonic()
        second = torchrun(2, [*BASE, "--overwrite", "--output-dir", str(alias)], check=False, timeout=240,
                          rdzv=rendezvous("samejob"))
        second_s = time.monotonic() - began
        _wait_rows(run, len(rows.splitlines()) + 1, proc, log)  # the live run goes on
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        _end(proc)
        if mounted:
            subprocess.run(["umount", str(alias)], check=True)
    holder = f"pid {pids[0]} on host {socket.gethostname()}"
    said = second.stdout + second.stderr
    assert second.returncode != 0 and f"error: --overwrite would delete the files of a live run: {alias / LOCK} is " \
        f"held by {holder}" in said, said[-3000:]
    assert (run / "metrics.jsonl").read_text().startswith(rows)
    checkpoint_files._VERIFIED.clear()
    assert checkpoint_files.read_manifest(saved.path)["step"] == saved.step  # every byte of it
    assert "stopped on a signal after step" in log.read_text() and not (run / LOCK).exists()
    print(f"\nthe second launch (same rdzv id, --overwrite through {'a bind mount' if mounted else 'a symlink'}) "
          f"was refused and its torchrun gone in {second_s:.1f} s")


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
    torchrun(2, ["--resume", str(stopped), "--output-dir", str(stopped), "--steps", str(steps + 1)])
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
    resumed = torchrun(2, ["--resume", str(run), "--output-dir", str(run)])
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
    hooks = args[args.index("--debug-slow-rank"):][:2] if "--debug-slow-rank" in args else []
    torchrun(nproc, ["--resume", str(run), "--output-dir", str(run), *hooks], env=traced(run))  # hooks never carried
    assert_nccl_ok(run, ["data.to", "publish"])  # with TCSS version N is sent again at the start
    _bitwise(trained_weights(str(straight), steps), trained_weights(str(run), steps), mode)
    keys = ("step", "reward/mean", "train/loss", "train/staleness_mean", "train/num_transitions")
    assert [[r[k] for k in keys] for r in _rows(run)] == [[r[k] for k in keys] for r in _rows(straight)]
    if mode == "tcss":
        assert [r["train/staleness_mean"] for r in _rows(run)] == [0.0, 1.0, 1.0]


def test_a_disk_that_fills_during_a_checkpoint_is_named_and_nothing_is_lost(tmp_path):
    """The output folder on a 200 KiB file system: step-1 fits, step-2 does not. Every rank stops
    (exit 3) with one line naming ENOSPC, the folder and its free space; once there is room the
    run continues from step-1 with --resume DIR --output-dir DIR."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("mounting a small tmpfs needs CAP_SYS_ADMIN")
    try:
        run = disk / "run"
        args = [*BASE, "--steps", "3", "--save-every", "1", "--keep-checkpoints", "0", "--output-dir", str(run)]
        full = run_cases([{"name": "full", "world": 2, "env": {}, "argv": args}], limit=120)["full"]
        subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)  # room again
        resumed = run_cases([{"name": "resumed", "world": 2, "env": {},
                              "argv": ["--resume", str(run), "--output-dir", str(run)]}], limit=120)["resumed"]
        rows = _rows(run)
    finally:
        subprocess.run(["umount", str(disk)])
    said = (f"checkpoint step-2: no space left on device (ENOSPC) writing into {run / 'checkpoints'}, 0 bytes free of "
            f"200.0 KiB on its file system: free space (the unfinished step-2.tmp can go), then continue from step-1")
    for r in full["ranks"]:
        lines = [line for line in r["stderr"].splitlines() if line.startswith("error:")]
        assert r["code"] == 3 and len(lines) == 1 and said in lines[0], (r["code"], r["stderr"][-3000:])
        assert "Traceback" not in r["stderr"] and "CheckpointException" not in lines[0]
    assert [r["code"] for r in resumed["ranks"]] == [0, 0], resumed["ranks"][1]["stderr"][-3000:]
    assert f"continuing from {run / 'checkpoints' / 'step-1'} (step 1)" in resumed["ranks"][0]["stderr"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    print(f"\nENOSPC: every rank gone {max(r['seconds'] for r in full['ranks']):.1f} s after its start "
          f"(2 steps, one checkpoint)")
