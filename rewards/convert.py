"""Convert the original HPSv2 and ImageReward checkpoints into the transformers folders their rewards load.

    python -m rewards.convert hpsv2 --checkpoint HPS_v2.1_compressed.pt --base CLIP-ViT-H-14-DIR --out DIR
    python -m rewards.convert image_reward --checkpoint ImageReward.pt --tokenizer BERT-DIR --out DIR

Everything is local: `--base` is a transformers folder of laion/CLIP-ViT-H-14-laion2B-s32B-b79K (the
architecture, processor and tokenizer HPSv2 was fine-tuned from) and `--tokenizer` a folder of
bert-base-uncased (BLIP's tokenizer, to which ImageReward adds [DEC] and [ENC]). See rewards/README.md."""
from __future__ import annotations

import argparse
import os
import re

import torch
from safetensors.torch import save_file
from torch import Tensor
from transformers import AutoTokenizer, BlipConfig, BlipForImageTextRetrieval, CLIPModel, CLIPProcessor
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from rewards.reward import load_state_dict

# ---------------------------------------------------------------- HPSv2: open_clip ViT -> transformers CLIPModel

_OPEN_CLIP_BLOCK = {
    "ln_1": "layer_norm1", "ln_2": "layer_norm2", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
    "attn.out_proj": "self_attn.out_proj",
}


def open_clip_to_transformers(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename an open_clip CLIP state dict (ViT image tower, default text tower) to CLIPModel keys.
    open_clip fuses q, k, v into `in_proj_*` and applies its projections as `x @ proj`, so those are
    split and transposed."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        key = key.removeprefix("module.")
        if key == "attn_mask" or key.endswith(".attn_mask"):
            continue  # a causal-mask buffer, rebuilt by transformers
        tower, _, rest = key.partition(".") if key.startswith("visual.") else ("text", "", key)
        prefix = "vision_model" if tower == "visual" else "text_model"
        block = re.match(r"transformer\.resblocks\.(\d+)\.(.+)\.(weight|bias|in_proj_weight|in_proj_bias)$", rest)
        if block:
            layer, module, kind = block.groups()
            base = f"{prefix}.encoder.layers.{layer}"
            if kind.startswith("in_proj"):
                for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0)):
                    out[f"{base}.self_attn.{name}.{kind.removeprefix('in_proj_')}"] = part.clone()
            else:
                out[f"{base}.{_OPEN_CLIP_BLOCK[module]}.{kind}"] = value
            continue
        renamed = {
            "positional_embedding": "text_model.embeddings.position_embedding.weight",
            "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
            "ln_final.weight": "text_model.final_layer_norm.weight",
            "ln_final.bias": "text_model.final_layer_norm.bias",
            "logit_scale": "logit_scale",
            "class_embedding": "vision_model.embeddings.class_embedding",
            "conv1.weight": "vision_model.embeddings.patch_embedding.weight",
            "ln_pre.weight": "vision_model.pre_layrnorm.weight",
            "ln_pre.bias": "vision_model.pre_layrnorm.bias",
            "ln_post.weight": "vision_model.post_layernorm.weight",
            "ln_post.bias": "vision_model.post_layernorm.bias",
        }
        if tower == "visual" and rest == "positional_embedding":
            out["vision_model.embeddings.position_embedding.weight"] = value
        elif rest == "text_projection":
            out["text_projection.weight"] = value.t().contiguous()
        elif tower == "visual" and rest == "proj":
            out["visual_projection.weight"] = value.t().contiguous()
        elif rest in renamed:
            out[renamed[rest]] = value
        else:
            raise ValueError(f"unexpected open_clip key {key!r}: not a ViT CLIP checkpoint?")
    return out


def convert_hpsv2(checkpoint: str, base: str, out: str) -> None:
    model = CLIPModel.from_pretrained(base, local_files_only=True, dtype=torch.float32)
    state = open_clip_to_transformers(load_state_dict(checkpoint))
    _load_strict(model, state, ignore=("position_ids",))
    model.save_pretrained(out)
    CLIPProcessor.from_pretrained(base, local_files_only=True).save_pretrained(out)


# ---------------------------------------------------------------- ImageReward: BLIP + MLP -> transformers BLIP

_BLIP_VIT = [
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
    (r"^norm\.", "post_layernorm."),
]


