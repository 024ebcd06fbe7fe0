"""Micro-batching: concurrent single-query requests become one batched search call.

Requests are queued per parameter set (only queries with identical parameters may share
a `Searcher.search` call, so results equal unbatched ones). Batching is continuous, as an
LLM server batches tokens: when no search is in flight a query is searched at once (on the
event loop's next turn, so requests that arrived in the same turn go together), and what
queues while a search runs goes into the next call the moment a slot frees. Only with
several slots (`max_concurrent` > 1) and a search already running does a free slot wait
for company, at most `max_wait_s` or until `max_batch_size` queries are queued. The search
runs in a thread pool (the one thread hop of a request), so the event loop stays free for
other connections; with `run_inline`, a call that nothing else could be waiting for (the
caller decides: one query arriving at an idle batcher, no other request in progress) runs on
the loop itself, without the hop.

With `search_many`, a flush also takes what the other parameter sets have queued (up to
`max_batch_size` queries in all) into the same call, as separate groups: the server
tokenises and encodes every query of the call in one batch (the query encoder is the
largest cost of a search) and then searches each group with its own parameters.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import time
from typing import Any, Callable, Generic, Hashable, Mapping, Optional, Sequence, TypeVar, Union

from ..errors import QueueFullError, ShuttingDownError

__all__ = ["MicroBatcher", "BatchedResult"]

logger = logging.getLogger(__name__)

R = TypeVar("R")
SearchFn = Callable[[list[str], Mapping[str, Any]], Sequence[R]]
#: Several groups of queries, each with its parameters -> per group its results, or the
#: exception that group raised (a failure reaches only its own group); a result may itself be
#: an exception, that one query's (the group's others were answered).
SearchManyFn = Callable[[list[tuple[list[str], Mapping[str, Any]]]], list[Union[Sequence[R], BaseException]]]


@dataclasses.dataclass(frozen=True)
class BatchedResult(Generic[R]):
    """One query's result and how it was batched."""

    result: R
    queue_ms: float  # from submit to the start of its search call
    batch_size: int  # queries in that call


@dataclasses.dataclass
class _Item:
    query: str
    future: "asyncio.Future[Any]"
    enqueued: float


#: How long a batcher must have seen no concurrency (a query waiting behind a running call, a
#: call of several queries) before a lone arrival may be searched on the event loop.
QUIET_S = 0.05


def _params_key(params: Mapping[str, Any]) -> Hashable:
    return tuple(sorted(params.items()))


