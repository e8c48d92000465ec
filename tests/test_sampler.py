"""The sampler against float64 formulas, diffusers' own FluxPipeline, and placement invariance."""
import math

import pytest
import torch
from diffusers import FluxPipeline

from scripts import sample as sample_script
from rl import sampler
from rl import seeding
from models import load_model


@pytest.fixture(scope="module")
def flux():
    return load_model("flux")


def _reference_log_prob(x, v, s, s_next, x_next, sde_type, a):
    """docs/ALGORITHMS.md evaluated in float64, written independently of sampler.sde_step."""
    x, v, x_next = x.double(), v.double(), x_next.double()
    s = torch.tensor(s, dtype=torch.float64)
    s_next = torch.tensor(s_next, dtype=torch.float64)
    dt = s_next - s
    if sde_type == "sde":
        denom_sigma = s_next if s == 1 else s
        std_t = a * torch.sqrt(s / (1 - denom_sigma))
        mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        std = std_t * torch.sqrt(-dt)
    elif sde_type == "dance":
        x0 = x - s * v
        score = -(x - (1 - s) * x0) / s**2
        mean = x + dt * v - 0.5 * a**2 * score * dt
        std = a * torch.sqrt(-dt)
    else:
        std_c = s_next * math.sin(a * math.pi / 2)
        mean = (1 - s_next) * (x - s * v) + torch.sqrt(s_next**2 - std_c**2) * (x + (1 - s) * v)
        return (-((x_next - mean) ** 2)).flatten(1).mean(1)
    lp = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(1)


@pytest.mark.parametrize("sde_type,a", [("sde", 0.7), ("sde", 1.2), ("cps", 0.7), ("dance", 0.3)])
@pytest.mark.parametrize("s,s_next", [(1.0, 0.9), (0.6, 0.45), (0.2, 0.05)])
def test_log_prob_matches_float64_formula(sde_type, a, s, s_next):
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 4, 6, 6, generator=g), torch.randn(3, 4, 6, 6, generator=g)
    eps = torch.randn(3, 4, 6, 6, generator=g)
    out = sampler.sde_step(x, v, s, s_next, sde_type=sde_type, noise_level=a, noise=eps)
    ref = _reference_log_prob(x, v, s, s_next, out.x_next, sde_type, a)
    torch.testing.assert_close(out.log_prob.double(), ref, rtol=1e-5, atol=1e-5)
    # Scoring the stored x' (training) gives the same log-prob as sampling it (rollout).
    rescored = sampler.sde_step(x, v, s, s_next, sde_type=sde_type, noise_level=a, x_next=out.x_next)
    assert torch.equal(rescored.log_prob, out.log_prob)
    # A per-sample sigma vector (TSP packing) gives the same numbers as a scalar.
    vec = sampler.sde_step(x, v, torch.full((3,), s), torch.full((3,), s_next), sde_type=sde_type,
                           noise_level=a, x_next=out.x_next)
    assert torch.equal(vec.log_prob, out.log_prob)


def test_log_prob_gradient_flows_through_velocity_only():
    x = torch.randn(2, 4, 4, 4)
    v = torch.randn(2, 4, 4, 4, requires_grad=True)
    out = sampler.sde_step(x, v, 0.5, 0.4, sde_type="sde", noise_level=0.7, noise=torch.randn_like(x))
    assert not out.x_next.requires_grad
    out.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0


def test_zero_noise_is_the_euler_step():
    x, v = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4)
    for sde_type in sampler.SDE_TYPES:
        out = sampler.sde_step(x, v, 0.8, 0.6, sde_type=sde_type, noise_level=0.0, noise=torch.randn_like(x))
        torch.testing.assert_close(out.x_next, x + v * (0.6 - 0.8))


def test_bad_step_arguments():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown sde type 'ode'"):
        sampler.sde_step(x, x, 0.5, 0.4, sde_type="ode", noise_level=0.7, noise=x)
    with pytest.raises(ValueError, match="noise level must be >= 0, got -0.1"):
        sampler.sde_step(x, x, 0.5, 0.4, sde_type="sde", noise_level=-0.1, noise=x)


