"""Wan2.1 text-to-video (WanTransformer3DModel): UMT5 text encoder, 3D patch embedding, CFG, AutoencoderKLWan."""
from __future__ import annotations

from typing import ClassVar

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from torch import Tensor
from transformers import UMT5Config, UMT5EncoderModel

from models import tiny_text
from models.adapter import TINY_FRAMES, TINY_SAMPLING, Conditioning, DiTAdapter, SamplingDefaults, State, to_unit_range, video_latent_shape


class WanAdapter(DiTAdapter):
    family = "wan"
    pipeline_class = WanPipeline
    release = "wan2_1_t2v_14b"
    video = True
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
    # WanPipeline's defaults (480p, 81 frames, CFG 5.0, no guidance embedding); noise level 0.7 and
    # DanceGRPO eta 0.3 / shift 3 from docs/ALGORITHMS.md.
    defaults = SamplingDefaults(height=480, width=832, num_frames=81, num_steps=50, shift="static", noise_level=0.7,
                                guidance=None, cfg_scale=5.0, dance_eta=0.3, dance_shift=3.0)
    # Wan2.1's scheduler flow_shift at 480p (its model card recommends 5.0 for 720p).
    static_shift: ClassVar[float] = 3.0

    def __init__(self, pipe):
        super().__init__(pipe)
        # WanPipeline.__call__ pads UMT5 output to 512 tokens; a tokenizer that says less (tiny presets) wins.
        # Padding to a fixed length (never the longest prompt) keeps samples independent of their batch.
        self.max_sequence_length = int(min(512, pipe.tokenizer.model_max_length))
        # Tiled decoding, as DanceGRPO decodes (vae.enable_tiling()): a 720p clip decoded whole holds
        # activations of every frame at full resolution at once; tiles of 256 px overlap and blend.
        # Samples below a tile (the tiny presets) decode exactly as untiled.
        pipe.vae.enable_tiling()

    def _block_list(self):
        return list(self.transformer.blocks)

    # ----- shapes ---------------------------------------------------------------------------
    geometry_presets = {"tiny": {"spatial": 4, "temporal": 4, "patch": [1, 2, 2], "rope_len": 32}}

    @classmethod
    def geometry(cls, transformer_config, vae_config):
        return {"spatial": vae_config.get("scale_factor_spatial", 8), "temporal": vae_config.get("scale_factor_temporal", 4),
                "patch": list(transformer_config["patch_size"]), "rope_len": transformer_config["rope_max_seq_len"]}

    def own_geometry(self):
        c = self.transformer.config
        return {"spatial": self.pipe.vae_scale_factor_spatial, "temporal": self.pipe.vae_scale_factor_temporal,
                "patch": list(c.patch_size), "rope_len": c.rope_max_seq_len}

    @classmethod
    def check_size(cls, geometry, height, width, num_frames=None):
        spatial, temporal, rope_len = geometry["spatial"], geometry["temporal"], geometry["rope_len"]
        p_t, p_h, p_w = geometry["patch"]
        if num_frames is None or num_frames <= 0 or (num_frames - 1) % temporal:
            raise ValueError(f"num_frames {num_frames} must be 1 + a multiple of {temporal} for {cls.family!r} "
                             f"(VAE temporal factor {temporal})")
        frames = (num_frames - 1) // temporal + 1
        if frames % p_t or frames // p_t > rope_len:
            raise ValueError(f"num_frames {num_frames} gives {frames} latent frames: must be a multiple of the "
                             f"temporal patch {p_t} and at most {rope_len * p_t} for {cls.family!r}")
        for name, size, patch in (("height", height, p_h), ("width", width, p_w)):
            factor = spatial * patch
            if size <= 0 or size % factor:
                raise ValueError(f"{name} {size} must be a positive multiple of {factor} for {cls.family!r} "
                                 f"(VAE factor {spatial} x patch {patch})")
            if size // factor > rope_len:
                raise ValueError(f"{name} {size} gives {size // factor} patches, above the rotary table's "
                                 f"{rope_len} for {cls.family!r}")

    latent_shape = video_latent_shape

    def image_seq_len(self, latent_shape):
        _, f, h, w = latent_shape
        p_t, p_h, p_w = self.transformer.config.patch_size
        return (f // p_t) * (h // p_h) * (w // p_w)

    # ----- text -----------------------------------------------------------------------------
    def _encode_prompts(self, prompts):
        # The unconditional branch of CFG is encode_prompts([""] * B): WanPipeline's default negative prompt.
        with torch.no_grad():
            prompt_embeds, _ = self.pipe.encode_prompt(
                prompt=list(prompts), do_classifier_free_guidance=False, device=self.device,
                max_sequence_length=self.max_sequence_length)
        return Conditioning({"prompt_embeds": prompt_embeds})  # (B, L, D), zero past each prompt's end

    # ----- the split ------------------------------------------------------------------------
    def side_inputs(self, latent_shape, cond):
        # The rotary table depends only on the latent shape: a zero-stride view carries the shape without memory.
        shape_only = torch.empty((), device=self.device).expand(1, *latent_shape)
        return {"rotary": self.transformer.rope(shape_only), "latent_shape": tuple(latent_shape)}

    @staticmethod
    def _timestep(sigma: Tensor) -> Tensor:
        # WanPipeline passes the scheduler's float32 timesteps, sigma * 1000, expanded over the batch.
        return sigma.float() * 1000

    def embed(self, latents, sigma, cond, guidance=None):
        tr = self.transformer
        hidden = tr.patch_embedding(latents.to(self.dtype))  # (B, D, F', H', W')
        hidden = hidden.flatten(2).transpose(1, 2).contiguous()  # (B, N, D)
        temb, temb_proj, text, _ = tr.condition_embedder(
            self._timestep(sigma), cond.tensors["prompt_embeds"].to(self.dtype), None, timestep_seq_len=None)
        temb_proj = temb_proj.unflatten(1, (6, -1))  # (B, 6, D): per-block shift/scale/gate
        # The text context is never updated by a block, but it comes out of condition_embedder's
        # parameters, so it is an activation (with gradients), not a side input.
        acts = {"hidden": hidden, "text": text, "temb": temb, "temb_proj": temb_proj}
        return State(acts, self.side_inputs(tuple(latents.shape[1:]), cond))

    def run_block(self, i, state):
        a = state.acts
        hidden = self.blocks[i](a["hidden"], a["text"], a["temb_proj"], state.side["rotary"])
        return State({**a, "hidden": hidden}, state.side)

    def head(self, state):
        tr = self.transformer
        hidden, temb = state.acts["hidden"], state.acts["temb"]
        shift, scale = (tr.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        hidden = (tr.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        return self._unpatchify(tr.proj_out(hidden), state.side["latent_shape"])

    def _unpatchify(self, tokens: Tensor, latent_shape) -> Tensor:
        """(B, N, C*p_t*p_h*p_w) -> (B, C, F, H, W), as WanTransformer3DModel.forward does."""
        _, f, h, w = latent_shape
        p_t, p_h, p_w = self.transformer.config.patch_size
        x = tokens.reshape(tokens.shape[0], f // p_t, h // p_h, w // p_w, p_t, p_h, p_w, -1)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def reference_velocity(self, latents, sigma, cond, guidance=None):
        return self.transformer(
            hidden_states=latents.to(self.dtype), timestep=self._timestep(sigma),
            encoder_hidden_states=cond.tensors["prompt_embeds"].to(self.dtype), return_dict=False)[0]

    # ----- pixels ---------------------------------------------------------------------------
    def _decode(self, latents):
        vae = self.pipe.vae
        stats_shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(stats_shape).to(latents.device, vae.dtype)
        std = torch.tensor(vae.config.latents_std).view(stats_shape).to(latents.device, vae.dtype)
        z = latents.to(vae.dtype) * std + mean  # WanPipeline's `latents / (1 / std) + mean`
        with torch.no_grad():
            video = vae.decode(z, return_dict=False)[0]  # (B, 3, F, H, W) in [-1, 1]
        return to_unit_range(video)

    # ----- presets --------------------------------------------------------------------------
    @classmethod
    def scheduler(cls):
        return wan_scheduler()

    @classmethod
    def offline_tokenizer(cls, key: str, length: int):
        return tiny_text.t5_tokenizer()

    @classmethod
    def tiny(cls, seed: int = 0):
        torch.manual_seed(seed)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=32, ffn_dim=32, num_layers=4, rope_max_seq_len=32)
        # Three levels: spatial factor 4, temporal factor 4 (num_frames = 4k + 1).
        vae = AutoencoderKLWan(
            base_dim=8, z_dim=4, dim_mult=[1, 1, 1], num_res_blocks=1, temperal_downsample=[True, True],
            latents_mean=[0.1, -0.1, 0.2, -0.2], latents_std=[1.5, 0.5, 2.0, 1.0],
            scale_factor_temporal=4, scale_factor_spatial=4)
        tokenizer = tiny_text.t5_tokenizer()
        tokenizer.model_max_length = 32
        pipe = WanPipeline(
            tokenizer=tokenizer, text_encoder=umt5_encoder(d_model=16, seed=seed + 1), vae=vae.eval(),
            scheduler=wan_scheduler(), transformer=transformer)
        return cls(pipe).with_sampling(**TINY_SAMPLING, num_frames=TINY_FRAMES)


def umt5_encoder(d_model: int = 16, num_layers: int = 1, seed: int = 0) -> UMT5EncoderModel:
    """A tiny UMT5 over ByT5's 384-symbol byte vocabulary."""
    torch.manual_seed(seed)
    config = UMT5Config(
        vocab_size=384, d_model=d_model, d_kv=d_model // 2, d_ff=2 * d_model, num_layers=num_layers,
        num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=32)
    return UMT5EncoderModel(config).eval()


def wan_scheduler() -> UniPCMultistepScheduler:
    """The scheduler config Wan2.1-T2V ships: UniPC over flow sigmas with a static shift."""
    return UniPCMultistepScheduler(
        num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
        flow_shift=WanAdapter.static_shift)
