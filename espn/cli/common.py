"""What every `espn` subcommand shares, here and in the build job's and the server's: the
parser class, usage errors, one-line messages, logging, and the flags of the reader."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from ..errors import InvalidParameterError, UsageError

__all__ = ["UsageError", "CliParser", "configure_logging", "one_line", "add_reader_options", "reader_options",
           "check_output_file", "OWN_LOGGERS", "IO_ENGINES", "COMMANDS_GROUP"]

#: The entry-point group through which the build job and the server add their subcommands.
COMMANDS_GROUP = "espn.commands"
IO_ENGINES = ("auto", "io_uring", "aio", "threads")
#: Loggers of this project (the library, the build job, the server): INFO by default.
OWN_LOGGERS = ("espn", "espn_indexing", "espn_server")


class CliParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `espn search: error: ... (see `espn search --help`)`, exit 2.

    argparse prints the whole usage block before its error; the help is one flag away.
    Subparsers inherit the class (`add_subparsers` uses the parent's type).
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def add_subparsers(self, **kwargs: Any) -> Any:
        """argparse's, remembering the subcommands' parsers by name in `subcommands` (the docs'
        CLI reference lists them without reaching into argparse's private actions)."""
        action = super().add_subparsers(**kwargs)
        self.subcommands: dict[str, argparse.ArgumentParser] = action.choices
        return action


def configure_logging(verbosity: int) -> None:
    """This project's INFO lines on stderr; third-party loggers and Python warnings only with -v.

    verbosity 0: ours at INFO, everyone else's at ERROR (FAISS's loader announces its
    fallbacks at INFO, with a ModuleNotFoundError in the text: noise to a user).
    1 (-v): ours at DEBUG, theirs at INFO; 2 (-vv): everything at DEBUG.
    Calling it again replaces the handler it installed (tests call `main` more than once).
    """
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "espn_cli", False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr)
    handler.espn_cli = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel((logging.ERROR, logging.INFO, logging.DEBUG)[min(verbosity, 2)])
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if verbosity else logging.INFO)
    logging.captureWarnings(True)  # warnings.warn from libraries: through the "py.warnings" logger, as above
    # transformers logs through its own handler, not the root's: its own switch (a user's setting wins).
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", ("error", "info", "debug")[min(verbosity, 2)])


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (some libraries' messages span several)."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def add_reader_options(p: argparse.ArgumentParser) -> None:
    """--io-engine, --io-depth, --max-extent-bytes, --no-direct: options of the posix reader."""
    g = p.add_argument_group("reader I/O (posix reader only)")
    g.add_argument("--io-engine", choices=IO_ENGINES, default=os.environ.get("ESPN_IO_ENGINE") or None,
                   help="read engine (ESPN_IO_ENGINE; default auto: io_uring, then aio, then threads)")
    g.add_argument("--io-depth", type=int, metavar="N", help="extents in flight at once (default 64)")
    g.add_argument("--max-extent-bytes", type=int, metavar="N", help="cap on one coalesced read (default 1 MiB)")
    g.add_argument("--no-direct", action="store_true", help="buffered reads instead of O_DIRECT")
    p.add_argument("--ram-mib", type=float, metavar="MIB", default=None,
                   help="RAM the index may use: its first stage keeps what it must resident, the rest holds a cache "
                        "of frequently read records in front of the posix reader (`espn stats INDEX --ram-mib N` "
                        "shows the split; default: no cache)")
    p.add_argument("--record-cache-mb", type=float, metavar="MB", default=None,
                   help="RAM for a cache of frequently read records in front of the reader, instead of what "
                        "--ram-mib leaves it (default 0: off)")


def reader_options(args: argparse.Namespace) -> dict[str, Any]:
    """The reader options the user set (only those: other readers take none)."""
    options: dict[str, Any] = {}
    if getattr(args, "io_engine", None) is not None:
        options["io_engine"] = None if args.io_engine == "auto" else args.io_engine
    if getattr(args, "io_depth", None) is not None:
        options["io_depth"] = args.io_depth
    if getattr(args, "max_extent_bytes", None) is not None:
        options["max_extent_bytes"] = args.max_extent_bytes
    if getattr(args, "no_direct", False):
        options["direct"] = False
    if options and getattr(args, "reader", None) not in (None, "posix"):
        raise InvalidParameterError(f"--io-engine, --io-depth, --max-extent-bytes and --no-direct apply to the "
                                    f"posix reader only, not --reader {args.reader}")
    if getattr(args, "ram_mib", None) is not None:  # espn.store.ram_plan; checked where the reader opens
        options["ram_mib"] = args.ram_mib
    if getattr(args, "record_cache_mb", None):  # espn.store.record_cache; checked where the reader opens
        options["record_cache_mb"] = args.record_cache_mb
    return options


def check_output_file(path: Path) -> None:
    """Refuse an output file that cannot be written before any work is done."""
    parent = path.absolute().parent
    if not parent.is_dir():
        raise InvalidParameterError(f"--out {path}: directory {parent} does not exist")
    if path.is_dir():
        raise InvalidParameterError(f"--out {path} is a directory; give a file name")
    if not os.access(parent, os.W_OK):
        raise InvalidParameterError(f"--out {path}: directory {parent} is not writable")