def test_dance_and_static_schedules(flux):
    sched = sampler.flow_scheduler(flux)
    dance = sampler.make_sigmas(sched, 8, "dance", shift=3.0)
    lin = torch.linspace(1, 0, 9, dtype=torch.float64)
    torch.testing.assert_close(dance.double(), 3 * lin / (1 + 2 * lin), rtol=1e-6, atol=1e-6)
    static = sampler.make_sigmas(sched, 8, "static", shift=3.0)
    assert static[0] == 1 and static[-1] == 0 and bool((static[:-1] > static[1:]).all())


def test_ode_rollout_matches_flux_pipeline(flux):
    """Noise level 0 must reproduce diffusers' own FluxPipeline on the same transformer and latent."""
    cfg = sampler.SamplingConfig.for_adapter(flux, height=32, width=32, num_steps=6, noise_level=0.0, seed=3)
    prompts = ["a red circle", "two blue squares on the left"]
    cond = flux.encode_prompts(prompts)
    traj = sampler.denoise(flux, cond, None, [0, 1], step=0, cfg=cfg)
    shape = flux.latent_shape(32, 32)
    x0 = traj.latents[:, 0]
    packed = FluxPipeline._pack_latents(x0, 2, *shape)
    pipe = flux.pipe
    out = pipe(prompt=prompts, height=32, width=32, num_inference_steps=6, guidance_scale=cfg.guidance,
               latents=packed, output_type="latent", max_sequence_length=flux.max_sequence_length).images
    ref = FluxPipeline._unpack_latents(out, 32, 32, pipe.vae_scale_factor)
    ours = traj.latents[:, -1]
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-4, rel
    torch.testing.assert_close(pipe.scheduler.sigmas.float(), traj.sigmas)


