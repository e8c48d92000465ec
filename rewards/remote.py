"""Rewards scored by an HTTP reward service (`--reward http://HOST:PORT/NAME[:WEIGHT]`).

The strongest rewards of the field are large models served apart from training (Flow-GRPO's OCR,
GenEval and UnifiedReward servers; VeRL-Omni's reward pool on a GPU of its own). A run names the
service by URL; `python -m scripts.reward_server` (rewards/server.py) serves any registered
reward. The wire carries no pickle:

    POST http://HOST:PORT/NAME   body: a safetensors file, {"images": float32 (B, 3, H, W) or
                                 (B, 3, F, H, W) in [0, 1]}, its header's metadata holding
                                 "prompts" and "metadata" as JSON lists of B entries
    200 application/json         {"reward": NAME, "protocol": 1, "scores": [B floats]}
    GET  http://HOST:PORT/NAME   {"reward": NAME, "protocol": 1}: the service is up and serves NAME

Images travel as float32, so the service scores exactly the tensor the run decoded, and scores
come back as JSON numbers: a float32 widened to a double prints and parses back to the same
bits, so remote scores equal local ones bit for bit (tests/test_remote_reward.py).

`HttpReward.submit` sends a fragment's images in a worker thread and returns a future: the
generator denoises its next fragment while the service scores (parallel/scoring.LocalScorer
lags a fragment's scores by one, as it does for scorer ranks). A request that fails to connect,
times out or gets a 5xx answer is retried with exponential backoff until `timeout_s` has passed
since the fragment was sent, so a service restarted within that time loses no sample; an answer
that is not the protocol (a 4xx, or a 200 that is not the JSON above) fails at once. Either way
the run ends with one line naming the URL and what it answered (`RewardServiceError`, a
`RunAbort`: exit code 3), never with a made-up score.
"""
from __future__ import annotations

import json
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence
from urllib.parse import urlsplit

import requests
import torch
from safetensors.torch import save as save_safetensors
from safetensors.torch import load as load_safetensors
from torch import Tensor

from rl.nonfinite import RunAbort

PROTOCOL = 1
SCHEMES = ("http://", "https://")
DEFAULT_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 5.0
BACKOFF_S = (0.1, 2.0)  # first wait between tries, longest wait (doubling in between)
MAX_ANSWER_CHARS = 200  # how much of a bad answer the error line quotes


class RewardServiceError(RunAbort):
    """A reward service did not answer with scores: the run stops, naming the URL and the answer."""


def is_url(spec: str) -> bool:
    return spec.strip().lower().startswith(SCHEMES)


def split_url_spec(spec: str) -> tuple[str, str, str | None]:
    """"http://HOST:PORT/NAME[:WEIGHT]" -> (url, NAME, weight text or None). The weight is the text
    after a colon in the last path segment, so a port's colon never reads as one."""
    spec = spec.strip()
    head, sep, last = spec.rpartition("/")
    name, colon, weight = last.partition(":")
    url = f"{head}{sep}{name}"
    parts = urlsplit(url)
    if not parts.hostname or not name or parts.path.count("/") < 1 or parts.query or parts.fragment:
        raise ValueError(f"bad reward spec {spec!r}: expected http://HOST:PORT/NAME[:WEIGHT]")
    try:
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError:
        raise ValueError(f"bad reward spec {spec!r}: the port of {url!r} is not a number") from None
    return url, name, weight if colon else None


# ----- the wire ---------------------------------------------------------------------------------

def encode_request(images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None) -> bytes:
    """A safetensors file of the float32 images with the prompts and metadata as JSON in its header."""
    prompts = list(prompts)
    metadata = [{} for _ in prompts] if metadata is None else [dict(m) for m in metadata]
    meta = {"prompts": json.dumps(prompts), "metadata": json.dumps(metadata)}
    return save_safetensors({"images": images.detach().float().cpu().contiguous()}, metadata=meta)


def decode_request(body: bytes) -> tuple[Tensor, list[str], list[dict]]:
    """The inverse of `encode_request`; a ValueError says what is wrong with a body that is not one."""
    if len(body) < 8:
        raise ValueError(f"the body is {len(body)} bytes, not a safetensors file")
    (header_len,) = struct.unpack("<Q", body[:8])
    if header_len > len(body) - 8:
        raise ValueError("the safetensors header runs past the body")
    try:
        header = json.loads(body[8:8 + header_len])
        meta = header.get("__metadata__") or {}
        prompts, metadata = json.loads(meta["prompts"]), json.loads(meta["metadata"])
        images = load_safetensors(body)["images"]
    except (ValueError, KeyError, TypeError, RuntimeError) as e:  # safetensors raises its own errors as these
        raise ValueError(f"not a reward request ({type(e).__name__}: {e})") from None
    if (not isinstance(prompts, list) or not isinstance(metadata, list) or images.dim() not in (4, 5)
            or images.dtype != torch.float32 or not len(prompts) == len(metadata) == images.shape[0]
            or not all(isinstance(p, str) for p in prompts) or not all(isinstance(m, dict) for m in metadata)):
        raise ValueError(f"a reward request holds float32 images (B, 3, H, W) or (B, 3, F, H, W) and B prompts "
                         f"and metadata dicts; got images {tuple(images.shape)} {images.dtype}, "
                         f"{len(prompts)} prompts, {len(metadata)} metadata entries")
    return images, prompts, metadata


