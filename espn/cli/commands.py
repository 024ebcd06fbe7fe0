"""The library's own commands by name (the live-index ones included): what
`parsers.run_command` dispatches to once the command line is parsed and logging configured."""

from __future__ import annotations

import argparse
from typing import Callable

from ..live.commands import COMMANDS as LIVE_COMMANDS
from .calibrate import cmd_calibrate
from .search import cmd_search
from .verify import cmd_verify

__all__ = ["COMMANDS"]

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "search": cmd_search,
    "calibrate": cmd_calibrate,
    "verify": cmd_verify,
    **LIVE_COMMANDS,
}
