"""Multi-node launches on this machine: two torchrun agents (--nnodes 2 --nproc_per_node 1) joined by a
c10d rendezvous on localhost train exactly the weights of a one-node run, relaunched from that run's
config.json; and the SLURM launcher builds the torchrun command every node runs."""
import os
import socket
import subprocess
import sys

import torch

from lab.launch import ROOT, TINY, torchrun, trained_weights


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_relaunched_from_config_json_match_one_node(tmp_path):
    torchrun(2, [*TINY, "--lora-rank", "4", "--steps", "2", "--output-dir", str(tmp_path / "one")])
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "two-nodes",
           os.path.join(ROOT, "train_disagg.py"), "--config", str(tmp_path / "one" / "config.json"),
           "--output-dir", str(tmp_path / "two")]
    logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT) for log in logs]
    codes = [node.wait(timeout=300) for node in nodes]
    for log in logs:
        log.close()
    assert codes == [0, 0], "\n".join((tmp_path / f"node{i}.log").read_text()[-3000:] for i in range(2))
    one, two = trained_weights(str(tmp_path / "one"), 2), trained_weights(str(tmp_path / "two"), 2)
    assert one.keys() == two.keys() and len(one) > 0
    for name in one:
        assert torch.equal(one[name], two[name]), name  # bit for bit: the placement and the data are the same
    lora_b = [n for n in one if "lora_B" in n]  # zero at version 0 (peft's init): nonzero once trained
    assert lora_b and any(one[n].abs().sum() > 0 for n in lora_b)


def test_slurm_launcher_runs_one_torchrun_per_node(tmp_path):
    """scripts/slurm/launch.sh with stand-ins for srun and scontrol that print what they are given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'gpu-a\\ngpu-b\\n'\n")
    (bin_dir / "srun").write_text("#!/bin/bash\necho \"srun $*\"\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_JOB_ID": "77", "PYTHON": "python3"}
    out = subprocess.run(["bash", "scripts/slurm/launch.sh", "recipes/dance_grpo/flux_dev.toml", "--steps", "5"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("srun "))
    assert ("--ntasks-per-node=1 --kill-on-bad-exit=1 python3 -m torch.distributed.run --nnodes 2 --nproc_per_node 8 "
            "--rdzv-backend c10d --rdzv-endpoint gpu-a:29500 --rdzv-id 77 train_disagg.py "
            "--config recipes/dance_grpo/flux_dev.toml --config recipes/topology/16gpus.toml --steps 5") in line
    for sbatch in ("flow_grpo.sbatch", "dance_grpo.sbatch"):
        with open(os.path.join(ROOT, "scripts", "slurm", sbatch)) as f:
            text = f.read()
        assert "#SBATCH --ntasks-per-node=1" in text and "scripts/slurm/launch.sh" in text
