"""Searches of one served index: a request's checks, micro-batched searches over the newest
generation, passages and page images.

Every query goes through the micro-batcher (espn.engine.batching): concurrent requests of
several parameter sets are tokenised and encoded in one batch, then each group is searched
with its own parameters (a failure stays in its group, and a query the library refuses is
that query's alone: espn.search.isolation). A request holds the generation it started on,
so a write published meanwhile closes the older Searcher only when the request is done.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from ..encoders import Encoder
from ..errors import DocumentNotFoundError, InvalidParameterError
from ..filters import canonical_filter
from ..prefetch import PrefetchEstimates
from ..results import Document, QueryResult
from ..search.isolation import encode_together, search_isolated, sort_outcomes
from ..search.live_searcher import LiveSearcher
from ..search.searcher import Searcher
from .batching import BatchedResult, MicroBatcher
from .budget import check_budget
from .config import IndexConfig
from .messages import QueryAnswer, SearchAnswer, SearchOptions
from .protocol import Observer

__all__ = ["Searching", "open_searcher", "EncoderLoader"]

logger = logging.getLogger(__name__)

#: Seconds between the idle refreshes of a served index (one stat of live/CURRENT when nothing changed).
IDLE_REFRESH_S = 5.0

#: (encoder directory, the manifest's encoder entry) -> the loaded encoder (a shared one).
EncoderLoader = Callable[[Path, Mapping[str, Any]], Encoder]
#: What one search call measured, from its thread to the loop: per call (queries, stage times,
#: waves, waves skipped), the reader's description (its record cache's counters, its RAM plan),
#: the prefetch model's estimates.
_Measured = tuple[list[tuple[int, Mapping[str, float], int, int]], Mapping[str, Any], Optional[PrefetchEstimates]]


def open_searcher(index: Path, config: IndexConfig, encoder_loader: Optional[EncoderLoader] = None) -> Searcher:
    """The index's Searcher, with this process's share of the cores for torch."""
    # N workers x all cores each would oversubscribe the CPU; each gets its share.
    torch.set_num_threads(config.torch_threads)
    return Searcher.open(index, reader=config.reader, device=config.device, reader_options=config.open_options(),
                         trust_remote_code=config.trust_remote_code, encoder_loader=encoder_loader)


def _isolated(outcomes: list[BatchedResult[QueryResult] | Exception]
              ) -> tuple[list[BatchedResult[QueryResult]], list[int], dict[int, InvalidParameterError], list[int]]:
    """(results, their positions, refusals by position, failed positions) of a batch's outcomes.
    A failure that is not the library's refusal (a bug, a failed read) is logged once with its
    traceback, never shown to the client as a bad query nor turned into the whole batch's failure."""
    sorted_ = sort_outcomes(outcomes)
    logged: set[int] = set()
    for i, one in sorted_.failed.items():
        if id(one) not in logged:  # a group's failure reaches each of its queries: one log line
            logged.add(id(one))
            logger.error("internal error searching a batch's query %d: %s", i, one,
                         exc_info=(type(one), one, one.__traceback__))
    return list(sorted_.answered.values()), list(sorted_.answered), sorted_.refused, list(sorted_.failed)


