"""Qwen-Image (QwenImageTransformer2DModel): Qwen2.5-VL text encoder with a padding mask, 2x2 latent
packing, complex64 rotary tables, a video VAE used with one frame, true CFG and a dynamic shift."""
from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from torch import Tensor
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from models import tiny_text
from models.adapter import TINY_SAMPLING, Conditioning, DiTAdapter, SamplingDefaults, State, check_packed_image_size, packed_image_tokens, to_unit_range

# Special tokens of Qwen2.5-VL's vocabulary that the prompt template and the model config refer to.
_QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                        "<|image_pad|>", "<|video_pad|>"]


class QwenImageAdapter(DiTAdapter):
    family = "qwen_image"
    pipeline_class = QwenImagePipeline
    release = "qwen_image"
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
    # Prompts of different lengths are padded and the padding masked (_text_mask); the joint
    # sequence is [text, image], so the masked keys sit between the valid ones.
    attention_mask = "masks the padded text tokens of prompts shorter than the longest of a batch"
    # QwenImagePipeline's defaults (1024 px, 50 steps, true CFG 4.0, no guidance embedding);
    # noise level 1.2 and DanceGRPO eta 0.3 / shift 3 from docs/ALGORITHMS.md.
    defaults = SamplingDefaults(height=1024, width=1024, num_steps=50, shift="dynamic", noise_level=1.2,
                                guidance=None, cfg_scale=4.0, dance_eta=0.3, dance_shift=3.0)

    def __init__(self, pipe):
        super().__init__(pipe)
        config = self.transformer.config
        variant_flags = ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")
        unsupported = {k: config[k] for k in variant_flags if config.get(k)}
        if unsupported:
            raise ValueError(f"{self.family!r} supports the text-to-image transformer only; it sets {unsupported}")
        # QwenImagePipeline.__call__'s default text length.
        self.max_sequence_length = 512
        # encode_prompt drops the template tokens before the prompt (system turn and user header) by a
        # fixed count, 34 for Qwen2.5-VL's tokenizer. Count them with this folder's own tokenizer so other
        # vocabularies (the tiny byte-level one) drop exactly the template too; the pipeline's __init__
        # resets the count on every load, so it is set here.
        template = pipe.prompt_template_encode
        prefix = template[: template.index("{}")]
        pipe.prompt_template_encode_start_idx = len(pipe.tokenizer(prefix).input_ids)

    def _block_list(self):
        return list(self.transformer.transformer_blocks)

    # ----- shapes ---------------------------------------------------------------------------
    geometry_presets = {"tiny": {"vae": 8}}

    @classmethod
    def geometry(cls, transformer_config, vae_config):
        return {"vae": 2 ** len(vae_config["temperal_downsample"])}  # QwenImagePipeline's vae_scale_factor

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
        vsf = self.pipe.vae_scale_factor
        channels = self.transformer.config.in_channels // 4
        return (channels, height // vsf, width // vsf)

    def image_seq_len(self, latent_shape):
        _, h, w = latent_shape
        return (h // 2) * (w // 2)

    # ----- text -----------------------------------------------------------------------------
    def _encode_prompts(self, prompts):
        with torch.no_grad():
            prompt_embeds, mask = self.pipe.encode_prompt(
                prompt=list(prompts), device=self.device, max_sequence_length=self.max_sequence_length)
        if mask is None:  # the pipeline drops an all-ones mask; keep one so batches can be concatenated
            mask = torch.ones(prompt_embeds.shape[:2], dtype=torch.long, device=prompt_embeds.device)
        return Conditioning({"prompt_embeds": prompt_embeds, "prompt_mask": mask})  # (B, L, D), (B, L)

    # ----- the split ------------------------------------------------------------------------
    def side_inputs(self, latent_shape, cond):
        _, h, w = latent_shape
        text_len = cond.tensors["prompt_embeds"].shape[1]
        # Same img_shapes as QwenImagePipeline; the (img, txt) freqs are complex64 and must stay so.
        rotary = self.transformer.pos_embed([[(1, h // 2, w // 2)]], max_txt_seq_len=text_len, device=self.device)
        return {"rotary": rotary, "text_mask": self._text_mask(cond), "latent_shape": tuple(latent_shape)}

    @staticmethod
    def _text_mask(cond: Conditioning) -> Tensor | None:
        # Padded text (encode_prompt's batch padding, Conditioning.cat's) is masked out of attention,
        # so a sample's velocity does not depend on its neighbours. Like QwenImagePipeline.encode_prompt,
        # an all-valid mask becomes None: unmasked attention (and the flash backend) then applies.
        mask = cond.tensors["prompt_mask"].bool()  # (B, L)
        return None if bool(mask.all()) else mask


    def embed(self, latents, sigma, cond, guidance=None):
        self.check_no_guidance(guidance)
        tr = self.transformer
        b, c, h, w = latents.shape
        packed = QwenImagePipeline._pack_latents(latents.to(self.dtype), b, c, h, w)  # (B, h*w/4, 4C)
        hidden = tr.img_in(packed)
        # QwenImagePipeline passes t / 1000 = sigma; the model's time projection scales by 1000 itself.
        temb = tr.time_text_embed(sigma.to(hidden.dtype), hidden)
        text = tr.txt_in(tr.txt_norm(cond.tensors["prompt_embeds"].to(hidden.dtype)))
        return State({"hidden": hidden, "text": text, "temb": temb}, self.side_inputs((c, h, w), cond))

    def run_block(self, i, state):
        a = state.acts
        text, hidden = self.blocks[i](
            hidden_states=a["hidden"], encoder_hidden_states=a["text"],
            encoder_hidden_states_mask=state.side["text_mask"], temb=a["temb"],
            image_rotary_emb=state.side["rotary"])
        return State({"hidden": hidden, "text": text, "temb": a["temb"]}, state.side)

    def head(self, state):
        tr = self.transformer
        hidden = tr.norm_out(state.acts["hidden"], state.acts["temb"])
        return self._unpack(tr.proj_out(hidden), state.side["latent_shape"])

    def _unpack(self, packed: Tensor, latent_shape) -> Tensor:
        _, h, w = latent_shape
        vsf = self.pipe.vae_scale_factor
        return QwenImagePipeline._unpack_latents(packed, h * vsf, w * vsf, vsf)[:, :, 0]  # drop the frame axis

    def combine_cfg(self, v_cond, v_uncond, scale):
        # QwenImagePipeline's true CFG rescales the guided velocity to the conditional one's norm, per
        # token of the packed layout (the norm runs over a 2x2 patch's channels).
        b, c, h, w = v_cond.shape
        cond = QwenImagePipeline._pack_latents(v_cond, b, c, h, w)  # (B, h*w/4, 4C)
        uncond = QwenImagePipeline._pack_latents(v_uncond, b, c, h, w)
        combined = uncond + scale * (cond - uncond)
        combined = combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
        return self._unpack(combined, (c, h, w))

    def reference_velocity(self, latents, sigma, cond, guidance=None):
        self.check_no_guidance(guidance)
        b, c, h, w = latents.shape
        out = self.transformer(
            hidden_states=QwenImagePipeline._pack_latents(latents.to(self.dtype), b, c, h, w),
            encoder_hidden_states=cond.tensors["prompt_embeds"].to(self.dtype),
            encoder_hidden_states_mask=self._text_mask(cond), timestep=sigma.to(self.dtype),
            img_shapes=[[(1, h // 2, w // 2)]] * b, return_dict=False)[0]
        return self._unpack(out, (c, h, w))

    # ----- pixels ---------------------------------------------------------------------------
    def _decode(self, latents):
        vae = self.pipe.vae
        z = latents.unsqueeze(2).to(vae.dtype)  # (B, C, 1, H, W): the video VAE's single frame
        # QwenImagePipeline's de-normalisation, written the same way.
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        z = z / inv_std + mean
        with torch.no_grad():
            images = vae.decode(z, return_dict=False)[0][:, :, 0]
        return to_unit_range(images)

    # ----- presets --------------------------------------------------------------------------
    @classmethod
    def scheduler(cls):
        return qwen_image_scheduler()

    @classmethod
    def offline_tokenizer(cls, key: str, length: int):
        return tiny_text.byte_bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                            pad_token="<|endoftext|>", eos_token="<|im_end|>")

    @classmethod
    def tiny(cls, seed: int = 0):
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=4, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4))
        # Three downsamplings: the real VAE factor of 8 (latent channels 4 = in_channels / 4).
        vae = AutoencoderKLQwenImage(
            base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
            latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
        tokenizer = tiny_text.byte_bpe_tokenizer(
            _QWEN_SPECIAL_TOKENS, pad_token="<|endoftext|>", eos_token="<|im_end|>")
        pipe = QwenImagePipeline(
            scheduler=qwen_image_scheduler(), vae=vae.eval(),
            text_encoder=tiny_qwen_vl_encoder(tokenizer, hidden=16, seed=seed + 1), tokenizer=tokenizer,
            transformer=transformer)
        return cls(pipe).with_sampling(**TINY_SAMPLING)


def tiny_qwen_vl_encoder(tokenizer, hidden: int = 16, seed: int = 0) -> Qwen2_5_VLForConditionalGeneration:
    """A Qwen2.5-VL of a few ten thousand parameters whose special-token ids are the tokenizer's."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _QWEN_SPECIAL_TOKENS}
    head_dim = hidden // 2
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
            # Multimodal rope: the (temporal, height, width) sections must sum to head_dim / 2.
            rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                             "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8]},
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden,
                           fullatt_block_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen_image_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """The scheduler config Qwen-Image ships (dynamic exponential shift from the image sequence length)."""
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
