"""FLUX.1 (FluxTransformer2DModel): T5 + CLIP text encoders, 2x2 latent packing, guidance embedding."""
from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from torch import Tensor

from models import tiny_text
from models.adapter import MID_SAMPLING, TINY_SAMPLING, Conditioning, DiTAdapter, SamplingDefaults, State, check_packed_image_size, packed_image_tokens, to_unit_range


class FluxAdapter(DiTAdapter):
    family = "flux"
    pipeline_class = FluxPipeline
    release = "flux1_dev"
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler")
    # FluxPipeline's defaults; noise level 0.9 and DanceGRPO eta 0.3 / shift 3 from docs/ALGORITHMS.md.
    defaults = SamplingDefaults(height=512, width=512, num_steps=28, shift="dynamic", noise_level=0.9,
                                guidance=3.5, cfg_scale=1.0, dance_eta=0.3, dance_shift=3.0)

    def __init__(self, pipe):
        super().__init__(pipe)
        # FluxPipeline's default T5 length is 512; a tokenizer that says less (tiny presets) wins.
        self.max_sequence_length = int(min(512, pipe.tokenizer_2.model_max_length))

    def _block_list(self):
        return list(self.transformer.transformer_blocks) + list(self.transformer.single_transformer_blocks)

    # ----- shapes ---------------------------------------------------------------------------
    geometry_presets = {"tiny": {"vae": 2}, "mid": {"vae": 2}}

    @classmethod
    def geometry(cls, transformer_config, vae_config):
        return {"vae": 2 ** (len(vae_config["block_out_channels"]) - 1)}  # FluxPipeline's vae_scale_factor

    def own_geometry(self):
        return {"vae": self.pipe.vae_scale_factor}

    @classmethod
    def check_size(cls, geometry, height, width, num_frames=None):
        check_packed_image_size(cls.family, geometry["vae"], height, width, num_frames)

    @classmethod
    def image_tokens(cls, geometry, height, width, num_frames=None):
        return packed_image_tokens(geometry["vae"], height, width)

    def latent_shape(self, height, width, num_frames=None):
        self.check_size(self.own_geometry(), height, width, num_frames)
        channels = self.transformer.config.in_channels // 4
        return (channels, height // self.pipe.vae_scale_factor, width // self.pipe.vae_scale_factor)

    def image_seq_len(self, latent_shape):
        _, h, w = latent_shape
        return (h // 2) * (w // 2)

    # ----- text -----------------------------------------------------------------------------
    def _encode_prompts(self, prompts):
        with torch.no_grad():
            prompt_embeds, pooled, _ = self.pipe.encode_prompt(
                prompt=list(prompts), prompt_2=None, device=self.device,
                max_sequence_length=self.max_sequence_length)
        return Conditioning({"prompt_embeds": prompt_embeds, "pooled": pooled})  # (B, L, D), (B, P)

    # ----- the split ------------------------------------------------------------------------
    def side_inputs(self, latent_shape, cond):
        _, h, w = latent_shape
        text_len = cond.tensors["prompt_embeds"].shape[1]
        img_ids = FluxPipeline._prepare_latent_image_ids(None, h // 2, w // 2, self.device, self.dtype)
        txt_ids = torch.zeros(text_len, 3, device=self.device, dtype=self.dtype)
        rotary = self.transformer.pos_embed(torch.cat([txt_ids, img_ids], dim=0))
        return {"rotary": rotary, "latent_shape": tuple(latent_shape)}

    def _guidance(self, guidance, batch):
        if not self.transformer.config.guidance_embeds:
            return None
        value = self.defaults.guidance if guidance is None else guidance
        return torch.full((batch,), float(value), device=self.device, dtype=torch.float32)

    def embed(self, latents, sigma, cond, guidance=None):
        tr = self.transformer
        b, c, h, w = latents.shape
        packed = FluxPipeline._pack_latents(latents.to(self.dtype), b, c, h, w)  # (B, h*w/4, 4C)
        hidden = tr.x_embedder(packed)
        timestep = sigma.to(hidden.dtype) * 1000
        g = self._guidance(guidance, b)
        pooled = cond.tensors["pooled"].to(hidden.dtype)
        if g is None:
            temb = tr.time_text_embed(timestep, pooled)
        else:
            temb = tr.time_text_embed(timestep, g.to(hidden.dtype) * 1000, pooled)
        text = tr.context_embedder(cond.tensors["prompt_embeds"].to(hidden.dtype))
        return State({"hidden": hidden, "text": text, "temb": temb}, self.side_inputs((c, h, w), cond))

    def run_block(self, i, state):
        a = state.acts
        text, hidden = self.blocks[i](hidden_states=a["hidden"], encoder_hidden_states=a["text"],
                                      temb=a["temb"], image_rotary_emb=state.side["rotary"])
        return State({"hidden": hidden, "text": text, "temb": a["temb"]}, state.side)

    def head(self, state):
        tr = self.transformer
        hidden = tr.norm_out(state.acts["hidden"], state.acts["temb"])
        return self._unpack(tr.proj_out(hidden), state.side["latent_shape"])

    def _unpack(self, packed: Tensor, latent_shape) -> Tensor:
        _, h, w = latent_shape
        vsf = self.pipe.vae_scale_factor
        return FluxPipeline._unpack_latents(packed, h * vsf, w * vsf, vsf)

    def reference_velocity(self, latents, sigma, cond, guidance=None):
        b, c, h, w = latents.shape
        text_len = cond.tensors["prompt_embeds"].shape[1]
        g = self._guidance(guidance, b)
        out = self.transformer(
            hidden_states=FluxPipeline._pack_latents(latents.to(self.dtype), b, c, h, w),
            encoder_hidden_states=cond.tensors["prompt_embeds"], pooled_projections=cond.tensors["pooled"],
            timestep=sigma.to(self.dtype), guidance=g,
            img_ids=FluxPipeline._prepare_latent_image_ids(None, h // 2, w // 2, self.device, self.dtype),
            txt_ids=torch.zeros(text_len, 3, device=self.device, dtype=self.dtype), return_dict=False)[0]
        return self._unpack(out, (c, h, w))

    # ----- pixels ---------------------------------------------------------------------------
    def _decode(self, latents):
        vae = self.pipe.vae
        z = latents / vae.config.scaling_factor + vae.config.shift_factor
        with torch.no_grad():
            images = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        return to_unit_range(images)

    # ----- presets --------------------------------------------------------------------------
    @classmethod
    def scheduler(cls):
        return flux_scheduler()

    @classmethod
    def offline_tokenizer(cls, key: str, length: int):
        return tiny_text.t5_tokenizer() if key == "tokenizer_2" else tiny_text.clip_tokenizer(length)

    @classmethod
    def tiny(cls, seed: int = 0):
        return cls._random(seed, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                           axes_dims_rope=(4, 6, 6)).with_sampling(**TINY_SAMPLING)

    @classmethod
    def mid(cls, seed: int = 0):
        """About 42M transformer parameters (4 double + 8 single blocks, width 384): big enough that
        compute, not Python overhead, dominates a CPU benchmark."""
        return cls._random(seed, num_layers=4, num_single_layers=8, attention_head_dim=64, num_attention_heads=6,
                           axes_dims_rope=(16, 24, 24)).with_sampling(**MID_SAMPLING)

    @classmethod
    def _random(cls, seed: int, **transformer_config):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=16, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            **transformer_config)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8), layers_per_block=1,
            norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, scaling_factor=1.0, shift_factor=0.0)
        tokenizer = tiny_text.clip_tokenizer()
        tokenizer_2 = tiny_text.t5_tokenizer()
        tokenizer_2.model_max_length = 64
        pipe = FluxPipeline(
            scheduler=flux_scheduler(), vae=vae.eval(),
            text_encoder=tiny_text.clip_text_encoder(tokenizer, hidden=32, seed=seed + 1), tokenizer=tokenizer,
            text_encoder_2=tiny_text.t5_encoder(d_model=32, seed=seed + 2), tokenizer_2=tokenizer_2,
            transformer=transformer)
        return cls(pipe)


def flux_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """The scheduler config FLUX.1-dev ships (dynamic shift from the image sequence length)."""
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)


@torch.no_grad()
def encode_latents(vae, x: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] -> the transformer's latents (the autoencoder's shift and scale applied)."""
    z = vae.encode(x).latent_dist.mode()  # (B, 4, 16, 16)
    return (z - vae.config.shift_factor) * vae.config.scaling_factor
