"""Run train_disagg.py, or a module such as a distributed test script, under torchrun in a subprocess
(tiny settings, a timeout, offline): the tests, the bench and the fault figures start runs through here."""
import json
import os
import socket
import subprocess
import sys
import time

from checkpointing.checkpoint import checkpoint_dir, read_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--placement", "fixed", "--preset", "tiny", "--prompts-per-step", "2", "--group-size", "2", "--micro-batch", "2",
        "--sample-steps", "3", "--height", "16", "--width", "16", "--reward", "jpeg_compressibility",
        "--log-images-every", "1", "--lr", "1e-3", "--eval-every", "0"]


def torchrun(nproc: int, args: list[str], env: dict | None = None, timeout: int = 300,
             check: bool = True, rdzv: list[str] | None = None) -> subprocess.CompletedProcess:
    """`rdzv`: torchrun's rendezvous flags in place of --standalone (`rendezvous`)."""
    return _torchrun(nproc, [os.path.join(ROOT, "train_disagg.py")], args, env, timeout, check, rdzv)


def torchrun_module(nproc: int, module: str, args: list[str] = (), env: dict | None = None, timeout: int = 300,
                    check: bool = True) -> subprocess.CompletedProcess:
    """`python -m module` on every rank (e.g. tests.dist_scripts.p2p_publish), from the project root."""
    return _torchrun(nproc, ["-m", module], args, env, timeout, check)


def rendezvous(run_id: str) -> list[str]:
    """torchrun's flags for a c10d rendezvous of one node on a free local port with the rdzv id
    `run_id`, as scripts/slurm/launch.sh launches (there, $SLURM_JOB_ID for every launch)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]


def _torchrun(nproc: int, target: list[str], args, env, timeout, check, rdzv=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", *(rdzv or ["--standalone"]), "--nproc_per_node", str(nproc),
           *target, *args]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    _log_run(nproc, target, args, env, time.perf_counter() - start, proc.returncode)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def _log_run(nproc, target, args, env, seconds, returncode) -> None:
    """With DIGENRL_RUN_LOG=FILE, one JSON line per run: the test that started it, its world, flags,
    extra environment, wall seconds and exit code (which runs the suite starts, and what they cost)."""
    path = os.environ.get("DIGENRL_RUN_LOG")
    if path:
        row = {"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "nproc": nproc, "target": target[-1],
               "args": list(args), "env": env or {}, "s": round(seconds, 2), "rc": returncode}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def trained_weights(run_dir: str, step: int):
    """The trained weights of checkpoint `step`, float32 as trained (the run state, not the export)."""
    return read_state(checkpoint_dir(run_dir, step))


def torchrun_background(nproc: int, args: list[str], log_path: str, env: dict | None = None,
                        rdzv: list[str] | None = None) -> subprocess.Popen:
    """train_disagg.py under torchrun, running on: its own session (so a test can end everything it
    started by process group), stdout and stderr to `log_path`. `rdzv`: as `torchrun`'s."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *(rdzv or ["--standalone"]), "--nproc_per_node", str(nproc),
           os.path.join(ROOT, "train_disagg.py"), *args]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    log = open(log_path, "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def worker_pids(torchrun_pid: int) -> dict[int, int]:
    """RANK -> pid of the workers torchrun started (Linux /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != torchrun_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in env:
            out[int(env[b"RANK"])] = int(entry)
    return out


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting for its parent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
