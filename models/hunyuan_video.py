"""HunyuanVideo text-to-video (HunyuanVideoTransformer3DModel): Llama + CLIP text encoders, token refiner,
guidance embedding, masked joint attention, AutoencoderKLHunyuanVideo."""
from __future__ import annotations

from typing import ClassVar

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
)
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
from torch import Tensor
from transformers import LlamaConfig, LlamaModel

from models import tiny_text
from models.adapter import TINY_FRAMES, TINY_SAMPLING, Conditioning, DiTAdapter, SamplingDefaults, State, to_unit_range, video_latent_shape

# The Llama chat template needs Llama 3's header tokens, and its crop_start (95) counts the real
# tokenizer's tokens. A tokenizer without those tokens (the tiny preset's byte vocabulary) gets the
# template's tail only: the prompt then <|eot_id|>, so even an empty prompt keeps one unmasked token
# (the token refiner mean-pools over the mask and would divide by zero).
BARE_PROMPT_TEMPLATE = {"template": "{}<|eot_id|>", "crop_start": 0}


class HunyuanVideoAdapter(DiTAdapter):
    family = "hunyuan_video"
    pipeline_class = HunyuanVideoPipeline
    release = "hunyuan_video"
    video = True
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                           "scheduler")
    # HunyuanVideoPipeline's defaults (720p, 129 frames, guidance embedding 6.0, no true CFG); noise
    # level 0.7 and DanceGRPO eta 0.25 / shift 5 from docs/ALGORITHMS.md.
    defaults = SamplingDefaults(height=720, width=1280, num_frames=129, num_steps=50, shift="static",
                                noise_level=0.7, guidance=6.0, cfg_scale=1.0, dance_eta=0.25, dance_shift=5.0)
    # HunyuanVideo's scheduler shift (FlowMatchEulerDiscreteScheduler, flow_shift 7.0 in the reference code).
    static_shift: ClassVar[float] = 7.0
    # side_inputs builds a mask in every forward: the joint sequence is [image, text] and the keys
    # after each prompt's last text token are masked, a prefix of the keys.
    attention_mask = "masks the keys after each prompt's last text token in every forward"
    mask_is_key_prefix = True

    def __init__(self, pipe):
        super().__init__(pipe)
        if pipe.transformer.config.image_condition_type is not None:
            raise ValueError(f"image_condition_type {pipe.transformer.config.image_condition_type!r}: only the "
                             f"text-to-video HunyuanVideo transformer is supported")
        # HunyuanVideoPipeline pads Llama output to 256 tokens; a tokenizer that says less (tiny presets) wins.
        # Padding to a fixed length (never the longest prompt) keeps samples independent of their batch.
        self.max_sequence_length = int(min(256, pipe.tokenizer.model_max_length))
        llama_template = "<|start_header_id|>" in pipe.tokenizer.get_vocab()
        self.prompt_template = DEFAULT_PROMPT_TEMPLATE if llama_template else BARE_PROMPT_TEMPLATE
        # Tiled decoding, as DanceGRPO decodes (vae.enable_tiling()): a 720p clip decoded whole holds
        # activations of every frame at full resolution at once; tiles of 256 px overlap and blend.
        # Samples below a tile (the tiny presets) decode exactly as untiled.
        pipe.vae.enable_tiling()

    def _block_list(self):
        return list(self.transformer.transformer_blocks) + list(self.transformer.single_transformer_blocks)

    # ----- shapes ---------------------------------------------------------------------------
    geometry_presets = {"tiny": {"spatial": 4, "temporal": 4, "patch": 2, "patch_t": 1}}

    @classmethod
    def geometry(cls, transformer_config, vae_config):
        return {"spatial": vae_config.get("spatial_compression_ratio", 8),
                "temporal": vae_config.get("temporal_compression_ratio", 4),
                "patch": transformer_config["patch_size"], "patch_t": transformer_config["patch_size_t"]}

    def own_geometry(self):
        c = self.transformer.config
        return {"spatial": self.pipe.vae_scale_factor_spatial, "temporal": self.pipe.vae_scale_factor_temporal,
                "patch": c.patch_size, "patch_t": c.patch_size_t}

    @classmethod
    def check_size(cls, geometry, height, width, num_frames=None):
        spatial, temporal, p, p_t = geometry["spatial"], geometry["temporal"], geometry["patch"], geometry["patch_t"]
        if num_frames is None or num_frames <= 0 or (num_frames - 1) % temporal:
            raise ValueError(f"num_frames {num_frames} must be 1 + a multiple of {temporal} for {cls.family!r} "
                             f"(VAE temporal factor {temporal})")
        frames = (num_frames - 1) // temporal + 1
        if frames % p_t:
            raise ValueError(f"num_frames {num_frames} gives {frames} latent frames, not a multiple of the "
                             f"temporal patch {p_t} for {cls.family!r}")
        for name, size in (("height", height), ("width", width)):
            if size <= 0 or size % (spatial * p):
                raise ValueError(f"{name} {size} must be a positive multiple of {spatial * p} for {cls.family!r} "
                                 f"(VAE factor {spatial} x patch {p})")

    latent_shape = video_latent_shape

    def image_seq_len(self, latent_shape):
        _, f, h, w = latent_shape
        p, p_t = self.transformer.config.patch_size, self.transformer.config.patch_size_t
        return (f // p_t) * (h // p) * (w // p)

    # ----- text -----------------------------------------------------------------------------
    def _encode_prompts(self, prompts):
        with torch.no_grad():
            prompt_embeds, pooled, mask = self.pipe.encode_prompt(
                prompt=list(prompts), prompt_template=self.prompt_template, device=self.device,
                max_sequence_length=self.max_sequence_length)
        # (B, L, D) Llama states, (B, P) CLIP pooled, (B, L) int64 mask (1 = token, right-padded)
        return Conditioning({"prompt_embeds": prompt_embeds, "pooled": pooled, "mask": mask})

    # ----- the split ------------------------------------------------------------------------
    def side_inputs(self, latent_shape, cond):
        text_mask = cond.tensors["mask"].to(self.device)  # (B, L)
        num_image = self.image_seq_len(latent_shape)
        # Joint attention runs over [image tokens, text tokens]; keys past each sample's last real text
        # token are masked, exactly as HunyuanVideoTransformer3DModel.forward builds it.
        num_keys = num_image + text_mask.shape[1]
        num_valid = num_image + text_mask.sum(dim=1, dtype=torch.int)  # (B,)
        keys = torch.arange(num_keys, device=self.device).unsqueeze(0)  # (1, N)
        attention_mask = (keys < num_valid.unsqueeze(1)).unsqueeze(1).unsqueeze(1)  # (B, 1, 1, N) bool
        # The rotary table depends only on the latent shape: a zero-stride view carries the shape without memory.
        shape_only = torch.empty((), device=self.device).expand(1, *latent_shape)
        return {"rotary": self.transformer.rope(shape_only), "attention_mask": attention_mask,
                "latent_shape": tuple(latent_shape)}

    @staticmethod
    def _timestep(sigma: Tensor) -> Tensor:
        # HunyuanVideoPipeline passes the scheduler's timestep (sigma * 1000) in the float32 latents' dtype.
        return sigma.float() * 1000

    def _guidance(self, guidance, batch):
        if not self.transformer.config.guidance_embeds:
            return None
        value = self.defaults.guidance if guidance is None else guidance
        # HunyuanVideoPipeline: a tensor in the transformer's dtype, times 1000.
        return torch.full((batch,), float(value), device=self.device, dtype=self.dtype) * 1000.0

    def embed(self, latents, sigma, cond, guidance=None):
        tr = self.transformer
        timestep = self._timestep(sigma)
        temb, _ = tr.time_text_embed(timestep, cond.tensors["pooled"].to(self.dtype),
                                     self._guidance(guidance, latents.shape[0]))
        hidden = tr.x_embedder(latents.to(self.dtype))  # (B, N, D)
        # The token refiner has parameters and reads the timestep: it belongs to embed, not to a stage's side inputs.
        text = tr.context_embedder(cond.tensors["prompt_embeds"].to(self.dtype), timestep,
                                   cond.tensors["mask"])  # (B, L, D)
        return State({"hidden": hidden, "text": text, "temb": temb},
                     self.side_inputs(tuple(latents.shape[1:]), cond))

    def run_block(self, i, state):
        a, side = state.acts, state.side
        # HunyuanVideo blocks return (image, text): the reverse of FLUX's order.
        hidden, text = self.blocks[i](a["hidden"], a["text"], a["temb"], side["attention_mask"], side["rotary"])
        return State({"hidden": hidden, "text": text, "temb": a["temb"]}, side)

    def head(self, state):
        tr = self.transformer
        hidden = tr.norm_out(state.acts["hidden"], state.acts["temb"])
        return self._unpatchify(tr.proj_out(hidden), state.side["latent_shape"])

    def _unpatchify(self, tokens: Tensor, latent_shape) -> Tensor:
        """(B, N, C*p_t*p*p) -> (B, C, F, H, W), as HunyuanVideoTransformer3DModel.forward does."""
        _, f, h, w = latent_shape
        p, p_t = self.transformer.config.patch_size, self.transformer.config.patch_size_t
        x = tokens.reshape(tokens.shape[0], f // p_t, h // p, w // p, -1, p_t, p, p)
        x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def reference_velocity(self, latents, sigma, cond, guidance=None):
        return self.transformer(
            hidden_states=latents.to(self.dtype), timestep=self._timestep(sigma),
            encoder_hidden_states=cond.tensors["prompt_embeds"].to(self.dtype),
            encoder_attention_mask=cond.tensors["mask"], pooled_projections=cond.tensors["pooled"].to(self.dtype),
            guidance=self._guidance(guidance, latents.shape[0]), return_dict=False)[0]

    # ----- pixels ---------------------------------------------------------------------------
    def _decode(self, latents):
        vae = self.pipe.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor
        with torch.no_grad():
            video = vae.decode(z, return_dict=False)[0]  # (B, 3, F, H, W) in [-1, 1]
        return to_unit_range(video)

    # ----- presets --------------------------------------------------------------------------
    @classmethod
    def scheduler(cls):
        return hunyuan_video_scheduler()

    @classmethod
    def offline_tokenizer(cls, key: str, length: int):
        if key == "tokenizer":
            return tiny_text.byte_bpe_tokenizer(["<|eot_id|>", "<|end_of_text|>"], pad_token="<|end_of_text|>")
        return tiny_text.clip_tokenizer(length)

    @classmethod
    def tiny(cls, seed: int = 0):
        torch.manual_seed(seed)
        transformer = HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
            num_single_layers=2, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=16,
            pooled_projection_dim=8, rope_axes_dim=(4, 6, 6), guidance_embeds=True)
        # Three levels: spatial factor 4 and temporal factor 4 (the only temporal factor the VAE supports).
        vae = AutoencoderKLHunyuanVideo(
            latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 3,
            up_block_types=("HunyuanVideoUpBlock3D",) * 3, block_out_channels=(8, 8, 8), layers_per_block=1,
            norm_num_groups=4, spatial_compression_ratio=4, temporal_compression_ratio=4,
            mid_block_add_attention=False)
        tokenizer = tiny_text.byte_bpe_tokenizer(["<|eot_id|>", "<|end_of_text|>"], pad_token="<|end_of_text|>")
        tokenizer.model_max_length = 32
        tokenizer_2 = tiny_text.clip_tokenizer()
        pipe = HunyuanVideoPipeline(
            text_encoder=llama_encoder(tokenizer, hidden=16, seed=seed + 1), tokenizer=tokenizer,
            transformer=transformer, vae=vae.eval(), scheduler=hunyuan_video_scheduler(),
            text_encoder_2=tiny_text.clip_text_encoder(tokenizer_2, hidden=8, projection_dim=8, seed=seed + 2),
            tokenizer_2=tokenizer_2)
        return cls(pipe).with_sampling(**TINY_SAMPLING, num_frames=TINY_FRAMES)


def llama_encoder(tok, hidden: int = 16, seed: int = 0) -> LlamaModel:
    """A tiny Llama. Two layers because HunyuanVideoPipeline reads the hidden state two layers below the top."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=tok.model_max_length,
        pad_token_id=tok.pad_token_id, bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|eot_id|>"))
    return LlamaModel(config).eval()


def hunyuan_video_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """The scheduler config HunyuanVideo ships: flow matching with a static shift."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=HunyuanVideoAdapter.static_shift)