def encode_scores(name: str, scores: Tensor) -> bytes:
    return json.dumps({"reward": name, "protocol": PROTOCOL, "scores": scores.float().cpu().tolist()}).encode()


def decode_scores(name: str, text: str, batch: int) -> Tensor:
    """The scores of an answer; a ValueError names what is wrong with one that does not follow the protocol."""
    try:
        answer = json.loads(text)
    except ValueError:
        raise ValueError("an answer that is not JSON") from None
    scores = answer.get("scores") if isinstance(answer, dict) else None
    if not isinstance(scores, list) or len(scores) != batch or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in scores):
        raise ValueError(f"JSON without {batch} scores")
    if answer.get("reward") != name:
        raise ValueError(f"the scores of reward {answer.get('reward')!r}, not {name!r}")
    return torch.tensor(scores, dtype=torch.float64).float()  # the float32 the service computed, bit for bit


def _quote(text: str) -> str:
    text = " ".join(text.split())
    return repr(text[:MAX_ANSWER_CHARS] + ("..." if len(text) > MAX_ANSWER_CHARS else ""))


# ----- the client -------------------------------------------------------------------------------

class HttpReward:
    """A reward scored by a service at `url`; called like any reward, or asynchronously with `submit`."""

    remote = True

    def __init__(self, url: str, name: str, timeout_s: float = DEFAULT_TIMEOUT_S, workers: int = 2):
        self.url, self.name, self.timeout_s = url, name, float(timeout_s)
        # Two workers: a fragment's request may be in flight while the next one is sent.
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"reward-{name}")
        self.local = threading.local()  # a requests.Session per worker thread (sessions are not thread-safe)

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        return self.submit(images, prompts, metadata).result()

    def submit(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Future:
        """Send the batch in a worker thread; the future's result is its (B,) float32 scores, or
        RewardServiceError. The deadline counts from now."""
        if images.shape[0] == 0:
            done: Future = Future()
            done.set_result(torch.zeros(0))
            return done
        body = encode_request(images, prompts, metadata)
        return self.pool.submit(self._post, body, images.shape[0], time.monotonic() + self.timeout_s)

    def _session(self) -> requests.Session:
        if not hasattr(self.local, "session"):
            self.local.session = requests.Session()
        return self.local.session

    def _post(self, body: bytes, batch: int, deadline: float) -> Tensor:
        wait, tries, last = BACKOFF_S[0], 0, "nothing"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RewardServiceError(f"reward service {self.url} gave no scores within {self.timeout_s:g} s "
                                         f"(--reward-timeout-s; {tries} tries, the last: {last})")
            tries += 1
            try:
                answer = self._session().post(self.url, data=body, timeout=(min(CONNECT_TIMEOUT_S, left), left),
                                              headers={"Content-Type": "application/octet-stream"})
            except requests.Timeout:
                last = f"no answer within {left:.0f} s"
            except requests.RequestException as e:  # refused, reset, closed mid-answer: a restart, or down
                last = f"{type(e).__name__}: {str(e).splitlines()[0][:MAX_ANSWER_CHARS]}"
            else:
                if answer.status_code == 200:
                    try:
                        return decode_scores(self.name, answer.text, batch)
                    except ValueError as e:
                        raise RewardServiceError(f"reward service {self.url} answered {e}: "
                                                 f"{_quote(answer.text)}") from None
                last = f"HTTP {answer.status_code} {_quote(answer.text)}"
                if answer.status_code < 500:  # the service understood and refused: trying again cannot help
                    raise RewardServiceError(f"reward service {self.url} answered {last}")
            time.sleep(max(0.0, min(wait, deadline - time.monotonic())))
            wait = min(2 * wait, BACKOFF_S[1])

    def __repr__(self) -> str:
        return f"HttpReward({self.url})"


__all__ = ["DEFAULT_TIMEOUT_S", "HttpReward", "PROTOCOL", "RewardServiceError", "decode_request", "decode_scores",
           "encode_request", "encode_scores", "is_url", "split_url_spec"]
