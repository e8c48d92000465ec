"""Run train_disagg.py, or a torchrun script of tests/, under torchrun in a subprocess (tiny settings, a timeout,
offline)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--preset", "tiny", "--prompts-per-step", "2", "--group-size", "2", "--micro-batch", "2",
        "--sample-steps", "3", "--height", "16", "--width", "16", "--reward", "jpeg_compressibility",
        "--log-images-every", "1", "--lr", "1e-3", "--eval-every", "0"]


def torchrun(nproc: int, args: list[str], env: dict | None = None, timeout: int = 300,
             check: bool = True) -> subprocess.CompletedProcess:
    return torchrun_script(nproc, os.path.join(ROOT, "train_disagg.py"), args, env, timeout, check)


def torchrun_script(nproc: int, script: str, args: list[str] = (), env: dict | None = None, timeout: int = 300,
                    check: bool = True) -> subprocess.CompletedProcess:
    """`script`: a path, or a file name in tests/."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           os.path.join(os.path.dirname(os.path.abspath(__file__)), script), *args]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def trained_weights(run_dir: str, step: int):
    from checkpoint import checkpoint_dir, read_trained_weights

    weights, _ = read_trained_weights(checkpoint_dir(run_dir, step))
    return weights
