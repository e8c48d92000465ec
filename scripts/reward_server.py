"""Serve registered rewards over HTTP, for runs that score with `--reward http://HOST:PORT/NAME`.

    python -m scripts.reward_server --reward ocr --reward-model ocr=/weights/trocr-large-printed --port 8000
    CUDA_VISIBLE_DEVICES=7 python -m scripts.reward_server --reward pickscore \\
        --reward-model pickscore=/weights/PickScore_v1 --host 0.0.0.0 --port 8000   # a GPU of its own

Every reward named is built before the port opens (a missing weight folder fails at once), then
served at /NAME until Ctrl-C; one line per scored request goes to stdout. The protocol is in
rewards/remote.py, the server in rewards/server.py.
"""
from __future__ import annotations

import argparse

from config import cli
from models import resolve_device
from rewards import parse_reward_specs, reward_model_paths, reward_names, reward_url
from rewards.server import serve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--reward", action="append", required=True, metavar="NAME",
                   help=f"a reward to serve at /NAME, repeatable; known: {', '.join(reward_names())}")
    p.add_argument("--reward-model", action="append", default=[], metavar="NAME=DIR",
                   help="local weights folder of a model reward, repeatable (rewards/README.md)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface, for runs on other machines)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port, printed at start)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    args = p.parse_args(argv)
    for spec in args.reward:
        if reward_url(spec) or ":" in spec:
            raise ValueError(f"--reward {spec!r}: the server takes reward names (weights are the run's, "
                             f"URLs the run's too)")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port {args.port} must be in [0, 65535]")
    paths = reward_model_paths(args.reward_model)
    names = [n for n, _ in parse_reward_specs(args.reward, paths)]
    serve(names, paths, device=str(resolve_device(args.device)), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    cli.run(main)
