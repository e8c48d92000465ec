"""An HTTP reward service: any registered reward, served with aiohttp (protocol: rewards/remote.py).

    python -m scripts.reward_server --reward ocr --reward-model ocr=/weights/trocr --port 8000

serves `http://HOST:8000/ocr`; a run scores through it with `--reward http://HOST:8000/ocr`.
Connections are handled by aiohttp's event loop; scoring runs on one worker thread, so a reward
model (one GPU, not re-entrant) scores one batch at a time, in arrival order, while the loop keeps
accepting requests and answering `GET` health checks. A request that is not the protocol is
answered 400 with the reason; a reward that fails on a well-formed request, 500 with its error.
"""
from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from rewards import build_reward
from rewards.remote import PROTOCOL, decode_request, encode_scores

MAX_REQUEST_BYTES = 4 << 30  # a fragment of float32 video frames can be large; the run's batches bound it


def make_app(rewards: dict, log=None) -> web.Application:
    """An aiohttp application serving each reward of `rewards` (name -> reward object) at /NAME.
    `log(line)` is told of every scored request."""
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="score")
    counter = {"requests": 0}

    async def index(request: web.Request) -> web.Response:
        return web.json_response({"rewards": sorted(rewards), "protocol": PROTOCOL})

    async def health(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in rewards:
            raise web.HTTPNotFound(text=f"this service scores {sorted(rewards)}, not {name!r}")
        return web.json_response({"reward": name, "protocol": PROTOCOL})

    async def score(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in rewards:
            raise web.HTTPNotFound(text=f"this service scores {sorted(rewards)}, not {name!r}")
        body = await request.read()
        try:
            images, prompts, metadata = decode_request(body)
        except ValueError as e:
            raise web.HTTPBadRequest(text=str(e)) from None
        start = time.monotonic()
        try:
            scores = await asyncio.get_running_loop().run_in_executor(worker, rewards[name], images, prompts,
                                                                      metadata)
        except Exception as e:  # noqa: BLE001 - the client gets the reward's own error, and the service stays up
            raise web.HTTPInternalServerError(text=f"reward {name!r} failed: {type(e).__name__}: {e}") from None
        counter["requests"] += 1
        if log is not None:
            log(f"scored request {counter['requests']}: {name}, {images.shape[0]} samples of "
                f"{'x'.join(map(str, images.shape[2:]))} in {time.monotonic() - start:.3f} s")
        return web.Response(body=encode_scores(name, scores), content_type="application/json")

    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app.router.add_get("/", index)
    app.router.add_get("/{name}", health)
    app.router.add_post("/{name}", score)
    app.on_cleanup.append(lambda _: asyncio.get_running_loop().run_in_executor(None, worker.shutdown))
    return app


def serve(names: list[str], model_paths: dict[str, str], *, device: str, host: str, port: int) -> None:
    """Build the rewards (all before the port opens: a missing weight folder fails here) and serve
    them until interrupted. Prints one line with the URL of each reward once it listens."""
    rewards = {n: build_reward(n, device=device, model_path=model_paths.get(n)) for n in names}

    def say(line: str) -> None:
        print(line, flush=True)

    async def main() -> None:
        runner = web.AppRunner(make_app(rewards, log=say), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]  # the port the OS gave for --port 0
        say("serving " + ", ".join(f"http://{host}:{bound}/{n}" for n in names) + f" on {device}")
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)


__all__ = ["make_app", "serve"]
