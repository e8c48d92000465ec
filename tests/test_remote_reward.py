"""Rewards scored over HTTP (rewards/remote.py, rewards/server.py, scripts/reward_server.py).

Every server here is a real process or socket on 127.0.0.1, stopped by the test that started it:
the reward server of this project (aiohttp), and stand-ins that answer garbage, answer slowly or
are not there at all."""
from __future__ import annotations

import http.server
import importlib.util
import json
import os
import queue
import re
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
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
    """`python -m scripts.reward_server` in its own process; `url(name)` once it listens. `args`: more
    flags; `nofile`: its open-file limit (ulimit -n); `env`: more environment variables."""

    def __init__(self, rewards: list[str], port: int = 0, args: list[str] = (), nofile: int | None = None,
                 env: dict | None = None):
        cmd = [sys.executable, "-m", "scripts.reward_server", "--port", str(port), "--device", "cpu", *args]
        for r in rewards:
            cmd += ["--reward", r]
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                            "PYTHONUNBUFFERED": "1", **(env or {})})
        self.lines: queue.Queue = queue.Queue()
        self.said = []  # what it printed before it served
        while not (line := self.proc.stdout.readline()).startswith("serving ") and line:
            self.said.append(line)
        if not line:
            self.kill()
            raise AssertionError(f"the reward server did not start: {''.join(self.said)}")
        self.first = line
        self.port = int(line.split()[1].split(":")[2].split("/")[0])
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
    # a service may serve a reward of any name; the scheme names a peer's protocol
    assert parse_reward_spec("http://h:1/my_judge:2") == ("my_judge", 2.0)
    assert parse_reward_spec("flow_grpo+http://h:1/geneval") == ("geneval", 1.0)
    with pytest.raises(ValueError, match="unknown protocol 'grpc'"):
        parse_reward_spec("grpc+http://h:1/ocr")
    with pytest.raises(ValueError, match="port"):
        parse_reward_spec("http://h:port/ocr")
    with pytest.raises(ValueError, match="given more than once"):
        parse_reward_specs(["http://h:1/shapes", "shapes"])


def test_the_wire_carries_float32_images_and_json_text_exactly():
    images = torch.rand(3, 3, 2, 8, 8)
    meta = [{"text": "OPEN"}, {}, {"height": 8}]
    got, prompts, metadata = decode_request(encode_request(images, ["a", "b", "ç"], meta))
    assert torch.equal(got, images) and prompts == ["a", "b", "ç"] and metadata == meta
    body = bytearray(encode_request(images, ["a", "b", "ç"], meta))
    view = decode_request(body)[0]  # a writable body is not copied: the images are a view of its bytes
    assert torch.equal(view, images) and view.data_ptr() - np.frombuffer(body, np.uint8).ctypes.data == len(body) - \
        images.numel() * 4


def _crafted(entry: dict, data: bytes, meta=None, extra: dict | None = None) -> bytes:
    meta = {"prompts": '["a"]', "metadata": "[{}]"} if meta is None else meta
    header = json.dumps({"images": entry, "__metadata__": meta, **(extra or {})}).encode()
    return struct.pack("<Q", len(header)) + header + data