class Searching:
    """Searches and passages of the newest generation; owns the micro-batcher and its thread pool.

    quiet: asked before a lone query runs on the event loop instead of a search thread; True
    when nothing else is in progress in this process (the registry counts its requests)."""

    def __init__(self, live: LiveSearcher, config: IndexConfig, observer: Observer,
                 quiet: Callable[[], bool]) -> None:
        self.live = live
        self.config = config
        self.observer = observer
        self._quiet = quiet
        self.text_bytes = live.current.mean_document_bytes()
        self._measured: collections.deque[_Measured] = collections.deque()  # appended by threads, popped on the loop
        self._executor = concurrent.futures.ThreadPoolExecutor(config.search_threads, thread_name_prefix="espn-search")
        self.batcher: MicroBatcher[QueryResult] = MicroBatcher(
            None,
            self._executor,
            max_batch_size=config.max_batch_size,
            max_wait_s=config.batch_wait_ms / 1000.0,
            max_concurrent=config.search_threads,
            max_pending=config.max_pending,
            fair_chunk=config.fair_chunk_queries,
            on_batch=self._observe_batches,
            search_many=self._search_many,
            run_inline=self._run_inline if config.inline_search_ms > 0 else None,
        )
        self._lone_call_ms = 0.0  # running mean of one-query calls' time (inline or not)
        self._idle_refresh: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the batcher and the idle refresh; call from the running event loop."""
        self.batcher.start()
        self._idle_refresh = asyncio.get_running_loop().create_task(self._refresh_while_idle())

    async def close(self) -> None:
        """Search what is queued, then stop the search threads (the Searcher stays open)."""
        if self._idle_refresh is not None:
            self._idle_refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._idle_refresh
            self._idle_refresh = None
        await self.batcher.close()
        self._executor.shutdown(wait=True)

    async def _refresh_while_idle(self) -> None:
        """Every IDLE_REFRESH_S, what a request does first: open the newest generation. A worker
        that no request reaches thus lets go of the generation a compaction replaced (its maps
        and its record cache segment, which the other workers may have left already)."""
        while True:
            await asyncio.sleep(IDLE_REFRESH_S)
            try:
                await asyncio.to_thread(self.live.refresh)
            except Exception:  # noqa: BLE001 - the next request (or tick) tries again
                logger.warning("the idle refresh of the index failed", exc_info=True)

    def warmup(self) -> None:
        with self.live.lease() as searcher:
            searcher.warmup()

    @contextlib.contextmanager
    def lease(self) -> Iterator[Searcher]:
        """The newest published generation, held for the block: one stat of live/CURRENT; a
        generation another process published opens here first, so a request that starts after
        a write's answer sees the write."""
        self.live.refresh()
        with self.live.lease() as searcher:
            yield searcher

    async def check(self, options: SearchOptions) -> None:
        with self.lease() as searcher:
            await self._checked_kwargs(searcher, 0, options)

    async def search(self, queries: Sequence[str], options: SearchOptions, *, isolate: bool = False) -> SearchAnswer:
        """See espn.engine.protocol.Engine.search."""
        with self.lease() as searcher:
            kwargs = await self._checked_kwargs(searcher, len(queries), options)
            if isolate:
                results, answered, refused, failed = _isolated(await self.batcher.submit_each(queries, kwargs))
            else:
                results = await self.batcher.submit_many(queries, kwargs)
                answered, refused, failed = list(range(len(results))), {}, []
            engine = searcher.reader.engine
        documents: Optional[dict[str, Document]] = None
        if options.return_text:
            wanted = sorted({hit.doc_id for item in results for hit in item.result.hits})
            documents = await asyncio.to_thread(self._documents, wanted)
        # The next loop turn: after this request's answer is written (the caller sends it in this one).
        asyncio.get_running_loop().call_soon(self._observe_queries, results)
        answers = [QueryAnswer(item.result, item.queue_ms, item.batch_size) for item in results]
        return SearchAnswer(answers, answered, refused, failed, documents, engine)

    async def document(self, doc_id: str) -> Document:
        with self.lease() as searcher:
            return await asyncio.to_thread(searcher.document, doc_id)  # reads the passage from disk

    def page_image(self, doc_id: str, max_side: Optional[int]) -> tuple[bytes, str]:
        """In a worker thread: it reads the file."""
        with self.lease() as searcher:
            return searcher.page_image(doc_id, max_side)

    def _observe_queries(self, results: list[BatchedResult[QueryResult]]) -> None:
        for item in results:
            stats = item.result.stats
            self.observer.observe_query(queue_ms=item.queue_ms, hit_rate=stats.hit_rate, prefetched=stats.prefetched,
                                        missed=stats.missed, bytes_read=stats.bytes_read, ios=stats.ios)

    def _run_inline(self, n_queries: int) -> bool:
        """Whether a call about to start runs on the event loop: a lone query, nothing else in
        progress in this process (nothing else waits on the loop meanwhile), and one-query calls
        have been quick (a slow index or device keeps the loop free of them)."""
        return n_queries == 1 and self._lone_call_ms < self.config.inline_search_ms and self._quiet()

    def _observe_batches(self, size: int, seconds: float) -> None:
        """The batcher's on_batch (on the loop, once the batch's answers are out)."""
        if size == 1:
            self._lone_call_ms += 0.25 * (seconds * 1000.0 - self._lone_call_ms)
        self.observer.set_queued(self.batcher.pending)
        while self._measured:
            calls, reader, prefetch = self._measured.popleft()
            for queries, stage_ms, waves, skipped in calls:
                self.observer.observe_batch(queries, stage_ms)
                self.observer.observe_waves(waves, skipped)
            self.observer.set_record_cache(reader.get("record_cache"), reader.get("ram"))
            self.observer.set_prefetch(prefetch)

    async def _checked_kwargs(self, searcher: Searcher, n_queries: int, options: SearchOptions) -> dict[str, Any]:
        """The request's own checks (bounds, mode, explain, budget, filter), before it queues: a
        refused request costs nothing, whatever its queries hold. Returns the batcher's keyword arguments."""
        kwargs = options.search_kwargs()
        modes = options.mode_kwargs()
        params = searcher.params(**{key: value for key, value in kwargs.items() if key not in modes})
        searcher.check_request(searcher.hybrid_params(**modes), options.explain)
        check_budget(params, n_queries, searcher.num_documents, self.text_bytes, options.return_text,
                     max_work=self.config.max_request_work, max_response_bytes=self.config.max_response_bytes)
        if options.filter is not None:
            # Validated (a bad filter names its problem) and compiled into the searcher's cache off
            # the event loop; the batch key carries its canonical text, so requests with the same
            # filter share a batch and different filters never do.
            await asyncio.to_thread(searcher.filtered_docs, options.filter)
            kwargs["filter"] = canonical_filter(options.filter)
        if options.explain:
            kwargs["explain"] = True
        return kwargs

    def _documents(self, doc_ids: Sequence[str]) -> dict[str, Document]:
        """The hits' passages from the newest generation; a hit deleted since is left without text."""
        out = {}
        with self.live.lease() as searcher:
            for doc_id in doc_ids:
                try:
                    out[doc_id] = searcher.document(doc_id)
                except DocumentNotFoundError:
                    continue
        return out

    def _search_many(self, groups: list[tuple[list[str], Mapping[str, Any]]]) -> list[Any]:
        """The batcher's call (in a search thread), on a leased Searcher of the newest generation."""
        with self.live.lease() as searcher:
            return self._search_groups(searcher, groups)

    def _search_groups(self, searcher: Searcher, groups: list[tuple[list[str], Mapping[str, Any]]]) -> list[Any]:
        """Every group searched with its own parameters, their queries encoded in one call; per
        group, its outcomes by query (a result or the library's refusal of that query), or the
        exception that failed the whole group (handed to each of its waiters)."""
        shared, encode_ms = encode_together(searcher, groups)
        outcomes: list[Any] = []
        measured: list[tuple[int, Mapping[str, float], int, int]] = []
        for (queries, params), embeddings in zip(groups, shared):
            try:
                results: list[Any] = search_isolated(searcher, queries, params, embeddings=embeddings,
                                                     encode_ms=encode_ms)
            except Exception as exc:  # noqa: BLE001 - not a query's fault: handed to this group's waiters
                outcomes.append(exc)
                continue
            answered = [r for r in results if not isinstance(r, BaseException)]
            if answered:
                stats = answered[0].stats
                measured.append((len(answered), stats.stage_ms, stats.waves, stats.waves_skipped))
            outcomes.append(results)
        if measured:
            self._measured.append((measured, searcher.reader.describe(),
                                   searcher.prefetch_estimates))
        return outcomes
