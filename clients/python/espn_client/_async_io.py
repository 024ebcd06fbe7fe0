"""What the async client waits with: sleeping, several calls at once, a deadline over a call.

_sync_io.py has the same three names for the sync client, which is generated from the async
one (scripts/unasync.py rewrites `_async_io` to `_sync_io`)."""

from __future__ import annotations

import asyncio
import sys
from typing import Awaitable, Callable, Sequence, TypeVar

from ._exchange import Exchange

__all__ = ["sleep", "gather", "within"]

T = TypeVar("T")


async def sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def gather(runs: Sequence[Callable[[], Awaitable[T]]], concurrency: int) -> list[T]:
    """The results of `runs` in order, at most `concurrency` of them running at once; the first
    error is raised and the runs not yet finished are cancelled."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(run: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await run()

    tasks = [asyncio.ensure_future(gated(run)) for run in runs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def within(exchange: Exchange[T], run: Callable[[], Awaitable[T]]) -> T:
    """`run()` cancelled at the exchange's deadline (DeadlineExceededError, with what had come)."""
    left = exchange.deadline.left_s()
    if left is None:
        return await run()
    try:
        if sys.version_info >= (3, 11):  # a scope on this task; wait_for runs the call as a task of its own
            async with asyncio.timeout(max(left, 0.0)):
                return await run()
        return await asyncio.wait_for(run(), max(left, 0.0))
    except asyncio.TimeoutError:
        raise exchange.expired() from None
