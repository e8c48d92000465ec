"""The planner's model specs, derived from the released configs in models/configs/ (JSON only: the
planner imports neither models/ nor torch).

Each released config names its transformer, VAE and text encoders by diffusers / transformers class
and gives their sizes; the formulas below turn those sizes into the parameter split by stream that
planner/specs.py prices (image-token, text-token, per-sample and shared weights per block kind).
tests/test_planner.py checks every spec's parameter counts against models/released.py, which builds
the same configs on the meta device. What a config does not say (sampling steps, VAE decode FLOPs,
the typical text length of a masked encoder) is in `RELEASED`, the spec table keyed by config name.

Select a model as `--model FAMILY [--variant V]` (`--model sd3 --variant large`, `--model wan
--variant 1.3b`) or by its config name (`sd3_5_large`); a family alone is its first variant.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from planner.specs import AuxModel, BlockKind, ModelSpec

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "configs")


@dataclass(frozen=True)
class Released:
    """What the planner needs beyond a released config."""

    variant: str
    name: str
    default_steps: int
    """the model card's sampling steps"""
    guidance_distilled: bool
    """no CFG branch by default (guidance embedding, or timestep distillation: FLUX.1-schnell)"""
    text_tokens: int | None = None
    """text tokens the DiT sees when the encoder masks instead of padding (Qwen-Image: a typical prompt);
    None: the padded length of the config's tokenizers"""
    encoder_tokens: int | None = None
    """tokens the text encoder reads when it masks: the prompt plus its chat template (Qwen-Image drops
    the template's first 34 tokens from what the DiT sees); None: the tokenizer's padded length"""
    notes: str = ""


# Config name -> facts; the first entry of a family is its default variant.
RELEASED = {
    "flux1_dev": Released("dev", "FLUX.1-dev", 28, True),
    "flux1_schnell": Released("schnell", "FLUX.1-schnell", 4, True, notes="timestep-distilled: 4 steps, no CFG"),
    "wan2_1_t2v_14b": Released("14b", "Wan2.1-T2V-14B", 50, False),
    "wan2_1_t2v_1_3b": Released("1.3b", "Wan2.1-T2V-1.3B", 50, False),
    "qwen_image": Released("20b", "Qwen-Image", 50, False, text_tokens=128, encoder_tokens=128 + 34),
    "hunyuan_video": Released("13b", "HunyuanVideo", 50, True),
    "sd3_5_medium": Released("medium", "SD3.5-medium", 40, False),
    "sd3_5_large": Released("large", "SD3.5-large", 28, False),
}

# VAEs by class: parameters (models/released.py on meta; the configs give block widths, not a formula
# this file should repeat) and decode FLOPs per output pixel and frame, measured at one resolution.
VAES = {
    "AutoencoderKL": (83.82e6, 2.5e12 / 512 ** 2),
    "AutoencoderKLWan": (126.89e6, 28e12 / (240 * 416 * 33)),
    "AutoencoderKLQwenImage": (126.89e6, 28e12 / (240 * 416 * 33)),  # Wan's architecture
    "AutoencoderKLHunyuanVideo": (246.48e6, 213e12 / (480 * 480 * 53)),
}
QWEN2_5_VL_PARAMS = 8_292_166_656
"""Qwen-Image's config names its text encoder's class only (transformers' defaults: the 7B language
model plus its vision tower), so its size is this constant (models/released.py on meta)."""


LORA_MATRICES = {"double": 8, "joint": 8, "dual": 12, "last": 7, "single": 4, "wan": 8}
"""D x D attention projections per block kind that LoRA adapts (q, k, v, out of each stream; SD3's
last block has no text out; Wan's self- and cross-attention): rank r adds r x 2D each."""


def lin(i: int, o: int, bias: bool = True) -> int:
    return i * o + (o if bias else 0)


def load_config(name: str) -> dict:
    path = os.path.join(CONFIG_DIR, f"{name}.json")
    with open(path) as f:
        return json.load(f)


# ----- transformers ---------------------------------------------------------------------------

