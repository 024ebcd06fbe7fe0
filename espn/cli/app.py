"""The `espn` parser and its dispatch (`espn.cli.main` calls `run`).

The only place that reads argv; every command calls the library. Every error ends as one
line on stderr, `espn CMD: error: ...`, with exit status 1, or 2 when the command line
itself is wrong (as argparse does); never a traceback (`-v` adds one). Third-party
libraries' log lines (FAISS's loader, transformers, ...) are shown only with `-v`.

Subcommands are registered in one place, `register_commands`. The library must not import
the build job or the server (they import it), so their subcommands register themselves
through the `espn.commands` entry-point group: each entry point is a `register(subparsers)`
that adds its parsers and sets `handler`.
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import logging
import sys
from typing import Callable, Sequence, cast

from ..choices import READER_NAMES
from ..errors import EspnError
from ..live import parsers as live_parsers
from .parsers import register_calibrate, register_search, register_verify, run_command
from .common import COMMANDS_GROUP, CliParser, UsageError, configure_logging, one_line

__all__ = ["run", "build_parser", "register_commands"]

# Entry points register in this order, so `espn --help` lists the build before the server.
_PLUGIN_ORDER = ("indexing", "server")

log = logging.getLogger("espn")


def register_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Every subcommand, in the order `espn --help` lists them: the library's own, then the
    entry points' (the build job, the server)."""
    readers = sorted(READER_NAMES)
    register_search(sub, readers)
    register_calibrate(sub, readers)
    register_verify(sub)
    live_parsers.register(sub, run_command)
    _register_plugins(sub)


def _register_plugins(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Subcommands from the `espn.commands` entry points (the build job, the server)."""
    found = sorted(importlib.metadata.entry_points(group=COMMANDS_GROUP),
                   key=lambda ep: (_PLUGIN_ORDER.index(ep.name) if ep.name in _PLUGIN_ORDER else 99, ep.name))
    for entry_point in found:
        try:
            register = entry_point.load()
        except ImportError as exc:  # a broken install: say which part and why, keep the rest usable
            p = sub.add_parser(entry_point.name, help=f"(unavailable: {exc})")
            p.set_defaults(handler=_unavailable(entry_point.name, exc))
            continue
        register(sub)


def _unavailable(name: str, exc: ImportError) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        raise EspnError(f"the {name} commands cannot load: {exc}")

    return handler


def build_parser() -> CliParser:
    parser = CliParser(prog="espn", description="Multi-vector retrieval with the embedding table on SSD.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more output: -v adds debug lines, other libraries' log lines and a traceback with an "
                             "error; -vv debug lines of every library")
    sub = parser.add_subparsers(dest="command", required=True)
    # The plugins' register(sub) take the plain argparse type; the parsers they add are CliParsers.
    register_commands(cast("argparse._SubParsersAction[argparse.ArgumentParser]", sub))
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv) and run the command; its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    handler: Callable[[argparse.Namespace], int] = args.handler
    prefix = f"espn {args.command}: error:"
    try:
        return handler(args)
    except KeyboardInterrupt:
        print(f"espn {args.command}: interrupted", file=sys.stderr)
        return 130
    except UsageError as exc:
        print(f"{prefix} {one_line(exc)} (see `espn {args.command} --help`)", file=sys.stderr)
        return 2
    except (EspnError, ValueError, FileNotFoundError) as exc:
        log.debug("traceback", exc_info=True)
        print(f"{prefix} {one_line(exc)}", file=sys.stderr)
        return 1
    except OSError as exc:
        log.debug("traceback", exc_info=True)
        if exc.errno == errno.ENOSPC:
            print(f"{prefix} no space left on device"
                  f"{' writing ' + str(exc.filename) if exc.filename else ''}; the partial build is kept, "
                  "free space and re-run the same command to resume", file=sys.stderr)
        else:
            print(f"{prefix} {exc.strerror or one_line(exc)}{': ' + str(exc.filename) if exc.filename else ''}",
                  file=sys.stderr)
        return 1
    except Exception as exc:  # a bug: still one line, the traceback one -v away
        log.debug("traceback", exc_info=True)
        print(f"{prefix} internal error, {type(exc).__name__}: {one_line(exc)} (run with -v for the traceback; "
              "please report it)", file=sys.stderr)
        return 1

