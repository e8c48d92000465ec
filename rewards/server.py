"""An HTTP reward service: any registered reward, served with aiohttp (protocol: rewards/wire.py).

    python -m scripts.reward_server --reward ocr --reward-model ocr=/weights/trocr --port 8000

serves `http://HOST:8000/ocr`; a run scores through it with `--reward http://HOST:8000/ocr`.
With `ServerConfig.protocol = "flow_grpo"` (--protocol flow_grpo) it speaks the pickle protocol of
Flow-GRPO's reward servers and VeRL-Omni's scorers instead (rewards/pickle_wire.py), at `POST /NAME`
and, when it serves one reward, at `POST /` as they do, so their clients score with it unchanged;
their pickles are read by the restricted unpickler, so a client cannot run code on the service.
Connections are handled by aiohttp's event loop; scoring runs on one worker thread, so a reward
model (one GPU, not re-entrant) scores one batch at a time, in arrival order, while the loop keeps
accepting requests and answering `GET` health checks.

Safe to expose (docs/rewards-http.md): with a token (`ServerConfig.token`) every request without
`Authorization: Bearer TOKEN` is answered 401 before its body is read; a body must declare its
length, at most what the largest allowed request needs (413), and arrive whole within the read
deadline (408); at most `max_requests` bodies are held at once (read into one buffer each, the
images a view of it, freed when the answer is sent), the others wait their turn unread; a
connection must send its request within the read deadline, and at most `max_connections` are open
(never more than the open-file limit leaves): a new one closes the oldest that is not being served,
or is refused with a 503 when every one is. A request that is not the protocol is answered 400 with
the reason; a reward that fails on a well-formed request, 500 with its error.
"""
from __future__ import annotations

import asyncio
import ctypes
import errno
import hmac
import ipaddress
import os
import resource
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from rewards import pickle_wire
from rewards.wire import MAX_HEADER_BYTES, PROTOCOL, decode_request, encode_scores

try:
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim  # noqa: B018 - glibc only
except (OSError, AttributeError):
    _LIBC = None
FD_MARGIN = 16  # open files kept free beside those open at start (a log, a late import)


@dataclass
class ServerConfig:
    """What a reward service accepts (scripts/reward_server.py's flags)."""

    max_batch: int = 32
    """samples per request (--max-batch); a run sends a fragment, an evaluation batch, at a time"""
    max_side: int = 1024
    """pixels on either side of an image or frame (--max-side)"""
    max_frames: int = 1
    """frames per sample (--max-frames); 1 takes images only"""
    read_timeout_s: float = 60.0
    """a request's headers must arrive within this many seconds of its connection (or of the previous
    answer on it), and its body within as many of its headers (--read-timeout-s)"""
    max_requests: int = 2
    """request bodies held at once, read or scored (--max-requests); memory: this many bodies"""
    max_connections: int = 512
    """open connections (--max-connections), and never more than the open-file limit leaves"""
    backlog: int = 128
    """connections the kernel queues before the server accepts them (--backlog)"""
    token: str | None = None
    """the shared token every request must carry (--token-file); None: none needed"""
    protocol: str = "digenrl"
    """what requests speak (--protocol): digenrl (rewards/wire.py) or flow_grpo (the peers' pickle of
    JPEG images, rewards/pickle_wire.py; VeRL-Omni's scorer clients speak it too)"""

    def max_body_bytes(self) -> int:
        """The largest body a request of `max_batch` samples of `max_frames` frames of `max_side`
        squared pixels can be: its float32 images and the longest header."""
        return 8 + MAX_HEADER_BYTES + 4 * 3 * self.max_batch * self.max_frames * self.max_side ** 2

    def check_images(self, shape: tuple[int, ...]) -> None:
        """A ValueError naming the flag that a request's images (B, 3, [F,] H, W) exceed."""
        frames = shape[2] if len(shape) == 5 else 1
        for what, got, limit, flag in (("samples", shape[0], self.max_batch, "--max-batch"),
                                       ("frames", frames, self.max_frames, "--max-frames"),
                                       ("pixels on a side", max(shape[-2:]), self.max_side, "--max-side")):
            if got > limit:
                raise ValueError(f"{got} {what}; this service takes at most {limit} ({flag} {limit})")


def give_back_memory() -> None:
    """Return the freed memory of the reward's working tensors to the system. glibc keeps what a
    thread frees in that thread's arena, and serves allocations below its mmap threshold (which
    grows to 32 MB) from there: without a trim a request's intermediates stay resident after it."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def connection_limit(config: ServerConfig) -> int:
    """max_connections, within the open-file limit: beside the files already open and a margin."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = config.max_connections if soft == resource.RLIM_INFINITY else soft - _open_files() - FD_MARGIN
    return max(1, min(config.max_connections, room))


def _open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: a guess at what a loaded reward model holds
        return 64


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to any interface
        return False