def _mmdit_double(d: int, hd: int, mlp: int, qk: bool) -> BlockKind:
    """A FLUX / Qwen-Image / HunyuanVideo dual-stream block: per stream q, k, v, out, q/k norms and
    an MLP; adaLN modulation Linear(D, 6D) per stream."""
    stream = 4 * lin(d, d) + (2 * hd if qk else 0) + lin(d, mlp * d) + lin(mlp * d, d)
    return BlockKind("double", 0, stream, stream, 2 * lin(d, 6 * d))


def _mmdit_single(d: int, hd: int, mlp: int) -> BlockKind:
    """A single-stream block on image and text tokens alike: fused q, k, v and MLP in, one out."""
    return BlockKind("single", 0, 0.0, 0.0, lin(d, 3 * d),
                     p_shared=3 * lin(d, d) + 2 * hd + lin(d, mlp * d) + lin((mlp + 1) * d, d))


def _n(kind: BlockKind, count: int) -> BlockKind:
    return BlockKind(kind.name, count, kind.p_img, kind.p_txt, kind.p_mod, kind.p_shared, kind.attention)


def _time(d: int, freq: int = 256) -> int:
    return lin(freq, d) + lin(d, d)


def flux(t: dict) -> tuple:
    d, hd = t["num_attention_heads"] * t["attention_head_dim"], t["attention_head_dim"]
    out = t.get("out_channels") or t["in_channels"]
    blocks = (_n(_mmdit_double(d, hd, 4, True), t["num_layers"]), _n(_mmdit_single(d, hd, 4), t["num_single_layers"]))
    extra_mod = _time(d) * (2 if t.get("guidance_embeds") else 1) + lin(t["pooled_projection_dim"], d) + lin(d, d)
    return (d, blocks, lin(t["in_channels"], d) + lin(d, t["patch_size"] ** 2 * out),
            lin(t["joint_attention_dim"], d), extra_mod + lin(d, 2 * d))


def sd3(t: dict) -> tuple:
    """SD3 / SD3.5 MMDiT: dual-attention layers (SD3.5-medium) add an image-only attention and a
    Linear(D, 9D) modulation; the last block reads the text but returns none (no text out, no text MLP)."""
    d, hd = t["num_attention_heads"] * t["attention_head_dim"], t["attention_head_dim"]
    qk = 2 * hd if t.get("qk_norm") else 0
    dual = set(t.get("dual_attention_layers") or ())
    mlp = lin(d, 4 * d) + lin(4 * d, d)
    stream = 4 * lin(d, d) + qk + mlp
    kinds = []
    for i in range(t["num_layers"]):
        last = i == t["num_layers"] - 1
        img = stream + (4 * lin(d, d) + qk if i in dual else 0)
        txt = 3 * lin(d, d) + qk if last else stream
        mod = lin(d, (9 if i in dual else 6) * d) + lin(d, (2 if last else 6) * d)
        kind = BlockKind("dual" if i in dual else "last" if last else "joint", 1, img, txt, mod,
                         attention="dual" if i in dual else "joint")
        if kinds and kinds[-1].name == kind.name:
            kinds[-1] = _n(kinds[-1], kinds[-1].count + 1)
        else:
            kinds.append(kind)
    p, c = t["patch_size"], t["in_channels"]
    extra_img = c * p * p * d + d + lin(d, p * p * t["out_channels"])
    extra_mod = _time(d) + lin(t["pooled_projection_dim"], d) + lin(d, d) + lin(d, 2 * d)
    return d, tuple(kinds), extra_img, lin(t["joint_attention_dim"], t["caption_projection_dim"]), extra_mod


def wan(t: dict) -> tuple:
    """Wan: self-attention and an MLP on video tokens, cross-attention whose keys and values are
    the text's; modulation is a per-block table added to one shared time projection."""
    d = t["num_attention_heads"] * t["attention_head_dim"]
    img = 4 * lin(d, d) + 2 * d + 2 * lin(d, d) + d + (2 * d if t.get("cross_attn_norm") else 0) \
        + lin(d, t["ffn_dim"]) + lin(t["ffn_dim"], d)
    blocks = (BlockKind("wan", t["num_layers"], img, 2 * lin(d, d) + d, 6 * d, attention="cross"),)
    patch = math.prod(t["patch_size"])
    extra_img = t["in_channels"] * patch * d + d + lin(d, t["out_channels"] * patch)
    extra_mod = _time(d, t["freq_dim"]) + lin(d, 6 * d) + 2 * d
    return d, blocks, extra_img, lin(t["text_dim"], d) + lin(d, d), extra_mod


