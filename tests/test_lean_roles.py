"""Lean roles and mixed precision (docs/DESIGN.md, "What each role holds"): what each role loads and
holds, the start-up probe, autocast without a weight cache, checksums from shards, precomputed
prompt embeddings, the attention check of masked families, tiled video decoding, and the FSDP2
mixed-precision trainers with their publication across ranks."""
import json

import pytest
import torch

from config.preflight import check_choices
from config.schema import RunConfig
from config.validate import validate
from models import autocast, load_model
from parallel.checksums import checksum, checksum_sums, fold
from parallel.topology import ProcessGroups
from prompts import embeds
from rl import sampler
from runtime import context, probe
from lab.launch import torchrun_module
from telemetry.tracing import Slowdown


def test_autocast_casts_to_the_compute_dtype_and_caches_no_weight():
    """bf16 autocast keeps no cached cast of the float32 weights (a bf16 copy of every weight the
    block touched, for as long as it runs); float32 runs no autocast at all."""
    cpu = torch.device("cpu")
    with autocast(cpu, "bfloat16"):
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    with autocast(cpu, "auto"):  # auto is float32 on a CPU
        assert not torch.is_autocast_enabled("cpu")


def _config(tmp_path, *flags):
    cfg = RunConfig()
    cfg.model.preset, cfg.model.dtype, cfg.optim.lora_rank = "tiny", "bfloat16", 0
    cfg.output.output_dir, cfg.output.eval_every = str(tmp_path / "run"), 0
    cfg.sampling.height = cfg.sampling.width = 16
    cfg.rl.micro_batch = 2
    for flag in flags:
        section, name, value = flag
        setattr(getattr(cfg, section), name, value)
    cfg.resolve_defaults()
    return cfg


def test_each_role_holds_what_it_runs(tmp_path):
    """Disaggregated, 1 generator + 1 trainer: the generator holds the transformer frozen in the
    compute dtype, its text encoders and VAE; the trainer float32 trained weights and neither text
    encoder nor VAE (it neither generates nor evaluates). Neither probe leaves a gradient, and the
    generator's runs no backward at all."""
    cfg = _config(tmp_path, ("model", "model", "flux"), ("topology", "placement", "fixed"))  # the flags' 1 + 1
    facts = validate(cfg, 2)
    assert facts.topology.generator_ranks == (0,) and facts.topology.trainer_ranks == (1,)
    gen, _ = context.make_context(cfg, facts, 0, ProcessGroups(trainers=None))
    params = list(gen.adapter.transformer.parameters())
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in params)
    assert gen.adapter.holds("vae") and all(gen.adapter.holds(n) for n in gen.adapter.text_encoders())
    trainer, _ = context.make_context(cfg, facts, 1, ProcessGroups(trainers=None))
    assert all(p.dtype == torch.float32 for p in trainer.adapter.transformer.parameters())
    assert not trainer.adapter.holds("vae") and not any(trainer.adapter.holds(n) for n in trainer.adapter.text_encoders())
    with pytest.raises(RuntimeError, match="released its text encoders"):
        trainer.adapter.encode_prompts(["a red circle"])
    cond = gen.adapter.encode_prompts(["", ""])
    amp = lambda: autocast(gen.device, cfg.model.dtype)  # noqa: E731
    assert set(probe.probe_speed(gen.adapter, gen.sampling, 2, Slowdown(), amp, training=False, cond=cond)) == \
        {"generate_s"}
    assert all(p.grad is None for p in params)
    trainer.adapter.transformer.requires_grad_(True)
    speeds = probe.probe_speed(trainer.adapter, trainer.sampling, 2, Slowdown(), amp, training=True, cond=cond)
    assert set(speeds) == {"generate_s", "train_s"}
    assert all(p.grad is None for p in trainer.adapter.transformer.parameters())


def test_what_ranks_release():
    """Text encoders where prompts are encoded (a replica's first stage; trainers that generate or
    evaluate), the VAE where samples are decoded (its last stage; the same trainers), neither on a
    scorer, no text encoder anywhere with --prompt-embeds."""
    def released(rank, *flags, world=4, evaluate=False, embeddings=None):
        cfg = RunConfig()
        cfg.model.preset, cfg.output.eval_every = "tiny", (10 if evaluate else 0)
        for section, name, value in flags:
            setattr(getattr(cfg, section), name, value)
        cfg.resolve_defaults()
        facts = validate(cfg, world)
        cfg.model.prompt_embeds = embeddings  # (validate would read the file)
        return set(context.released_components(cfg, facts, rank))

    text = {"text_encoder", "text_encoder_2", "text_encoder_3"}
    gap = [("topology", "generators", 2), ("topology", "trainers", 1), ("topology", "scorers", 1),
           ("topology", "gap_stages", 2)]
    assert released(0, *gap) == {"vae"}  # stage 0 encodes, the last stage decodes
    assert released(1, *gap) == text
    assert released(2, *gap) == text | {"vae"}  # a trainer that neither generates nor evaluates
    assert released(2, *gap, evaluate=True) == set()
    assert released(3, *gap) == text | {"vae"}  # the scorer
    assert released(2, ("topology", "generators", 2), ("topology", "trainers", 2), ("topology", "tag", True)) == set()
    assert released(0, world=2, embeddings="embeds.safetensors") == text


