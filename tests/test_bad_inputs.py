"""The bad-input table: each case runs train_disagg's entry point on every rank of a 2-rank world
(tests/bad_input_driver.py forks the ranks, as torchrun would start them, and hosts their store as
torchrun's agent does) and must end on every rank with exit code 2 within BOUND_S seconds, printing
one line that names the bad value, with no traceback. Most cases fail before any model loads or any
rank waits on another; those that only a loaded model shows (AFTER_LOAD) fail on every rank alike
and leave no config.json, lock or other run file behind, so the corrected command runs as is. No
case changes a byte of a folder that holds another run."""
import hashlib
import json
import os
import shutil
import socket
import subprocess

import pytest
import torch

from checkpointing import manifest as checkpoint_files
from checkpointing.digests import folder_digest
from checkpointing.folder import RUN_ENTRIES
from checkpointing.lock import LOCK, _start_ticks
from lab.launch import ROOT, TINY
from forked import run_cases

BOUND_S = 20.0  # every rank exits within this (it reads flags and files, or loads a tiny model)
SHIPPED = os.path.join(ROOT, "assets", "shapes-flux")
AFTER_LOAD = ("memory budget 0.001", "weights of the wrong shape", "gap stages above blocks",
              "scorer's reward model incomplete", "init-lora of another model")


def _fake_run(folder, step, config, name=None, run_config=None):
    """A run folder with one checkpoint whose manifest verifies (no weights needed to resume-check),
    and the run's config.json when given."""
    def write(tmp):
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump({"step": step}, f)
    os.makedirs(os.path.join(folder, "checkpoints"), exist_ok=True)
    checkpoint_files.write_atomic(os.path.join(folder, "checkpoints", name or f"step-{step}"), write,
                                  {"step": step, "version": step, "lora": True, "config": config})
    if run_config is not None:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(run_config, f)