class Connections:
    """Accepts connections one at a time, each within the open-connection bound, and gives each a
    first deadline; aiohttp serves them (`server`, its protocol factory, which tracks the open
    connections oldest first in `Server.connections`). asyncio's own server accepts a backlog of
    connections before it makes any protocol, so a bound there would be counted late, and the
    open files run out (EMFILE pauses its accepting for a second at a time). The middleware marks
    the connections a request is being served on (`busy`) and those that have sent one (no
    longer `fresh`)."""

    def __init__(self, limit: int, deadline_s: float):
        self.server: web.Server | None = None  # aiohttp's protocol factory, set once the app runner is set up
        self.limit, self.deadline_s = limit, deadline_s
        self.busy: set = set()
        self.fresh: set = set()

    async def accept(self, sock: socket.socket) -> None:
        """Serve the listening socket until cancelled."""
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError:  # out of files or buffers for a moment: the margin beside the bound
                await asyncio.sleep(0.1)
                continue
            if len(self.server.connections) >= self.limit and not self._evict():
                _refuse(conn)
                continue
            try:
                await loop.connect_accepted_socket(self._protocol, conn)
            except OSError:  # the client went away already
                conn.close()

    def _protocol(self):
        handler = self.server()
        self.fresh.add(handler)
        asyncio.get_running_loop().call_later(self.deadline_s, self._expire, handler)
        return handler

    def _evict(self) -> bool:
        """Close the oldest connection that no request is being served on; False when every one is."""
        for handler in self.server.connections:
            if handler not in self.busy:
                handler.force_close()
                return True
        return False

    def _expire(self, handler) -> None:
        """A connection that has sent no whole request's headers within the deadline is closed
        (after an answer, aiohttp's keep-alive timeout, the same deadline, does the same)."""
        if handler in self.fresh:
            self.fresh.discard(handler)
            handler.force_close()

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        protocol = request.protocol
        self.fresh.discard(protocol)
        self.busy.add(protocol)
        try:
            return await handler(request)
        finally:
            self.busy.discard(protocol)


def _refuse(conn: socket.socket) -> None:
    """A connection over the bound while every open one is being served: 503, closed."""
    text = b"every connection of this service is in use; try again"
    try:
        conn.setblocking(False)
        conn.send(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: text/plain\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(text), text))
    except OSError:
        pass
    conn.close()


