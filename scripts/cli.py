"""The scripts' shared ending: a user error (ValueError) is one `error:` line on stderr and exit
code 2, with no stack trace from inside the libraries."""
from __future__ import annotations

import sys
from collections.abc import Callable


def run(main: Callable[[], int]) -> None:
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