def test_trajectory_independent_of_batch_and_order(flux):
    cfg = sampler.SamplingConfig.for_adapter(flux, height=16, width=16, num_steps=4, seed=11)
    prompts = ["a red circle", "a green square", "three blue triangles", "a cyan circle on the top"]
    batch = sampler.denoise(flux, flux.encode_prompts(prompts), None, [10, 11, 12, 13], step=2, cfg=cfg)
    order = [3, 1, 0, 2]
    shuffled = sampler.denoise(flux, flux.encode_prompts([prompts[i] for i in order]), None,
                               [10 + i for i in order], step=2, cfg=cfg)
    for j, i in enumerate(order):
        alone = sampler.denoise(flux, flux.encode_prompts([prompts[i]]), None, [10 + i], step=2, cfg=cfg)
        torch.testing.assert_close(alone.latents[0], batch.latents[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(shuffled.latents[j], batch.latents[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(alone.log_probs[0], batch.log_probs[i], atol=1e-5, rtol=1e-5)
    # Another step or seed gives other noise.
    other = sampler.denoise(flux, flux.encode_prompts(prompts[:1]), None, [10], step=3, cfg=cfg)
    assert not torch.allclose(other.latents[0, 0], batch.latents[0, 0])


def test_noise_depends_on_key_only():
    a = seeding.initial_noise(1, 2, 3, (4, 5))
    assert torch.equal(a, seeding.initial_noise(1, 2, 3, (4, 5)))
    assert not torch.equal(a, seeding.initial_noise(1, 2, 4, (4, 5)))
    assert not torch.equal(a, seeding.step_noise(1, 2, 3, 0, (4, 5)))
    assert seeding.derive_seed(1, 2, 3) == seeding.derive_seed(1, 2, 3) != seeding.derive_seed(1, 3, 2)


def test_sample_cli_writes_pngs_and_trajectory(tmp_path):
    out = tmp_path / "out"
    traj_path = tmp_path / "traj.safetensors"
    code = sample_script.main(["--model", "flux", "--preset", "tiny", "--prompt", "a red circle", "--prompt", "a blue square",
                         "--prompt", "two green triangles", "--height", "16", "--width", "16", "--sample-steps", "3",
                         "--batch-size", "2", "--out-dir", str(out), "--save-trajectory", str(traj_path)])
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["0000.png", "0001.png", "0002.png"]
    from PIL import Image
    from safetensors.torch import load_file

    assert Image.open(out / "0000.png").size == (16, 16)
    t = load_file(str(traj_path))
    assert t["latents"].shape == (3, 4, 4, 8, 8) and t["latents"].dtype == torch.float32
    assert t["sigmas"].shape == (4,) and t["log_probs"].shape == (3, 3)
    assert torch.isfinite(t["log_probs"]).all()


def test_sample_cli_honours_each_prompts_shape_in_prompt_order(tmp_path):
    """A mixed-shape .jsonl samples each prompt at its own shape (the run's --height/--width for a
    prompt without one), in batches of one shape, and writes prompt j to j.png with the noise of
    sample id j: the same image as sampling that prompt alone at its shape with that id."""
    import json
    import numpy as np
    from PIL import Image
    from safetensors.torch import load_file
    from prompts.resolutions import sampling_for
    from rollout import sample_images

    rows = [{"prompt": "a red circle", "height": 16, "width": 32}, {"prompt": "a blue square"},
            {"prompt": "two green triangles", "height": 32, "width": 16}, {"prompt": "a cyan circle", "height": 16,
                                                                           "width": 32}]
    prompts = tmp_path / "mixed.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, traj = tmp_path / "out", tmp_path / "traj.safetensors"
    common = ["--model", "flux", "--preset", "tiny", "--height", "16", "--width", "16", "--sample-steps", "2"]
    assert sample_script.main([*common, "--prompts", str(prompts), "--batch-size", "4", "--out-dir", str(out),
                               "--save-trajectory", str(traj)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["0000.png", "0001.png", "0002.png", "0003.png"]
    sizes = [Image.open(out / f"{j:04d}.png").size for j in range(4)]  # PIL: (width, height)
    assert sizes == [(32, 16), (16, 16), (16, 32), (32, 16)]
    t = load_file(str(traj))
    assert t["sample_ids/16x32"].tolist() == [0, 3] and t["latents/32x16"].shape[:2] == (1, 3)
    cfg, _ = sample_script.parse_args([*common, "--prompt", "x"])
    adapter = load_model("flux", preset="tiny", seed=cfg.seed)
    base = sampler.SamplingConfig.for_adapter(adapter, height=16, width=16, num_steps=2, seed=cfg.seed)
    _, alone = sample_images(adapter, ["a cyan circle"], sampling_for(base, (16, 32, None)), sample_ids=[3])
    expected = (alone[0].clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)
    assert torch.equal(torch.from_numpy(np.array(Image.open(out / "0003.png"))), expected)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n" + json.dumps({"prompt": "y", "height": 18}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: prompt shape 18x16"):
        sample_script.main([*common, "--prompts", str(bad), "--out-dir", str(tmp_path / "never")])
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("argv,message", [
    (["--model", "flx"], "unknown model 'flx'"),
    (["--model-path", "/no/such/folder"], "/no/such/folder"),
    (["--height", "18", "--width", "16"], "height 18"),
    (["--noise-level", "-0.5"], "noise level must be >= 0, got -0.5"),
])
def test_cli_bad_inputs(argv, message):
    with pytest.raises(ValueError, match=message):
        sample_script.main(["--preset", "tiny", "--prompt", "a red circle", "--sample-steps", "2", *argv])


def test_folder_missing_a_component(flux, tmp_path):
    flux.save_pretrained(str(tmp_path / "m"))
    assert load_model("flux", str(tmp_path / "m")).latent_shape(16, 16) == (4, 8, 8)
    import shutil

    shutil.rmtree(tmp_path / "m" / "text_encoder_2")
    with pytest.raises(ValueError, match=r"missing component\(s\) \['text_encoder_2'\]"):
        sample_script.main(["--prompt", "a", "--model-path", str(tmp_path / "m")])
