"""Run folders in process (docs/reliability.md): one run per folder, the lock a live run holds,
what a resume continues from and what config.json records of it, and config files that describe a
run, never an action. tests/test_bad_inputs.py runs the same refusals through the real entry point
on every rank of a 2-rank world; tests/test_faults.py takes a live run's folder."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from checkpointing import manifest as checkpoint_files
from checkpointing import folder as run_folders
from checkpointing import lock
from config.cli import parse_config
from config.schema import NOT_CARRIED, RunConfig
from lab.launch import ROOT


def _cfg(out, resume=None, overwrite=False, steps=5, lora_rank=4, seed=0, anyway=False) -> RunConfig:
    cfg = RunConfig(seed=seed)
    cfg.model.preset, cfg.optim.lora_rank, cfg.rl.steps = "tiny", lora_rank, steps
    o = cfg.output
    o.output_dir, o.resume, o.overwrite, o.resume_anyway = str(out), resume and str(resume), overwrite, anyway
    return cfg


def _checkpoint(folder, step, config, name=None):
    checkpoint_files.write_atomic(str(folder / "checkpoints" / (name or f"step-{step}")),
                                  lambda tmp: Path(tmp, "w").write_text(f"weights of step {step}"),
                                  {"step": step, "config": config})


def _run_folder(folder, steps_done, saved, run_id="run-a", seed=0):
    """A run that logged `steps_done` steps and saved `saved`, with its config.json and run record."""
    folder.mkdir(exist_ok=True)
    rows = [{"step": s, "time": 0, "reward/mean": s} for s in range(steps_done)]
    rows += [{"step": s, "time": 0, "eval/reward": s} for s in range(0, steps_done + 1, 2)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "tor')
    (folder / "samples").mkdir()
    for s in range(steps_done):
        (folder / "samples" / f"step-{s:06d}.png").write_bytes(b"png")
    record = {"id": run_id, "prompts_sha256": "p" * 64, "resumes": []}
    config = {**_cfg(folder, seed=seed).describe(), "run": record}
    for s in saved:
        _checkpoint(folder, s, config)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "slurm-123.out").write_text("a launcher's log")


def test_a_folder_that_holds_a_run_is_refused_unless_resumed_in_place_or_overwritten(tmp_path):
    run = tmp_path / "run"
    _run_folder(run, 4, [2, 4])
    with pytest.raises(ValueError, match="already holds a run .*continue its run with --resume"):
        run_folders.check(_cfg(run))
    assert run_folders.check(_cfg(run, overwrite=True)) is None
    point = run_folders.check(_cfg(run, resume=run, steps=6), "p" * 64, NOT_CARRIED)
    assert point.step == 4 and point.same_folder and point.changed == {"rl.steps": [5, 6]} and not point.anyway
    with pytest.raises(ValueError, match="--lora-rank 4 \\(this run: 8\\).*change what its weights mean"):
        run_folders.check(_cfg(run, resume=run, lora_rank=8))
    with pytest.raises(ValueError, match="--steps 4 is not above the step of the checkpoint"):
        run_folders.check(_cfg(run, resume=run, steps=4))
    only_logs = tmp_path / "logs"
    only_logs.mkdir()
    (only_logs / "slurm-1.out").write_text("x")
    assert run_folders.check(_cfg(only_logs)) is None  # a launcher's log is not a run
    record = run_folders.prepare(_cfg(run, overwrite=True), None, {"prompts_sha256": "q" * 64}, say=lambda line: None)
    assert sorted(os.listdir(run)) == ["config.json", "slurm-123.out"]
    written = json.loads((run / "config.json").read_text())
    assert written["run"] == record and record["resumes"] == [] and record["id"] != "run-a"
    assert "overwrite" not in written["output"] and "resume" not in written["output"]  # a run, not an action


def test_resuming_in_place_cuts_the_run_back_and_config_json_records_the_resume(tmp_path):
    run = tmp_path / "run"
    _run_folder(run, 5, [2, 4])
    with open(run / "checkpoints" / "step-4" / "w", "w") as f:
        f.write("torn")  # the newest checkpoint no longer verifies
    point = run_folders.check(_cfg(run, resume=run, steps=6), "p" * 64, NOT_CARRIED)
    assert point.step == 2 and point.skipped[0][0].endswith("step-4")
    lines = []
    record = run_folders.prepare(_cfg(run, resume=run, steps=6), point, {"prompts_sha256": "p" * 64}, say=lines.append)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "eval/reward" in r) for r in rows] == [(0, False), (1, False), (0, True), (2, True)]
    assert sorted(os.listdir(run / "checkpoints")) == ["step-2"]
    assert sorted(os.listdir(run / "samples")) == ["step-000000.png", "step-000001.png"]
    (aside,) = (run / "discarded").iterdir()
    assert len((aside / "metrics.jsonl").read_text().splitlines()) == 5  # steps 2-4, eval 4, the torn line
    assert (aside / "checkpoints" / "step-4").is_dir()
    assert json.loads((aside / "config.json").read_text())["run"]["resumes"] == []  # the description before
    assert any("skipped" in line and "step-4" in line for line in lines)
    assert [r["step"] for r in run_folders.rows_to_replay(str(run), 2)] == [2]
    (event,) = json.loads((run / "config.json").read_text())["run"]["resumes"]
    assert record["id"] == "run-a" and event["step"] == 2 and event["changed"] == {"rl.steps": [5, 6]}
    assert event["from"] == str(run / "checkpoints" / "step-2")


def test_a_checkpoint_copied_in_under_another_steps_name_is_skipped_by_name(tmp_path):
    run = tmp_path / "run"
    _run_folder(run, 2, [2])
    shutil.copytree(run / "checkpoints" / "step-2", run / "checkpoints" / "step-4")
    found = checkpoint_files.find_valid(str(run / "checkpoints"))
    assert found.step == 2
    assert found.skipped == [(str(run / "checkpoints" / "step-4"),
                              "its manifest.json records step 2, not 4: a copy of another checkpoint under this name")]
    shutil.rmtree(run / "checkpoints" / "step-2")
    with pytest.raises(ValueError, match="holds no valid checkpoint: skipped .*step-4 \\(its manifest.json records "
                                         "step 2, not 4"):
        run_folders.check(_cfg(run, resume=run, steps=6))


def test_a_resume_that_changes_the_data_needs_resume_anyway_and_is_recorded(tmp_path):
    run = tmp_path / "run"
    _run_folder(run, 2, [2])
    with pytest.raises(ValueError, match="this run changes --seed 0 \\(this run: 5\\); resume with --resume-anyway"):
        run_folders.check(_cfg(run, resume=run, steps=4, seed=5), "p" * 64, NOT_CARRIED)
    with pytest.raises(ValueError, match="the prompt file's content \\(SHA-256 pppppppppppp at the checkpoint, "
                                         "qqqqqqqqqqqq now\\)"):
        run_folders.check(_cfg(run, resume=run, steps=4), "q" * 64, NOT_CARRIED)
    point = run_folders.check(_cfg(run, resume=run, steps=4, seed=5, anyway=True), "p" * 64, NOT_CARRIED)
    assert point.changed == {"seed": [0, 5], "rl.steps": [5, 4]} and point.anyway == ("--seed 0 (this run: 5)",)
    record = run_folders.prepare(_cfg(run, resume=run, steps=4, seed=5, anyway=True), point,
                               {"prompts_sha256": "p" * 64}, say=lambda line: None)
    assert record["resumes"][-1]["resume_anyway"] == ["--seed 0 (this run: 5)"]


def test_another_runs_checkpoint_is_named_and_needs_resume_anyway(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    _run_folder(run, 2, [2], run_id="run-a")
    _run_folder(other, 4, [4], run_id="run-b", seed=1)
    shutil.copytree(other / "checkpoints" / "step-4", run / "checkpoints" / "step-4")
    with pytest.raises(ValueError, match=f"it was not written by the run in {run} \\(run id run-b \\(the folder's "
                                         f"run: run-a\\); --seed 1 \\(the folder's run: 0\\)\\)"):
        run_folders.check(_cfg(run, resume=run, steps=6, seed=1), "p" * 64, NOT_CARRIED)
    for folder in (run, other):  # runs of an older version: no ids, their seeds tell them apart
        for path in [folder / "config.json", *(folder / "checkpoints").glob("step-*/manifest.json")]:
            data = json.loads(path.read_text())
            (data.get("config") or data).pop("run")
            path.write_text(json.dumps(data))
    checkpoint_files._VERIFIED.clear()
    with pytest.raises(ValueError, match="not written by the run in .*--seed 1 \\(the folder's run: 0\\)"):
        run_folders.check(_cfg(run, resume=run, steps=6, seed=1), "p" * 64, NOT_CARRIED)


def _live_process():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _write_lock(folder, **record):
    folder.mkdir(exist_ok=True)
    (folder / lock.LOCK).write_text(json.dumps({"job": "another job", "since": "then", **record}))


def test_a_live_runs_folder_is_refused_naming_its_host_and_pid(tmp_path):
    live = _live_process()
    try:
        pid = live.pid
        _write_lock(tmp_path / "run", host=socket.gethostname(), pid=pid, start_ticks=lock._start_ticks(pid))
        with pytest.raises(ValueError, match=f"--overwrite would delete the files of a live run: .*run.lock is held by "
                                             f"pid {pid} on host {socket.gethostname()}"):
            lock.check(str(tmp_path / "run"), overwrite=True)
        with pytest.raises(ValueError, match=f"pid {pid} on host"):
            run_folders.check(_cfg(tmp_path / "run", resume=tmp_path / "run"))
        with pytest.raises(ValueError, match="held by"):
            lock.acquire(str(tmp_path / "run"))
    finally:
        live.kill()
        live.wait()
    # the same pid, reused by a younger process, is not the holder
    _write_lock(tmp_path / "reused", host=socket.gethostname(), pid=os.getpid(), start_ticks=1)
    assert lock.state(str(tmp_path / "reused"))[0] == "stale"


def test_a_dead_runs_lock_is_named_and_taken_over_and_another_hosts_is_not(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)
    _write_lock(tmp_path / "run", host=socket.gethostname(), pid=pid)
    note = lock.acquire(str(tmp_path / "run"))
    try:
        assert f"was left by pid {pid} on host {socket.gethostname()}" in note and "taking it over" in note
        mine = lock.read(str(tmp_path / "run"))
        assert (mine["pid"], mine["job"]) == (os.getpid(), lock.job_id())
        assert lock.state(str(tmp_path / "run"))[0] == "ours"  # every rank of this job reads it as its own
    finally:
        lock.release()
    assert not (tmp_path / "run" / lock.LOCK).exists()
    _write_lock(tmp_path / "far", host="node-b.example", pid=4242)
    with pytest.raises(ValueError, match="held by pid 4242 on host node-b.example .*a host this one cannot check: if "
                                         "that run has ended .*remove .*run.lock and launch again"):
        lock.acquire(str(tmp_path / "far"))
    assert lock.read(str(tmp_path / "far"))["host"] == "node-b.example"  # never broken silently


def test_the_output_folder_is_checked_for_writes_and_path_length_before_anything_loads(tmp_path):
    with pytest.raises(ValueError, match="the folder name 'nnnnnnnn.*has 300 bytes; this file system allows 255"):
        run_folders.check_writable(str(tmp_path / ("n" * 300)), 5)
    deep = str(tmp_path / "/".join(["d" * 200] * 20))
    with pytest.raises(ValueError, match="is too long .*the run writes paths of up to .* bytes under it"):
        run_folders.check_writable(deep, 5)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        run_folders.check_writable(str(tmp_path / "file" / "out"), 5)
    if not os.access("/sys/fs", os.W_OK) or os.geteuid() == 0:  # sysfs refuses new files, even to root
        with pytest.raises(ValueError, match="cannot write into '/sys/fs'"):
            run_folders.check_writable("/sys/fs/digenrl-run", 5)
    run_folders.check_writable(str(tmp_path / "new" / "run"), 5)
    assert os.listdir(tmp_path) == ["file"]  # a probe creates nothing it leaves behind


def test_config_files_describe_a_run_and_never_an_action(tmp_path):
    """An old config.json that carries --overwrite and --resume: neither is taken, nor the folder."""
    old = _cfg(tmp_path / "a", resume=tmp_path / "c", overwrite=True).to_dict()
    old["output"]["debug_slow_rank"] = [0, 2.0]
    (tmp_path / "config.json").write_text(json.dumps(old))
    cfg = parse_config(["--config", str(tmp_path / "config.json"), "--seed", "5", "--output-dir", str(tmp_path / "b")])
    assert (cfg.output.overwrite, cfg.output.resume, cfg.output.output_dir) == (False, None, str(tmp_path / "b"))
    assert cfg.output.debug_slow_rank is None and cfg.optim.lora_rank == 4 and cfg.seed == 5
    default = parse_config(["--config", str(tmp_path / "config.json")])
    assert default.output.output_dir == RunConfig().output.output_dir


def test_a_resume_starts_from_the_checkpoints_config_and_flags_override_it(tmp_path):
    """--resume DIR --output-dir DIR --steps N alone continues a run started with other flags."""
    run = tmp_path / "run"
    run.mkdir()
    started = _cfg(run, lora_rank=0, steps=2)
    started.model.model_path, started.rl.group_size = "/w/flux", 4
    _checkpoint(run, 2, {**started.describe(), "run": {"id": "run-a"}})
    cfg = parse_config(["--resume", str(run), "--output-dir", str(run), "--steps", "6"])
    assert (cfg.optim.lora_rank, cfg.model.model_path, cfg.rl.group_size, cfg.rl.steps) == (0, "/w/flux", 4, 6)
    assert cfg.output.resume == str(run) and not cfg.output.overwrite
    split = _cfg(tmp_path / "split", steps=2)
    split.topology.generators, split.topology.trainers, split.topology.tsp = 1, 1, True
    (tmp_path / "split").mkdir()
    _checkpoint(tmp_path / "split", 2, split.describe())
    moved = parse_config(["--resume", str(tmp_path / "split"), "--mode", "colocated", "--steps", "4"])
    t = moved.topology  # the role split is the command's as a whole; the rest of the placement is carried
    assert (t.mode, t.generators, t.trainers, t.tsp) == ("colocated", None, None, True)
    again = parse_config(["--resume", str(run), "--output-dir", str(run), "--steps", "6", "--lora-rank", "8"])
    again.resolve_defaults()
    with pytest.raises(ValueError, match="--lora-rank 0 \\(this run: 8\\)"):
        run_folders.check(again)


# ----- issue 39: a lock no launcher can bypass ---------------------------------------------------
def _holder_process(folder, env):
    """Another launch that takes `folder`'s lock and keeps it while it lives."""
    code = f"import time; from checkpointing import lock; lock.acquire({str(folder)!r}); print('held', flush=True); " \
           f"time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env},
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_launches_that_share_an_rdzv_id_are_two_runs(tmp_path, monkeypatch):
    """torchrun's rdzv id (TORCHELASTIC_RUN_ID) is the same for every launch of a SLURM allocation
    (scripts/slurm/launch.sh): it never makes another launch's live lock this run's."""
    live = _holder_process(tmp_path / "run", {"TORCHELASTIC_RUN_ID": "samejob"})
    try:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "samejob")
        with pytest.raises(ValueError, match=f"--overwrite would delete the files of a live run: .* pid {live.pid} "):
            lock.check(str(tmp_path / "run"), overwrite=True)
        with pytest.raises(ValueError, match=f"held by pid {live.pid} "):
            lock.acquire(str(tmp_path / "run"))
    finally:
        live.kill()
        live.wait()


