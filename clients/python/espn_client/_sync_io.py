"""What the sync client waits with: the twins of _async_io.py's `sleep`, `gather` and `within`
(the sync client is generated from the async one; scripts/unasync.py rewrites the import)."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Callable, Sequence, TypeVar

from ._exchange import Exchange

__all__ = ["sleep", "gather", "within"]

T = TypeVar("T")


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def gather(runs: Sequence[Callable[[], T]], concurrency: int) -> list[T]:
    """The results of `runs` in order, at most `concurrency` running at once on threads (a
    `Client` is safe to share between threads); the first error is raised and the runs not yet
    started are cancelled."""
    if concurrency == 1 or len(runs) < 2:
        return [run() for run in runs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(concurrency, len(runs)),
                                               thread_name_prefix="espn-client") as pool:
        futures = [pool.submit(run) for run in runs]
        try:
            return [future.result() for future in futures]
        finally:
            for future in futures:
                future.cancel()


def within(exchange: Exchange[T], run: Callable[[], T]) -> T:
    """`run()`: the sync client keeps the deadline itself, between reads (each read waits at most
    the time that was left when its try began), since a blocking read cannot be cancelled."""
    return run()