def _digest(folder) -> str:
    """Every file's path and bytes under `folder`."""
    h = hashlib.sha256()
    for root, _, names in sorted(os.walk(folder)):
        for name in sorted(names):
            path = os.path.join(root, name)
            h.update(path.encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def _header_shape_changed(folder):
    """A transformer file whose header gives one tensor another shape, its byte ranges left as they were."""
    path = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2)
    header[name]["shape"] = [header[name]["shape"][0] // 2, header[name]["shape"][1]]
    text = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(data[:8] + text.ljust(n) + data[8 + n:])  # the same header length, padded with spaces


def _symlink_loop(folder):
    os.remove(folder / "transformer" / "config.json")
    os.symlink("config.json", folder / "transformer" / "config.json")


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
    lora4 = {"seed": 0, "model": {"model": "flux", "model_path": None, "preset": "tiny"},
             "optim": {"lora_rank": 4, "lora_alpha": None, "lora_targets": "attn"},
             "rl": {"algorithm": "flow_grpo"}, "sampling": {"sde_type": "sde"}}
    _fake_run(str(tmp_path / "run4"), 2, lora4)
    torn = tmp_path / "torn"
    _fake_run(str(torn), 1, lora4)
    _truncate(torn / "checkpoints" / "step-1" / "state.json", 3)
    _fake_run(str(tmp_path / "mislabelled"), 2, lora4, name="step-4")
    _fake_run(str(tmp_path / "mixed"), 4, {**lora4, "seed": 1, "run": {"id": "run-b"}},
              run_config={**lora4, "seed": 0, "run": {"id": "run-a"}})
    live, far = tmp_path / "live", tmp_path / "far"
    for folder, pid, host in ((live, os.getpid(), socket.gethostname()), (far, 4242, "node-b.example")):
        folder.mkdir()
        (folder / LOCK).write_text(json.dumps({"host": host, "pid": pid, "job": "another job", "since": "now",
                                               "start_ticks": _start_ticks(pid) if pid == os.getpid() else None}))
    (live / "metrics.jsonl").write_text('{"step": 0}\n')
    a = tmp_path / "a"  # an old config.json: it carries --overwrite and --resume
    a.mkdir()
    (a / "config.json").write_text(json.dumps({**lora4, "output": {"overwrite": True, "resume": str(tmp_path / "run4"),
                                                                   "output_dir": str(a)}}))
    held_b = tmp_path / "held_b"
    shutil.copytree(held, held_b)
    empty = tmp_path / "empty_clip"
    empty.mkdir()
    jsonl17 = tmp_path / "shapes.jsonl"
    jsonl17.write_text('{"prompt": "a red circle"}\n{"prompt": "a blue square", "height": 17}\n')
    weights = "diffusion_pytorch_model.safetensors"
    t_trunc = _model_copy(tmp_path, "t_trunc", lambda d: _truncate(d / "transformer" / weights, 1_000_000))
    v_trunc = _model_copy(tmp_path, "v_trunc", lambda d: _truncate(d / "vae" / weights, 400_000))
    bad_json = _model_copy(tmp_path, "bad_json", lambda d: (d / "transformer" / "config.json").write_text('{"_class_name": '))
    loop = _model_copy(tmp_path, "loop", _symlink_loop)
    reshaped = _model_copy(tmp_path, "reshaped", _header_shape_changed)
    heads = _model_copy(tmp_path, "heads", lambda d: (d / "transformer" / "config.json").write_text(
        (d / "transformer" / "config.json").read_text().replace('"num_attention_heads": 4', '"num_attention_heads": 2')))
    flux = ["--output-dir", out]
    tiny = [*TINY, "--output-dir", out]
    issue39 = _issue_39_cases(tmp_path, lora4, out, tiny)
    cases = [  # (name, argv, env, text the message must hold)
        ("lr nan", [*tiny, "--lr", "nan"], {}, "--lr must be a finite number > 0, got nan"),
        ("noise nan", [*tiny, "--noise-level", "nan"], {}, "--noise-level must be a finite number >= 0, got nan"),
        ("noise -1", [*tiny, "--noise-level", "-1"], {}, "--noise-level must be a finite number >= 0, got -1.0"),
        ("height 17", [*tiny, "--height", "17"], {}, "height 17 must be a positive multiple of 4"),
        ("dtype fp7", [*tiny, "--dtype", "fp7"], {}, "unknown --dtype 'fp7'"),
        ("dtype float16", [*tiny, "--dtype", "float16"], {}, "use --dtype bfloat16"),
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
        # issue 33: floats beyond float32, AdamW's first step
        ("lr 1e39", [*tiny, "--lr", "1e39", "--steps", "3"], {}, "--lr 1e+39 is beyond float32's range"),
        ("lr overflows AdamW", [*tiny, "--lr", "3.5e37"], {}, "--lr must be small enough that AdamW's first step"),
        ("guidance 1e39", [*tiny, "--guidance", "1e39"], {}, "--guidance 1e+39 is beyond float32's range"),
        ("memory budget 1e39", [*tiny, "--memory-budget-gb", "1e39"], {}, "--memory-budget-gb 1e+39 is beyond"),
        ("raise hook", tiny, {"DIGENRL_DEBUG_RAISE": "trainer"}, "DIGENRL_DEBUG_RAISE='trainer' must be RANK:STEP"),
        # the output folder: written to before anything loads
        ("output read-only", [*TINY, "--output-dir", "/sys/fs/digenrl-run"], {}, "cannot write into '/sys/fs'"),
        ("output name 300", [*TINY, "--output-dir", str(tmp_path / ("n" * 300))], {}, "has 300 bytes; this file"),
        ("output path 4200", [*TINY, "--output-dir", str(tmp_path / "/".join(["p" * 100] * 42))], {},
         "is too long (4"),
        ("folder of a live run", [*TINY, "--overwrite", "--output-dir", str(live)], {},
         f"--overwrite would delete the files of a live run: {live}/run.lock is held by pid {os.getpid()} on host "
         f"{socket.gethostname()}"),
        ("lock of another host", [*TINY, "--output-dir", str(far)], {}, "held by pid 4242 on host node-b.example"),
        # the README's reproduce command: another run's config.json into a folder holding a run
        ("reproduce into a run", ["--config", str(tmp_path / "a" / "config.json"), "--seed", "5", "--output-dir",
                                  str(held_b)], {}, f"--output-dir {str(held_b)!r} already holds a run"),
        # files the run reads
        ("symlink loop", ["--model-path", loop, *flux], {}, "transformer/config.json: cannot be read (Too many levels"),
        ("header shapes", ["--model-path", reshaped, *flux], {}, "but its range holds"),
        ("jsonl height 17", [*tiny, "--prompts", str(jsonl17)], {}, f"{jsonl17}:2: prompt shape 17x16: height 17"),
        ("reward model folder", [*tiny, "--reward", "clip_score", "--reward-model", "clip_score=/no/such/clip"], {},
         "--reward-model clip_score=/no/such/clip: no such folder"),
        ("reward service token file", [*tiny, "--reward", "http://127.0.0.1:9/rule_aesthetic"],
         {"DIGENRL_REWARD_TOKEN_FILE": "/no/such/token"},
         "DIGENRL_REWARD_TOKEN_FILE='/no/such/token': cannot read the reward service token"),
        # what a resume continues from
        ("resume mislabelled", [*TINY, "--steps", "6", "--resume", str(tmp_path / "mislabelled"), "--output-dir", out],
         {}, "step-4 (its manifest.json records step 2, not 4"),
        ("resume another run", [*TINY, "--steps", "6", "--resume", str(tmp_path / "mixed"), "--output-dir", out], {},
         "it was not written by the run in"),
        ("resume seed", [*TINY, "--steps", "4", "--seed", "5", "--resume", str(tmp_path / "run4"), "--output-dir", out],
         {}, "this run changes --seed 0 (this run: 5); resume with --resume-anyway"),
        # found once the model has loaded: exit 2 on every rank, nothing left in the folder
        ("memory budget 0.001", [*TINY, "--memory-budget-gb", "0.00001", "--output-dir", str(tmp_path / "after1")], {},
         "--memory-budget-gb 1e-05: a generator needs"),
        ("weights of the wrong shape", ["--model-path", heads, "--output-dir", str(tmp_path / "after2")], {},
         f"--model-path {heads}: Cannot load"),
        ("gap stages above blocks", [*TINY, "--generators", "5", "--trainers", "1", "--gap-stages", "5",
                                     "--output-dir", str(tmp_path / "after3")], {}, "--gap-stages 5: the model has 4"),
        ("scorer's reward model incomplete", [*TINY, "--scorers", "1", "--reward", "clip_score", "--reward-model",
                                              f"clip_score={empty}", "--output-dir", str(tmp_path / "after4")], {},
         f"reward 'clip_score': model folder {str(empty)!r} is incomplete"),
    ]
    if not torch.cuda.is_available():
        cases.append(("cuda on a CPU build", [*tiny, "--device", "cuda"], {}, "--device cuda, but this torch"))
    return cases + issue39 + _issue_41_cases(tmp_path, tiny) + _topology_and_shape_cases(tmp_path, tiny)


def _topology_and_shape_cases(tmp_path, tiny):
    """Roles that do not add up to the world, a mode or reward that does not exist, a prompt shape or
    a size the model cannot take, a user's reward that returns the wrong number of scores."""
    bad_shape = tmp_path / "bad_shape.jsonl"
    bad_shape.write_text('{"prompt": "a red circle"}\n{"prompt": "two blue squares", "width": 30}\n')
    at = tiny.index("--reward")
    no_reward = tiny[:at] + tiny[at + 2:]
    user = os.path.join("tests", "fixtures", "user_rewards.py")
    return [
        ("roles above the world", [*tiny, "--generators", "2", "--trainers", "2"], {},
         "--generators 2 + --trainers 2 + --scorers 0 = 4, but the world size is 3"),
        ("colocated with generators", [*tiny, "--mode", "colocated", "--generators", "1"], {},
         "--mode colocated gives every rank both roles"),
        ("mode sideways", [*tiny, "--mode", "sideways"], {}, "unknown mode 'sideways'"),
        ("reward nonexistent", [*tiny, "--reward", "nonexistent"], {}, "nonexistent"),
        ("eval samples 0", [*tiny, "--eval-every", "1", "--eval-samples-per-prompt", "0"], {},
         "--eval-samples-per-prompt must be >= 1, got 0"),
        ("jsonl width 30", [*tiny, "--prompts", str(bad_shape)], {},
         f"{bad_shape}:2: prompt shape 16x30: width 30 must be a positive multiple of 4"),
        ("wan height 480", ["--model", "wan", "--preset", "tiny", "--height", "480", "--steps", "1", "--eval-every",
                            "0", "--output-dir", str(tmp_path / "out")], {},
         "--height/--width/--num-frames: height 480 gives 60 patches, above the rotary table's 32 for 'wan'"),
        ("user reward's score count", [*no_reward, "--reward", f"{user}:wrong_count"], {},
         f"--reward {user}:wrong_count: returned (3,) scores for 2 images"),
    ]


def _issue_41_cases(tmp_path, tiny):
    """The LoRA a user brings (--init-lora) and the wandb flags (issue 41): a LoRA of another family
    (wan) is found once the model has loaded; the rest before anything loads."""
    from peft import LoraConfig, get_peft_model

    from models import load_model

    wan_lora = str(tmp_path / "wan_lora")
    get_peft_model(load_model("wan", preset="tiny").transformer,
                   LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k"])).save_pretrained(wan_lora)
    return [
        ("init-lora missing", [*tiny, "--init-lora", "/no/such/lora"], {},
         "--init-lora '/no/such/lora': no such file or folder"),
        ("init-lora full fine-tune", [*tiny, "--lora-rank", "0", "--init-lora", wan_lora], {},
         "it starts LoRA training, and --lora-rank 0 means full fine-tuning"),
        ("wandb flags alone", [*tiny, "--wandb-tags", "a,b"], {}, "--wandb-tags without --wandb PROJECT"),
        ("wandb mode", [*tiny, "--wandb", "proj"], {"WANDB_MODE": "ofline"}, "WANDB_MODE='ofline' is not a mode"),
        ("init-lora of another model", [*TINY, "--init-lora", wan_lora, "--output-dir", str(tmp_path / "after5")], {},
         "are not linear layers of FluxTransformer2DModel"),
    ]


def _issue_39_cases(tmp_path, lora4, out, tiny):
    """Files that block or lie (issue 39): a FIFO for prompts, a prompt whose timestep shift
    overflows, a resume over a metrics.jsonl that is not UTF-8, over changed model bytes, from a
    live run's unpinned checkpoint and through a bind mount with --overwrite, prompt embeddings of
    another model of the family (other dimensions; the same dimensions, other weights)."""
    from scripts import encode_prompts
    from test_model_bytes import ENCODER, TRANSFORMER, noise

    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.jsonl"
    huge.write_text('{"prompt": "a red circle"}\n{"prompt": "a blue square", "height": 65536, "width": 65536}\n')
    latin = tmp_path / "latin_metrics"
    _fake_run(str(latin), 2, lora4)
    (latin / "metrics.jsonl").write_bytes(b'{"step": 0}\n{"step": 1, "note": "caf\xe9"}\n')
    changed = _model_copy(tmp_path, "changed_model", lambda d: None)
    _fake_run(str(tmp_path / "run_m"), 2, {**lora4, "model": {**lora4["model"], "model_path": changed},
                                           "run": {"id": "run-m", "model_digest": folder_digest(changed)}})
    noise(os.path.join(changed, TRANSFORMER))
    source = tmp_path / "live_source"
    _fake_run(str(source), 2, lora4)
    (source / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "job": "another job",
                                           "since": "now", "start_ticks": _start_ticks(os.getpid())}))
    alias = tmp_path / "alias"  # a bind mount of run4 (a symlink where mounting is refused)
    alias.mkdir()
    if subprocess.run(["mount", "--bind", str(tmp_path / "run4"), str(alias)], capture_output=True).returncode:
        alias.rmdir()
        alias.symlink_to(tmp_path / "run4")
    prompts = tmp_path / "one_prompt.txt"
    prompts.write_text("a red circle\n")
    embeds_file = str(tmp_path / "shipped.safetensors")
    encode_prompts.main(["--model-path", SHIPPED, "--prompts", str(prompts), "--out", embeds_file])
    other_encoder = _model_copy(tmp_path, "other_encoder", lambda d: noise(str(d / ENCODER)))
    return [
        ("prompts a FIFO", [*tiny, "--prompts", str(fifo)], {}, f"prompt file {str(fifo)!r} is a FIFO (named pipe), "
                                                                f"not a regular file"),
        ("jsonl shift overflows", [*tiny, "--prompts", str(huge)], {},
         f"{huge}:2: prompt shape 65536x65536: its timestep shift overflows at 268435456 image tokens"),
        ("metrics not utf-8", [*TINY, "--steps", "4", "--resume", str(latin), "--output-dir", str(latin)], {},
         f"{latin}/metrics.jsonl: line 2 holds the byte 0xe9, not UTF-8"),
        ("resume over changed model bytes", ["--model-path", changed, "--steps", "4", "--resume", str(tmp_path / "run_m"),
                                             "--output-dir", out], {},
         f"other base model bytes: {TRANSFORMER} changed in --model-path {changed} since the checkpoint"),
        ("resume a live run's unpinned checkpoint", [*TINY, "--steps", "4", "--resume", str(source), "--output-dir",
                                                    out], {}, f"is the folder of a live run, pid {os.getpid()} on host"),
        ("overwrite through an alias", [*TINY, "--steps", "4", "--resume", str(alias), "--overwrite", "--output-dir",
                                        str(tmp_path / "run4")], {},
         f"--overwrite would delete the checkpoints --resume {str(alias)!r} continues from"),
        ("prompt embeds, other dimensions", [*tiny, "--prompt-embeds", embeds_file], {},
         f"was encoded by the text encoders of {SHIPPED} (prompt_embeds 64x64, pooled 32), not by the tiny preset"),
        ("prompt embeds, other weights", ["--model-path", other_encoder, "--output-dir", out, "--prompt-embeds",
                                          embeds_file], {}, f"the run's; {ENCODER} changed"),
    ]


