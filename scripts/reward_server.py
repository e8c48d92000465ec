"""Serve registered rewards over HTTP, for runs that score with `--reward http://HOST:PORT/NAME`.

    python -m scripts.reward_server --reward ocr --reward-model ocr=/weights/trocr-large-printed --port 8000
    CUDA_VISIBLE_DEVICES=7 python -m scripts.reward_server --reward pickscore \\
        --reward-model pickscore=/weights/PickScore_v1 --host 0.0.0.0 --port 8000 --token-file ~/.reward-token
    python -m scripts.reward_server --reward jpeg_compressibility --protocol flow_grpo --port 18085
        # Flow-GRPO's and VeRL-Omni's clients score with it at POST /, runs at flow_grpo+http://HOST:18085/NAME

Every reward named is built before the service takes a request (a missing weight folder fails at
once, and so does a port in use), then served at /NAME until Ctrl-C; one line per scored request
goes to stdout. Exposing it (--host beyond loopback, --token-file, the limits): docs/rewards-http.md;
the protocol: rewards/wire.py; the server: rewards/server.py.
"""
from __future__ import annotations

import argparse
import dataclasses

from config import cli
from models import resolve_device
from rewards import VIDEO_REWARDS, build_reward, parse_reward_specs, reward_model_paths, reward_names, reward_url
from rewards.server import ServerConfig, serve

VIDEO_FRAMES = 81  # --max-frames when a video reward is served (Wan's 81 frames)


def read_token(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--token-file {path!r}: {e}") from None
    if len(token) < 16 or any(c.isspace() for c in token):
        raise ValueError(f"--token-file {path!r}: the file must hold one token of 16 characters or more, without "
                         f"spaces (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE)")
    return token


def main(argv: list[str] | None = None) -> int:
    d = ServerConfig()
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--reward", action="append", required=True, metavar="NAME",
                   help=f"a reward to serve at /NAME, repeatable; known: {', '.join(reward_names())}")
    p.add_argument("--reward-model", action="append", default=[], metavar="NAME=DIR",
                   help="local weights folder of a model reward, repeatable (rewards/README.md)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface, for runs on other machines: give "
                        "--token-file too)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port, printed at start)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--protocol", default=d.protocol, choices=("digenrl", "flow_grpo"),
                   help="digenrl (this project's: exact float32 images) or flow_grpo (the pickle of JPEG images that "
                        "Flow-GRPO's reward servers and VeRL-Omni's scorers speak, at POST / with one reward; "
                        "runs name it flow_grpo+http://HOST:PORT/NAME)")
    p.add_argument("--token-file", metavar="FILE",
                   help="a file holding a shared token: requests without 'Authorization: Bearer TOKEN' are refused "
                        "(401); runs send it from the file named by DIGENRL_REWARD_TOKEN_FILE")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="samples per request")
    p.add_argument("--max-side", type=int, default=d.max_side, help="pixels on either side of an image or frame")
    p.add_argument("--max-frames", type=int, default=None,
                   help=f"frames per sample (default 1, or {VIDEO_FRAMES} when a video reward is served)")
    p.add_argument("--read-timeout-s", type=float, default=d.read_timeout_s,
                   help="a request's headers must arrive within this many seconds of its connection, its body "
                        "within as many of its headers (408)")
    p.add_argument("--max-requests", type=int, default=d.max_requests,
                   help="request bodies held in memory at once (read or scored); the others wait, unread")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections, and never more than the open-file limit (ulimit -n) leaves")
    p.add_argument("--backlog", type=int, default=d.backlog, help="connections the kernel queues for accepting")
    args = p.parse_args(argv)
    for spec in args.reward:
        if reward_url(spec) or ":" in spec:
            raise ValueError(f"--reward {spec!r}: the server takes reward names (weights are the run's, "
                             f"URLs the run's too)")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port {args.port} must be in [0, 65535]")
    for flag in ("max_batch", "max_side", "max_requests", "max_connections", "backlog"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1")
    if args.max_frames is not None and args.max_frames < 1:
        raise ValueError(f"--max-frames {args.max_frames} must be at least 1")
    if not 0 < args.read_timeout_s <= 3600:
        raise ValueError(f"--read-timeout-s {args.read_timeout_s} must be in (0, 3600]")
    paths = reward_model_paths(args.reward_model)
    names = [n for n, _ in parse_reward_specs(args.reward, paths)]
    frames = args.max_frames or (VIDEO_FRAMES if VIDEO_REWARDS & set(names) else 1)
    config = dataclasses.replace(d, max_batch=args.max_batch, max_side=args.max_side, max_frames=frames,
                                 read_timeout_s=args.read_timeout_s, max_requests=args.max_requests,
                                 max_connections=args.max_connections, backlog=args.backlog, protocol=args.protocol,
                                 token=read_token(args.token_file) if args.token_file else None)
    device = str(resolve_device(args.device))
    serve(lambda: {n: build_reward(n, device=device, model_path=paths.get(n)) for n in names},
          args.host, args.port, config, device=device)
    return 0


if __name__ == "__main__":
    cli.run(main)
