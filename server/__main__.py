"""`python -m espn_server INDEX ...`: the same as `espn serve INDEX ...`."""

from __future__ import annotations

import os
import sys


def main() -> int:
    # As in `espn`: before torch or FAISS load OpenMP, idle threads must not spin.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from espn.service import CliParser  # entry point: only once OMP_WAIT_POLICY is set (above)

    from .cli import add_serve_arguments, run_command  # entry point, as espn.cli

    parser = CliParser(prog="python -m espn_server", description="Serve an ESPN index over HTTP.")
    add_serve_arguments(parser)
    parser.set_defaults(command="serve")
    return run_command(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
