"""Rewards scored over HTTP (rewards/remote.py, rewards/server.py, scripts/reward_server.py).

Every server here is a real process or socket on 127.0.0.1, stopped by the test that started it:
the reward server of this project (aiohttp), and stand-ins that answer garbage, answer slowly or
are not there at all."""
from __future__ import annotations

import http.server
import importlib.util
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from prompts.sets import load_prompts
from rewards import RewardSet, parse_reward_spec, parse_reward_specs, reward_model_paths
from rewards.remote import HttpReward, RewardServiceError, decode_request, encode_request
from lab.launch import ROOT, TINY, torchrun, trained_weights

needs_aiohttp = pytest.mark.skipif(importlib.util.find_spec("aiohttp") is None,
                                   reason="the reward server needs aiohttp (requirements.txt)")
PROMPTS = [r.prompt for r in load_prompts(os.path.join(ROOT, "data", "shapes_train.txt"))[:6]]


class Server:
    """`python -m scripts.reward_server` in its own process; `url(name)` once it listens."""

    def __init__(self, rewards: list[str], port: int = 0):
        cmd = [sys.executable, "-m", "scripts.reward_server", "--port", str(port), "--device", "cpu"]
        for r in rewards:
            cmd += ["--reward", r]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        self.lines: queue.Queue = queue.Queue()
        first = self.proc.stdout.readline()
        if not first.startswith("serving "):
            self.kill()
            raise AssertionError(f"the reward server did not start: {first}{self.proc.stdout.read()}")
        self.port = int(first.split()[1].split(":")[2].split("/")[0])
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server():
    s = Server(["jpeg_compressibility", "shapes", "rule_aesthetic", "temporal_consistency"])
    yield s
    s.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_url_specs_parse_and_name_their_errors():
    assert parse_reward_spec("http://127.0.0.1:8000/ocr:0.5") == ("ocr", 0.5)
    assert parse_reward_spec("https://rewards.example:443/pickscore") == ("pickscore", 1.0)
    # a served model reward needs no local weights, and refuses them
    assert parse_reward_specs(["http://h:1/ocr", "shapes:0.1"]) == [("ocr", 1.0), ("shapes", 0.1)]
    with pytest.raises(ValueError, match="leave out --reward-model"):
        parse_reward_specs(["http://h:1/ocr"], reward_model_paths(["ocr=/w"]))
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        parse_reward_spec("http://h:1/nope")
    with pytest.raises(ValueError, match="port"):
        parse_reward_spec("http://h:port/ocr")
    with pytest.raises(ValueError, match="given more than once"):
        parse_reward_specs(["http://h:1/shapes", "shapes"])


def test_the_wire_carries_float32_images_and_json_text_exactly():
    images = torch.rand(3, 3, 2, 8, 8)
    meta = [{"text": "OPEN"}, {}, {"height": 8}]
    got, prompts, metadata = decode_request(encode_request(images, ["a", "b", "ç"], meta))
    assert torch.equal(got, images) and prompts == ["a", "b", "ç"] and metadata == meta
    with pytest.raises(ValueError, match="not a reward request|not a safetensors"):
        decode_request(b"\x05\x00\x00\x00\x00\x00\x00\x00hello")


@needs_aiohttp
def test_scores_over_http_equal_local_scores_bit_for_bit(server):
    g = torch.Generator().manual_seed(0)
    images = torch.rand(6, 3, 32, 32, generator=g)
    specs = ["jpeg_compressibility:0.5", "shapes", "rule_aesthetic:0.25"]
    local = RewardSet(specs).score_combined(images, PROMPTS, None)
    remote_set = RewardSet([server.url(s.split(":")[0]) + s[len(s.split(":")[0]):] for s in specs])
    assert remote_set.remote
    remote = remote_set.score_combined(images, PROMPTS, None)
    assert local.keys() == remote.keys()
    for name in local:
        assert torch.equal(local[name], remote[name]), name
    video = torch.rand(2, 3, 3, 16, 16, generator=g)  # a video reward of whole clips, and per-frame scores
    for name in ("temporal_consistency", "jpeg_compressibility"):
        assert torch.equal(RewardSet([name]).score(video, PROMPTS[:2])[name],
                           HttpReward(server.url(name), name)(video, PROMPTS[:2]))