MALFORMED = {  # a hostile or broken client's body: what the ValueError (the server's 400) says
    "not safetensors": (b"\x05\x00\x00\x00\x00\x00\x00\x00hello", "the safetensors header is not JSON"),
    "huge declared shape": (_crafted({"dtype": "F32", "shape": [1, 3, 1 << 40, 1 << 40], "data_offsets": [0, 48]},
                                     bytes(48)), "images [1, 3, 1099511627776, 1099511627776] are 14507109835375"),
    "bad offsets": (_crafted({"dtype": "F32", "shape": [1, 3, 2, 2], "data_offsets": [8, 56]}, bytes(48)),
                    "the header says [8, 56]"),
    "trailing bytes": (_crafted({"dtype": "F32", "shape": [1, 3, 2, 2], "data_offsets": [0, 48]}, bytes(64)),
                       "the body holds 64 bytes after it"),
    "header past the body": (struct.pack("<Q", 1 << 62) + b"{}", "runs past the body"),
    "nested JSON": (struct.pack("<Q", 200000) + b"[" * 200000, "RecursionError"),
    "float16": (_crafted({"dtype": "F16", "shape": [1, 3, 2, 2], "data_offsets": [0, 24]}, bytes(24)),
                "images are float32"),
    "a second tensor": (_crafted({"dtype": "F32", "shape": [1, 3, 2, 2], "data_offsets": [0, 48]}, bytes(96),
                                 extra={"x": {"dtype": "F32", "shape": [12], "data_offsets": [48, 96]}}),
                        "one tensor, 'images'"),
    "prompts of another batch": (_crafted({"dtype": "F32", "shape": [2, 3, 2, 2], "data_offsets": [0, 96]}, bytes(96)),
                                 "a request of 2 images holds 2 prompts"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_body_is_refused_before_anything_is_allocated(case):
    body, expected = MALFORMED[case]
    with pytest.raises(ValueError, match=re.escape(expected)):
        decode_request(body)


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
    assert not pending.future.done()
    again = Server(["jpeg_compressibility"], port=port)
    try:
        assert torch.equal(pending.result(), RewardSet(["jpeg_compressibility"]).score(
            images, ["x"] * 4)["jpeg_compressibility"])
    finally:
        again.kill()


class _StandIn(http.server.BaseHTTPRequestHandler):
    """Answers every POST after `delay` seconds with `body` and `status`; `trickle`: sends its headers
    at once, then one byte of a 1,000-byte body every 0.5 s."""

    delay, body, status, trickle = 0.0, b"", 200, False
    requests: list  # when each request arrived (time.monotonic())

    def do_POST(self):  # noqa: N802 - the name http.server calls
        self.requests.append(time.monotonic())
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(self.delay)
        try:
            self.send_response(self.status)
            self.send_header("Content-Length", str(1000 if self.trickle else len(self.body)))
            self.end_headers()
            if not self.trickle:
                self.wfile.write(self.body)
            for _ in range(1000 if self.trickle else 0):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.5)
        except OSError:
            pass  # the client gave up

    def log_message(self, *args):
        pass


def _stand_in(delay: float, body: bytes, status: int = 200, trickle: bool = False):
    handler = type("Handler", (_StandIn,), {"delay": delay, "body": body, "status": status, "trickle": trickle,
                                            "requests": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.requests = handler.requests
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


BAD_SERVICES = {  # case: (status, body, what the error line says)
    "garbage": (200, b"<html>502 Bad Gateway</html>", "not JSON: '<html>502 Bad Gateway</html>'"),
    "wrong count": (200, b'{"reward": "shapes", "scores": [1.0]}', "JSON without 2 scores"),
    "nan": (200, b'{"reward": "shapes", "protocol": 1, "scores": [NaN, 1.0]}', "non-finite scores (nan at sample 0)"),
    "inf": (200, b'{"reward": "shapes", "protocol": 1, "scores": [0.5, 1e999]}', "non-finite scores (inf at sample 1)"),
    "beyond float32": (200, b'{"reward": "shapes", "protocol": 1, "scores": [1e39, 0]}',
                       "non-finite scores (inf at sample 0)"),
    "refused": (400, b"the safetensors header runs past the body", "answered HTTP 400 'the safetensors header"),
    "slow": (200, b"", "no complete answer within"),
    "trickle": (200, b"", "no complete answer within"),
    "nothing listening": (0, b"", "Cannot connect to host"),
}


@pytest.mark.parametrize("case", list(BAD_SERVICES))
def test_a_bad_service_stops_the_run_naming_the_url_within_the_timeout(case):
    """One deadline for the whole request, retries included: a service that sends its headers and
    then one byte every 0.5 s is cut off like one that never answers. An answer that is not the
    protocol (NaN or inf among the scores too) or a 4xx fails at once: no retry can help."""
    httpd = None
    status, body, expected = BAD_SERVICES[case]
    if case == "nothing listening":
        url = f"http://127.0.0.1:{free_port()}/shapes"
    else:
        httpd = _stand_in(30.0 if case == "slow" else 0.0, body, status, trickle=case == "trickle")
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
    assert expected in line, line
    assert took < timeout + 1.5, took
    if case not in ("slow", "trickle", "nothing listening"):
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


def test_a_run_whose_service_trickles_ends_within_the_deadline_naming_the_url(tmp_path):
    """The service sends its headers, then a byte every 0.5 s, from the first request of the first
    step on: every rank exits within --reward-timeout-s + 60 s of that request (code 3; the
    generator names the service, the trainer prints its line), never blaming a rank."""
    httpd = _stand_in(0.0, b"", trickle=True)
    url = f"http://127.0.0.1:{httpd.server_address[1]}/jpeg_compressibility"
    args = [a for a in TINY]
    at = args.index("--reward")
    del args[at:at + 2]
    try:
        run = torchrun(2, [*args, "--reward", url, "--reward-timeout-s", "10", "--steps", "2",
                           "--output-dir", str(tmp_path / "run")], check=False, timeout=240)
        ended = time.monotonic()
    finally:
        httpd.shutdown()
    assert httpd.requests, run.stderr[-3000:]
    took = ended - httpd.requests[0]
    lines = [line[line.index("error: "):] for line in run.stderr.splitlines()  # (after a progress bar's text)
             if "error: " in line and "traceback :" not in line]
    said = f"error: generator rank 0 (replica 0) stopped the run at step 0: reward service {url} gave no scores " \
           f"within 10 s"
    assert len(lines) == 2 and all(line.startswith((said, f"error: reward service {url} gave no scores within 10 s"))
                                   for line in lines), run.stderr[-3000:]
    assert "stopped answering" not in run.stderr and "train_disagg.py\", line" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.count("exitcode  : 3") == 2, run.stderr[-3000:]
    assert took < 10 + 60, took