def test_shard_checksums_add_up_to_the_whole():
    """Pieces of a tensor starting at any element (FSDP shards: float32 rows, bf16 with odd rows)
    give sums that fold into the whole tensor's checksum, so trainers checksum their shards."""
    g = torch.Generator().manual_seed(0)
    for t in (torch.randn(7, 5, generator=g), torch.randn(9, 3, generator=g).to(torch.bfloat16),
              torch.randn(11, generator=g).to(torch.bfloat16)):
        flat = t.reshape(-1)
        for cuts in ([], [5], [3, 4, 10], [1, 2, 3]):
            bounds = [0, *cuts, flat.numel()]
            lo = hi = 0
            for a, b in zip(bounds, bounds[1:]):
                piece = checksum_sums(flat[a:b].clone(), a)
                lo, hi = lo + piece[0], hi + piece[1]
            assert fold(lo, hi, t.numel() * t.element_size()) == checksum(t), (t.dtype, cuts)
    changed = torch.randn(7, 5, generator=g)
    assert checksum(changed) != checksum(changed + 1e-6)


def test_precomputed_prompt_embeddings_equal_the_encoders(tmp_path):
    """scripts/encode_prompts.py's file gives, batch by batch, exactly the text encoders' output;
    preflight names a prompt it lacks and a file of another family."""
    from scripts import encode_prompts

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\ntwo blue squares above a green triangle\n")
    out = tmp_path / "embeds.safetensors"
    assert encode_prompts.main(["--model", "flux", "--prompts", str(prompts), "--out", str(out)]) == 0
    adapter = load_model("flux", preset="tiny", seed=0)
    batch = ["two blue squares above a green triangle", "", "a red circle"]
    cache = embeds.PromptEmbeddings(str(out), adapter.max_sequence_length)
    got, want = cache.lookup(batch), adapter.encode_prompts(batch)
    assert got.tensors.keys() == want.tensors.keys()
    assert all(torch.equal(got.tensors[k], want.tensors[k]) for k in want.tensors)
    embeds.check(str(out), "flux", batch)
    with pytest.raises(ValueError, match="lacks 1 of the run's prompts, e.g. 'a yellow star'"):
        embeds.check(str(out), "flux", [*batch, "a yellow star"])
    with pytest.raises(ValueError, match="holds 'flux' embeddings, the run's model is 'wan'"):
        embeds.check(str(out), "wan", batch)
    adapter.prompt_cache = cache
    assert torch.equal(adapter.encode_prompts(batch).tensors["pooled"], want.tensors["pooled"])


@pytest.mark.parametrize("model,backend,family", [("hunyuan_video", "flash", "hunyuan_video"),
                                                  ("hunyuan_video", "sage", "hunyuan_video"),
                                                  ("qwen_image", "flash", "qwen_image"),
                                                  ("qwen_image", "flash_varlen", "qwen_image")])
def test_flash_attention_is_refused_for_masked_families(model, backend, family):
    cfg = RunConfig()
    cfg.model.model, cfg.model.attention = model, backend
    with pytest.raises(ValueError, match=f"--attention {backend} cannot run '{family}'"):
        check_choices(cfg)


def test_flash_varlen_is_allowed_where_the_mask_keeps_a_key_prefix():
    for model, backend in (("hunyuan_video", "flash_varlen"), ("flux", "flash"), ("wan", "flash")):
        cfg = RunConfig()
        cfg.model.model, cfg.model.attention = model, backend
        check_choices(cfg)  # no error: HunyuanVideo's mask is a prefix of [image, text]; FLUX and Wan mask nothing


@pytest.mark.parametrize("family", ["hunyuan_video", "wan"])
def test_video_decoding_is_tiled(family, monkeypatch):
    """The video families decode in tiles (DanceGRPO's vae.enable_tiling()): a sample wider than a
    tile goes through the VAE's tiled decoder; the tiny presets' samples are below a tile."""
    adapter = load_model(family, preset="tiny", seed=0)
    vae = adapter.pipe.vae
    assert vae.use_tiling
    calls = []
    tiled = vae.tiled_decode
    monkeypatch.setattr(vae, "tiled_decode", lambda *a, **k: calls.append(1) or tiled(*a, **k))
    shape = adapter.latent_shape(16, 16)
    adapter.decode(torch.randn(1, *shape))
    assert not calls  # 16 px: one tile, decoded as untiled
    vae.tile_sample_min_height = vae.tile_sample_min_width = 8
    vae.tile_sample_stride_height = vae.tile_sample_stride_width = 4
    video = adapter.decode(torch.randn(1, *shape))
    assert calls and video.shape[-2:] == (16, 16)


