"""Precomputed prompt embeddings (--prompt-embeds FILE; written by scripts/encode_prompts.py).

DanceGRPO encodes its prompt set once before training and trains without text encoders on its
GPUs; this is that option. The file is a safetensors file: the conditioning tensors of every prompt
as a batch of one (`{row}/{name}`, e.g. `0/prompt_embeds`), and in its metadata the prompts in row
order, the model family, the text length, each tensor's dimensions and the encoder that wrote it:
the model folder and the digest of its text encoders' and tokenizers' files
(checkpointing/digests.py), or the preset and seed. A run refuses, before any rank waits, a file
whose encoder is not its model's: another model of the family (other dimensions, or the same
dimensions and other weights: the rows would condition the transformer on another encoder's space).
Conditioning is padded to a fixed length, so a prompt encoded alone equals the same prompt encoded
in a batch (docs/DESIGN.md section 4), and a looked-up batch is the concatenation of its rows.
Every rank that would encode (generators, evaluating or TAG trainers) reads the rows it needs from
the file (memory-mapped), so no rank holds a text encoder. The embeddings carry the dtype and
device kernels they were computed with: a run that encodes on the fly on other hardware may differ
in the last bits, but every rank of a run reads the same file, so placement invariance holds.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from checkpointing import digests
from models import TEXT_ENCODERS
from rl.conditioning import Conditioning

KIND = "digenrl-prompt-embeds"
ENCODER_FOLDERS = (*TEXT_ENCODERS, "tokenizer", "tokenizer_2", "tokenizer_3")
"""the model folder's components whose bytes decide what a prompt's conditioning is"""


def encoder_record(model_path: str | None, preset: str, seed: int) -> dict:
    """What encodes a run's prompts: its model folder's text encoders and tokenizers (their bytes),
    or a preset built from the seed."""
    if model_path:
        return {"model_path": os.path.realpath(model_path),
                "digest": digests.folder_digest(model_path, under=ENCODER_FOLDERS)}
    return {"preset": preset, "seed": seed}


def describe_encoder(encoder: dict) -> str:
    if "preset" in encoder:
        return f"the {encoder['preset']} preset with seed {encoder['seed']}"
    return f"the text encoders of {encoder['model_path']}"


def save(path: str, rows: dict[str, Conditioning], family: str, text_length: int, encoder: dict) -> None:
    """Write the conditioning of each prompt (a batch of one) to `path`, with what encoded it
    (`encoder_record`)."""
    tensors = {f"{i}/{name}": t.detach().to("cpu").clone()
               for i, cond in enumerate(rows.values()) for name, t in cond.tensors.items()}
    first = next(iter(rows.values())).tensors
    dims = {name: list(t.shape[1:]) for name, t in first.items()}  # a row's shape, batch dimension left out
    meta = {"kind": KIND, "family": family, "text_length": str(text_length), "prompts": json.dumps(list(rows)),
            "dims": json.dumps(dims), "encoder": json.dumps(encoder)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(tensors, path, metadata=meta)


def read_header(path: str) -> dict:
    """The file's metadata (no tensor is read): {"family", "text_length", "prompts", "dims",
    "encoder"} (the last two None in a file of an older version). A file that is not a
    prompt-embeddings file is a ValueError naming it."""
    if not os.path.exists(path):
        raise ValueError(f"--prompt-embeds {path!r} does not exist (write it with python -m scripts.encode_prompts)")
    if not os.path.isfile(path):
        raise ValueError(f"--prompt-embeds {path!r} is not a regular file")
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"--prompt-embeds {path!r} is not a safetensors file ({e})") from None
    if meta.get("kind") != KIND:
        raise ValueError(f"--prompt-embeds {path!r} is not a prompt-embeddings file of scripts/encode_prompts.py")
    return {"family": meta["family"], "text_length": int(meta["text_length"]), "prompts": json.loads(meta["prompts"]),
            "dims": json.loads(meta["dims"]) if "dims" in meta else None,
            "encoder": json.loads(meta["encoder"]) if "encoder" in meta else None}


def check(path: str, family: str, prompts: list[str], encoder: dict | None = None) -> None:
    """Before anything loads: the file is of this family, was written by the run's text encoders
    (`encoder`: `encoder_record` of the run's model; None: not compared, no model folder at hand)
    and holds every prompt the run encodes (ValueError naming the first missing one)."""
    header = read_header(path)
    if header["family"] != family:
        raise ValueError(f"--prompt-embeds {path!r} holds {header['family']!r} embeddings, the run's model is {family!r}")
    if encoder is not None:
        check_encoder(path, header, encoder)
    held = set(header["prompts"])
    missing = [p for p in dict.fromkeys(prompts) if p not in held]
    if missing:
        raise ValueError(f"--prompt-embeds {path!r} lacks {len(missing)} of the run's prompts, e.g. {missing[0]!r}; "
                         f"encode every prompt file the run reads (and the negative prompt with CFG)")


def check_encoder(path: str, header: dict, encoder: dict) -> None:
    """The file's rows come from `encoder` (its bytes, wherever its folder is now): ValueError
    naming both encoders, the file's dimensions and the files that differ otherwise."""
    theirs = header["encoder"]
    if theirs is None:
        raise ValueError(f"--prompt-embeds {path!r} does not record the text encoders that wrote it (an older "
                         f"scripts.encode_prompts): encode the prompts again")
    if "preset" in theirs or "preset" in encoder:
        same, why = theirs == encoder, ""
    else:
        changed = digests.differences(theirs.get("digest"), encoder["digest"])
        same, why = changed == [], f"; {', '.join(changed[:3]) if changed else 'not comparable'}"
    if not same:
        dims = ", ".join(f"{n} {'x'.join(map(str, d))}" for n, d in (header["dims"] or {}).items())
        raise ValueError(f"--prompt-embeds {path!r} was encoded by {describe_encoder(theirs)} ({dims}), not by "
                         f"{describe_encoder(encoder)}, the run's{why}: encode the prompts again with the run's model "
                         f"(python -m scripts.encode_prompts)")


class PromptEmbeddings:
    """The rows of a prompt-embeddings file, read on demand (`DiTAdapter.prompt_cache`)."""

    def __init__(self, path: str, text_length: int | None = None):
        """`text_length`: the adapter's; a file written with another is refused."""
        header = read_header(path)
        if text_length is not None and header["text_length"] != text_length:
            raise ValueError(f"--prompt-embeds {path!r} was encoded with text length {header['text_length']}, the "
                             f"model pads to {text_length}")
        self.path = path
        self.row = {p: i for i, p in enumerate(header["prompts"])}
        self._file = safe_open(path, framework="pt")
        self.names = sorted({k.split("/", 1)[1] for k in self._file.keys()})

    def lookup(self, prompts: list[str]) -> Conditioning:
        """The conditioning of `prompts` as one batch (on the host)."""
        rows = []
        for p in prompts:
            if p not in self.row:
                raise KeyError(f"prompt {p!r} is not in {self.path}")
            i = self.row[p]
            rows.append(Conditioning({n: self._file.get_tensor(f"{i}/{n}") for n in self.names}))
        return Conditioning.cat(rows)


def encode_all(adapter, prompts: list[str], batch_size: int = 8) -> dict[str, Conditioning]:
    """Each distinct prompt's conditioning as a batch of one, encoded `batch_size` at a time."""
    unique = list(dict.fromkeys(prompts))
    out = {}
    with torch.no_grad():
        for lo in range(0, len(unique), batch_size):
            batch = unique[lo:lo + batch_size]
            cond = adapter.encode_prompts(batch)
            for j, p in enumerate(batch):
                out[p] = cond.select(slice(j, j + 1))
    return out
