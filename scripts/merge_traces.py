"""Merge the per-rank Chrome traces of a run into one file that Perfetto (https://ui.perfetto.dev) or
chrome://tracing opens with a lane per rank.

    python -m scripts.merge_traces runs/default                  # -> runs/default/trace/merged.json
    python -m scripts.merge_traces a/trace/rank0.json b/trace/rank1.json --out merged.json

Each rank writes DIR/trace/rank{R}.json with microseconds since the Unix epoch, so the lanes line up
as they ran; across nodes that needs their clocks in sync (NTP): a lane shifted by a constant offset
is a clock that was not.
"""
from __future__ import annotations

import argparse
import json
import os
import re


from config import cli
from telemetry.tracing import merge_traces

RANK_FILE = re.compile(r"rank(\d+)\.json$")


def trace_files(paths: list[str]) -> list[str]:
    """The rank traces named by `paths` (files, or run / trace folders), in rank order."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            folder = os.path.join(path, "trace") if os.path.isdir(os.path.join(path, "trace")) else path
            found = [os.path.join(folder, f) for f in os.listdir(folder) if RANK_FILE.search(f)]
            if not found:
                raise ValueError(f"{path!r} holds no rank traces (trace/rank{{R}}.json)")
            files += found
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise ValueError(f"{path!r} is neither a trace file nor a folder")
    rank = lambda f: int(RANK_FILE.search(f).group(1)) if RANK_FILE.search(f) else -1  # noqa: E731
    return sorted(dict.fromkeys(files), key=lambda f: (rank(f), f))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("paths", nargs="+", help="a run folder, its trace/ folder, or rank trace files")
    p.add_argument("--out", default=None, help="merged file (default: TRACE_FOLDER/merged.json of the first path)")
    args = p.parse_args(argv)
    files = trace_files(args.paths)
    out = args.out or os.path.join(os.path.dirname(files[0]), "merged.json")
    files = [f for f in files if os.path.abspath(f) != os.path.abspath(out)]  # never merge a merge into itself
    merge_traces(files, out)
    with open(out) as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    ranks = sorted({e["pid"] for e in events})
    seconds = (max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)) / 1e6 if spans else 0.0
    print(f"{out}: {len(files)} trace(s), ranks {ranks}, {len(spans)} spans over {seconds:.2f} s")
    return 0


if __name__ == "__main__":
    cli.run(main)
