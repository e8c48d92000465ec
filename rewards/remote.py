"""Rewards scored by an HTTP reward service (`--reward http://HOST:PORT/NAME[:WEIGHT]`).

The strongest rewards of the field are large models served apart from training (Flow-GRPO's OCR,
GenEval and UnifiedReward servers; VeRL-Omni's reward pool on a GPU of its own). A run names the
service by URL; `python -m scripts.reward_server` (rewards/server.py) serves any registered
reward. The wire carries no pickle (rewards/wire.py):

    POST http://HOST:PORT/NAME   body: a safetensors file of the float32 images, prompts and metadata
    200 application/json         {"reward": NAME, "protocol": 1, "scores": [B finite floats]}
    GET  http://HOST:PORT/NAME   {"reward": NAME, "protocol": 1}: the service is up and serves NAME

Images travel as float32, so the service scores exactly the tensor the run decoded, and scores
come back as JSON numbers: a float32 widened to a double prints and parses back to the same
bits, so remote scores equal local ones bit for bit (tests/test_remote_reward.py).

`HttpReward.submit` sends a fragment's images from an event loop thread (aiohttp) and returns at
once: the generator denoises its next fragment while the service scores (parallel/scoring.LocalScorer
lags a fragment's scores by one, as it does for scorer ranks). A request has one deadline,
`timeout_s` (--reward-timeout-s) from when the fragment was sent: connecting, sending, the answer's
headers and its body, retries included, so a service that answers a byte at a time is cut off as
one that never answers. A request that fails to connect, is cut off or gets a 5xx answer is retried
with exponential backoff until the deadline, so a service restarted within that time loses no
sample; an answer that is not the protocol (a 4xx, or a 200 that is not the JSON above, NaN or inf
among its scores) fails at once. Either way the run ends with one line naming the URL and what it
answered (`RewardServiceError`, a `RunAbort`: exit code 3), never with a made-up score.

A service started with `--token-file FILE` answers only requests that carry its token: a run sends
`Authorization: Bearer TOKEN` read from the file named by the environment variable
DIGENRL_REWARD_TOKEN_FILE (docs/rewards-http.md).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from typing import Sequence
from urllib.parse import urlsplit

import aiohttp
import torch
from torch import Tensor

from rewards.wire import PROTOCOL, decode_request, decode_scores, encode_request, encode_scores
from rl.nonfinite import RunAbort

SCHEMES = ("http://", "https://")
DEFAULT_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 5.0  # one try's connection; a service being restarted refuses or drops it, and is tried again
BACKOFF_S = (0.1, 2.0)  # first wait between tries, longest wait (doubling in between)
RESULT_MARGIN_S = 5.0  # a waiting caller's own bound beyond the deadline, should the event loop thread stall
MAX_ANSWER_CHARS = 200  # how much of a bad answer the error line quotes
TOKEN_ENV = "DIGENRL_REWARD_TOKEN_FILE"  # a file holding the token of services started with --token-file


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


def service_token() -> str | None:
    """The token sent to reward services: the text of the file DIGENRL_REWARD_TOKEN_FILE names (the
    one the service reads with --token-file), or None when the variable is unset. A ValueError names
    the variable and the file when it cannot be read or is empty."""
    path = os.environ.get(TOKEN_ENV, "").strip()
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{TOKEN_ENV}={path!r}: cannot read the reward service token ({e})") from None
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"{TOKEN_ENV}={path!r}: the file must hold one token (no spaces); it holds "
                         f"{'nothing' if not token else 'several words'}")
    return token


def _quote(text: str) -> str:
    text = " ".join(text.split())
    return repr(text[:MAX_ANSWER_CHARS] + ("..." if len(text) > MAX_ANSWER_CHARS else ""))


# ----- the event loop every request of this process runs on ------------------------------------

_loop_lock = threading.Lock()
_loop: tuple[int, asyncio.AbstractEventLoop] | None = None  # (the pid that started it, the loop)


def _event_loop() -> asyncio.AbstractEventLoop:
    """One daemon thread per process runs every reward request (it never holds up an exit); a
    forked child, which has no such thread, starts its own."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="reward-requests", daemon=True).start()
            _loop = (os.getpid(), loop)
        return _loop[1]


# ----- the client -------------------------------------------------------------------------------

