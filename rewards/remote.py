"""Rewards scored by an HTTP reward service: `--reward [PROTOCOL+]http://HOST:PORT/NAME[:WEIGHT]`.

The strongest rewards of the field are large models served apart from training (Flow-GRPO's OCR,
GenEval and UnifiedReward servers; VeRL-Omni's reward pool on a GPU of its own). A run names the
service by URL, and the URL's scheme says which protocol it speaks (`PROTOCOLS`):

    http://HOST:PORT/NAME                 this project's (python -m scripts.reward_server; rewards/wire.py):
                                          POST to the URL, float32 images in a safetensors body, JSON scores,
                                          exact; the service must serve NAME
    flow_grpo+http://HOST:PORT/NAME       Flow-GRPO's reward servers (rewards/pickle_wire.py): POST to
                                          http://HOST:PORT/ (the URL without NAME), JPEG images in a pickle
    verl_omni+http://HOST:PORT/NAME       VeRL-Omni's HTTP scorers: the same, with its own keys
    openai+http://HOST:PORT/v1/NAME       a VLM judge (rewards/judge.py): POST to http://HOST:PORT/v1/chat/completions,
                                          one image per request, with --reward-judge NAME=FILE

NAME is the reward's name in the run (its weight, logs, --reward-scale); for the peers' protocols
it is the run's only, since their servers serve one reward at their root. `https` works for each.

`HttpReward.submit` sends a fragment's images from an event loop thread (aiohttp) and returns at
once: the generator denoises its next fragment while the service scores (parallel/scoring.LocalScorer
lags a fragment's scores by one, as it does for scorer ranks). A batch has one deadline, `timeout_s`
(--reward-timeout-s) from when the fragment was sent, for all its requests (a judge's, one per
image, `concurrency` at a time): connecting, sending, the answer's headers and its body, retries
included, so a service that answers a byte at a time is cut off as one that never answers. A
request that fails to connect, is cut off or gets a 5xx, 408 or 429 answer is retried with
exponential backoff until the deadline, so a service restarted within that time loses no sample;
an answer that is not the protocol (another 4xx, a 200 that is not the protocol's scores, the
wrong count, NaN or inf among them, a pickle that names anything but plain data) fails at once.
Either way the run ends with one line naming the URL and what it answered (`RewardServiceError`,
a `RunAbort`: exit code 3), never with a made-up score.

The peers' protocols take images: a video (B, 3, F, H, W) goes as its B x F frames, and a sample's
score is the mean of its frames' scores, as every image reward scores a video (rewards/reward.py).

A service started with `--token-file FILE` answers only requests that carry its token: a run sends
`Authorization: Bearer TOKEN` read from the file named by the environment variable
DIGENRL_REWARD_TOKEN_FILE (docs/rewards-http.md); an OpenAI-compatible server started with
`--api-key TOKEN` reads the same header.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import threading
import time
from typing import Sequence
from urllib.parse import urlsplit

import aiohttp
import torch
from torch import Tensor

from rewards import judge as judges
from rewards import pickle_wire
from rewards.wire import PROTOCOL, decode_request, decode_scores, encode_request, encode_scores
from rl.nonfinite import RunAbort

PROTOCOLS = ("digenrl", *pickle_wire.PROTOCOLS, "openai")
"""what a reward URL's scheme may name: PROTOCOL+http://... (plain http(s):// is digenrl, this project's)"""
_URL = re.compile(r"^(?:([A-Za-z0-9_]+)\+)?(https?://.*)$", re.IGNORECASE)
DEFAULT_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 5.0  # one try's connection; a service being restarted refuses or drops it, and is tried again
BACKOFF_S = (0.1, 2.0)  # first wait between tries, longest wait (doubling in between)
RESULT_MARGIN_S = 5.0  # a waiting caller's own bound beyond the deadline, should the event loop thread stall
MAX_ANSWER_CHARS = 200  # how much of a bad answer the error line quotes
RETRIED = frozenset({408, 429})  # besides every 5xx: the service is busy or was slow to read; trying again can help
TOKEN_ENV = "DIGENRL_REWARD_TOKEN_FILE"  # a file holding the token of services started with --token-file


class RewardServiceError(RunAbort):
    """A reward service did not answer with scores: the run stops, naming the URL and the answer."""


class QuotedError(ValueError):
    """An answer that is not the protocol, whose text already quotes what matters of it."""


def is_url(spec: str) -> bool:
    return _URL.match(spec.strip()) is not None


def split_url_spec(spec: str) -> tuple[str, str, str | None]:
    """"[PROTOCOL+]http://HOST:PORT/NAME[:WEIGHT]" -> (url, NAME, weight text or None), the url without
    the protocol. The weight is the text after a colon in the last path segment, so a port's colon
    never reads as one."""
    spec = spec.strip()
    protocol, rest = _URL.match(spec).groups() if is_url(spec) else (None, spec)
    if protocol is not None and protocol.lower() not in PROTOCOLS:
        raise ValueError(f"bad reward spec {spec!r}: unknown protocol {protocol!r} before the URL; known: "
                         f"{list(PROTOCOLS)} (plain http:// is digenrl)")
    head, sep, last = rest.rpartition("/")
    name, colon, weight = last.partition(":")
    url = f"{head}{sep}{name}"
    parts = urlsplit(url)
    if not parts.hostname or not name or parts.path.count("/") < 1 or parts.query or parts.fragment:
        raise ValueError(f"bad reward spec {spec!r}: expected [PROTOCOL+]http://HOST:PORT/NAME[:WEIGHT]")
    try:
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError:
        raise ValueError(f"bad reward spec {spec!r}: the port of {url!r} is not a number") from None
    return url, name, weight if colon else None


def url_protocol(spec: str) -> str:
    """The protocol a reward URL's scheme names ("digenrl" for plain http(s)://)."""
    split_url_spec(spec)  # a ValueError for an unknown one
    protocol = _URL.match(spec.strip()).group(1)
    return protocol.lower() if protocol else "digenrl"


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