@needs_aiohttp
def test_a_service_restarted_within_the_timeout_loses_nothing():
    server = Server(["jpeg_compressibility"])
    port, url = server.port, server.url("jpeg_compressibility")
    server.kill()
    images = torch.rand(4, 3, 16, 16)
    pending = HttpReward(url, "jpeg_compressibility", timeout_s=60).submit(images, ["x"] * 4)
    time.sleep(1.0)  # the client retries against a closed port meanwhile
    assert not pending.done()
    again = Server(["jpeg_compressibility"], port=port)
    try:
        assert torch.equal(pending.result(timeout=60), RewardSet(["jpeg_compressibility"]).score(
            images, ["x"] * 4)["jpeg_compressibility"])
    finally:
        again.kill()


class _StandIn(http.server.BaseHTTPRequestHandler):
    """Answers every POST after `delay` seconds with `body` (status 200)."""

    delay, body = 0.0, b""

    def do_POST(self):  # noqa: N802 - the name http.server calls
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(self.delay)
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.body)))
            self.end_headers()
            self.wfile.write(self.body)
        except OSError:
            pass  # the client gave up

    def log_message(self, *args):
        pass


def _stand_in(delay: float, body: bytes):
    handler = type("Handler", (_StandIn,), {"delay": delay, "body": body})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.mark.parametrize("case", ["garbage", "wrong count", "slow", "nothing listening"])
def test_a_bad_service_stops_the_run_naming_the_url_within_the_timeout(case):
    httpd = None
    if case == "nothing listening":
        url = f"http://127.0.0.1:{free_port()}/shapes"
    else:
        body = {"garbage": b"<html>502 Bad Gateway</html>", "wrong count": b'{"reward": "shapes", "scores": [1.0]}',
                "slow": b""}[case]
        httpd = _stand_in(30.0 if case == "slow" else 0.0, body)
        url = f"http://127.0.0.1:{httpd.server_address[1]}/shapes"
    timeout = 2.0
    start = time.monotonic()
    try:
        with pytest.raises(RewardServiceError) as err:
            HttpReward(url, "shapes", timeout_s=timeout)(torch.rand(2, 3, 8, 8), ["a", "b"])
    finally:
        if httpd is not None:
            httpd.shutdown()
    took = time.monotonic() - start
    line = str(err.value)
    assert url in line and "\n" not in line, line
    expected = {"garbage": "not JSON: '<html>502 Bad Gateway</html>'", "wrong count": "JSON without 2 scores",
                "slow": "no answer within", "nothing listening": "ConnectionError"}[case]
    assert expected in line, line
    assert took < timeout + 1.5, took
    if case in ("garbage", "wrong count"):  # not the protocol: no retry can help
        assert took < 1.0, took


@needs_aiohttp
def test_the_service_refuses_what_it_does_not_serve(server):
    with pytest.raises(RewardServiceError, match=r"answered HTTP 404 .*scores \['jpeg_compressibility'"):
        HttpReward(f"http://127.0.0.1:{server.port}/ocr", "ocr", timeout_s=5)(torch.rand(1, 3, 8, 8), ["x"])


@needs_aiohttp
def test_a_run_scoring_over_http_through_a_server_restart_trains_the_local_runs_weights(tmp_path):
    """A 2-step disaggregated run scores through a reward server on localhost; after the server's
    first answer it is killed (SIGKILL) and started again on the same port. The run finishes and its
    trained weights equal those of the run that scores locally: no sample was lost or scored twice."""
    args = [a for a in TINY]
    at = args.index("--reward")
    del args[at:at + 2]
    args += ["--steps", "2", "--save-every", "2"]
    local = tmp_path / "local"
    torchrun(2, [*args, "--reward", "jpeg_compressibility", "--output-dir", str(local)])
    server = Server(["jpeg_compressibility"])
    port = server.port
    remote = tmp_path / "remote"
    restarted = {}

    def restart_after_first_answer():
        while "scored request 1" not in server.lines.get(timeout=240):
            pass
        server.kill()
        time.sleep(1.0)
        restarted["server"] = Server(["jpeg_compressibility"], port=port)

    chaos = threading.Thread(target=restart_after_first_answer, daemon=True)
    chaos.start()
    try:
        torchrun(2, [*args, "--reward", f"{server.url('jpeg_compressibility')}", "--output-dir", str(remote)])
        chaos.join(timeout=30)
        assert "server" in restarted, "the server was not restarted during the run"
        answered = restarted["server"].lines
        assert "scored request 1" in answered.get(timeout=5), "the restarted server scored nothing: not mid-run"
    finally:
        server.kill()
        if "server" in restarted:
            restarted["server"].kill()
    a, b = trained_weights(str(local), 2), trained_weights(str(remote), 2)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
