"""`python -m espn_server INDEX ...`: the same as `espn serve INDEX ...` (it runs that command)."""

from __future__ import annotations

import os
import sys


def main() -> int:
    """Replace this process with `espn serve` and the same arguments (its parser, its exit codes)."""
    os.execv(sys.executable, [sys.executable, "-m", "espn.cli", "serve", *sys.argv[1:]])
    return 1  # not reached: execv returns only by raising


if __name__ == "__main__":
    sys.exit(main())