class MicroBatcher(Generic[R]):
    """Queue single queries, run them in batches of identical parameters.

    search:          `search(queries, params) -> results`, one result per query in order;
                     called in `executor`, so it may block (None when `search_many` is given)
    max_batch_size:  most queries in one call
    max_wait_s:      beside a running search, how long a free slot waits for company (an
                     idle batcher never waits: the query is searched at once)
    max_concurrent:  search calls in flight at once (size `executor` to match)
    max_pending:     queued queries beyond which `submit` raises QueueFullError
    fair_chunk:      `submit_many` queues a large request this many queries at a time, the
                     next chunk only when the previous one is done: a request that arrives
                     meanwhile is older than the next chunk, so it runs first (one 256-query
                     batch cannot hold a single query behind all of its work)
    on_batch:        called with (batch size, seconds the call took) after each call, on the
                     loop turn after its waiters' (their answers go out first)
    search_many:     `search_many([(queries, params), ...])`: when given, a flush takes the
                     other parameter sets' queued queries into the same call as more groups
    run_inline:      `run_inline(n_queries) -> bool`, asked when a call of queries that arrived at
                     an idle batcher is about to start, if for `quiet_s` no query has waited
                     behind a running search and no call took several: True runs it on the event
                     loop, blocking it for the search (without the hop to a thread and back, an
                     answer took 0.36 ms less on a 2-vCPU VM). Under concurrent load the calls
                     stay on the threads, where what arrives meanwhile is read and batched.
    """

    def __init__(
        self,
        search: Optional[SearchFn[R]],
        executor: concurrent.futures.Executor,
        *,
        max_batch_size: int = 32,
        max_wait_s: float = 0.002,
        max_concurrent: int = 1,
        max_pending: int = 4096,
        fair_chunk: Optional[int] = None,
        on_batch: Optional[Callable[[int, float], None]] = None,
        search_many: Optional[SearchManyFn[R]] = None,
        run_inline: Optional[Callable[[int], bool]] = None,
        quiet_s: float = QUIET_S,
    ) -> None:
        if max_batch_size < 1 or max_concurrent < 1 or max_pending < 1 or max_wait_s < 0:
            raise ValueError("max_batch_size, max_concurrent, max_pending must be >= 1 and max_wait_s >= 0")
        if search is None and search_many is None:
            raise ValueError("give search or search_many")
        if fair_chunk is not None and fair_chunk < 1:
            raise ValueError(f"fair_chunk must be >= 1, got {fair_chunk}")
        self._fair_chunk = fair_chunk
        self._search = search
        self._search_many = search_many
        self._executor = executor
        self._max_batch_size = max_batch_size
        self._max_wait_s = max_wait_s
        self._max_pending = max_pending
        self._on_batch = on_batch
        self._run_inline, self._quiet_s = run_inline, quiet_s
        self._contended_at = float("-inf")  # when a query last waited behind a call, or a call took several
        self._queues: dict[Hashable, collections.deque[_Item]] = {}
        self._params: dict[Hashable, Mapping[str, Any]] = {}
        self._pending = 0
        self._wakeup = asyncio.Event()
        self._max_concurrent = max_concurrent
        self._in_flight = 0  # search calls running
        self._launch_scheduled = False
        self._running: set[asyncio.Future[None]] = set()  # one per call in flight, done once it is handed out
        self._dispatcher: Optional[asyncio.Task[None]] = None
        self._closing = False

    @property
    def pending(self) -> int:
        """Queries queued and not yet handed to a search call."""
        return self._pending

    def start(self) -> None:
        """Start the dispatcher; call from the running event loop (e.g. in the app lifespan)."""
        if self._dispatcher is None:
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch(), name="espn-batcher")

    async def submit(self, query: str, params: Mapping[str, Any]) -> BatchedResult[R]:
        """Search one query; resolves when its batch has run."""
        return (await self.submit_many([query], params))[0]

    async def submit_many(self, queries: Sequence[str], params: Mapping[str, Any]) -> list[BatchedResult[R]]:
        """Search several queries with the same parameters; they may share batches with others.
        The first query's failure, if any, is raised.

        With `fair_chunk`, a larger request queues one chunk at a time, behind whatever
        arrived while its previous chunk ran.
        """
        results: list[BatchedResult[R]] = []
        for outcome in await self.submit_each(queries, params, stop_at_failure=True):
            if isinstance(outcome, BaseException):
                raise outcome
            results.append(outcome)
        return results

    async def submit_each(self, queries: Sequence[str], params: Mapping[str, Any], *,
                          stop_at_failure: bool = False) -> list[Union[BatchedResult[R], Exception]]:
        """`submit_many`, with each query's failure in its place instead of raised (the others
        answered). stop_at_failure: no further chunk is queued after a chunk with a failure."""
        chunk = self._fair_chunk
        if chunk is None or len(queries) <= chunk:
            return await self._submit_now(queries, params)
        outcomes: list[Union[BatchedResult[R], Exception]] = []
        for start in range(0, len(queries), chunk):
            outcomes += await self._submit_now(queries[start : start + chunk], params)
            if stop_at_failure and any(isinstance(one, Exception) for one in outcomes):
                break
        return outcomes

    async def _submit_now(self, queries: Sequence[str],
                          params: Mapping[str, Any]) -> list[Union[BatchedResult[R], Exception]]:
        if self._closing or self._dispatcher is None or self._dispatcher.done():
            raise ShuttingDownError("the search queue is closed: the index is closing")
        if self._pending + len(queries) > self._max_pending:
            raise QueueFullError(f"{self._pending} queries are queued (limit {self._max_pending})")
        loop = asyncio.get_running_loop()
        key = _params_key(params)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = collections.deque()
            self._params[key] = dict(params)
        now = time.monotonic()
        futures = []
        for query in queries:
            future: asyncio.Future[BatchedResult[R]] = loop.create_future()
            queue.append(_Item(query, future, now))
            futures.append(future)
        self._pending += len(queries)
        if self._in_flight:
            self._contended_at = now
        if not self._launch_scheduled:  # next turn: what else arrives in this one joins the call
            self._launch_scheduled = True
            loop.call_soon(self._launch_due)
        # If the caller is cancelled (client gone), the await cancels the futures and the
        # dispatcher drops them instead of searching them. One query awaits its future itself
        # (gather would add two loop turns to every answer); return_exceptions: a failed batch
        # must not leave the other futures' exceptions unretrieved.
        if len(futures) == 1:
            try:
                return [await futures[0]]
            except Exception as exc:  # noqa: BLE001 - the caller decides (submit_many raises it)
                return [exc]
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome  # a cancellation is the request's, not a query's
        return list(outcomes)  # type: ignore[arg-type]  # Exceptions and results only, checked above

    async def close(self) -> None:
        """Stop taking queries, search everything already queued, wait for it."""
        self._closing = True
        self._wakeup.set()
        if self._dispatcher is not None:
            await self._dispatcher
        while self._running:  # a finishing call may launch the next one
            await asyncio.gather(*list(self._running), return_exceptions=True)

    # -- internals ---------------------------------------------------------------

    def _oldest_key(self) -> Optional[Hashable]:
        oldest: Optional[Hashable] = None
        oldest_time = float("inf")
        for key in list(self._queues):
            queue = self._queues[key]
            while queue and queue[0].future.done():  # cancelled while waiting
                queue.popleft()
                self._pending -= 1
            if not queue:
                del self._queues[key], self._params[key]
            elif queue[0].enqueued < oldest_time:
                oldest, oldest_time = key, queue[0].enqueued
        return oldest

    def _due(self, queue: collections.deque[_Item]) -> bool:
        """Whether a queue goes now: at once when nothing runs; beside a running search only
        when full, when its oldest query has waited max_wait_s, or when closing."""
        return (self._in_flight == 0 or self._closing or len(queue) >= self._max_batch_size
                or time.monotonic() >= queue[0].enqueued + self._max_wait_s)

    def _launch_due(self, after_call: bool = False) -> None:
        """Start search calls while a slot is free and a queue is due (on the loop, no await).
        after_call: called as a call's answers are handed out (its waiters have not written them
        yet), so nothing may run inline."""
        self._launch_scheduled = False
        while self._in_flight < self._max_concurrent:
            key = self._oldest_key()
            if key is None or not self._due(self._queues[key]):
                break
            groups = self._take_groups(key)
            if not groups:
                continue
            inline = (not after_call and self._in_flight == 0 and self._run_inline is not None
                      and time.monotonic() - self._contended_at >= self._quiet_s
                      and self._run_inline(sum(len(items) for _, items in groups)))
            self._in_flight += 1
            self._launch(groups, inline)
        if self._queues or self._closing:  # the dispatcher times what waits, and ends once drained
            self._wakeup.set()

    def _take_groups(self, key: Hashable) -> list[tuple[Mapping[str, Any], list[_Item]]]:
        """The oldest queue's queries and, with search_many, the other parameter sets' (oldest
        first), up to max_batch_size in all."""
        groups = [self._take(key, self._max_batch_size)]
        room = self._max_batch_size - len(groups[0][1])
        if self._search_many is not None:
            for other in sorted(self._queues, key=lambda k: self._queues[k][0].enqueued if self._queues[k] else 0.0):
                if room <= 0:
                    break
                taken = self._take(other, room)
                if taken[1]:
                    groups.append(taken)
                    room -= len(taken[1])
        return [(params, items) for params, items in groups if items]

    async def _dispatch(self) -> None:
        """The timer: wakes a queue that waits for company beside a running search when its
        max_wait_s is up; ends once closing has drained every queue."""
        while True:
            self._launch_due()
            key = self._oldest_key()
            if key is None and self._closing:
                return
            timeout = None
            if key is not None and self._in_flight < self._max_concurrent:
                timeout = max(0.0, self._queues[key][0].enqueued + self._max_wait_s - time.monotonic())
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _take(self, key: Hashable, limit: int) -> tuple[Mapping[str, Any], list[_Item]]:
        """Up to `limit` live queries from the queue of `key` (removed from it)."""
        queue, params = self._queues[key], self._params[key]
        items: list[_Item] = []
        while queue and len(items) < limit:
            item = queue.popleft()
            self._pending -= 1
            if not item.future.done():
                items.append(item)
        if not queue:
            del self._queues[key], self._params[key]
        return params, items

    def _launch(self, groups: list[tuple[Mapping[str, Any], list[_Item]]], inline: bool = False) -> None:
        """Hand a call to the executor now (no task in between: an answer is two loop turns after
        its search, the thread's callback and its waiter's wake-up), or run it here (inline)."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        calls = [([i.query for i in items], params) for params, items in groups]
        handed_out: asyncio.Future[None] = loop.create_future()
        self._running.add(handed_out)
        handed_out.add_done_callback(self._running.discard)

        def call() -> list[Any]:
            if self._search_many is not None:
                return self._search_many(calls)
            assert self._search is not None
            (queries, params), = calls
            return [self._search(queries, params)]

        def done(future: "concurrent.futures.Future[list[Any]]") -> None:  # in the search thread
            loop.call_soon_threadsafe(self._finish, groups, future, started, handed_out)

        if inline:
            ran: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
            try:
                ran.set_result(call())
            except Exception as exc:  # handed to the waiters, as the executor would
                ran.set_exception(exc)
            loop.call_soon(self._finish, groups, ran, started, handed_out)  # not from inside _launch_due
            return
        try:
            self._executor.submit(call).add_done_callback(done)
        except RuntimeError as exc:  # the executor is shut down: every waiter of this call gets it
            failed: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
            failed.set_exception(exc)
            loop.call_soon(self._finish, groups, failed, started, handed_out)  # not from inside _launch_due

    def _finish(self, groups: list[tuple[Mapping[str, Any], list[_Item]]],
                future: "concurrent.futures.Future[list[Any]]", started: float, handed_out: "asyncio.Future[None]") -> None:
        """On the loop: each waiter gets its result or its exception; then what queued meanwhile goes."""
        self._in_flight -= 1
        exc = ShuttingDownError("the search queue is closed: the index is closing") if future.cancelled() else future.exception()
        outcomes: list[Any] = [exc] * len(groups) if exc is not None else future.result()
        elapsed = time.monotonic() - started
        size = sum(len(items) for _, items in groups)
        for (_, items), outcome in zip(groups, outcomes):
            if not isinstance(outcome, BaseException) and len(outcome) != len(items):
                outcome = RuntimeError(f"search returned {len(outcome)} results for {len(items)} queries")
            for i, item in enumerate(items):
                if item.future.done():
                    continue
                if isinstance(outcome, BaseException):
                    item.future.set_exception(outcome)
                    continue
                one: Any = outcome[i]
                if isinstance(one, BaseException):  # that query's own failure (the others were answered)
                    item.future.set_exception(one)
                else:
                    item.future.set_result(BatchedResult(one, (started - item.enqueued) * 1000.0, size))
        handed_out.set_result(None)
        if size > 1:
            self._contended_at = time.monotonic()
        if self._on_batch is not None:  # behind the waiters' wake-ups: bookkeeping after the answers
            asyncio.get_running_loop().call_soon(self._on_batch, size, elapsed)
        # What queued during this call goes now, in this turn: no wait for the dispatcher.
        self._launch_due(after_call=True)
