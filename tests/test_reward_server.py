"""The reward server exposed to hostile clients (rewards/server.py, scripts/reward_server.py): a token,
bodies bounded by the reward's input shape and read within a deadline, malformed bodies answered
400 without a traceback, slow connections closed, the open connections bounded under a small
open-file limit, memory given back after each request, a port in use in one line.

One server serves every check here: `--token-file`, `--max-batch 4 --max-side 1024`,
`--read-timeout-s 2`, `--max-requests 1`, under `ulimit -n 256` (so at most 192 connections)."""
from __future__ import annotations

import http.client
import os
import select
import socket
import subprocess
import sys
import time

import pytest
import torch

from rewards import RewardSet
from rewards.remote import TOKEN_ENV, HttpReward, RewardServiceError, encode_request
from rewards.server import exposure_warning
from lab.launch import ROOT
from test_remote_reward import MALFORMED, Server, needs_aiohttp

TOKEN = "0123456789abcdef-token"
DEADLINE_S = 2.0
pytestmark = needs_aiohttp


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    s = Server(["jpeg_compressibility"], nofile=256,
               args=["--token-file", str(token_file), "--max-batch", "4", "--max-side", "1024", "--read-timeout-s",
                     str(DEADLINE_S), "--max-requests", "1"])
    s.token_file = str(token_file)
    yield s
    s.kill()


