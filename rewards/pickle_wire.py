"""The peers' pickle protocols for reward servers, and the restricted unpickler that reads them.

Flow-GRPO's reward servers (yifan123/reward-server, app_geneval.py and app_deqa.py: Flask, one
reward at `POST /`) and VeRL-Omni's HTTP scorers (verl_omni/utils/reward_score/http_scorer_client.py)
take a pickled dict with the images as JPEG bytes and answer a pickled dict:

    flow_grpo   {"images": [JPEG bytes], "meta_datas": [B dicts], "only_strict": True, "prompts": [B str]}
                -> {"scores": [B floats], ...} (GenEval: also rewards, strict_rewards, group_*), or
                   {"outputs": [B floats]} (DeQA, Flow-GRPO's UnifiedReward server); 500 with a traceback
    verl_omni   {"images": [JPEG bytes], "prompts": [B str], "metadata": {}}
                -> {"scores": [B floats]}, or {"error": TEXT} (also with a 200)

Images are made JPEG as both peers' clients make them: floats to uint8 by round(255 x), then PIL's
`save(format="JPEG")` at its default quality (75). A run that scores this way scores JPEG-decoded
images, so its local counterpart is a reward that scores the same JPEG round trip
(tests/test_peer_protocols.py).

A pickle runs whatever its bytes name. An answer is read by `safe_loads`, which admits only
plain containers (dict, list, tuple, set), numbers, strings, bytes, None and numpy arrays and
scalars of numeric dtypes; anything else (a class, a function such as os.system) is refused with
a ValueError naming what the pickle asked for, before it is called. The server reads requests the
same way (rewards/server.py), so neither side runs the other's code.
"""
from __future__ import annotations

import io
import pickle
from typing import Sequence

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from rewards.reward import to_uint8_hwc

PROTOCOLS = ("flow_grpo", "verl_omni")
ANSWER_KEYS = ("scores", "outputs")  # flow_grpo: GenEval's "scores" (the partial credit Flow-GRPO trains on), or "outputs"
MAX_SIDE = 4096  # a request image's side the server decodes at most (a JPEG declares its size before it is decoded)


class Refused(pickle.UnpicklingError):
    """A pickle asked for something beyond plain data."""


class _NdarrayToken:
    """Stands for numpy.ndarray in a pickle: accepted only as _reconstruct's first argument, never called."""


def _reconstruct(subtype, shape, dtype_code):
    """numpy's _reconstruct for the empty array numpy's own pickles start from (its state follows)."""
    if subtype is not _NdarrayToken or tuple(shape) != (0,):
        raise Refused("numpy _reconstruct of anything but an empty ndarray")
    return _NUMPY_RECONSTRUCT(np.ndarray, (0,), dtype_code)


def _frombuffer(buffer, dtype, shape, order):
    """numpy's _frombuffer (pickle protocol 5): an array of a numeric dtype over the given bytes."""
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise Refused("a numpy array of Python objects")
    return np.frombuffer(buffer, dtype=dtype).reshape(shape, order=order)


_NUMPY_RECONSTRUCT = np.zeros(0).__reduce__()[0]
_NUMPY = {"_reconstruct": _reconstruct, "scalar": np.zeros(1, np.float32)[0].__reduce__()[0],
          "_frombuffer": _frombuffer}
ALLOWED = {
    **{(module, name): fn for module in ("numpy.core.multiarray", "numpy._core.multiarray") for name, fn in _NUMPY.items()
       if name != "_frombuffer"},
    **{(module, "_frombuffer"): _frombuffer for module in ("numpy.core.numeric", "numpy._core.numeric")},
    ("numpy", "ndarray"): _NdarrayToken, ("numpy", "dtype"): np.dtype,
    **{(module, fn.__name__): fn for module in ("builtins", "__builtin__") for fn in (set, frozenset, bytearray)},
    ("_codecs", "encode"): lambda text, encoding="utf-8": text.encode(encoding),  # protocol 2's bytes
}
"""(module, name) -> what a pickle may name: numpy's array and scalar rebuilding, plain containers"""


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED:
            raise Refused(f"the pickle names {module}.{name}, which may run code; a reward answer "
                                         f"may hold only containers, numbers, strings, bytes and numpy arrays")
        return ALLOWED[(module, name)]


def safe_loads(data: bytes):
    """Unpickle plain data only; a ValueError says what else the pickle held or why it is not one."""
    try:
        return SafeUnpickler(io.BytesIO(data)).load()
    except Refused as e:
        raise ValueError(f"a pickle refused: {e}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, OverflowError, MemoryError,
            RecursionError) as e:
        raise ValueError(f"not a pickle ({type(e).__name__}: {str(e)[:100]})") from None


def jpeg_bytes(images: Tensor) -> list[bytes]:
    """(N, 3, H, W) floats in [0, 1] -> JPEG files, as Flow-GRPO's and VeRL-Omni's clients make them."""
    out = []
    for array in to_uint8_hwc(images):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG")
        out.append(buffer.getvalue())
    return out


def jpeg_round_trip(images: Tensor) -> Tensor:
    """What a pickle-protocol server sees of (N, 3, H, W) images: their JPEGs decoded, floats in [0, 1]."""
    return decode_images(jpeg_bytes(images))


