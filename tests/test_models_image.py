"""Qwen-Image and SD3.5 adapters on their tiny presets: the embed / blocks / head split against the
diffusers forward (values and gradients), a CFG rollout against the diffusers pipeline, save / load, folder
checks, shapes, decode and batch independence."""
import shutil

import pytest
import torch

import models
from rl import sampler
from models.adapter import Conditioning

FAMILIES = ["qwen_image", "sd3"]
PROMPTS = ["a red cube", "a small dog on a long wooden bench"]  # different lengths: Qwen pads the first


@pytest.fixture(scope="module", params=FAMILIES)
def adapter(request):
    return models.load_model(request.param)


@pytest.fixture(scope="module")
def inputs(adapter):
    torch.manual_seed(0)
    latents = torch.randn(2, *adapter.latent_shape(64, 64))  # (B, C, H, W)
    sigma = torch.tensor([0.3, 0.85])  # per-sample noise levels
    return latents, sigma, adapter.encode_prompts(PROMPTS)


@pytest.fixture(scope="module")
def saved(adapter, tmp_path_factory):
    path = tmp_path_factory.mktemp(adapter.family) / "model"
    adapter.save_pretrained(str(path))
    return path


def test_split_equals_reference_forward(adapter, inputs):
    latents, sigma, cond = inputs
    with torch.no_grad():
        split = adapter.velocity(latents, sigma, cond)
        reference = adapter.reference_velocity(latents, sigma, cond)
    assert split.shape == latents.shape
    assert torch.equal(split, reference)


def test_state_acts_are_tensors_between_every_block(adapter, inputs):
    # Stage boundaries send State.acts: no None (SD3's last block returns no text stream).
    latents, sigma, cond = inputs
    with torch.no_grad():
        state = adapter.embed(latents, sigma, cond)
        for i in range(len(adapter.blocks)):
            state = adapter.run_block(i, state)
            assert all(isinstance(v, torch.Tensor) for v in state.acts.values()), (i, state.acts.keys())
    assert {"hidden", "temb"} <= set(state.acts)


def test_split_gradients_equal_reference(adapter, inputs):
    latents, sigma, cond = inputs
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    weights = torch.randn(latents.shape, generator=torch.Generator().manual_seed(1))

    def grads(velocity_fn):
        x = latents.clone().requires_grad_(True)
        loss = (velocity_fn(x, sigma, cond) * weights).sum()
        return torch.autograd.grad(loss, [x, *params], allow_unused=True)

    split, reference = grads(adapter.velocity), grads(adapter.reference_velocity)
    assert split[0] is not None and any(g is not None for g in split[1:])
    for g_split, g_ref in zip(split, reference):
        assert (g_split is None) == (g_ref is None)
        if g_split is not None:
            assert torch.allclose(g_split, g_ref, rtol=1e-6, atol=1e-6)


def test_save_and_load_round_trip(adapter, inputs, saved):
    latents, sigma, cond = inputs
    loaded = models.load_model(adapter.family, model_path=str(saved))
    reloaded_cond = loaded.encode_prompts(PROMPTS)  # tokenizers and text encoders survive too
    for key, value in cond.tensors.items():
        assert torch.equal(reloaded_cond.tensors[key], value), key
    with torch.no_grad():
        assert torch.equal(loaded.velocity(latents, sigma, cond), adapter.velocity(latents, sigma, cond))


