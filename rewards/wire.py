"""The reward service's wire format (rewards/remote.py is the client, rewards/server.py the server).

    POST http://HOST:PORT/NAME   body: a safetensors file, {"images": float32 (B, 3, H, W) or
                                 (B, 3, F, H, W) in [0, 1]}, its header's metadata holding
                                 "prompts" and "metadata" as JSON lists of B entries
    200 application/json         {"reward": NAME, "protocol": 1, "scores": [B finite floats]}

A body is checked against the safetensors layout before any tensor is made: one float32 tensor
"images" whose shape, data offsets and the body's length agree exactly (no trailing bytes), and a
header of at most MAX_HEADER_BYTES. A declared shape is never allocated: the images are a view of
the body's own bytes, so a body costs its size once. An answer's scores must be finite in float32:
NaN, inf and numbers beyond float32 are a broken service, not a score.
"""
from __future__ import annotations

import json
import math
import struct
from typing import Sequence

import numpy as np
import torch
from safetensors.torch import save as save_safetensors
from torch import Tensor

PROTOCOL = 1
MAX_HEADER_BYTES = 16 << 20  # the prompts and metadata of a batch; safetensors itself allows 100 MB


def encode_request(images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None) -> bytes:
    """A safetensors file of the float32 images with the prompts and metadata as JSON in its header."""
    prompts = list(prompts)
    metadata = [{} for _ in prompts] if metadata is None else [dict(m) for m in metadata]
    meta = {"prompts": json.dumps(prompts), "metadata": json.dumps(metadata)}
    return save_safetensors({"images": images.detach().float().cpu().contiguous()}, metadata=meta)


def decode_request(body) -> tuple[Tensor, list[str], list[dict]]:
    """The inverse of `encode_request` for any bytes-like body (a writable one is not copied: the
    images are a view of it); a ValueError says what is wrong with a body that is not one."""
    view = memoryview(body).cast("B")
    if len(view) < 8:
        raise ValueError(f"the body is {len(view)} bytes, not a safetensors file")
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > len(view) - 8:
        raise ValueError(f"the safetensors header ({header_len} bytes) runs past the body ({len(view)} bytes)")
    if header_len > MAX_HEADER_BYTES:
        raise ValueError(f"a safetensors header of {header_len} bytes; a request's is at most {MAX_HEADER_BYTES}")
    header = _json(bytes(view[8:8 + header_len]), "the safetensors header")
    if not isinstance(header, dict) or set(header) != {"images", "__metadata__"}:
        raise ValueError(f"a reward request holds one tensor, 'images', and metadata; the header has "
                         f"{sorted(header)[:8] if isinstance(header, dict) else type(header).__name__}")
    entry, meta = header["images"], header["__metadata__"]
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if (not isinstance(shape, list) or entry.get("dtype") != "F32" or len(shape) not in (4, 5)
            or not all(type(n) is int and n > 0 for n in shape) or shape[1] != 3):
        raise ValueError(f"images are float32 (B, 3, H, W) or (B, 3, F, H, W); the header says {_clip(entry)}")
    start, nbytes = 8 + header_len, 4 * math.prod(shape)
    if entry.get("data_offsets") != [0, nbytes] or len(view) - start != nbytes:
        raise ValueError(f"images {shape} are {nbytes} bytes at data_offsets [0, {nbytes}]; the header says "
                         f"{_clip(entry.get('data_offsets'))} and the body holds {len(view) - start} bytes after it")
    if not isinstance(meta, dict) or not isinstance(meta.get("prompts"), str) or \
            not isinstance(meta.get("metadata"), str):
        raise ValueError("the header's __metadata__ holds 'prompts' and 'metadata', each a JSON list as text")
    prompts, metadata = _json(meta["prompts"], "prompts"), _json(meta["metadata"], "metadata")
    batch = shape[0]
    if (not isinstance(prompts, list) or not isinstance(metadata, list) or not len(prompts) == len(metadata) == batch
            or not all(isinstance(p, str) for p in prompts) or not all(isinstance(m, dict) for m in metadata)):
        raise ValueError(f"a request of {batch} images holds {batch} prompts (text) and {batch} metadata dicts; got "
                         f"{_count(prompts)} prompts and {_count(metadata)} metadata entries")
    return _images(view, start, shape), prompts, metadata


def _images(view: memoryview, start: int, shape: list[int]) -> Tensor:
    """The images as a view of the body (safetensors is little-endian, as every supported host);
    a read-only or misaligned body is copied first."""
    data = np.frombuffer(view, dtype=np.uint8, offset=start)
    if view.readonly or data.ctypes.data % 4:
        data = data.copy()
    return torch.from_numpy(data.view(np.float32)).reshape(shape)


def encode_scores(name: str, scores: Tensor) -> bytes:
    return json.dumps({"reward": name, "protocol": PROTOCOL, "scores": scores.float().cpu().tolist()}).encode()


def decode_scores(name: str, text: str, batch: int) -> Tensor:
    """The scores of an answer; a ValueError names what is wrong with one that does not follow the protocol."""
    try:
        answer = json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError("an answer that is not JSON") from None
    scores = answer.get("scores") if isinstance(answer, dict) else None
    if not isinstance(scores, list) or len(scores) != batch or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in scores):
        raise ValueError(f"JSON without {batch} scores")
    if answer.get("reward") != name:
        raise ValueError(f"the scores of reward {answer.get('reward')!r}, not {name!r}")
    wide = [float(x) if isinstance(x, float) or abs(x) < 2 ** 1023 else math.inf for x in scores]
    got = torch.tensor(wide, dtype=torch.float64).float()  # the float32 the service computed, bit for bit
    bad = [i for i in range(batch) if not math.isfinite(got[i])]
    if bad:
        raise ValueError(f"non-finite scores ({', '.join(f'{got[i].item()} at sample {i}' for i in bad[:4])}"
                         f"{', ...' if len(bad) > 4 else ''})")
    return got


def _json(text, what: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
        raise ValueError(f"{what} is not JSON ({type(e).__name__}: {str(e)[:100]})") from None


def _clip(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text[:200] + ("..." if len(text) > 200 else "")


def _count(value) -> str:
    return str(len(value)) if isinstance(value, list) else f"a {type(value).__name__}"


__all__ = ["MAX_HEADER_BYTES", "PROTOCOL", "decode_request", "decode_scores", "encode_request", "encode_scores"]