@pytest.fixture
def alias(tmp_path):
    """(folder, another name of it that realpath cannot resolve: a bind mount; a symlink where
    mounting is refused, as for a user without CAP_SYS_ADMIN)."""
    real, other = tmp_path / "run", tmp_path / "alias"
    real.mkdir()
    other.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(real), str(other)], capture_output=True).returncode == 0
    if not mounted:
        other.rmdir()
        other.symlink_to(real)
    else:
        assert os.path.realpath(other) != os.path.realpath(real)
    yield real, other
    if mounted:
        subprocess.run(["umount", str(other)], check=True)


def test_an_alias_of_a_run_folder_is_that_folder(alias, tmp_path):
    """Folders are compared by (device, inode): --resume through a bind mount continues the run in
    place, and --overwrite through it is refused (it would delete the checkpoints it resumes); a
    live run's folder is refused through any name."""
    real, other = alias
    _run_folder(real, 4, [2, 4])
    with pytest.raises(ValueError, match="--overwrite would delete the checkpoints --resume .* continues from"):
        run_folders.check(_cfg(real, resume=other, overwrite=True))
    point = run_folders.check(_cfg(other, resume=real, steps=6), "p" * 64, NOT_CARRIED)
    assert point.same_folder and point.step == 4
    assert run_folders.same_folder(str(real), str(other)) and not run_folders.same_folder(str(real), str(tmp_path))
    live = _holder_process(real, {})
    try:
        with pytest.raises(ValueError, match=f"--overwrite would delete the files of a live run: .*pid {live.pid} "):
            run_folders.check(_cfg(other, overwrite=True))
    finally:
        live.kill()
        live.wait()


