"""What the bytes of a model folder are, cheaply: a digest per file that a run records (config.json's
run record, every checkpoint's) and compares when it resumes, so that a base model whose weights
changed under the same path is named, and the same bytes under another path are recognised
(docs/reliability.md). scripts/encode_prompts.py records the text encoders' digests in its file.

A file's digest is the SHA-256 of its size and:
- a file of up to WHOLE bytes: all of it (configs, tokenizers, small weights: every byte counts);
- a larger safetensors file: its header (every tensor's name, dtype, shape and byte range) and,
  for every tensor, its bytes at the start, the middle and the end (WINDOW bytes each; a tensor of
  up to 3 windows whole);
- any other larger file: WINDOWS windows spread evenly over it.
It catches another model or checkpoint of the same architecture, a fine-tune, weights converted to
another dtype, a tensor reshaped, renamed, added or removed, a truncated or extended file, and
noise or any other change that reaches a tensor's first, middle or last 4 KiB; it misses a change
confined to bytes between those windows (a few weights edited by hand). It reads about 12 KiB per
tensor: a few MB for a 12B-parameter model, not its 24 GB. Pure file code: no torch.
"""
from __future__ import annotations

import hashlib
import json
import os

METHOD = "sha256-sampled-1"  # the digest's recipe: records made with another are not compared
WHOLE = 4 << 20
WINDOW = 4096
WINDOWS = 64
KINDS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json", ".model", ".txt", ".tiktoken")
"""what a model folder's meaning is made of: weights, configs, tokenizers (not READMEs or licenses)"""


def _windows(size: int, begin: int, end: int, count: int) -> list[tuple[int, int]]:
    """`count` windows of WINDOW bytes spread over [begin, end), the whole range when it is short."""
    if end - begin <= count * WINDOW:
        return [(begin, end)]
    step = (end - begin - WINDOW) / (count - 1)
    return [(begin + int(i * step), begin + int(i * step) + WINDOW) for i in range(count)]


def file_digest(path: str) -> str:
    """The sampled SHA-256 of one file (module docstring)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= WHOLE:
            h.update(f.read())
            return h.hexdigest()
        ranges = _tensor_windows(f, size) if path.endswith(".safetensors") else None
        for begin, end in ranges if ranges is not None else _windows(size, 0, size, WINDOWS):
            f.seek(begin)
            h.update(f.read(end - begin))
    return h.hexdigest()


def _tensor_windows(f, size: int) -> list[tuple[int, int]] | None:
    """The header and three windows of every tensor of a safetensors file (None: not one)."""
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 2 or 8 + n > size:
        return None
    try:
        header = json.loads(f.read(n))
        spans = sorted((int(v["data_offsets"][0]), int(v["data_offsets"][1])) for k, v in header.items()
                       if k != "__metadata__")
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    out = [(0, 8 + n)]
    for begin, end in spans:
        out += _windows(size, 8 + n + begin, 8 + n + end, 3)
    return out


def folder_digest(folder: str, under: tuple[str, ...] | None = None) -> dict:
    """{"method", "files": {relative path: digest}} of the model files of `folder` (KINDS; hidden
    files and folders left out), only those below the subfolders `under` when given."""
    files = {}
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(root, name), folder)
            if name.startswith(".") or not name.endswith(KINDS):
                continue
            if under is not None and rel.split(os.sep, 1)[0] not in under:
                continue
            files[rel] = file_digest(os.path.join(root, name))
    return {"method": METHOD, "files": files}


def differences(then: dict | None, now: dict | None) -> list[str] | None:
    """The files whose bytes differ between two digests of a folder ('transformer/x.safetensors
    changed', '... added', '... removed'); [] for the same bytes; None when either is missing or
    made another way (nothing to compare)."""
    if not then or not now or then.get("method") != METHOD or now.get("method") != METHOD:
        return None
    a, b = then.get("files", {}), now.get("files", {})
    out = [f"{rel} changed" for rel in sorted(a) if rel in b and a[rel] != b[rel]]
    out += [f"{rel} removed" for rel in sorted(a) if rel not in b]
    out += [f"{rel} added" for rel in sorted(b) if rel not in a]
    return out