def image_reward_to_transformers(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """ImageReward.pt -> (BlipForImageTextRetrieval state dict, MLP head state dict). BLIP's text
    encoder already uses transformers' BERT names; its timm-style ViT is renamed."""
    blip, head = {}, {}
    for key, value in state.items():
        if key.startswith("mlp."):
            head[key.removeprefix("mlp.")] = value
        elif key.startswith("blip.visual_encoder."):
            rest = key.removeprefix("blip.visual_encoder.")
            for pattern, repl in _BLIP_VIT:
                if re.search(pattern, rest):
                    blip["vision_model." + re.sub(pattern, repl, rest)] = value
                    break
            else:
                raise ValueError(f"unexpected ImageReward key {key!r}")
        elif key.startswith("blip.") and not key.endswith("position_ids"):
            blip[key.removeprefix("blip.")] = value  # text_encoder.*, vision_proj.*, text_proj.*
    return blip, head


def image_reward_config(blip: dict[str, Tensor], vision_heads: int = 16, text_heads: int = 12):
    """A BlipConfig read off the tensor shapes (head counts are not in the shapes: ViT-L 16, BERT-base 12)."""
    width = blip["vision_model.embeddings.class_embedding"].shape[-1]
    patch = blip["vision_model.embeddings.patch_embedding.weight"].shape[-1]
    num_patches = blip["vision_model.embeddings.position_embedding"].shape[1] - 1
    words = blip["text_encoder.embeddings.word_embeddings.weight"]

    def count(pattern: str) -> int:  # layers present in the checkpoint
        return len({m.group(1) for k in blip if (m := re.match(pattern, k))})

    return BlipConfig(
        vision_config=dict(
            hidden_size=width, image_size=round(num_patches ** 0.5) * patch, patch_size=patch,
            num_hidden_layers=count(r"vision_model\.encoder\.layers\.(\d+)\."), num_attention_heads=vision_heads,
            intermediate_size=blip["vision_model.encoder.layers.0.mlp.fc1.weight"].shape[0],
            layer_norm_eps=1e-6,  # BLIP's ViT uses LayerNorm(eps=1e-6)
        ),
        text_config=dict(
            vocab_size=words.shape[0], hidden_size=words.shape[1], encoder_hidden_size=width,
            num_hidden_layers=count(r"text_encoder\.encoder\.layer\.(\d+)\."), num_attention_heads=text_heads,
            intermediate_size=blip["text_encoder.encoder.layer.0.intermediate.dense.weight"].shape[0],
            max_position_embeddings=blip["text_encoder.embeddings.position_embeddings.weight"].shape[0],
            layer_norm_eps=1e-12,
        ),
        image_text_hidden_size=blip["vision_proj.weight"].shape[0] if "vision_proj.weight" in blip else 256,
    )


def convert_image_reward(checkpoint: str, tokenizer: str, out: str, vision_heads: int = 16,
                         text_heads: int = 12) -> None:

    blip_state, head = image_reward_to_transformers(load_state_dict(checkpoint))
    model = BlipForImageTextRetrieval(image_reward_config(blip_state, vision_heads, text_heads))
    _load_strict(model, blip_state, ignore=("position_ids", "itm_head."))  # ImageReward has no ITM head
    model.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in head.items()}, os.path.join(out, "head.safetensors"))
    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    if "[DEC]" not in tok.get_vocab():  # BLIP's init_tokenizer
        tok.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    tok.save_pretrained(out)
    size = model.config.vision_config.image_size
    # ImageReward's transform: Resize(224, bicubic), CenterCrop(224), OpenAI CLIP mean / std.
    CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(out)


def _load_strict(model: torch.nn.Module, state: dict[str, Tensor], ignore: tuple[str, ...] = ()) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not any(s in k for s in ignore)]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="reward", required=True)
    hps = sub.add_parser("hpsv2", help="HPS_v2(.1)_compressed.pt -> transformers CLIP folder")
    hps.add_argument("--checkpoint", required=True)
    hps.add_argument("--base", required=True, help="transformers folder of laion/CLIP-ViT-H-14-laion2B-s32B-b79K")
    hps.add_argument("--out", required=True)
    ir = sub.add_parser("image_reward", help="ImageReward.pt -> transformers BLIP folder + head.safetensors")
    ir.add_argument("--checkpoint", required=True)
    ir.add_argument("--tokenizer", required=True, help="folder of bert-base-uncased")
    ir.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.reward == "hpsv2":
        convert_hpsv2(args.checkpoint, args.base, args.out)
    else:
        convert_image_reward(args.checkpoint, args.tokenizer, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
