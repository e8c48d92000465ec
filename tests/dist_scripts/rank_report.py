"""The end every check script shares: each rank writes its checks to OUT/rank{R}.json, prints its
exit code as a JSON line and leaves at once (os._exit: no interpreter teardown racing the other
ranks' process-group shutdown)."""
import json
import os
import sys


def finish(out_dir: str, rank: int, checks: dict, report=None, clean_exit=None) -> None:
    """Exit 0 when every check is True (and no exception was recorded), else 1. `report`: what the
    rank file holds (default: `checks`). `clean_exit`: called before leaving when every check passed
    (a barrier and destroy_process_group, for a script that checks a clean shutdown)."""
    code = 0 if all(v is True for v in checks.values()) else 1
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(checks if report is None else report, f, indent=1)
    if code == 0 and clean_exit is not None:
        clean_exit()
    print(json.dumps({"rank": rank, "code": code}), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