def _race(folders: list[str], start, results, launch: str) -> None:
    """One racer: for each folder, wait for the others, then try to take the folder's lock, and wait
    until every racer has tried (a winner that ended would leave a dead run's lock to take over)."""
    lock.set_launch(launch)
    for folder in folders:
        start.wait()
        try:
            lock.acquire(folder)
            results.put((folder, os.getpid()))
        except ValueError:
            results.put((folder, None))
        start.wait()


def test_a_stale_lock_has_exactly_one_taker_among_6_racers(tmp_path):
    """6 processes take over the same dead run's lock at once, 300 times: exactly one wins each time,
    and the lock names it."""
    import multiprocessing
    racers, trials = 6, 300
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folders = []
    for t in range(trials):
        _write_lock(tmp_path / f"f{t}", host=socket.gethostname(), pid=int(gone.stdout), start_ticks=1)
        folders.append(str(tmp_path / f"f{t}"))
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(racers), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(folders, start, results, f"racer-{i}")) for i in range(racers)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in range(racers * trials)]
    for p in procs:
        p.join(timeout=30)
    winners = {f: [pid for g, pid in got if g == f and pid] for f in folders}
    doubles = {f: w for f, w in winners.items() if len(w) != 1}
    assert not doubles, f"{len(doubles)} of {trials} trials had no single winner: {list(doubles.items())[:3]}"
    assert all(lock.read(f)["pid"] == w[0] for f, w in winners.items())
    assert not [n for f in folders for n in os.listdir(f) if n != lock.LOCK]  # no marker or temporary left