def _quote(data: bytes) -> str:
    text = " ".join(data.decode("utf-8", errors="replace").split())
    return repr(text[:MAX_ANSWER_CHARS] + ("..." if len(text) > MAX_ANSWER_CHARS else ""))


# ----- the protocols: what a batch's requests are, and how an answer becomes scores ---------------

class Digenrl:
    """This project's protocol (rewards/wire.py): one request of the float32 images, video whole."""

    frames, concurrency, content_type = False, 1, "application/octet-stream"

    def __init__(self, url: str, name: str):
        self.endpoint, self.name = url, name

    def bodies(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> list[tuple[bytes, int]]:
        return [(encode_request(images, prompts, metadata), images.shape[0])]

    def decode(self, data: bytes, count: int) -> Tensor:
        return decode_scores(self.name, data.decode("utf-8", errors="replace"), count)

    def cap(self, count: int) -> int:
        return 4096 + 64 * count

    def error_text(self, data: bytes) -> bytes:
        return data


class PeerPickle:
    """Flow-GRPO's or VeRL-Omni's pickle protocol (rewards/pickle_wire.py): one request of JPEG frames."""

    frames, concurrency, content_type = True, 1, "application/octet-stream"

    def __init__(self, url: str, name: str, protocol: str):
        self.endpoint, self.name, self.protocol = url[:len(url) - len(name)], name, protocol

    def bodies(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> list[tuple[bytes, int]]:
        return [(pickle_wire.encode_request(self.protocol, images, prompts, metadata), images.shape[0])]

    def decode(self, data: bytes, count: int) -> Tensor:
        return pickle_wire.decode_answer(data, count)

    def cap(self, count: int) -> int:
        return 4096 + 256 * count  # GenEval's answer: five lists of B floats, 9 bytes each pickled

    def error_text(self, data: bytes) -> bytes:
        return pickle_wire.error_text(data)


class OpenAIJudge:
    """An OpenAI-compatible chat completions judge (rewards/judge.py): one request per image."""

    frames, content_type = True, "application/json"

    def __init__(self, url: str, name: str, judge: judges.JudgeConfig):
        self.endpoint, self.name, self.judge = url[:len(url) - len(name)] + "chat/completions", name, judge
        self.concurrency = judge.concurrency

    def bodies(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> list[tuple[bytes, int]]:
        return [(body, 1) for body in judges.encode_requests(self.judge, images, prompts, metadata)]

    def decode(self, data: bytes, count: int) -> Tensor:
        text = judges.answer_text(data)
        score = judges.parse_score(self.judge, text)
        if score is not None and not torch.isfinite(torch.tensor(score).float()):
            score = None  # beyond float32: no score a judge means
        if score is None:
            score = self.judge.unparsed_score
        if score is None:
            raise QuotedError(f"a judgement its rule ({self.judge.score_regex or self.judge.score_json!r}) reads "
                              f"no finite score in (unparsed_score is unset): {_quote(text.encode())}")
        return torch.tensor([score], dtype=torch.float64).float()

    def cap(self, count: int) -> int:
        return 1 << 20

    def error_text(self, data: bytes) -> bytes:
        return data


def make_protocol(spec: str, judge: judges.JudgeConfig | None = None):
    """The protocol object of a reward URL spec (`judge`: its --reward-judge file, for openai)."""
    url, name, _ = split_url_spec(spec)
    protocol = url_protocol(spec)
    if protocol == "openai":
        if judge is None:
            raise ValueError(f"--reward {spec}: an openai judge needs --reward-judge {name}=FILE (rewards/judge.py)")
        return OpenAIJudge(url, name, judge)
    if judge is not None:
        raise ValueError(f"--reward-judge {name}=...: reward {name!r} is not an openai+http:// judge")
    return PeerPickle(url, name, protocol) if protocol in pickle_wire.PROTOCOLS else Digenrl(url, name)


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
    """A reward scored by a service at `url`; called like any reward, or asynchronously with `submit`.
    `protocol`: how to speak to it (Digenrl, PeerPickle or OpenAIJudge; make_protocol)."""

    remote = True

    def __init__(self, url: str, name: str, timeout_s: float = DEFAULT_TIMEOUT_S, token: str | None = None,
                 protocol=None):
        """`timeout_s`: a batch's deadline, retries included (--reward-timeout-s); `token`: sent as
        `Authorization: Bearer TOKEN` (service_token())."""
        self.protocol = protocol or Digenrl(url, name)
        self.url, self.name, self.timeout_s = self.protocol.endpoint, name, float(timeout_s)
        self.headers = {"Content-Type": self.protocol.content_type}
        if token is not None:
            self.headers["Authorization"] = f"Bearer {token}"

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        return self.submit(images, prompts, metadata).result()

    def submit(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
               ) -> PendingRequest:
        """Send the batch from the event loop thread and return at once; the deadline counts from now."""
        deadline = time.monotonic() + self.timeout_s
        future: concurrent.futures.Future = concurrent.futures.Future()
        batch = images.shape[0]
        if batch == 0:
            future.set_result(torch.zeros(0))
            return PendingRequest(self, future, deadline)
        prompts = list(prompts)
        metadata = [{} for _ in prompts] if metadata is None else [dict(m) for m in metadata]
        num_frames = 1
        if images.dim() == 5 and self.protocol.frames:  # (B*F, 3, H, W), a video's frames adjacent
            num_frames = images.shape[2]
            images = images.permute(0, 2, 1, 3, 4).flatten(0, 1)
            prompts = [p for p in prompts for _ in range(num_frames)]
            metadata = [m for m in metadata for _ in range(num_frames)]
        bodies = self.protocol.bodies(images.detach().float().cpu(), prompts, metadata)
        future = asyncio.run_coroutine_threadsafe(self._score(bodies, batch, num_frames, deadline), _event_loop())
        return PendingRequest(self, future, deadline)

    async def _score(self, bodies: list[tuple[bytes, int]], batch: int, num_frames: int, deadline: float) -> Tensor:
        """Every request of a batch, `concurrency` at a time, on one connection pool; the first failure
        cancels the others."""
        slots = asyncio.Semaphore(self.protocol.concurrency)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async def one(body: bytes, count: int) -> Tensor:
                async with slots:
                    return await self._post(session, body, count, deadline)
            tasks = [asyncio.ensure_future(one(body, count)) for body, count in bodies]
            try:
                scores = await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
        return torch.cat(scores).reshape(batch, num_frames).mean(dim=1)  # (B,)

    async def _post(self, session: aiohttp.ClientSession, body: bytes, count: int, deadline: float) -> Tensor:
        wait, tries, last = BACKOFF_S[0], 0, "nothing"
        while (left := deadline - time.monotonic()) > 0:
            tries += 1
            try:  # the whole try within the deadline: connect, send, the answer's headers and body
                status, data = await asyncio.wait_for(self._try(session, body, count), left)
            except aiohttp.ClientError as e:  # refused, reset, closed mid-answer, no connection in time: down?
                last = f"{type(e).__name__}: {str(e).splitlines()[0][:MAX_ANSWER_CHARS] if str(e) else ''}"
            except asyncio.TimeoutError:  # the deadline, in the middle of a try
                last = f"no complete answer within {left:.0f} s"
            else:
                if status == 200:
                    try:
                        return self.protocol.decode(data, count)
                    except ValueError as e:
                        quote = "" if isinstance(e, QuotedError) else f": {_quote(data)}"
                        raise RewardServiceError(f"reward service {self.url} answered {e}{quote}") from None
                last = f"HTTP {status} {_quote(self.protocol.error_text(data))}"
                if status < 500 and status not in RETRIED:  # the service understood and refused: trying again cannot help
                    raise RewardServiceError(f"reward service {self.url} answered {last}")
            await asyncio.sleep(max(0.0, min(wait, deadline - time.monotonic())))
            wait = min(2 * wait, BACKOFF_S[1])
        raise RewardServiceError(f"reward service {self.url} gave no scores within {self.timeout_s:g} s "
                                 f"(--reward-timeout-s; {tries} tries, the last: {last})")

    async def _try(self, session: aiohttp.ClientSession, body: bytes, count: int) -> tuple[int, bytes]:
        """One request: (status, the answer's bytes). An answer longer than the protocol's scores can
        be is cut short (its start still says what went wrong)."""
        cap = self.protocol.cap(count)
        async with session.post(self.url, data=body, headers=self.headers) as answer:
            data = bytearray()
            async for chunk in answer.content.iter_chunked(1 << 16):
                data += chunk[:cap - len(data)]
                if len(data) >= cap:
                    break
            return answer.status, bytes(data)

    def __repr__(self) -> str:
        return f"HttpReward({self.url})"


__all__ = ["DEFAULT_TIMEOUT_S", "Digenrl", "HttpReward", "OpenAIJudge", "PROTOCOL", "PROTOCOLS", "PeerPickle",
           "PendingRequest", "RewardServiceError", "TOKEN_ENV", "decode_request", "decode_scores", "encode_request",
           "encode_scores", "is_url", "make_protocol", "service_token", "split_url_spec", "url_protocol"]
