"""Named crash points of the writers (live writes, compaction, replication, the bulk build):
a no-op in service, the one place a test stops, pauses or kills a writer at a chosen step.

A test sets `_checkpoint` (tests/test_live.py, tests/crash_serve.py, tests/fault_serve.py);
every writer calls `checkpoint`, so one hook reaches them all.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["checkpoint"]

#: Test hook: called with a step name at each point a crash test kills the writer.
_checkpoint: Callable[[str], None] = lambda step: None


def checkpoint(step: str) -> None:
    """A named crash point of a writer (live writes, compaction, replication): a no-op unless
    a test set the hook."""
    _checkpoint(step)
