"""Stable Diffusion 3.5 (SD3Transformer2DModel): CLIP-L + CLIP-G + T5 text encoders, a patch embedding
with a fixed sin-cos table, CFG and a static shift. The last block returns no text stream."""
from __future__ import annotations

from typing import ClassVar

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from torch import Tensor
from transformers import CLIPTextModelWithProjection, CLIPTokenizer

from models import tiny_text
from models.adapter import TINY_SAMPLING, Conditioning, DiTAdapter, SamplingDefaults, State, check_image_frames, to_unit_range


class SD3Adapter(DiTAdapter):
    family = "sd3"
    pipeline_class = StableDiffusion3Pipeline
    release = "sd3_5_medium"
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                           "text_encoder_3", "tokenizer_3", "scheduler")
    # StableDiffusion3Pipeline's size and step defaults (1024 px, 28 steps); CFG 4.5 and noise level 0.7
    # as Flow-GRPO trains SD3.5 (docs/ALGORITHMS.md); no guidance embedding.
    defaults = SamplingDefaults(height=1024, width=1024, num_steps=28, shift="static", noise_level=0.7,
                                guidance=None, cfg_scale=4.5, dance_eta=0.3, dance_shift=3.0)
    # SD3.5's scheduler config: shift 3.0, no dynamic shifting. The sampler reads this attribute.
    static_shift: ClassVar[float] = 3.0

    def __init__(self, pipe):
        super().__init__(pipe)
        # StableDiffusion3Pipeline's default T5 length is 256; a tokenizer that says less (tiny presets) wins.
        self.max_sequence_length = int(min(256, pipe.tokenizer_3.model_max_length))

    def _block_list(self):
        return list(self.transformer.transformer_blocks)

    # ----- shapes ---------------------------------------------------------------------------
    geometry_presets = {"tiny": {"vae": 8, "patch": 2, "pos_max": 16}}

    @classmethod
    def geometry(cls, transformer_config, vae_config):
        return {"vae": 2 ** (len(vae_config["block_out_channels"]) - 1), "patch": transformer_config["patch_size"],
                "pos_max": transformer_config["pos_embed_max_size"]}

    def own_geometry(self):
        c = self.transformer.config
        return {"vae": self.pipe.vae_scale_factor, "patch": c.patch_size, "pos_max": c.pos_embed_max_size}

    @classmethod
    def check_size(cls, geometry, height, width, num_frames=None):
        check_image_frames(cls.family, num_frames)
        vsf, patch = geometry["vae"], geometry["patch"]
        factor = vsf * patch
        # The sin-cos position table covers pos_embed_max_size patches per side.
        max_size = factor * geometry["pos_max"]
        for name, size in (("height", height), ("width", width)):
            if size <= 0 or size % factor:
                raise ValueError(f"{name} {size} must be a positive multiple of {factor} for {cls.family!r} "
                                 f"(VAE factor {vsf} x patch {patch})")
            if size > max_size:
                raise ValueError(f"{name} {size} exceeds {max_size}, the largest size the position table of "
                                 f"{cls.family!r} covers (pos_embed_max_size {geometry['pos_max']} patches)")

    def latent_shape(self, height, width, num_frames=None):
        self.check_size(self.own_geometry(), height, width, num_frames)
        vsf = self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels, height // vsf, width // vsf)

    def image_seq_len(self, latent_shape):
        _, h, w = latent_shape
        patch = self.transformer.config.patch_size
        return (h // patch) * (w // patch)

    # ----- text -----------------------------------------------------------------------------
    def _encode_prompts(self, prompts):
        # Every encoder pads to a fixed length (77 CLIP + max_sequence_length T5 tokens), so a sample's
        # conditioning never depends on its batch neighbours and no mask is needed.
        with torch.no_grad():
            prompt_embeds, _, pooled, _ = self.pipe.encode_prompt(
                prompt=list(prompts), prompt_2=None, prompt_3=None, device=self.device,
                do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length)
        return Conditioning({"prompt_embeds": prompt_embeds, "pooled": pooled})  # (B, L, D), (B, P)

    # ----- the split ------------------------------------------------------------------------
    def side_inputs(self, latent_shape, cond):
        # The sin-cos position table is added inside the patch embedding (embed); nothing else is shared.
        return {"latent_shape": tuple(latent_shape)}

    @staticmethod
    def _timestep(sigma: Tensor) -> Tensor:
        # StableDiffusion3Pipeline passes the scheduler's timestep, sigma * num_train_timesteps (1000).
        return sigma * 1000


    def embed(self, latents, sigma, cond, guidance=None):
        self.check_no_guidance(guidance)
        tr = self.transformer
        _, c, h, w = latents.shape
        hidden = tr.pos_embed(latents.to(self.dtype)).contiguous()  # (B, h*w/p^2, D), sin-cos table added
        temb = tr.time_text_embed(self._timestep(sigma), cond.tensors["pooled"].to(self.dtype))
        text = tr.context_embedder(cond.tensors["prompt_embeds"].to(self.dtype))
        return State({"hidden": hidden, "text": text, "temb": temb}, self.side_inputs((c, h, w), cond))

    def run_block(self, i, state):
        a = state.acts
        text, hidden = self.blocks[i](hidden_states=a["hidden"], encoder_hidden_states=a["text"], temb=a["temb"])
        acts = {"hidden": hidden, "temb": a["temb"]}
        if text is not None:  # the last block (context_pre_only) updates the image stream only
            acts["text"] = text
        return State(acts, state.side)

    def head(self, state):
        tr = self.transformer
        hidden = tr.norm_out(state.acts["hidden"], state.acts["temb"])
        return self._unpatchify(tr.proj_out(hidden), state.side["latent_shape"])

    def _unpatchify(self, tokens: Tensor, latent_shape) -> Tensor:
        # The same ops as the end of SD3Transformer2DModel.forward, which has no method for them.
        _, h, w = latent_shape
        p = self.transformer.config.patch_size
        out_channels = self.transformer.out_channels
        x = tokens.reshape(tokens.shape[0], h // p, w // p, p, p, out_channels)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(tokens.shape[0], out_channels, h, w)  # (B, C, H, W)

    def reference_velocity(self, latents, sigma, cond, guidance=None):
        self.check_no_guidance(guidance)
        return self.transformer(
            hidden_states=latents.to(self.dtype), encoder_hidden_states=cond.tensors["prompt_embeds"].to(self.dtype),
            pooled_projections=cond.tensors["pooled"].to(self.dtype), timestep=self._timestep(sigma),
            return_dict=False)[0]

    # ----- pixels ---------------------------------------------------------------------------
    def _decode(self, latents):
        vae = self.pipe.vae
        z = latents / vae.config.scaling_factor + vae.config.shift_factor  # StableDiffusion3Pipeline's inverse
        with torch.no_grad():
            images = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        return to_unit_range(images)

    # ----- presets --------------------------------------------------------------------------
    @classmethod
    def scheduler(cls):
        return sd3_scheduler()

    @classmethod
    def offline_tokenizer(cls, key: str, length: int):
        return tiny_text.t5_tokenizer() if key == "tokenizer_3" else tiny_text.clip_tokenizer(length)

    @classmethod
    def tiny(cls, seed: int = 0):
        torch.manual_seed(seed)
        # SD3.5-medium's structure in miniature: qk rms-norm and a dual-attention (MMDiT-X) first block.
        transformer = SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=4, attention_head_dim=8,
            num_attention_heads=2, caption_projection_dim=16, joint_attention_dim=48, pooled_projection_dim=40,
            pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm")
        # Four blocks: the real VAE factor of 8; SD3's latent scaling and shift.
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
            norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False)
        tokenizer, tokenizer_2 = tiny_text.clip_tokenizer(), tiny_text.clip_tokenizer()
        tokenizer_3 = tiny_text.t5_tokenizer()
        tokenizer_3.model_max_length = 64
        # CLIP-L 16 + CLIP-G 24 = 40 pooled and token dims; T5's 48 is joint_attention_dim (CLIP is zero-padded).
        pipe = StableDiffusion3Pipeline(
            transformer=transformer, scheduler=sd3_scheduler(), vae=vae.eval(),
            text_encoder=clip_with_projection(tokenizer, hidden=16, seed=seed + 1), tokenizer=tokenizer,
            text_encoder_2=clip_with_projection(tokenizer_2, hidden=24, seed=seed + 2), tokenizer_2=tokenizer_2,
            text_encoder_3=tiny_text.t5_encoder(d_model=48, seed=seed + 3), tokenizer_3=tokenizer_3)
        return cls(pipe).with_sampling(**TINY_SAMPLING)


def clip_with_projection(tokenizer: CLIPTokenizer, hidden: int, seed: int) -> CLIPTextModelWithProjection:
    """tiny_text's CLIP text encoder recipe with the projection head SD3 pools from (projection = hidden)."""
    config = tiny_text.clip_text_encoder(tokenizer, hidden=hidden, projection_dim=hidden, seed=seed).config
    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(config).eval()


def sd3_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """The scheduler config SD3.5 ships: a static shift of 3."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SD3Adapter.static_shift)