def qwen_image(t: dict) -> tuple:
    d, hd = t["num_attention_heads"] * t["attention_head_dim"], t["attention_head_dim"]
    p, joint = t["patch_size"], t["joint_attention_dim"]
    return (d, (_n(_mmdit_double(d, hd, 4, True), t["num_layers"]),),
            lin(t["in_channels"], d) + lin(d, p * p * t["out_channels"]), joint + lin(joint, d),
            _time(d) + lin(d, 2 * d))


def hunyuan_video(t: dict) -> tuple:
    """HunyuanVideo: FLUX-like double and single blocks, and a token refiner of the text (its own
    self-attention blocks on text tokens, modulated per sample)."""
    d, hd = t["num_attention_heads"] * t["attention_head_dim"], t["attention_head_dim"]
    mlp = int(t.get("mlp_ratio", 4.0))
    blocks = (_n(_mmdit_double(d, hd, mlp, True), t["num_layers"]), _n(_mmdit_single(d, hd, mlp), t["num_single_layers"]))
    p, pt, te, refiners = t["patch_size"], t["patch_size_t"], t["text_embed_dim"], t["num_refiner_layers"]
    extra_img = t["in_channels"] * pt * p * p * d + d + lin(d, pt * p * p * t["out_channels"])
    refiner_txt = lin(te, d) + refiners * (2 * 2 * d + 4 * lin(d, d) + lin(d, 4 * d) + lin(4 * d, d))
    refiner_mod = _time(d) + lin(te, d) + lin(d, d) + refiners * lin(d, 2 * d)
    extra_mod = _time(d) * (2 if t.get("guidance_embeds") else 1) + lin(t["pooled_projection_dim"], d) + lin(d, d) \
        + lin(d, 2 * d)
    return d, blocks, extra_img, refiner_txt, extra_mod + refiner_mod


TRANSFORMERS = {"FluxTransformer2DModel": flux, "SD3Transformer2DModel": sd3, "WanTransformer3DModel": wan,
                "QwenImageTransformer2DModel": qwen_image, "HunyuanVideoTransformer3DModel": hunyuan_video}


# ----- text encoders --------------------------------------------------------------------------

