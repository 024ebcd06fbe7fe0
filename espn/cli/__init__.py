"""`espn` command line: search, calibrate, verify here; index, index-merge, serve, route plug in.

`main` is the console script (`espn = "espn.cli:main"`); `build_parser` the whole parser
(the docs pages render it). The rest is what the build job's and the server's commands
share with these: the parser class, usage errors, logging and the reader options. The
commands live in `app` (parser and dispatch), `search`, `calibrate` and `verify`.
"""

from __future__ import annotations

import os
from typing import Sequence

from .common import (COMMANDS_GROUP, OWN_LOGGERS, CliParser, UsageError, add_reader_options, configure_logging,
                     reader_options)

__all__ = ["main", "build_parser", "add_reader_options", "reader_options", "configure_logging", "CliParser",
           "UsageError", "COMMANDS_GROUP", "OWN_LOGGERS"]


def main(argv: Sequence[str] | None = None) -> int:
    """The `espn` console script: parse `argv` (default: sys.argv), run the command, its exit status."""
    # Before torch or FAISS load OpenMP: spinning idle threads starve the other pool on
    # small machines (a 9x slower search measured on 2 cores). Users can still override.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # Entry point: the commands import torch and FAISS at their top, so they load only now.
    from .app import run

    return run(argv)


def build_parser() -> CliParser:
    """The whole `espn` parser, entry points' subcommands included."""
    from .app import build_parser as build  # entry point: the commands import torch and FAISS (see main)

    return build()