WORLDS = {"gap stages above blocks": 6,  # 5 generators as one 5-stage replica: more stages than 4 blocks
          "roles above the world": 3,
          "scorer's reward model incomplete": 3}  # only the scorer loads it: the others learn of it


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bad")
    cases = _cases(tmp_path)
    others = {p: _digest(p) for p in (tmp_path / "held", tmp_path / "held_b", tmp_path / "live", tmp_path / "run4",
                                      tmp_path / "live_source", tmp_path / "latin_metrics")}
    try:
        got = run_cases([{"name": n, "argv": argv, "env": env, "world": WORLDS.get(n, 2)} for n, argv, env, _ in cases])
    finally:
        if not (tmp_path / "alias").is_symlink():  # a bind mount (os.path.ismount cannot tell one of a folder)
            subprocess.run(["umount", str(tmp_path / "alias")], check=True)
    changed = [str(p) for p, digest in others.items() if _digest(p) != digest]
    left = {n: sorted(os.listdir(tmp_path / f"after{i}")) for i, n in enumerate(AFTER_LOAD, 1)
            if (tmp_path / f"after{i}").is_dir()}
    seconds = [max(r["seconds"] for r in got[n]["ranks"]) for n in got]
    print(f"\nbad inputs: {len(got)} cases, every rank gone within {min(seconds):.1f} to {max(seconds):.1f} s")
    return {name: (got[name], text) for name, _, _, text in cases}, changed, left