def test_fsdp_mixed_precision_trainers_and_their_publication(tmp_path):
    """tests/dist_scripts/lean_fsdp.py on 3 ranks: one FSDP2 root over the units, bf16 forwards,
    float32 gradients, shard checksums equal whole ones, bucket-by-bucket publication into a bf16
    generator (live and staged), the lossy codec on shards equal to it on whole tensors."""
    proc = torchrun_module(3, "tests.dist_scripts.lean_fsdp", [str(tmp_path)], timeout=240, check=False)
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) if (tmp_path / f"rank{r}.json").exists()
               else {"missing": True} for r in range(3)}
    assert proc.returncode == 0, f"{results}\n{proc.stderr[-3000:]}"
    assert len(results[0]) == 10 and len(results[2]) == 4
    assert all(v is True for checks in results.values() for v in checks.values()), results


def test_sampling_steps_read_nothing_from_the_device():
    """The denoising loop fills sigmas on the device and decides nothing from a value read back: a
    row of a packed batch whose std is 0 (CPS's last step) is scored as it is alone, as Flow-GRPO
    scores it."""
    x, v = torch.randn(2, 4), torch.randn(2, 4)
    sigma, sigma_next = torch.tensor([0.5, 0.25]), torch.tensor([0.25, 0.0])
    out = sampler.sde_step(x, v, sigma, sigma_next, sde_type="cps", noise_level=0.5, x_next=x + 0.1)
    for i in range(2):
        alone = sampler.sde_step(x[i:i + 1], v[i:i + 1], sigma[i:i + 1], sigma_next[i:i + 1], sde_type="cps",
                                 noise_level=0.5, x_next=x[i:i + 1] + 0.1)
        assert torch.equal(out.log_prob[i:i + 1], alone.log_prob) and alone.log_prob.item() != 0.0
    ode = sampler.sde_step(x, v, 0.5, 0.25, sde_type="sde", noise_level=0.0, noise=torch.zeros(2, 4))
    assert torch.equal(ode.log_prob, torch.zeros(2))



def _update_difference(a: dict, b: dict, initial: dict) -> float:
    """|a - b| / |a - initial| over all tensors: how far two runs' updates are apart, in units of
    the update."""
    num = sum(((a[n].double() - b[n].double()) ** 2).sum() for n in a) ** 0.5
    den = sum(((a[n].double() - initial[n].double()) ** 2).sum() for n in a) ** 0.5
    return float(num / den)


def test_bf16_modes_train_the_colocated_weights(tmp_path):
    """bf16 compute on CPU, LoRA, 4 prompts per step: a GAP replica of 2 stages with TAG and a scorer
    rank, FSDP2 trainers with TAG, and a run whose generator reads precomputed prompt embeddings and
    offloads nothing it holds (no text encoder at all) end with the colocated run's weights, ratio 1.
    TSP regroups transitions into other forwards, and each forward's weight gradient is rounded to
    bf16 once before the float32 sum (FSDP2 mixed precision), so it agrees within a tolerance: 5% of
    the update after 2 steps here (Adam turns the sign of a near-zero gradient entry into a whole
    step)."""
    from models.lora import apply_lora
    from lab.launch import TINY, torchrun, trained_weights
    from scripts import encode_prompts
    from telemetry.metrics import read_metrics
    from weights import assert_same_weights

    embeddings = tmp_path / "embeds.safetensors"
    encode_prompts.main(["--model", "flux", "--prompts", "data/shapes_train.txt", "--dtype", "bfloat16",
                         "--out", str(embeddings)])
    args = [a if a != "2" or TINY[i - 1] != "--prompts-per-step" else "4" for i, a in enumerate(TINY)]
    args += ["--lora-rank", "4", "--dtype", "bfloat16", "--steps", "2"]
    runs = {"colocated": (2, ["--mode", "colocated"]),
            "gap-tag-scorer": (4, ["--generators", "2", "--gap-stages", "2", "--trainers", "1", "--scorers", "1",
                                   "--tag"]),
            "tag-fsdp": (4, ["--generators", "2", "--trainers", "2", "--tag", "--train-sharding", "fsdp"]),
            "embeds-offload": (2, ["--generators", "1", "--trainers", "1", "--prompt-embeds", str(embeddings),
                                   "--offload-text-encoders"]),
            "tsp-fsdp": (3, ["--generators", "1", "--trainers", "2", "--tsp", "--train-micro-batch", "3",
                             "--train-sharding", "fsdp"])}
    weights, metrics = {}, {}
    for name, (nproc, placement) in runs.items():
        out = tmp_path / name
        torchrun(nproc, [*args, "--output-dir", str(out), *placement], timeout=600)
        weights[name], metrics[name] = trained_weights(str(out), 2), read_metrics(str(out / "metrics.jsonl"))
    initial = load_model("flux", seed=0)
    apply_lora(initial.transformer, 4, None, "attn", seed=0)
    start = {n: p.detach() for n, p in initial.transformer.named_parameters() if n in weights["colocated"]}
    for name in runs:
        assert all(r["train/ratio"] == 1.0 for r in metrics[name]), name
        if name == "tsp-fsdp":
            assert _update_difference(weights[name], weights["colocated"], start) < 0.15
            continue
        assert_same_weights(weights["colocated"], weights[name], name)
        assert [r["reward/mean"] for r in metrics[name]] == [r["reward/mean"] for r in metrics["colocated"]], name
