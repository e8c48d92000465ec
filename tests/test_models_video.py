"""Video families (Wan2.1, HunyuanVideo) on their tiny presets: the embed / blocks / head split against
the diffusers forward, gradients, save / load, folder checks, shapes and decode."""
import shutil

import pytest
import torch

import models

FAMILIES = ["wan", "hunyuan_video"]
NUM_FRAMES, HEIGHT, WIDTH = 5, 16, 16  # tiny VAEs: temporal factor 4, spatial factor 4
PROMPTS = ["a red fox jumps over a log", "waves"]


@pytest.fixture(scope="module", params=FAMILIES)
def adapter(request):
    return models.load_model(request.param, seed=0)


def _inputs(adapter, prompts=PROMPTS, seed=0):
    shape = adapter.latent_shape(HEIGHT, WIDTH, NUM_FRAMES)
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn((len(prompts), *shape), generator=g)  # (B, C, F, H, W)
    sigma = torch.tensor([0.9, 0.35])[: len(prompts)]  # (B,) a different noise level per sample
    return latents, sigma, adapter.encode_prompts(prompts)


def test_split_equals_reference_forward(adapter):
    latents, sigma, cond = _inputs(adapter)
    with torch.no_grad():
        split = adapter.velocity(latents, sigma, cond)
        reference = adapter.reference_velocity(latents, sigma, cond)
    assert split.shape == latents.shape
    assert torch.equal(split, reference)


def test_split_gradients_equal_reference_gradients(adapter):
    latents, sigma, cond = _inputs(adapter)
    weight = torch.randn(latents.shape, generator=torch.Generator().manual_seed(1))
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]

    def grads(fn):
        x = latents.clone().requires_grad_(True)
        loss = (fn(x, sigma, cond) * weight).sum()
        return torch.autograd.grad(loss, [x, *params], allow_unused=True)

    split, reference = grads(adapter.velocity), grads(adapter.reference_velocity)
    assert split[0] is not None and split[0].abs().sum() > 0
    for a, b in zip(split, reference):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_save_and_load_round_trip(adapter, tmp_path):
    adapter.save_pretrained(str(tmp_path))
    loaded = models.load_model(adapter.family, model_path=str(tmp_path))
    assert type(loaded) is type(adapter)
    latents, sigma, cond = _inputs(adapter)
    loaded_cond = loaded.encode_prompts(PROMPTS)  # tokenizers and text encoders round-trip too
    for key, value in cond.tensors.items():
        assert torch.equal(loaded_cond.tensors[key], value), key
    with torch.no_grad():
        assert torch.equal(loaded.velocity(latents, sigma, loaded_cond), adapter.velocity(latents, sigma, cond))


def test_folder_missing_a_component_is_rejected(adapter, tmp_path):
    adapter.save_pretrained(str(tmp_path))
    shutil.rmtree(tmp_path / "vae")
    with pytest.raises(ValueError, match="vae"):
        models.load_model(adapter.family, model_path=str(tmp_path))


def test_latent_shape_rejects_sizes_that_do_not_fit(adapter):
    c, f, h, w = adapter.latent_shape(HEIGHT, WIDTH, NUM_FRAMES)
    assert (f, h, w) == (2, 4, 4)
    assert adapter.image_seq_len((c, f, h, w)) == 2 * 2 * 2
    with pytest.raises(ValueError, match="height 18"):
        adapter.latent_shape(18, WIDTH, NUM_FRAMES)
    with pytest.raises(ValueError, match="num_frames 4"):
        adapter.latent_shape(HEIGHT, WIDTH, 4)


def test_decode_gives_video_in_unit_range(adapter):
    latents, _, _ = _inputs(adapter)
    video = adapter.decode(latents)
    assert video.shape == (2, 3, NUM_FRAMES, HEIGHT, WIDTH)
    assert video.dtype == torch.float32
    assert video.min() >= 0 and video.max() <= 1


def test_sample_does_not_depend_on_its_batch_neighbour(adapter):
    latents, sigma, _ = _inputs(adapter)
    alone_cond = adapter.encode_prompts(PROMPTS[:1])
    batch_cond = adapter.encode_prompts([PROMPTS[0], ""])  # an empty neighbour: the shortest possible text
    for key, value in batch_cond.tensors.items():
        assert value.shape[0] == 2, key  # batch-first, masks included
        assert value.shape[1:] == alone_cond.tensors[key].shape[1:], key  # fixed text length, not the longest
    with torch.no_grad():
        alone = adapter.velocity(latents[:1], sigma[:1], alone_cond)
        in_batch = adapter.velocity(latents, sigma, batch_cond)
    assert torch.isfinite(in_batch).all()
    torch.testing.assert_close(in_batch[:1], alone, rtol=0, atol=1e-5)


def test_family_attributes(adapter):
    assert adapter.defaults.shift == "static" and adapter.defaults.num_frames is not None
    assert adapter.static_shift == {"wan": 3.0, "hunyuan_video": 7.0}[adapter.family]
    assert set(adapter.required_components) <= set(adapter.pipe.components)
