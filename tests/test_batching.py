"""The micro-batcher of espn.engine (no index): concurrent queries become batched search calls of
identical parameters, continuously, failures and cancellations staying with their own queries."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, Mapping

import pytest

from espn.engine.batching import MicroBatcher
from espn.errors import QueueFullError, ShuttingDownError

from helpers import wait_until_async




class _RecordingSearch:
    """A fake search: result = (query, params); records each call's batch."""

    def __init__(self, delay: float = 0.0, fail_on: str | None = None) -> None:
        self.calls: list[tuple[list[str], dict[str, Any]]] = []
        self.threads: list[int] = []  # the thread of each call
        self.delay = delay
        self.fail_on = fail_on
        self.lock = threading.Lock()

    def __call__(self, queries: list[str], params: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        with self.lock:
            self.calls.append((list(queries), dict(params)))
            self.threads.append(threading.get_ident())
        time.sleep(self.delay)  # the search's own work, simulated: not synchronisation
        if self.fail_on is not None and self.fail_on in queries:
            raise ValueError(f"bad query {self.fail_on!r}")
        return [(query, dict(params)) for query in queries]


def _run_batcher(search: _RecordingSearch, coro_factory, **kwargs: Any) -> Any:
    async def main() -> Any:
        with concurrent.futures.ThreadPoolExecutor(kwargs.get("max_concurrent", 1)) as executor:
            batcher = MicroBatcher(search, executor, **kwargs)
            batcher.start()
            try:
                return await coro_factory(batcher)
            finally:
                await batcher.close()

    return asyncio.run(main())


def test_batcher_groups_concurrent_queries_and_caps_batch_size() -> None:
    search = _RecordingSearch()
    queries = [f"q{i}" for i in range(10)]

    async def go(batcher: MicroBatcher) -> list:
        return await asyncio.gather(*(batcher.submit(q, {"k": 5}) for q in queries))

    results = _run_batcher(search, go, max_batch_size=4, max_wait_s=0.05)
    assert [r.result for r in results] == [(q, {"k": 5}) for q in queries]
    assert [len(call[0]) for call in search.calls] == [4, 4, 2]
    assert [r.batch_size for r in results] == [4] * 8 + [2] * 2


def test_batcher_never_mixes_parameters() -> None:
    search = _RecordingSearch()

    async def go(batcher: MicroBatcher) -> list:
        jobs = [batcher.submit(f"q{i}", {"k": 5 + i % 3}) for i in range(9)]
        return await asyncio.gather(*jobs)

    results = _run_batcher(search, go, max_batch_size=32, max_wait_s=0.05)
    for i, item in enumerate(results):
        assert item.result == (f"q{i}", {"k": 5 + i % 3})
    assert sorted(len(call[0]) for call in search.calls) == [3, 3, 3]
    for queries, params in search.calls:
        assert {int(q[1:]) % 3 for q in queries} == {params["k"] - 5}


def test_batcher_takes_other_parameter_sets_into_one_call_as_groups() -> None:
    """With search_many a flush carries every queued parameter set (one encode on the server),
    each group keeps its own parameters, and a failing group fails only its own queries."""
    calls: list[list[tuple[list[str], dict[str, Any]]]] = []

    def search_many(groups: list[tuple[list[str], Mapping[str, Any]]]) -> list[Any]:
        calls.append([(list(q), dict(p)) for q, p in groups])
        return [ValueError("bad group") if "bad" in queries else [(q, dict(params)) for q in queries]
                for queries, params in groups]

    async def go(batcher: MicroBatcher) -> list:
        jobs = [batcher.submit(f"q{i}", {"k": 5 + i % 3}) for i in range(9)]
        jobs.append(batcher.submit("bad", {"k": 99}))
        return await asyncio.gather(*jobs, return_exceptions=True)

    async def main() -> list:
        with concurrent.futures.ThreadPoolExecutor(1) as executor:
            batcher: MicroBatcher = MicroBatcher(None, executor, max_batch_size=32, max_wait_s=0.05,
                                                 search_many=search_many)
            batcher.start()
            try:
                return await go(batcher)
            finally:
                await batcher.close()

    results = asyncio.run(main())
    for i, item in enumerate(results[:9]):
        assert item.result == (f"q{i}", {"k": 5 + i % 3}) and item.batch_size == 10
    assert isinstance(results[9], ValueError)
    assert len(calls) == 1 and sorted(params["k"] for _, params in calls[0]) == [5, 6, 7, 99]
    with pytest.raises(ValueError, match="search or search_many"):
        MicroBatcher(None, concurrent.futures.ThreadPoolExecutor(1))


def test_batcher_failure_reaches_only_its_batch() -> None:
    search = _RecordingSearch(fail_on="bad")

    async def go(batcher: MicroBatcher) -> tuple:
        failing = asyncio.gather(batcher.submit("bad", {"k": 1}), batcher.submit("ok1", {"k": 1}),
                                 return_exceptions=True)
        fine = batcher.submit("ok2", {"k": 2})
        return await failing, await fine

    (bad, ok1), ok2 = _run_batcher(search, go, max_batch_size=8, max_wait_s=0.02)
    assert isinstance(bad, ValueError) and isinstance(ok1, ValueError)
    assert ok2.result == ("ok2", {"k": 2})


def test_batcher_rejects_when_full_and_after_close() -> None:
    search = _RecordingSearch(delay=0.2)

    async def go(batcher: MicroBatcher) -> None:
        first = asyncio.ensure_future(batcher.submit_many(["a", "b", "c"], {}))
        await asyncio.sleep(0)  # one turn of the loop, no time: the task queues its queries (its first step)
        with pytest.raises(QueueFullError):
            await batcher.submit_many(["d", "e"], {})
        assert len(await first) == 3
        await batcher.close()
        with pytest.raises(ShuttingDownError):
            await batcher.submit("late", {})

    _run_batcher(search, go, max_batch_size=8, max_wait_s=0.01, max_pending=4)


def test_batcher_close_drains_queued_queries() -> None:
    search = _RecordingSearch(delay=0.05)

    async def go(batcher: MicroBatcher) -> list:
        jobs = [asyncio.ensure_future(batcher.submit(f"q{i}", {})) for i in range(6)]
        await asyncio.sleep(0)  # one turn of the loop, no time: the tasks queue their queries
        await batcher.close()  # long wait window, but closing flushes at once
        return [job.result().result[0] for job in jobs]

    assert _run_batcher(search, go, max_batch_size=2, max_wait_s=10.0) == [f"q{i}" for i in range(6)]


def test_batcher_drops_cancelled_queries() -> None:
    search = _RecordingSearch()

    async def go(batcher: MicroBatcher) -> None:
        gone = asyncio.ensure_future(batcher.submit("gone", {}))
        await asyncio.sleep(0)  # one turn of the loop, no time: the task queues its query
        gone.cancel()
        assert (await batcher.submit("stays", {})).result[0] == "stays"

    _run_batcher(search, go, max_batch_size=8, max_wait_s=0.02)
    assert all("gone" not in queries for queries, _ in search.calls)


def test_an_idle_batcher_searches_at_once_whatever_its_wait() -> None:
    """Continuous batching: with nothing in flight a query does not wait max_wait_s for company."""
    search = _RecordingSearch()

    async def go(batcher: MicroBatcher) -> float:
        started = time.monotonic()
        await batcher.submit("alone", {"k": 5})
        return time.monotonic() - started

    assert _run_batcher(search, go, max_batch_size=32, max_wait_s=30.0) < 10.0
    assert search.calls == [(["alone"], {"k": 5})]


def test_a_batcher_batches_what_queues_while_a_search_runs() -> None:
    """The first query goes alone at once; those that arrive while it runs go together as soon as it ends."""
    search = _RecordingSearch(delay=0.3)

    async def go(batcher: MicroBatcher) -> list:
        first = asyncio.ensure_future(batcher.submit("first", {}))
        await wait_until_async(lambda: search.calls, "the first call to run", timeout_s=10)
        rest = await asyncio.gather(*(batcher.submit(f"q{i}", {}) for i in range(5)))
        return [(await first).batch_size] + [item.batch_size for item in rest]

    sizes = _run_batcher(search, go, max_batch_size=32, max_wait_s=30.0)
    assert search.calls == [(["first"], {}), ([f"q{i}" for i in range(5)], {})]
    assert sizes == [1, 5, 5, 5, 5, 5]


def test_a_lone_query_runs_on_the_loop_only_while_nothing_else_queues() -> None:
    """run_inline: a lone arrival at a quiet batcher is searched on the event loop's own thread
    (asked with its query count); what queues behind a running call, and any lone arrival within
    quiet_s of that, goes to the search thread; a failure inline reaches its waiter alone."""
    quiet_s = 0.5
    search = _RecordingSearch(delay=0.01, fail_on="bad")
    asked: list[int] = []

    def run_inline(n_queries: int) -> bool:
        asked.append(n_queries)
        return True

    async def go(batcher: MicroBatcher) -> tuple:
        loop_thread = threading.get_ident()
        assert (await batcher.submit("alone", {})).result[0] == "alone"
        with pytest.raises(ValueError, match="bad query"):
            await batcher.submit("bad", {})
        first = asyncio.ensure_future(batcher.submit("first", {}))
        await asyncio.sleep(0)  # "first" runs (inline: the loop is blocked until it ends)
        behind = await asyncio.gather(batcher.submit("b1", {}), batcher.submit("b2", {}))  # together: a batch of 2
        await first
        soon = await batcher.submit("soon", {})  # within quiet_s of that batch: on the thread
        await asyncio.sleep(quiet_s * 1.2)  # not synchronisation: quiet_s, the timer under test, must pass
        await batcher.submit("quiet again", {})
        return loop_thread, [item.batch_size for item in behind], soon.batch_size

    loop_thread, behind_sizes, soon_size = _run_batcher(search, go, max_batch_size=8, max_wait_s=0.0,
                                                        run_inline=run_inline, quiet_s=quiet_s)
    on_loop = {queries[0]: thread == loop_thread for (queries, _), thread in zip(search.calls, search.threads)}
    assert on_loop == {"alone": True, "bad": True, "first": True, "b1": False, "soon": False, "quiet again": True}
    assert behind_sizes == [2, 2] and soon_size == 1
    assert asked == [1, 1, 1, 1]  # never asked for the batch of 2, nor within quiet_s of it


def test_a_batcher_without_run_inline_never_searches_on_the_loop() -> None:
    search = _RecordingSearch()

    async def go(batcher: MicroBatcher) -> int:
        await batcher.submit("alone", {})
        return threading.get_ident()

    loop_thread = _run_batcher(search, go, max_batch_size=8, max_wait_s=0.0)
    assert len(search.threads) == 1 and search.threads[0] != loop_thread


def test_a_big_batch_cannot_starve_a_small_request() -> None:
    """A 64-query request goes in chunks of 8: a query submitted meanwhile runs after one chunk, not after all."""
    search = _RecordingSearch(delay=0.05)

    async def scenario(batcher: MicroBatcher) -> int:
        big = asyncio.ensure_future(batcher.submit_many([f"big{i}" for i in range(64)], {"k": 10}))
        await wait_until_async(lambda: search.calls, "the big request's first chunk to run", timeout_s=10)
        await batcher.submit("small", {"k": 10})
        calls_before_small = next(i for i, (queries, _) in enumerate(search.calls) if "small" in queries)
        await big
        return calls_before_small

    position = _run_batcher(search, scenario, max_batch_size=32, max_wait_s=0.001, fair_chunk=8)
    assert position <= 1, f"the small query waited for {position} search calls of the big one"
    assert sum(len(queries) for queries, _ in search.calls) == 65