def test_a_racer_that_died_in_a_takeover_leaves_a_marker_the_next_passes(tmp_path):
    """A takeover marker whose racer is gone does not block the folder: the next racer takes the
    next generation, and the winner removes both."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    _write_lock(tmp_path / "run", host=socket.gethostname(), pid=pid, start_ticks=1)
    (tmp_path / "run" / "run.lock.takeover-0").write_text(json.dumps(
        {"host": socket.gethostname(), "pid": pid, "job": "launch dead", "start_ticks": 1}))
    note = lock.acquire(str(tmp_path / "run"))
    try:
        assert "taking it over" in note and lock.read(str(tmp_path / "run"))["pid"] == os.getpid()
        assert sorted(os.listdir(tmp_path / "run")) == [lock.LOCK]
    finally:
        lock.release()


def test_a_live_runs_checkpoints_are_resumed_only_when_pinned(tmp_path):
    """--resume from a folder a live run holds: that run prunes its checkpoints, so only a pinned
    one (KEEP) is read, and without one the resume is refused naming the live run."""
    source = tmp_path / "source"
    _run_folder(source, 4, [2, 4])
    live = _holder_process(source, {})
    try:
        with pytest.raises(ValueError, match=f"--resume .*source' is the folder of a live run, pid {live.pid} on host "
                                             f".*none of them is pinned: pin the one to continue from .*KEEP"):
            run_folders.check(_cfg(tmp_path / "new", resume=source, steps=6), "p" * 64, NOT_CARRIED)
        (source / "checkpoints" / "step-2" / "KEEP").write_text("")
        point = run_folders.check(_cfg(tmp_path / "new", resume=source, steps=6), "p" * 64, NOT_CARRIED)
        assert point.step == 2 and not point.same_folder
        assert point.skipped == ((str(source / "checkpoints" / "step-4"),
                                  f"not pinned, and the live run in {source} (pid {live.pid} on host "
                                  f"{socket.gethostname()} (since {lock.read(str(source))['since']}, "
                                  f"{lock.read(str(source))['job']})) may prune it"),)
    finally:
        live.kill()
        live.wait()
    assert run_folders.check(_cfg(tmp_path / "new", resume=source, steps=6), "p" * 64, NOT_CARRIED).step == 4
