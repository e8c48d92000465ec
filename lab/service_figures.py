"""The reward server's figures of docs/reliability.md: hostile clients against `scripts.reward_server`
(jpeg_compressibility on the CPU, --token-file, --read-timeout-s 10, the other limits at their
defaults), printed as a markdown table: what each case got, how long it took, and the server's
resident memory.

    python -m lab.service_figures [--out /tmp/service-figures]

Cases: a request without the token; malformed safetensors bodies (a huge declared shape, bad
offsets, trailing bytes, a nested JSON header); a 2 GB body; a body of 33 images of 1024 x 1024
(read, then refused by --max-batch) and one of 32 (at the size limit, scored); 1,500 connections
that never finish their headers; 300 of them under `ulimit -n 256`; a second server on the port
of the first.
"""
import argparse
import http.client
import json
import os
import resource
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time

import torch

from lab.launch import ROOT
from rewards.wire import encode_request

DEADLINE_S = 10.0
SLOW_HEAD = b"POST /jpeg_compressibility HTTP/1.1\r\nHost: x\r\nX-Slow: "


class Server:
    """`python -m scripts.reward_server` serving jpeg_compressibility, started and stopped here."""

    def __init__(self, token_file: str, nofile: int | None = None):
        cmd = [sys.executable, "-m", "scripts.reward_server", "--reward", "jpeg_compressibility", "--port", "0",
               "--device", "cpu", "--token-file", token_file, "--read-timeout-s", str(DEADLINE_S)]
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        self.printed: list[str] = []
        while not (line := self.proc.stdout.readline()).startswith("serving "):
            if not line:
                raise SystemExit("the reward server did not start:\n" + "".join(self.printed))
            self.printed.append(line)
        self.port = int(line.split("127.0.0.1:")[1].split("/")[0])
        threading.Thread(target=lambda: self.printed.extend(self.proc.stdout), daemon=True).start()

    def rss_mb(self, reset_peak: bool = False) -> tuple[float, float]:
        """(resident, peak resident since the last reset) MB."""
        if reset_peak:
            with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
                f.write("5")
        fields = dict(line.split(":", 1) for line in open(f"/proc/{self.proc.pid}/status"))
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def post(port: int, body: bytes, token: str | None) -> tuple[int, str, float]:
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/jpeg_compressibility", body=body,
                 headers={"Authorization": f"Bearer {token}"} if token else {})
    answer = conn.getresponse()
    return answer.status, answer.read().decode()[:90], time.monotonic() - start


def health_s(port: int, token: str) -> float:
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("GET", "/", headers={"Authorization": f"Bearer {token}"})
    status = conn.getresponse().status
    if status != 200:
        raise SystemExit(f"the health check got {status}")
    return time.monotonic() - start


def crafted(entry: dict, data: bytes) -> bytes:
    header = json.dumps({"images": entry, "__metadata__": {"prompts": '["a"]', "metadata": "[{}]"}}).encode()
    return struct.pack("<Q", len(header)) + header + data


def huge_body(port: int, token: str, size: int) -> tuple[int, str, float]:
    """Declare `size` bytes and send them in 1 MB writes until the server answers or closes."""
    start = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /jpeg_compressibility HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
              f"Content-Length: {size}\r\n\r\n".encode())
    chunk, sent, answer = bytes(1 << 20), 0, b""
    try:
        while sent < size and not answer:
            s.sendall(chunk)
            sent += len(chunk)
            s.setblocking(False)
            try:
                answer = s.recv(4096)  # the answer, once the server has one
            except BlockingIOError:
                pass
            s.setblocking(True)
    except OSError:  # the server closed the connection
        pass
    status = int(answer.split()[1]) if answer.startswith(b"HTTP/") else 0
    return status, f"{sent / 2 ** 20:.0f} MB sent; " + answer.split(b"\r\n\r\n")[-1].decode()[:70], \
        time.monotonic() - start