def test_at_least_25_cases(results):
    assert len(results[0]) >= 25


def test_every_case_exits_2_on_every_rank_in_time_naming_the_value(results):
    failures = []
    for name, (result, text) in results[0].items():
        codes = [r["code"] for r in result["ranks"]]
        seconds = max(r["seconds"] for r in result["ranks"])
        errors = [line for r in result["ranks"] for line in r["stderr"].splitlines() if line.startswith("error:")]
        if set(codes) != {2} or seconds > BOUND_S or not errors or not any(text in line for line in errors):
            failures.append(f"{name}: codes {codes}, {seconds:.1f} s, error lines {errors}")
        elif any("Traceback" in r["stderr"] for r in result["ranks"]):
            failures.append(f"{name}: a traceback besides the one line")
    assert not failures, "\n".join(failures)


def test_no_case_touches_another_runs_folder_and_a_failed_load_leaves_nothing(results):
    """The reproduce command with a config.json that carried --overwrite, --overwrite of a live run:
    the other runs' folders are byte for byte as they were. A user error found after the model
    loaded leaves neither config.json nor the lock: the corrected command finds an empty folder."""
    _, changed, left = results
    assert not changed
    assert len(left) == len(AFTER_LOAD), left  # rank 0 took the folder's lock: it got past every earlier check
    assert all(not set(names) & (set(RUN_ENTRIES) | {LOCK}) for names in left.values()), left
