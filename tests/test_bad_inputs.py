"""The bad-input table: each case runs train_disagg's entry point on every rank of a 2-rank world
(tests/bad_input_driver.py forks the ranks, as torchrun would start them) and must end on every
rank with exit code 2 within BOUND_S seconds, printing one line that names the bad value, before
any model loads or any rank waits on another."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from checkpointing import files as checkpoint_files
from runtime.launch import ROOT, TINY

BOUND_S = 20.0  # every rank exits within this (it only reads flags and files)
SHIPPED = os.path.join(ROOT, "assets", "shapes-flux")


def _fake_run(folder, step, config):
    """A run folder with one checkpoint whose manifest verifies (no weights needed to resume-check)."""
    def write(tmp):
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump({"step": step}, f)
    os.makedirs(os.path.join(folder, "checkpoints"), exist_ok=True)
    checkpoint_files.write_atomic(os.path.join(folder, "checkpoints", f"step-{step}"), write,
                                  {"step": step, "version": step, "lora": True, "config": config})


def _model_copy(tmp_path, name, damage):
    folder = tmp_path / name
    shutil.copytree(SHIPPED, folder)
    damage(folder)
    return str(folder)


def _truncate(path, keep):
    with open(path, "r+b") as f:
        f.truncate(keep)


def _cases(tmp_path):
    out = str(tmp_path / "out")
    non_utf8 = tmp_path / "latin1.txt"
    non_utf8.write_bytes("a red circle\ntwo blue squares caf\xe9\n".encode("latin-1"))
    off_grammar = tmp_path / "off_grammar.txt"
    off_grammar.write_text("a red circle\na purple dragon on the moon\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    held = tmp_path / "held"
    held.mkdir()
    (held / "metrics.jsonl").write_text('{"step": 0}\n')
    lora4 = {"model": {"model": "flux", "model_path": None, "preset": "tiny"},
             "optim": {"lora_rank": 4, "lora_alpha": None, "lora_targets": "attn"},
             "rl": {"algorithm": "flow_grpo"}, "sampling": {"sde_type": "sde"}}
    _fake_run(str(tmp_path / "run4"), 2, lora4)
    torn = tmp_path / "torn"
    _fake_run(str(torn), 1, lora4)
    _truncate(torn / "checkpoints" / "step-1" / "state.json", 3)
    weights = "diffusion_pytorch_model.safetensors"
    t_trunc = _model_copy(tmp_path, "t_trunc", lambda d: _truncate(d / "transformer" / weights, 1_000_000))
    v_trunc = _model_copy(tmp_path, "v_trunc", lambda d: _truncate(d / "vae" / weights, 400_000))
    bad_json = _model_copy(tmp_path, "bad_json", lambda d: (d / "transformer" / "config.json").write_text('{"_class_name": '))
    flux = ["--output-dir", out]
    tiny = [*TINY, "--output-dir", out]
    cases = [  # (name, argv, env, text the message must hold)
        ("lr nan", [*tiny, "--lr", "nan"], {}, "--lr must be a finite number > 0, got nan"),
        ("noise nan", [*tiny, "--noise-level", "nan"], {}, "--noise-level must be a finite number >= 0, got nan"),
        ("noise -1", [*tiny, "--noise-level", "-1"], {}, "--noise-level must be a finite number >= 0, got -1.0"),
        ("height 17", [*tiny, "--height", "17"], {}, "height 17 must be a positive multiple of 4"),
        ("dtype fp7", [*tiny, "--dtype", "fp7"], {}, "unknown --dtype 'fp7'"),
        ("frames on image", [*tiny, "--num-frames", "5"], {}, "num_frames 5 given for 'flux', an image model"),
        ("save-every -1", [*tiny, "--save-every", "-1"], {}, "--save-every must be >= 0, got -1"),
        ("adv-clip -1", [*tiny, "--adv-clip", "-1"], {}, "--adv-clip must be a finite number > 0, got -1.0"),
        ("clip-range -1", [*tiny, "--clip-range", "-1"], {}, "--clip-range must be in (0, 1], got -1.0"),
        ("grad-clip 0", [*tiny, "--grad-clip", "0"], {}, "--grad-clip must be a finite number > 0, got 0.0"),
        ("beta -1", [*tiny, "--beta", "-1"], {}, "--beta must be a finite number >= 0 (0 = no KL term), got -1.0"),
        ("lora-alpha -5", [*tiny, "--lora-alpha", "-5"], {}, "--lora-alpha must be a finite number > 0, got -5.0"),
        ("dist-timeout 0", [*tiny, "--dist-timeout-s", "0"], {}, "--dist-timeout-s must be >= 1, got 0"),
        ("reward weight 1e39", [*tiny, "--reward", "jpeg_compressibility:1e39"], {}, "weight 1e39 must be a finite"),
        ("corrupt hook", tiny, {"DIGENRL_DEBUG_CORRUPT_PUBLISH": "bogus"}, "DIGENRL_DEBUG_CORRUPT_PUBLISH='bogus'"),
        ("kill hook", tiny, {"DIGENRL_DEBUG_KILL_IN_SAVE": "soon"}, "DIGENRL_DEBUG_KILL_IN_SAVE='soon'"),
        ("output-dir is a file", [*TINY, "--output-dir", str(a_file)], {}, f"--output-dir {str(a_file)!r} is a file"),
        ("output-dir holds a run", [*TINY, "--output-dir", str(held)], {}, f"{str(held)!r} already holds a run"),
        ("prompts not utf-8", [*tiny, "--prompts", str(non_utf8)], {}, f"{str(non_utf8)!r} is not UTF-8 text: line 2"),
        ("prompt off grammar", [*tiny, "--reward", "shapes", "--prompts", str(off_grammar)], {},
         "prompt 2: prompt 'a purple dragon on the moon' is not in the shapes-world grammar"),
        ("resume lora rank", [*TINY, "--lora-rank", "8", "--steps", "4", "--resume", str(tmp_path / "run4"),
                              "--output-dir", out], {}, "--lora-rank 4 (this run: 8)"),
        ("resume steps", [*TINY, "--lora-rank", "4", "--steps", "2", "--resume", str(tmp_path / "run4"),
                          "--output-dir", out], {}, "--steps 2 is not above the step of the checkpoint"),
        ("resume torn", [*TINY, "--lora-rank", "4", "--steps", "4", "--resume", str(torn), "--output-dir", out], {},
         "state.json has 3 bytes, the manifest says"),
        ("truncated transformer", ["--model-path", t_trunc, *flux], {},
         "transformer/diffusion_pytorch_model.safetensors: truncated"),
        ("truncated vae", ["--model-path", v_trunc, *flux], {}, "vae/diffusion_pytorch_model.safetensors: truncated"),
        ("broken model config", ["--model-path", bad_json, *flux], {}, "transformer/config.json: not valid JSON"),
        ("ema-decay 1", [*tiny, "--ema-decay", "1"], {}, "--ema-decay must be in [0, 1) (0 = off), got 1.0"),
        ("export-dtype", [*tiny, "--export-dtype", "fp8"], {}, "unknown --export-dtype 'fp8'"),
        ("cps noise 2", [*tiny, "--sde-type", "cps", "--noise-level", "2"], {}, "--noise-level 2.0 must be in [0, 1]"),
        ("adam-betas", [*tiny, "--adam-betas", "0.9,1.5"], {}, "--adam-betas must be two numbers in [0, 1), got 0.9,1.5"),
        ("weight-decay inf", [*tiny, "--weight-decay", "inf"], {}, "--weight-decay must be a finite number >= 0, got inf"),
        ("sd3 too tall", [*tiny, "--model", "sd3", "--height", "4096", "--width", "64"], {}, "height 4096 exceeds 256"),
        ("wan frames", [*tiny, "--model", "wan", "--num-frames", "6"], {}, "num_frames 6 must be 1 + a multiple of 4"),
        ("tag colocated", [*tiny, "--tag", "--mode", "colocated"], {}, "--tag needs --mode disagg"),
        ("heartbeat 1", [*tiny, "--heartbeat-timeout-s", "1"], {}, "--heartbeat-timeout-s must be in [5, 3600] seconds"),
        ("keep -1", [*tiny, "--keep-checkpoints", "-1"], {}, "--keep-checkpoints must be >= 0 (0 = keep all), got -1"),
        ("seed -1", [*tiny, "--seed", "-1"], {}, "--seed must be an integer in [0, 2**63), got -1"),
        ("attention", [*tiny, "--attention", "xformers"], {}, "unknown --attention 'xformers'"),
    ]
    if not torch.cuda.is_available():
        cases.append(("cuda on a CPU build", [*tiny, "--device", "cuda"], {}, "--device cuda, but this torch"))
    return cases


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bad")
    cases = _cases(tmp_path)
    table = [{"name": n, "argv": argv, "env": env, "world": 2} for n, argv, env, _ in cases]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.bad_input_driver", "--limit", "90"],
                          input=json.dumps(table), capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {r["name"]: r for r in map(json.loads, proc.stdout.splitlines())}
    return {name: (got[name], text) for name, _, _, text in cases}


def test_at_least_25_cases(results):
    assert len(results) >= 25


def test_every_case_exits_2_on_every_rank_in_time_naming_the_value(results):
    failures = []
    for name, (result, text) in results.items():
        codes = [r["code"] for r in result["ranks"]]
        seconds = max(r["seconds"] for r in result["ranks"])
        errors = [line for r in result["ranks"] for line in r["stderr"].splitlines() if line.startswith("error:")]
        if codes != [2, 2] or seconds > BOUND_S or not errors or not any(text in line for line in errors):
            failures.append(f"{name}: codes {codes}, {seconds:.1f} s, error lines {errors}")
        elif any("Traceback" in r["stderr"] for r in result["ranks"]):
            failures.append(f"{name}: a traceback besides the one line")
    assert not failures, "\n".join(failures)