def encode_request(protocol: str, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> bytes:
    """A peer server's request for (N, 3, H, W) images. Flow-GRPO's GenEval server reads each sample's
    metadata (its jsonl fields, with the prompt); its other servers read the images and the prompts."""
    jpegs = jpeg_bytes(images)
    if protocol == "flow_grpo":
        meta = [{**m, "prompt": m.get("prompt", p)} for p, m in zip(prompts, metadata)]
        payload = {"images": jpegs, "meta_datas": meta, "only_strict": True, "prompts": list(prompts)}
    else:
        payload = {"images": jpegs, "prompts": list(prompts), "metadata": {}}
    return pickle.dumps(payload, protocol=4)


def decode_answer(data: bytes, count: int) -> Tensor:
    """The (count,) float32 scores of a peer server's answer; a ValueError says what is wrong with it."""
    answer = safe_loads(data)
    if not isinstance(answer, dict):
        raise ValueError(f"a pickled {type(answer).__name__}, not a dict of scores")
    if "error" in answer:
        raise ValueError(f"an error: {str(answer['error'])[:200]!r}")
    key = next((k for k in ANSWER_KEYS if k in answer), None)
    if key is None:
        raise ValueError(f"a dict without 'scores' or 'outputs' (its keys: {sorted(map(str, answer))[:8]})")
    try:
        values = np.asarray(answer[key], dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{key!r} that are not numbers") from None
    if values.shape != (count,):
        raise ValueError(f"{values.size} {key} for {count} images")
    scores = torch.from_numpy(values).float()  # NaN, inf and numbers beyond float32 are a broken server
    bad = [i for i in range(count) if not torch.isfinite(scores[i])]
    if bad:
        raise ValueError(f"non-finite scores ({', '.join(f'{scores[i].item()} at sample {i}' for i in bad[:4])}"
                         f"{', ...' if len(bad) > 4 else ''})")
    return scores


def error_text(data: bytes) -> bytes:
    """What a failed answer says: the text of a pickled {"error": TEXT} (VeRL-Omni's), else its bytes."""
    try:
        answer = safe_loads(data)
    except ValueError:
        return data
    return str(answer["error"]).encode() if isinstance(answer, dict) and "error" in answer else data


# ----- the server's side (rewards/server.py serves registered rewards this way) --------------------

def decode_images(jpegs: Sequence[bytes], max_side: int = MAX_SIDE) -> Tensor:
    """JPEG files of one size -> (N, 3, H, W) floats in [0, 1]; each image's size is read from its
    header and checked before it is decoded. A ValueError names the image and what is wrong."""
    arrays = []
    for i, data in enumerate(jpegs):
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"image {i} is a {type(data).__name__}, not JPEG bytes")
        try:
            image = Image.open(io.BytesIO(data), formats=["jpeg"])
            if max(image.size) > max_side:
                raise ValueError(f"image {i} is {image.size[0]} x {image.size[1]}; this service takes at most "
                                 f"{max_side} pixels on a side")
            arrays.append(np.asarray(image.convert("RGB")))
        except (OSError, Image.DecompressionBombError) as e:
            raise ValueError(f"image {i} is not a JPEG ({type(e).__name__}: {str(e)[:100]})") from None
    if len({a.shape for a in arrays}) > 1:
        raise ValueError(f"images of several sizes: {sorted({a.shape[:2] for a in arrays})}")
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255.0  # (N, 3, H, W)


def decode_request(data: bytes, max_side: int = MAX_SIDE) -> tuple[Tensor, list[str], list[dict]]:
    """A Flow-GRPO or VeRL-Omni request -> (images (N, 3, H, W), prompts, metadata). The prompts are
    the request's "prompts", else each metadata's "prompt"; the metadata its "meta_datas" (Flow-GRPO)."""
    payload = safe_loads(data)
    if not isinstance(payload, dict) or not isinstance(payload.get("images"), (list, tuple)) or not payload["images"]:
        raise ValueError("a request is a pickled dict whose 'images' is a list of JPEG bytes")
    count = len(payload["images"])
    metadata = payload.get("meta_datas")
    metadata = [{} for _ in range(count)] if metadata is None else list(metadata)
    prompts = payload.get("prompts")
    prompts = [m.get("prompt", "") if isinstance(m, dict) else "" for m in metadata] if prompts is None else list(prompts)
    if len(prompts) != count or len(metadata) != count or not all(isinstance(p, str) for p in prompts) \
            or not all(isinstance(m, dict) for m in metadata):
        raise ValueError(f"a request of {count} images holds {count} prompts (text) and {count} metadata dicts; got "
                         f"{len(prompts)} and {len(metadata)}")
    return decode_images(payload["images"], max_side), prompts, metadata


def encode_answer(scores: Tensor) -> bytes:
    """Scores as both peers' clients read them: "scores" (VeRL-Omni, GenEval's) and "outputs" (DeQA)."""
    values = [float(s) for s in scores.float().tolist()]
    return pickle.dumps({"scores": values, "outputs": values}, protocol=4)


__all__ = ["ALLOWED", "PROTOCOLS", "SafeUnpickler", "decode_answer", "decode_images", "decode_request",
           "encode_answer", "error_text", "encode_request", "jpeg_bytes", "jpeg_round_trip", "safe_loads"]