class PendingRequest:
    """A batch's scores on their way from a service; `result()` waits for them, until the deadline."""

    def __init__(self, reward: "HttpReward", future: concurrent.futures.Future, deadline: float):
        self.reward, self.future, self.deadline = reward, future, deadline

    def result(self) -> Tensor:
        """The (B,) float32 scores, or RewardServiceError naming the URL. The request itself ends at
        its deadline; the margin only bounds this wait should the event loop thread stall."""
        try:
            return self.future.result(timeout=max(0.0, self.deadline - time.monotonic()) + RESULT_MARGIN_S)
        except concurrent.futures.TimeoutError:
            self.future.cancel()
            raise RewardServiceError(f"reward service {self.reward.url} gave no scores within "
                                     f"{self.reward.timeout_s:g} s (--reward-timeout-s; the request did not "
                                     f"end)") from None


class HttpReward:
    """A reward scored by a service at `url`; called like any reward, or asynchronously with `submit`."""

    remote = True

    def __init__(self, url: str, name: str, timeout_s: float = DEFAULT_TIMEOUT_S, token: str | None = None):
        """`timeout_s`: a request's deadline, retries included (--reward-timeout-s); `token`: sent as
        `Authorization: Bearer TOKEN` (service_token())."""
        self.url, self.name, self.timeout_s = url, name, float(timeout_s)
        self.headers = {"Content-Type": "application/octet-stream"}
        if token is not None:
            self.headers["Authorization"] = f"Bearer {token}"

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        return self.submit(images, prompts, metadata).result()

    def submit(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
               ) -> PendingRequest:
        """Send the batch from the event loop thread and return at once; the deadline counts from now."""
        deadline = time.monotonic() + self.timeout_s
        future: concurrent.futures.Future = concurrent.futures.Future()
        if images.shape[0] == 0:
            future.set_result(torch.zeros(0))
        else:
            body = encode_request(images, prompts, metadata)
            future = asyncio.run_coroutine_threadsafe(self._post(body, images.shape[0], deadline), _event_loop())
        return PendingRequest(self, future, deadline)

    async def _post(self, body: bytes, batch: int, deadline: float) -> Tensor:
        wait, tries, last = BACKOFF_S[0], 0, "nothing"
        while (left := deadline - time.monotonic()) > 0:
            tries += 1
            try:
                async with asyncio.timeout(left):  # the whole try: connect, send, the answer's headers and body
                    status, text = await self._try(body, batch, left)
            except aiohttp.ClientError as e:  # refused, reset, closed mid-answer, no connection in time: down?
                last = f"{type(e).__name__}: {str(e).splitlines()[0][:MAX_ANSWER_CHARS] if str(e) else ''}"
            except TimeoutError:  # the deadline, in the middle of a try
                last = f"no complete answer within {left:.0f} s"
            else:
                if status == 200:
                    try:
                        return decode_scores(self.name, text, batch)
                    except ValueError as e:
                        raise RewardServiceError(f"reward service {self.url} answered {e}: {_quote(text)}") from None
                last = f"HTTP {status} {_quote(text)}"
                if status < 500:  # the service understood and refused: trying again cannot help
                    raise RewardServiceError(f"reward service {self.url} answered {last}")
            await asyncio.sleep(max(0.0, min(wait, deadline - time.monotonic())))
            wait = min(2 * wait, BACKOFF_S[1])
        raise RewardServiceError(f"reward service {self.url} gave no scores within {self.timeout_s:g} s "
                                 f"(--reward-timeout-s; {tries} tries, the last: {last})")

    async def _try(self, body: bytes, batch: int, left: float) -> tuple[int, str]:
        """One request: (status, the answer's text). An answer longer than B scores can be is cut
        short (its text still says what went wrong)."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(CONNECT_TIMEOUT_S, left))
        cap = 4096 + 64 * batch
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.post(self.url, data=body, headers=self.headers) as answer:
            text = bytearray()
            async for chunk in answer.content.iter_chunked(1 << 16):
                text += chunk[:cap - len(text)]
                if len(text) >= cap:
                    break
            return answer.status, text.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"HttpReward({self.url})"


__all__ = ["DEFAULT_TIMEOUT_S", "HttpReward", "PROTOCOL", "PendingRequest", "RewardServiceError", "TOKEN_ENV",
           "decode_request", "decode_scores", "encode_request", "encode_scores", "is_url", "service_token",
           "split_url_spec"]