def slow_connections(port: int, token: str, count: int) -> tuple[float, int, float]:
    """(seconds a health check took while `count` connections hold their headers unfinished, how
    many of them are still open after the read deadline from the last, seconds all that took)."""
    start = time.monotonic()
    slow = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(SLOW_HEAD)
        slow.append(s)
    answered = health_s(port, token)
    time.sleep(DEADLINE_S + 2)  # from the last one
    still = sum(not _closed(s) for s in slow)
    for s in slow:
        s.close()
    return answered, still, time.monotonic() - start


def _closed(s: socket.socket) -> bool:
    """The server closed it: what it sent (a 503) is followed by EOF, or a reset."""
    s.setblocking(False)
    try:
        while s.recv(65536):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/service-figures")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    token, token_file = secrets.token_urlsafe(32), os.path.join(args.out, "token")
    with open(token_file, "w") as f:
        f.write(token)
    rows = []
    server = Server(token_file)
    try:
        small = encode_request(torch.rand(2, 3, 16, 16), ["a", "b"], None)
        rows.append(("a request without the token", *post(server.port, small, None), None))
        for name, body in (
                ("a declared shape of 10^24 pixels", crafted({"dtype": "F32", "shape": [1, 3, 1 << 40, 1 << 40],
                                                              "data_offsets": [0, 48]}, bytes(48))),
                ("data_offsets past the data", crafted({"dtype": "F32", "shape": [1, 3, 2, 2],
                                                        "data_offsets": [8, 56]}, bytes(48))),
                ("16 trailing bytes", crafted({"dtype": "F32", "shape": [1, 3, 2, 2], "data_offsets": [0, 48]},
                                              bytes(64))),
                ("a header nested 200,000 deep", struct.pack("<Q", 200000) + b"[" * 200000)):
            rows.append((name, *post(server.port, body, token), None))
        before, _ = server.rss_mb(reset_peak=True)
        rows.append(("a 2 GB body", *huge_body(server.port, token, 2 << 30), (before, *server.rss_mb())))
        for batch in (33, 32):  # one more than --max-batch: read whole, decoded, refused; then one scored
            body = encode_request(torch.rand(batch, 3, 1024, 1024), ["p"] * batch, None)
            before, _ = server.rss_mb(reset_peak=True)
            rows.append((f"a {len(body) / 1e6:.0f} MB body ({batch} images of 1024 x 1024)",
                         *post(server.port, body, token), (before, *server.rss_mb())))
            del body
        answered, still, took = slow_connections(server.port, token, 1500)
        rows.append(("1,500 connections that never finish their headers", 200,
                     f"health check answered in {answered:.2f} s; still open after {DEADLINE_S:g} + 2 s: {still}",
                     took, None))
        start = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "scripts.reward_server", "--reward", "jpeg_compressibility",
                                 "--port", str(server.port)], cwd=ROOT, capture_output=True, text=True, timeout=300)
        rows.append(("a second server on its port", second.returncode, second.stderr.strip()[:90],
                     time.monotonic() - start, None))
        tracebacks = sum("Traceback" in line for line in server.printed)
    finally:
        server.stop()
    limited = Server(token_file, nofile=256)
    try:
        answered, still, took = slow_connections(limited.port, token, 300)
        rows.append(("300 such connections under ulimit -n 256", 200,
                     f"health check answered in {answered:.2f} s; still open after {DEADLINE_S:g} + 2 s: {still}",
                     took, None))
    finally:
        limited.stop()
    print("| case | answer | what it said | seconds | server RSS MB (before, after, peak) |")
    print("|---|---|---|---|---|")
    for name, status, said, seconds, rss in rows:
        memory = "" if rss is None else ", ".join(f"{x:.0f}" for x in rss)
        print(f"| {name} | {status} | {said} | {seconds:.2f} | {memory} |")
    print(f"\ntracebacks the server printed: {tracebacks}")


if __name__ == "__main__":
    main()
