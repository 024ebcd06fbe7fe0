"""The Searcher of a live index's newest generation, lent out one search at a time: lifetimes
by reference count, never by a timer.

A search holds a lease on it for as long as it runs; `refresh()` swaps in a newer generation, and the Searcher it
replaces is closed when its last lease ends, at once if none is out. So a server that
takes a write every second holds one or two generations, not one per write for a minute,
and nothing a closed Searcher held (reader, maps, locks) is used after it closed.

A generation that fails to open is not tried again by every request: the failure is
remembered and retried on a back-off (`RETRY_FIRST_S`, doubling up to `RETRY_MAX_S`), logged
once with its traceback; a newer generation published meanwhile is tried at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Iterator

from .searcher import Searcher

__all__ = ["LiveSearcher", "RETRY_FIRST_S", "RETRY_MAX_S"]

log = logging.getLogger(__name__)

#: After a generation fails to open, the first retry waits this long; each failed retry
#: doubles the wait, up to RETRY_MAX_S (a file that was unreadable for a moment is picked up
#: soon; one that stays broken costs a stat per request and one open every RETRY_MAX_S).
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0


class _Entry:
    """One Searcher and the leases out on it."""

    __slots__ = ("searcher", "leases", "retired")

    def __init__(self, searcher: Searcher) -> None:
        self.searcher, self.leases, self.retired = searcher, 0, False


@dataclasses.dataclass
class _Failure:
    """The newest generation failed to open: which one (live/CURRENT's token), how often, when to retry."""

    token: tuple[int, int]
    attempts: int
    retry_at: float  # time.monotonic()
    wait_s: float


class LiveSearcher:
    """The Searcher of the newest generation of an index, lent out one search at a time.

    `with live.lease() as searcher:` holds the Searcher for the block; `refresh()` opens
    the newest published generation (one `stat` when nothing changed) and retires the
    previous Searcher, which closes when its last lease ends. Thread-safe.
    """

    def __init__(self, searcher: Searcher) -> None:
        self._entry = _Entry(searcher)
        self._lock = threading.Lock()
        self._refreshing = threading.Lock()
        self._closed = False
        self._failure: _Failure | None = None  # the newest generation would not open: retried on a back-off

    @property
    def current(self) -> Searcher:
        """The newest Searcher, without a lease: for what outlives no search (its generation,
        its manifest, a description of its reader)."""
        return self._entry.searcher

    @contextlib.contextmanager
    def lease(self) -> Iterator[Searcher]:
        """The newest Searcher, kept open until the block ends."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the index is closed")
            entry = self._entry
            entry.leases += 1
        try:
            yield entry.searcher
        finally:
            self._return(entry)

    def _return(self, entry: _Entry) -> None:
        with self._lock:
            entry.leases -= 1
            close = entry.retired and entry.leases == 0
        if close:
            entry.searcher.close()

    def refresh(self) -> bool:
        """Swap in the newest published generation, if there is a newer one; True when it did.

        A generation that fails to open is logged once (with its traceback) and the current one
        kept; it is tried again only after a back-off (see the module's docstring), or at once
        when a newer one is published. Concurrent callers do not open the same generation
        twice: the later one waits for the first.
        """
        with self._refreshing:
            current = self._entry
            if self._closed:
                return False
            failure = self._failure
            token: tuple[int, int] | None = None
            if failure is not None:
                token = current.searcher.published_token()
                if token == failure.token and time.monotonic() < failure.retry_at:
                    return False  # still the generation that failed: not before its retry
            try:
                newer = current.searcher.refresh()
            except Exception:  # noqa: BLE001 - a generation that fails to open: keep serving this one
                self._failed(current, token if token is not None else current.searcher.published_token())
                return False
            if failure is not None:
                log.info("the newest generation opened after %d failed attempt(s)", failure.attempts)
                self._failure = None
            if newer is None:
                return False
            self._retire(current, _Entry(newer))
            log.info("serving generation %d", newer.generation)
            return True

    def _failed(self, current: _Entry, token: tuple[int, int]) -> None:
        """Remember a failed open (in the handler of its exception): logged when it is a new
        failure (another generation than the one that failed last), silent when a retry fails."""
        failure = self._failure
        if failure is not None and failure.token == token:
            failure.attempts += 1
            failure.wait_s = min(failure.wait_s * 2.0, RETRY_MAX_S)
            failure.retry_at = time.monotonic() + failure.wait_s
            log.debug("the newest generation still does not open (attempt %d); next try in %.1f s",
                      failure.attempts, failure.wait_s, exc_info=True)
            return
        self._failure = _Failure(token, 1, time.monotonic() + RETRY_FIRST_S, RETRY_FIRST_S)
        log.exception("could not open the newest generation; still serving generation %d, retrying in "
                      "%.1f s and then less often (up to every %.0f s) until it opens",
                      current.searcher.generation, RETRY_FIRST_S, RETRY_MAX_S)

    def _retire(self, old: _Entry, new: _Entry | None) -> None:
        with self._lock:
            if new is not None:
                self._entry = new
            old.retired = True
            close = old.leases == 0
        if close:
            old.searcher.close()

    def close(self) -> None:
        """No new leases; the current Searcher closes now, or when its last lease ends."""
        with self._refreshing:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            self._retire(self._entry, None)
