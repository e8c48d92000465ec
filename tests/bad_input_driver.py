"""Runs train_disagg's entry point (`train_disagg.cli`) for a table of cases, one process per rank.

Reads a JSON list of cases on stdin ({"name", "argv", "world", "env"}), imports train_disagg once,
then forks one process per rank of each case with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT set as torchrun sets them, and hosts each case's rendezvous store itself as torchrun's
agent does (TORCHELASTIC_USE_AGENT_STORE), so a rank that exits takes no store with it: every rank
runs the real entry point, exit path included, without paying the imports again. Cases run in
batches in parallel. A batch's ranks are forked before its stores start: a store's server thread
holds libc's resolver lock while it names a peer, and a rank forked at that moment would inherit
the lock held and hang in its first connect. Each store serves a socket that listens from before
the fork, so a rank's connect waits in the backlog until its store runs. Prints one JSON line per
case: {"name", "ranks": [{"rank", "code", "seconds", "stderr"}]}; a rank still running after
--limit seconds is killed and reported with code null.
"""
import json
import os
import select
import signal
import socket
import sys
import time
from datetime import timedelta

from torch.distributed import TCPStore

import train_disagg
from models import adapter_class, model_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)


for family in model_names():  # the children find every family imported
    adapter_class(family)


def listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def agent_store(world: int, sock: socket.socket) -> TCPStore:
    """The store torchrun's agent would host for the case's ranks (they connect as clients), on `sock`."""
    return TCPStore("127.0.0.1", sock.getsockname()[1], world, is_master=True, timeout=timedelta(seconds=300),
                    wait_for_workers=False, master_listen_fd=sock.detach())


def start(case: dict, port: int, inherited: list[socket.socket]) -> list[dict]:
    ranks = []
    for rank in range(case.get("world", 2)):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the rank
            for sock in inherited:
                sock.close()
            os.close(read)
            os.dup2(write, 1)
            os.dup2(write, 2)
            os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(case.get("world", 2)),
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                               "TORCHELASTIC_USE_AGENT_STORE": "True", **case.get("env", {})})
            train_disagg.cli(case["argv"])  # ends with os._exit
            os._exit(99)
        os.close(write)
        ranks.append({"rank": rank, "pid": pid, "fd": read, "out": b"", "start": time.monotonic(), "code": None,
                      "seconds": None})
    return ranks


def collect(ranks: list[dict], limit: float) -> None:
    open_fds = {r["fd"]: r for r in ranks}
    while open_fds:
        ready = select.select(list(open_fds), [], [], 0.2)[0]
        for fd in ready:
            data = os.read(fd, 65536)
            if data:
                open_fds[fd]["out"] += data
            else:
                os.close(fd)
                del open_fds[fd]
        for r in ranks:
            if r["seconds"] is None:
                pid, status = os.waitpid(r["pid"], os.WNOHANG)
                if pid:
                    r["seconds"] = time.monotonic() - r["start"]
                    r["code"] = os.waitstatus_to_exitcode(status)
                elif time.monotonic() - r["start"] > limit:
                    os.kill(r["pid"], signal.SIGKILL)  # a rank of this driver that overran
    for r in ranks:
        if r["seconds"] is None:
            _, status = os.waitpid(r["pid"], 0)
            r["seconds"] = time.monotonic() - r["start"]
            r["code"] = os.waitstatus_to_exitcode(status) if time.monotonic() - r["start"] <= limit else None


def main() -> None:
    limit = float(sys.argv[sys.argv.index("--limit") + 1]) if "--limit" in sys.argv else 60.0
    batch = int(sys.argv[sys.argv.index("--batch") + 1]) if "--batch" in sys.argv else 6
    cases = json.load(sys.stdin)
    for i in range(0, len(cases), batch):
        socks = [listening() for _ in cases[i:i + batch]]
        running = [(case, start(case, sock.getsockname()[1], socks)) for case, sock in zip(cases[i:i + batch], socks)]
        stores = [agent_store(case.get("world", 2), sock) for case, sock in zip(cases[i:i + batch], socks)]
        collect([r for _, ranks in running for r in ranks], limit)  # times every rank of the batch as it ends
        del stores
        for case, ranks in running:
            print(json.dumps({"name": case["name"], "ranks": [
                {"rank": r["rank"], "code": r["code"], "seconds": round(r["seconds"], 3),
                 "stderr": r["out"].decode(errors="replace")} for r in ranks]}), flush=True)


if __name__ == "__main__":
    main()
