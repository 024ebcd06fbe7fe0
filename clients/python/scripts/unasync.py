"""Writes the sync client (espn_client/client.py) from the async one (espn_client/async_client.py).

    python clients/python/scripts/unasync.py           # rewrite client.py
    python clients/python/scripts/unasync.py --check   # exit 1, with a diff, if client.py is not current

The sync client is the async one with `async` and `await` taken out, the async names of httpx
swapped for the sync ones (`aiter_raw`, `aclose`, `__aenter__`) and the waiting primitives
imported from _sync_io instead of _async_io: httpcore's unasync, applied line by line. A few
sentences of the docstrings that only hold for one of the two are swapped whole; each must be
found, so an edit to one of them fails here instead of leaving a stale sentence behind.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "espn_client"
SOURCE = PACKAGE / "async_client.py"
TARGET = PACKAGE / "client.py"
HEADER = ("# Generated from async_client.py by clients/python/scripts/unasync.py: edit that file and run the script\n"
          "# (tests/test_client.py checks that this file is what the script writes).\n")

#: Whole sentences of the async docstrings and their sync wording (each must occur).
SENTENCES = [
    ('"""`AsyncClient`: the espn HTTP API from async code.', '"""`Client`: the espn HTTP API from synchronous code.'),
    ("""The source of both clients: client.py (`Client`) is generated from this file by
clients/python/scripts/unasync.py, which takes out `async` and `await` and swaps the waiting
primitives (_async_io for _sync_io). Edit this file, then run the script; tests/test_client.py
fails while client.py is not what the script writes.""",
     """Generated from async_client.py (`AsyncClient`, the twin of this class), with `async` and
`await` taken out, by clients/python/scripts/unasync.py."""),
    ("It belongs to one event loop.", "Threads may share it."),
]
#: Token rewrites, in order (word boundaries: `AsyncClient` -> `Client`, `httpx.AsyncClient` -> `httpx.Client`).
TOKENS = [
    (r"\basync def\b", "def"),
    (r"\basync with\b", "with"),
    (r"\basync for\b", "for"),
    (r"\bawait\s+", ""),
    (r"\bAsyncClient\b", "Client"),
    (r"\baiter_raw\b", "iter_raw"),
    (r"\baclose\b", "close"),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\b_async_io\b", "_sync_io"),
]


def unasync(source: str) -> str:
    """The sync module's text from the async module's (the sentences set aside while the tokens are rewritten)."""
    for at, (async_text, _) in enumerate(SENTENCES):
        if async_text not in source:
            raise SystemExit(f"unasync: {SOURCE.name} no longer holds the sentence {async_text[:60]!r}...; "
                             "update SENTENCES in this script")
        source = source.replace(async_text, f"\0{at}\0")
    for pattern, replacement in TOKENS:
        source = re.sub(pattern, replacement, source)
    for at, (_, sync_text) in enumerate(SENTENCES):
        source = source.replace(f"\0{at}\0", sync_text)
    return HEADER + source


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="do not write: exit 1 with a diff if client.py differs")
    args = parser.parse_args(argv)
    wanted = unasync(SOURCE.read_text(encoding="utf-8"))
    current = TARGET.read_text(encoding="utf-8") if TARGET.exists() else ""
    if args.check:
        if current != wanted:
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), wanted.splitlines(True),
                                                       str(TARGET), "generated"))
            print(f"{TARGET} is not current: run python clients/python/scripts/unasync.py", file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        TARGET.write_text(wanted, encoding="utf-8")
        print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