def make_app(rewards: dict, config: ServerConfig | None = None, log=None, connections: Connections | None = None
             ) -> web.Application:
    """An aiohttp application serving each reward of `rewards` (name -> reward object) at /NAME.
    `log(line)` is told of every scored request; `connections` (serve()) marks busy connections."""
    config = config or ServerConfig()
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="score")
    slots = asyncio.Semaphore(config.max_requests)
    limit = config.max_body_bytes()
    counter = {"requests": 0}

    @web.middleware
    async def authorize(request: web.Request, handler):
        if config.token is not None:
            sent = request.headers.get("Authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {config.token}".encode()):
                return _answer(401, "this service needs its token: Authorization: Bearer TOKEN (a run sends the "
                                    "file named by DIGENRL_REWARD_TOKEN_FILE)", close=True)
        return await handler(request)

    async def index(request: web.Request) -> web.Response:
        return web.json_response({"rewards": sorted(rewards), "protocol": PROTOCOL})

    async def health(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in rewards:
            raise web.HTTPNotFound(text=f"this service scores {sorted(rewards)}, not {name!r}")
        return web.json_response({"reward": name, "protocol": PROTOCOL})

    async def score(request: web.Request) -> web.Response:
        name = request.match_info.get("name")
        if name is None and len(rewards) == 1:  # POST /: a peer's server serves its one reward there
            name = next(iter(rewards))
        if name not in rewards:
            what = repr(name) if name is not None else "at POST / (it serves several: POST /NAME)"
            return _answer(404, f"this service scores {sorted(rewards)}, not {what}", close=True)
        length = request.content_length
        if length is None:
            return _answer(411, "a request declares its length (Content-Length)", close=True)
        if length > limit:
            return _answer(413, f"a body of {length} bytes; this service takes at most {limit} (--max-batch "
                                f"{config.max_batch}, --max-frames {config.max_frames}, --max-side {config.max_side})",
                           close=True)
        async with slots:  # at most max_requests bodies in memory; the others wait here, unread
            answer = await _score_one(request, name, length, rewards[name], worker)
            await asyncio.get_running_loop().run_in_executor(worker, give_back_memory)  # the body is freed now
        if isinstance(answer, web.Response):
            return answer
        scores, shape, seconds = answer
        counter["requests"] += 1
        if log is not None:
            log(f"scored request {counter['requests']}: {name}, {shape[0]} samples of {'x'.join(map(str, shape[2:]))} "
                f"in {seconds:.3f} s")
        if config.protocol == "flow_grpo":
            return web.Response(body=pickle_wire.encode_answer(scores), content_type="application/octet-stream")
        return web.Response(body=encode_scores(name, scores), content_type="application/json")

    async def _score_one(request: web.Request, name: str, length: int, reward, worker):
        """(scores, the images' shape, seconds) or the error's answer. The body lives only in this
        call: its memory goes back when it returns, before the next request is read."""
        body = await _read_body(request, length, config.read_timeout_s)
        if isinstance(body, web.Response):
            return body
        try:
            if config.protocol == "flow_grpo":  # JPEGs of at most max_side, checked before they are decoded
                images, prompts, metadata = pickle_wire.decode_request(body.tobytes(), config.max_side)
            else:
                images, prompts, metadata = decode_request(body)
        except ValueError as e:
            return _answer(400, str(e))
        try:
            config.check_images(tuple(images.shape))
        except ValueError as e:
            return _answer(413, str(e))
        start = time.monotonic()
        try:
            scores = await asyncio.get_running_loop().run_in_executor(worker, reward, images, prompts, metadata)
        except Exception as e:  # noqa: BLE001 - the client gets the reward's own error, and the service stays up
            return _answer(500, f"reward {name!r} failed: {type(e).__name__}: {e}")
        return scores, tuple(images.shape), time.monotonic() - start

    middlewares = [connections.middleware] if connections is not None else []
    app = web.Application(client_max_size=limit, middlewares=[*middlewares, authorize])
    app.router.add_get("/", index)
    if config.protocol == "flow_grpo":
        app.router.add_post("/", score)
    app.router.add_get("/{name}", health)
    app.router.add_post("/{name}", score)
    app.on_cleanup.append(lambda _: asyncio.get_running_loop().run_in_executor(None, worker.shutdown))
    return app


async def _read_body(request: web.Request, length: int, deadline_s: float):
    """The body, read into one buffer of its declared length within the deadline (a writable numpy
    array: its pages are committed as bytes arrive, and the images become a view of it), or the
    error's answer."""
    body, got = np.empty(length, dtype=np.uint8), 0

    async def read() -> None:
        nonlocal got
        while got < length:
            chunk = await request.content.readany()
            if not chunk:
                break
            body[got:got + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            got += len(chunk)

    try:
        await asyncio.wait_for(read(), deadline_s)
    except asyncio.TimeoutError:
        return _answer(408, f"{got} of the body's {length} bytes arrived within {deadline_s:g} s (--read-timeout-s)",
                       close=True)
    except (OSError, ValueError) as e:  # the client went away, or sent more than it declared
        return _answer(400, f"the body broke off after {got} of {length} bytes ({type(e).__name__})", close=True)
    if got < length:
        return _answer(400, f"the body ended after {got} of its {length} bytes", close=True)
    return body


def _answer(status: int, text: str, close: bool = False) -> web.Response:
    """An error's answer; `close`: the connection closes after it (a body may be left unread)."""
    response = web.Response(status=status, text=text)
    if close:
        response.force_close()
    return response


def exposure_warning(host: str, token: str | None) -> str | None:
    """The warning printed when the service listens beyond this machine without a token."""
    if token is not None or is_loopback(host):
        return None
    return (f"warning: --host {host} takes requests from other machines and no --token-file is set: anyone who "
            f"reaches this port can make it score (and spend its GPU); give --token-file FILE, and the runs "
            f"DIGENRL_REWARD_TOKEN_FILE=FILE (docs/rewards-http.md)")


def listen(host: str, port: int, backlog: int) -> socket.socket:
    """The listening socket, bound before any reward is built: a port in use or an address this
    machine does not have is one ValueError, at once."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=backlog)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: not an address of this machine ({e.strerror})") from None
    except OSError as e:
        hint = " (another process listens there: stop it, or choose another --port; --port 0 takes any free one)" \
            if e.errno == errno.EADDRINUSE else ""
        raise ValueError(f"cannot listen on {host}:{port}: {os.strerror(e.errno)}{hint}") from None


def serve(rewards_of, host: str, port: int, config: ServerConfig, *, device: str, say=print) -> None:
    """Listen on host:port, build the rewards (`rewards_of()`: name -> reward; a missing weight folder
    fails here, before any request is taken), and serve them until interrupted. Prints one line
    with the URL of each reward once it serves."""
    sock = listen(host, port, config.backlog)
    warning = exposure_warning(host, config.token)
    if warning:
        say(warning, file=sys.stderr)
    rewards = rewards_of()
    limit = connection_limit(config)

    async def main() -> None:
        connections = Connections(limit, config.read_timeout_s)
        app = make_app(rewards, config, log=lambda line: say(line, flush=True), connections=connections)
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=config.read_timeout_s)
        await runner.setup()
        connections.server = runner.server  # aiohttp's protocol factory
        accepting = asyncio.create_task(connections.accept(sock))
        bound = sock.getsockname()[1]  # the port the OS gave for --port 0
        scheme = "http" if config.protocol == "digenrl" else f"{config.protocol}+http"
        say("serving " + ", ".join(f"{scheme}://{host}:{bound}/{n}" for n in rewards) + f" on {device} (requests up "
            f"to {config.max_body_bytes() / 1e6:.0f} MB, at most {connections.limit} connections)", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            accepting.cancel()
            sock.close()
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        say("stopped", file=sys.stderr)