def _post(port: int, body: bytes, token: str | None = TOKEN, headers: dict | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    conn.request("POST", "/jpeg_compressibility", body=body, headers={**auth, **(headers or {})})
    answer = conn.getresponse()
    return answer.status, answer.read().decode()


def _rss_mb(pid: int) -> tuple[float, float]:
    """(resident, peak resident) MB of a process."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def test_only_requests_with_the_token_are_served(guarded, monkeypatch):
    url = guarded.url("jpeg_compressibility")
    images = torch.rand(2, 3, 16, 16)
    start = time.monotonic()
    with pytest.raises(RewardServiceError, match=rf"reward service {url} answered HTTP 401 'this service needs its "):
        HttpReward(url, "jpeg_compressibility", timeout_s=30)(images, ["a", "b"])
    assert time.monotonic() - start < 2  # a 4xx is not tried again
    assert _post(guarded.port, encode_request(images, ["a", "b"], None), token="x" * len(TOKEN))[0] == 401
    monkeypatch.setenv(TOKEN_ENV, guarded.token_file)
    served = RewardSet([url]).score(images, ["a", "b"])["jpeg_compressibility"]
    assert torch.equal(served, RewardSet(["jpeg_compressibility"]).score(images, ["a", "b"])["jpeg_compressibility"])
    monkeypatch.setenv(TOKEN_ENV, os.path.join(os.path.dirname(guarded.token_file), "missing"))
    with pytest.raises(ValueError, match=f"{TOKEN_ENV}=.*missing.*: cannot read the reward service token"):
        RewardSet([url])


def test_a_service_beyond_loopback_without_a_token_is_warned_about():
    assert "no --token-file is set" in exposure_warning("0.0.0.0", None)
    assert "no --token-file is set" in exposure_warning("reward-host.example", None)
    assert exposure_warning("0.0.0.0", TOKEN) is None
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None
    assert exposure_warning("localhost", None) is None


def test_malformed_and_oversized_bodies_are_4xx_with_the_reason_and_no_traceback(guarded):
    for case, (body, expected) in MALFORMED.items():
        status, text = _post(guarded.port, body)
        assert (status, expected in text) == (400, True), (case, status, text)
    status, text = _post(guarded.port, encode_request(torch.rand(5, 3, 8, 8), ["p"] * 5, None))
    assert (status, text) == (413, "5 samples; this service takes at most 4 (--max-batch 4)")
    status, text = _post(guarded.port, encode_request(torch.rand(1, 3, 8, 1025), ["p"], None))
    assert (status, text) == (413, "1025 pixels on a side; this service takes at most 1024 (--max-side 1024)")
    # a declared length beyond the largest request is refused before a byte of it is read
    conn = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=10)
    conn.putrequest("POST", "/jpeg_compressibility")
    for k, v in {"Authorization": f"Bearer {TOKEN}", "Content-Length": str(1 << 40)}.items():
        conn.putheader(k, v)
    conn.endheaders()
    answer = conn.getresponse()
    text = answer.read().decode()
    assert answer.status == 413 and "a body of 1099511627776 bytes; this service takes at most" in text, text
    time.sleep(0.5)
    printed = []
    while not guarded.lines.empty():
        printed.append(guarded.lines.get())
    assert not any("Traceback" in line or "Error handling request" in line for line in printed), printed


def _slow(port: int, head: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(head)
    s.setblocking(False)
    return s


def _readable(s: socket.socket) -> bool:
    poll = select.poll()  # not select(): the descriptors go beyond 1024
    poll.register(s, select.POLLIN)
    return bool(poll.poll(0))


def _closed_by_server(s: socket.socket) -> bool:
    """The server closed it: readable, and everything it sent (a 503, a 408) is followed by EOF."""
    try:
        while _readable(s):
            if not s.recv(65536):
                return True
    except ConnectionError:
        return True
    return False


def test_slow_connections_are_closed_and_never_hold_the_service(guarded):
    """1,500 connections that never finish their headers, under an open-file limit of 256: the
    service stays responsive (the oldest idle connection makes room for a new one), and each slow
    connection is closed within the read deadline; a body that trickles is answered 408."""
    slow = [_slow(guarded.port, b"POST /jpeg_compressibility HTTP/1.1\r\nHost: x\r\nX-Slow: ") for _ in range(1500)]
    try:
        start = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=10)
        conn.request("GET", "/", headers={"Authorization": f"Bearer {TOKEN}"})
        assert conn.getresponse().status == 200
        answered_s = time.monotonic() - start
        trickle = _slow(guarded.port, b"POST /jpeg_compressibility HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                                      + TOKEN.encode() + b"\r\nContent-Length: 1000\r\n\r\n")
        deadline = time.monotonic() + DEADLINE_S + 3
        while time.monotonic() < deadline:
            trickle.send(b"x")
            time.sleep(0.2)
            if _readable(trickle):
                break
        trickle.setblocking(True)
        assert trickle.recv(4096).startswith(b"HTTP/1.1 408"), "the trickling body was not answered 408"
        time.sleep(max(0.0, start + DEADLINE_S + 2 - time.monotonic()))
        still_open = [s for s in slow if not _closed_by_server(s)]
    finally:
        for s in slow:
            s.close()
    assert answered_s < 2.0, answered_s
    assert not still_open, f"{len(still_open)} of 1500 slow connections still open after the {DEADLINE_S} s deadline"
    health = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=10)
    health.request("GET", "/", headers={"Authorization": f"Bearer {TOKEN}"})
    assert health.getresponse().status == 200
    printed = []
    while not guarded.lines.empty():
        printed.append(guarded.lines.get())
    assert not any("Too many open files" in line or "Traceback" in line for line in printed), printed[-20:]


def test_a_large_body_costs_its_size_once_and_is_given_back(guarded):
    """A 63 MB body (5 images of 1024 x 1024, one more than --max-batch: read whole, then refused)
    raises the server's resident memory by about its size while it is read, and a 48 MB request
    that is scored leaves it near where it was once answered."""
    assert _post(guarded.port, encode_request(torch.rand(1, 3, 8, 8), ["p"], None))[0] == 200  # warm
    pid = guarded.proc.pid
    for batch, status in ((5, 413), (4, 200)):
        body = encode_request(torch.rand(batch, 3, 1024, 1024), ["p"] * batch, None)
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # the peak resident memory counts again from now (proc(5))
        before, _ = _rss_mb(pid)
        assert _post(guarded.port, body)[0] == status
        after, peak = _rss_mb(pid)
        size = len(body) / 2 ** 20
        if status == 413:  # read, decoded (a view) and refused: the body once
            assert peak - before < 1.25 * size, (before, peak, size)
        assert after - before < 0.25 * size, (status, before, after, size)


def test_a_port_in_use_is_one_line(guarded):
    proc = subprocess.run([sys.executable, "-m", "scripts.reward_server", "--reward", "jpeg_compressibility",
                           "--port", str(guarded.port)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{guarded.port}: Address already in use (another process listens there: "
        f"stop it, or choose another --port; --port 0 takes any free one)"], proc.stderr
