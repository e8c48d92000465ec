"""Offline tokenizers and tiny text encoders for the `tiny` presets (recipes: docs/MODELS.md).

Nothing here touches the network: byte-level vocabularies are built in memory."""
from __future__ import annotations

import torch
from transformers import (
    ByT5Tokenizer,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
)
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers.convert_slow_tokenizer import bytes_to_unicode


def byte_symbols() -> list[str]:
    return list(bytes_to_unicode().values())


def clip_tokenizer(max_length: int = 77) -> CLIPTokenizer:
    """CLIP BPE tokenizer over the 256 byte symbols (each also with `</w>`) and no merges."""
    vocab: dict[str, int] = {}
    for suffix in ("", "</w>"):
        for s in byte_symbols():
            vocab[s + suffix] = len(vocab)
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    tok = CLIPTokenizer(vocab=vocab, merges=[])
    tok.model_max_length = max_length
    return tok


def clip_text_encoder(tok: CLIPTokenizer, hidden: int = 32, projection_dim: int = 32, seed: int = 0) -> CLIPTextModel:
    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=tok.model_max_length, projection_dim=projection_dim,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    return CLIPTextModel(config).eval()


def t5_tokenizer() -> ByT5Tokenizer:
    """ByT5's byte tokenizer needs no vocabulary file."""
    return ByT5Tokenizer()


def t5_encoder(d_model: int = 32, num_layers: int = 1, seed: int = 0) -> T5EncoderModel:
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=384, d_model=d_model, d_kv=d_model // 2, d_ff=2 * d_model, num_layers=num_layers,
        num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=32,
    )
    return T5EncoderModel(config).eval()


def byte_bpe_tokenizer(special_tokens: list[str], **named_specials) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with no merges, for families whose encoder is a decoder LM
    (Qwen2.5-VL, Llama). `named_specials` maps e.g. pad_token='<|endoftext|>'."""
    vocab = {s: i for i, s in enumerate(byte_symbols())}
    for special in special_tokens:
        vocab.setdefault(special, len(vocab))
    tokenizer = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **named_specials)
    fast.add_special_tokens({"additional_special_tokens": [s for s in special_tokens if s not in named_specials.values()]})
    return fast
