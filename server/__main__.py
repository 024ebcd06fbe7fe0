"""`python -m server INDEX ...`: the same as `espn serve INDEX ...`."""

from __future__ import annotations

import argparse
import sys

from .cli import add_serve_arguments, run_serve


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m server", description="Serve an ESPN index over HTTP.")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
