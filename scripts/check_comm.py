"""Check a run's recorded communication for NCCL deadlocks (see lab/nccl/replay.py).

    DIGENRL_COMM_TRACE=runs/x/comm torchrun ... # record (any backend; gloo on CPU is enough)
    python -m scripts.check_comm runs/x/comm     # replay under NCCL's rules

Prints "ok: N ops on R ranks, G communicators, C groups created" and exits 0, or prints the deadlock
(the ranks that wait on each other, the line each is blocked on and the ops that cannot complete,
with file:line) or a group not created by every rank in one order, and exits 1; exits 2 when the
traces cannot be read. N counts sends, receives and collectives.
"""
from __future__ import annotations

import argparse
import sys

from lab.nccl.replay import TraceError, check, load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="folder holding rank{R}.jsonl (DIGENRL_COMM_TRACE of the run)")
    args = parser.parse_args(argv)
    try:
        result = check(load(args.dir))
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.message)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
