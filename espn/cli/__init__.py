"""`espn` command line: search, calibrate, verify here; index, index-merge, serve, route plug in.

`main` is the console script (`espn = "espn.cli:main"`); `build_parser` the whole parser
(the docs pages render it). The rest is what the build job's and the server's commands
share with these: the parser class, usage errors, logging and the reader options.
"""

from __future__ import annotations

from .app import (COMMANDS_GROUP, OWN_LOGGERS, CliParser, UsageError, add_reader_options, build_parser,
                   configure_logging, main, reader_options)

__all__ = ["main", "build_parser", "add_reader_options", "reader_options", "configure_logging", "CliParser",
           "UsageError", "COMMANDS_GROUP", "OWN_LOGGERS"]