def text_encoder_params(c: dict) -> float:
    """Parameters of a text encoder from its transformers config."""
    kind = c["_class_name"]
    if kind.startswith("CLIPText"):
        h, i = c["hidden_size"], c["intermediate_size"]
        layer = 4 * lin(h, h) + 4 * h + lin(h, i) + lin(i, h)
        proj = h * c["projection_dim"] if kind.endswith("WithProjection") else 0
        return (c["vocab_size"] + c["max_position_embeddings"]) * h + c["num_hidden_layers"] * layer + 2 * h + proj
    if kind in ("T5EncoderModel", "UMT5EncoderModel"):
        d, inner = c["d_model"], c["num_heads"] * c["d_kv"]
        ff = (3 if c["feed_forward_proj"].startswith("gated") else 2) * d * c["d_ff"]
        bias_layers = c["num_layers"] if kind == "UMT5EncoderModel" else 1  # umT5: a relative bias per layer
        return (c["vocab_size"] * d + c["num_layers"] * (4 * d * inner + ff + 2 * d)
                + bias_layers * c["relative_attention_num_buckets"] * c["num_heads"] + d)
    if kind == "LlamaModel":
        h, i = c["hidden_size"], c["intermediate_size"]
        kv = c.get("num_key_value_heads", c["num_attention_heads"]) * h // c["num_attention_heads"]
        return c["vocab_size"] * h + c["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h
    if kind == "Qwen2_5_VLForConditionalGeneration":
        return QWEN2_5_VL_PARAMS
    raise ValueError(f"no parameter formula for text encoder class {kind!r}")


def text_encoders(config: dict, facts: Released) -> tuple[AuxModel, ...]:
    """Each text encoder with the tokens it encodes per prompt (its tokenizer's padded length)."""
    lengths = config.get("tokenizer_max_length", {})
    out = []
    for key in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        if key in config:
            c = config[key]
            tokens = facts.encoder_tokens or lengths.get(key.replace("text_encoder", "tokenizer"), 77)
            out.append(AuxModel(c["_class_name"], float(text_encoder_params(c)), tokens))
    return tuple(out)


def dit_text_tokens(config: dict, facts: Released) -> int:
    """Text tokens the DiT attends to per prompt: SD3 concatenates CLIP's 77 with T5's padded length;
    FLUX and Wan see the T5 / umT5 tokens, HunyuanVideo the Llama tokens."""
    if facts.text_tokens is not None:
        return facts.text_tokens
    lengths = config["tokenizer_max_length"]
    if config["family"] == "sd3":
        return lengths["tokenizer"] + lengths["tokenizer_3"]
    if config["family"] == "flux":
        return lengths["tokenizer_2"]
    return lengths["tokenizer"]


def spec_of(name: str) -> ModelSpec:
    """The ModelSpec of a released config (by config name, see RELEASED)."""
    config, facts = load_config(name), RELEASED[name]
    t = config["transformer"]
    d, blocks, extra_img, extra_txt, extra_mod = TRANSFORMERS[t["_class_name"]](t)
    vae_params, vae_flops = VAES[config["vae"]["_class_name"]]
    lora = {b.name: LORA_MATRICES[b.name] * 2 * d for b in blocks}
    return ModelSpec(
        facts.name, config["family"], d, t["num_attention_heads"], t["attention_head_dim"], blocks,
        extra_img=float(extra_img), extra_txt=float(extra_txt), extra_mod=float(extra_mod),
        text_tokens=dit_text_tokens(config, facts), text_padded=facts.text_tokens is None,
        video=config["family"] in ("wan", "hunyuan_video"), latent_channels=config["vae"].get("latent_channels")
        or config["vae"].get("z_dim", 16), vae=AuxModel(config["vae"]["_class_name"], vae_params),
        vae_decode_flops_per_pixel=vae_flops, text_encoders=text_encoders(config, facts),
        guidance_distilled=facts.guidance_distilled, default_steps=facts.default_steps, notes=facts.notes,
        lora_targets_per_block=lora)


MODELS: dict[str, ModelSpec] = {name: spec_of(name) for name in RELEASED}
"""released config name -> spec"""
FAMILIES: dict[str, list[str]] = {}
for _name, _spec in MODELS.items():
    FAMILIES.setdefault(_spec.family, []).append(_name)


def model_names() -> list[str]:
    """What --model takes: a family or a released config name."""
    return sorted(FAMILIES) + sorted(MODELS)


def resolve(model: str, variant: str | None = None) -> str:
    """The config name of `--model` and `--variant`: a config name as it is, a family's named variant,
    or a family's first variant."""
    if model in MODELS and variant in (None, RELEASED[model].variant):
        return model
    if model not in FAMILIES:
        raise ValueError(f"unknown model {model!r}; known: families {sorted(FAMILIES)} or configs {sorted(MODELS)}"
                         if model not in MODELS else f"--variant {variant!r} of {model!r}: it is variant "
                         f"{RELEASED[model].variant!r}")
    names = FAMILIES[model]
    if variant is None:
        return names[0]
    match = [n for n in names if RELEASED[n].variant == variant.lower()]
    if not match:
        raise ValueError(f"unknown --variant {variant!r} of {model!r}; known: {[RELEASED[n].variant for n in names]}")
    return match[0]


def model_spec(model: str, variant: str | None = None) -> ModelSpec:
    return MODELS[resolve(model, variant)]


__all__ = ["CONFIG_DIR", "FAMILIES", "MODELS", "RELEASED", "Released", "load_config", "model_names", "model_spec",
           "resolve", "spec_of", "text_encoder_params"]
