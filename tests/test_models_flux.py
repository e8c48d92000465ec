"""FLUX.1 adapter: the embed / blocks / head split equals diffusers' forward, values and gradients."""
import pytest
import torch

from models import load_model, set_attention


@pytest.fixture(scope="module")
def flux():
    return load_model("flux")


def _inputs(flux, prompts):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(prompts), *flux.latent_shape(16, 16), generator=g)
    return x, torch.tensor([0.9, 0.25][: len(prompts)]), flux.encode_prompts(prompts)


def test_split_equals_model_forward(flux):
    x, sigma, cond = _inputs(flux, ["a red circle", "three yellow squares on the right"])
    with torch.no_grad():
        assert torch.equal(flux.velocity(x, sigma, cond), flux.reference_velocity(x, sigma, cond))
        assert torch.equal(flux.velocity(x, sigma, cond, 5.0), flux.reference_velocity(x, sigma, cond, 5.0))


def test_split_gradients_equal_model_gradients(flux):
    x, sigma, cond = _inputs(flux, ["a red circle", "a blue square"])
    grads = []
    for fn in (flux.velocity, flux.reference_velocity):
        flux.transformer.zero_grad()
        fn(x, sigma, cond).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in flux.transformer.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-6, atol=1e-7, msg=name)
    flux.transformer.zero_grad()


def test_conditioning_slices_and_concatenates(flux):
    cond = flux.encode_prompts(["a", "b", "c"])
    both = type(cond).cat([cond.select([0]), cond.select(slice(1, 3))])
    for k in cond.tensors:
        assert torch.equal(both.tensors[k], cond.tensors[k])


def test_decode_range_and_shape(flux):
    images = flux.decode(torch.randn(2, *flux.latent_shape(16, 16)))
    assert images.shape == (2, 3, 16, 16) and images.min() >= 0 and images.max() <= 1


def test_attention_backend_errors(flux):
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        set_attention(flux, "fast")
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ValueError, match="pip install flash-attn --no-build-isolation"):
            set_attention(flux, "flash")


def test_model_folder_carries_its_sampling_defaults(flux, tmp_path):
    """digenrl.json in a model folder overrides the family's defaults (the shipped model is 32x32)."""
    import json

    shipped = load_model("flux", "assets/shapes-flux")
    assert (shipped.defaults.height, shipped.defaults.width, shipped.defaults.num_steps) == (32, 32, 10)
    flux.save_pretrained(str(tmp_path / "m"))
    assert load_model("flux", str(tmp_path / "m")).defaults == type(flux).defaults
    (tmp_path / "m" / "digenrl.json").write_text(json.dumps({"sampling": {"hieght": 64}}))
    with pytest.raises(ValueError, match=r"unknown sampling default\(s\) \['hieght'\]"):
        load_model("flux", str(tmp_path / "m"))
