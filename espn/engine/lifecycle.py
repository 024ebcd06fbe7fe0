"""One index's life in a process as a state machine: its state, the requests inside it, and
waiting for either to change by a condition, never by polling.

    CLOSED -> OPENING -> WARMING -> READY -> CLOSING -> CLOSED
    OPENING -> CLOSED                      (the open failed)
    CLOSED | READY -> DELETING -> GONE     (DELETING -> back where it was, when the deletion fails)

Every change happens on the event loop, so a state read between two awaits is the state.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

from .messages import Lifecycle

__all__ = ["IndexLife", "IllegalTransition"]

_NEXT: dict[Lifecycle, frozenset[Lifecycle]] = {
    Lifecycle.CLOSED: frozenset({Lifecycle.OPENING, Lifecycle.DELETING}),
    Lifecycle.OPENING: frozenset({Lifecycle.WARMING, Lifecycle.READY, Lifecycle.CLOSED}),
    Lifecycle.WARMING: frozenset({Lifecycle.READY, Lifecycle.CLOSING}),
    Lifecycle.READY: frozenset({Lifecycle.CLOSING, Lifecycle.DELETING}),
    Lifecycle.CLOSING: frozenset({Lifecycle.CLOSED}),
    Lifecycle.DELETING: frozenset({Lifecycle.GONE, Lifecycle.CLOSED, Lifecycle.READY}),
    Lifecycle.GONE: frozenset(),
}
#: States in which requests are served.
SERVING = frozenset({Lifecycle.WARMING, Lifecycle.READY})


class IllegalTransition(RuntimeError):
    """A state change the machine does not have: a bug in the caller, never the user's doing."""


class IndexLife:
    """The state of one index and the requests inside it; `wait_until` sleeps until a change
    makes its predicate true (each change wakes the waiters, on the event loop)."""

    def __init__(self, state: Lifecycle = Lifecycle.CLOSED) -> None:
        self.state = state
        self.inside = 0  # requests between enter() and leave()
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def serving(self) -> bool:
        return self.state in SERVING

    def move(self, to: Lifecycle) -> None:
        """Change the state (IllegalTransition for a change the machine lacks) and wake the waiters."""
        if to not in _NEXT[self.state]:
            raise IllegalTransition(f"an index cannot go from {self.state.value} to {to.value}")
        self.state = to
        self._wake()

    def enter(self) -> None:
        self.inside += 1

    def leave(self) -> None:
        self.inside -= 1
        if self.inside == 0:
            self._wake()

    async def wait_until(self, ready: Callable[["IndexLife"], bool], timeout_s: Optional[float] = None) -> bool:
        """Wait until `ready(self)` holds (True), or until `timeout_s` passed (whether it holds then)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not ready(self):
            change: asyncio.Future[None] = loop.create_future()
            self._waiters.append(change)
            try:
                await asyncio.wait_for(change, None if deadline is None else max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return ready(self)
        return True

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for change in waiters:
            if not change.done():
                change.set_result(None)