def test_folder_missing_component_is_rejected(adapter, saved, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(ValueError, match="vae"):
        models.load_model(adapter.family, model_path=str(broken))


def test_latent_shape_rejects_bad_height(adapter):
    with pytest.raises(ValueError, match=r"height 70\b"):
        adapter.latent_shape(70, 64)
    with pytest.raises(ValueError, match=r"width -16\b"):
        adapter.latent_shape(64, -16)


def test_image_seq_len(adapter):
    assert adapter.image_seq_len(adapter.latent_shape(64, 128)) == (64 // 16) * (128 // 16)


def test_decode_gives_unit_range_images(adapter, inputs):
    latents = inputs[0]
    images = adapter.decode(latents)
    assert images.shape == (2, 3, 64, 64) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1


def test_sample_does_not_depend_on_batch_neighbour(adapter, inputs):
    latents, sigma, batch_cond = inputs
    alone_cond = adapter.encode_prompts(PROMPTS[:1])
    # Padding from concatenating separately encoded conditionings must be masked out as well.
    concat_cond = Conditioning.cat([alone_cond, adapter.encode_prompts(PROMPTS[1:])])
    with torch.no_grad():
        alone = adapter.velocity(latents[:1], sigma[:1], alone_cond)
        in_batch = adapter.velocity(latents, sigma, batch_cond)
        concatenated = adapter.velocity(latents, sigma, concat_cond)
    assert torch.allclose(alone, in_batch[:1], rtol=0, atol=1e-5)
    assert torch.allclose(alone, concatenated[:1], rtol=0, atol=1e-5)
    assert torch.allclose(in_batch, concatenated, rtol=0, atol=1e-5)


def test_cfg_ode_rollout_matches_pipeline(adapter):
    """Noise level 0 with the family's CFG, sigma schedule and timestep convention must reproduce
    diffusers' own pipeline on the same transformer and initial latent."""
    cfg = sampler.SamplingConfig.for_adapter(adapter, height=64, width=64, num_steps=4, noise_level=0.0, seed=3)
    negative = " "
    cond, neg_cond = adapter.encode_prompts(PROMPTS), adapter.encode_prompts([negative] * len(PROMPTS))
    traj = sampler.denoise(adapter, cond, neg_cond, [0, 1], step=0, cfg=cfg)
    x0 = traj.latents[:, 0]
    common = dict(prompt=PROMPTS, negative_prompt=negative, height=64, width=64, num_inference_steps=cfg.num_steps,
                  output_type="latent", max_sequence_length=adapter.max_sequence_length)
    if adapter.family == "qwen_image":
        packed = type(adapter.pipe)._pack_latents(x0, *x0.shape)
        out = adapter.pipe(true_cfg_scale=cfg.cfg_scale, latents=packed, **common).images
        ref = adapter._unpack(out, x0.shape[1:])
    else:
        ref = adapter.pipe(guidance_scale=cfg.cfg_scale, latents=x0, **common).images
    rel = (traj.latents[:, -1] - ref).norm() / ref.norm()
    assert rel < 1e-5, rel
    torch.testing.assert_close(adapter.pipe.scheduler.sigmas.float(), traj.sigmas)


def test_qwen_prompt_template_is_dropped_exactly(adapter):
    if adapter.family != "qwen_image":
        pytest.skip("Qwen-Image's prompt template only")
    pipe = adapter.pipe
    ids = pipe.tokenizer(pipe.prompt_template_encode.format(PROMPTS[0])).input_ids
    kept = pipe.tokenizer.decode(ids[pipe.prompt_template_encode_start_idx:])
    assert kept.startswith(PROMPTS[0] + "<|im_end|>")
    text_len = adapter.encode_prompts(PROMPTS[:1]).tensors["prompt_embeds"].shape[1]
    assert text_len == len(ids) - pipe.prompt_template_encode_start_idx


def test_sampling_attributes(adapter):
    if adapter.family == "sd3":
        assert adapter.defaults.shift == "static" and adapter.static_shift == 3.0
        assert not adapter.pipe.scheduler.config.use_dynamic_shifting
    else:
        assert adapter.defaults.shift == "dynamic" and getattr(adapter, "static_shift", None) is None
        config = adapter.pipe.scheduler.config
        assert config.use_dynamic_shifting and config.time_shift_type == "exponential"
        assert (config.base_shift, config.max_shift, config.max_image_seq_len) == (0.5, 0.9, 8192)
    assert adapter.defaults.guidance is None and adapter.defaults.cfg_scale > 1
    with pytest.raises(ValueError, match="guidance"):
        adapter.embed(torch.zeros(1, *adapter.latent_shape(32, 32)), torch.ones(1),
                      adapter.encode_prompts(["x"]), guidance=3.5)
