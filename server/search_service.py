"""The search service: what the routes ask of the index (a request's checks, batched
searches, passages), over the newest generation's Searcher. Routes reach it through
`deps.get_search` and never hold a Searcher themselves; the service knows the library's
public API only, and nothing of HTTP beyond the request's options.

Every query goes through the micro-batcher (`batching.MicroBatcher`): concurrent requests
of several parameter sets are tokenised and encoded in one batch, then each group is
searched with its own parameters (a failure stays in its group, and a query the library
refuses is that query's alone: `espn.service.search_isolated`). The library is reached
through `espn.service` only.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from espn.errors import DocumentNotFoundError, InvalidParameterError
from espn.service import (Document, Encoder, LiveSearcher, PrefetchEstimates, QueryResult, Searcher,
                          canonical_filter, encode_together, search_isolated, sort_outcomes)

from .batching import BatchedResult, MicroBatcher
from .budget import check_budget
from .connections import busy_connections
from .metrics import ServerMetrics
from .metrics_dir import record_cache_share
from .schemas import SearchOptions
from .settings import ServerSettings

__all__ = ["Answers", "SearchService", "open_searcher"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Answers:
    """One request's results, in query order, with what the response needs beside them."""

    results: list[BatchedResult[QueryResult]]  # the answered queries, in query order
    documents: Optional[dict[str, Document]]  # the hits' passages, when return_text asked for them
    engine: str  # the reader's I/O engine, for a searcher whose stats do not name it
    #: isolate: where each of `results` stands among the request's queries (empty: all of them, in order).
    answered: list[int] = dataclasses.field(default_factory=list)
    #: isolate: position -> the library's refusal of that query (its own, after the request's checks passed).
    refused: dict[int, InvalidParameterError] = dataclasses.field(default_factory=dict)
    #: isolate: positions whose search failed for another reason (a bug, a failed read): logged with
    #: its traceback here, answered as that query's `internal_error` entry without the details.
    failed: list[int] = dataclasses.field(default_factory=list)


def open_searcher(settings: ServerSettings,
                  encoder_loader: Optional[Callable[[Path, Mapping[str, Any]], Encoder]] = None) -> Searcher:
    """The served index's Searcher, with this worker's share of the cores for torch.
    encoder_loader: hands out the encoder (server.shared_encoders); None: the index loads its own."""
    # N workers x all cores each would oversubscribe the CPU; give each its share.
    torch.set_num_threads(settings.effective_torch_threads)
    options = settings.reader_open_options()
    share = record_cache_share()  # the workers of this server map one record cache
    if share is not None:
        options["record_cache_share"] = share
    return Searcher.open(settings.index, reader=settings.reader, device=settings.device,
                         reader_options=options, trust_remote_code=settings.trust_remote_code,
                         encoder_loader=encoder_loader)


def _isolated(outcomes: list[BatchedResult[QueryResult] | Exception]
              ) -> tuple[list[BatchedResult[QueryResult]], list[int], dict[int, InvalidParameterError], list[int]]:
    """(results, their positions, refusals by position, failed positions) of a batch's outcomes.
    A failure that is not the library's refusal (a bug, a failed read) is logged once with its
    traceback, never shown to the client as a bad query nor turned into the whole batch's 500."""
    sorted_ = sort_outcomes(outcomes)
    logged: set[int] = set()
    for i, one in sorted_.failed.items():
        if id(one) not in logged:  # a group's failure reaches each of its queries: one log line
            logged.add(id(one))
            logger.error("internal error searching a batch's query %d: %s", i, one,
                         exc_info=(type(one), one, one.__traceback__))
    return list(sorted_.answered.values()), list(sorted_.answered), sorted_.refused, list(sorted_.failed)


class SearchService:
    """Searches and passages of the newest generation; owns the micro-batcher and its thread pool."""

    def __init__(self, live: LiveSearcher, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.live = live
        self.settings = settings
        self.metrics = metrics
        self.text_bytes = live.current.mean_document_bytes()
        # What each search call measured, from its thread to the loop: recorded once the answers
        # are out (a deque: appends from the search threads, pops on the loop).
        self._measured: collections.deque[tuple[list[tuple[int, Mapping[str, float], int, int]],
                                                Mapping[str, Any], Optional[PrefetchEstimates]]] = \
            collections.deque()
        self._executor = concurrent.futures.ThreadPoolExecutor(settings.search_threads, thread_name_prefix="espn-search")
        self.batcher: MicroBatcher[QueryResult] = MicroBatcher(
            None,
            self._executor,
            max_batch_size=settings.max_batch_size,
            max_wait_s=settings.batch_wait_ms / 1000.0,
            max_concurrent=settings.search_threads,
            max_pending=settings.max_pending,
            fair_chunk=settings.fair_chunk_queries,
            on_batch=self._observe_batches,
            search_many=self._search_many,
            run_inline=self._run_inline if settings.inline_search_ms > 0 else None,
        )
        self._lone_call_ms = 0.0  # running mean of one-query calls' time (inline or not)

    def start(self) -> None:
        """Start the batcher; call from the running event loop (the app's lifespan)."""
        self.batcher.start()

    async def close(self) -> None:
        """Search what is queued, then stop the search threads (the Searcher stays open)."""
        await self.batcher.close()
        self._executor.shutdown(wait=True)

    def warmup(self) -> None:
        with self.live.lease() as searcher:
            searcher.warmup()

    @contextlib.contextmanager
    def _lease(self) -> Iterator[Searcher]:
        """The newest published generation, held for the block: one stat of live/CURRENT; a
        generation another worker published opens here first, so a request that starts after
        a write's answer sees the write."""
        self.live.refresh()
        with self.live.lease() as searcher:
            yield searcher

    async def check(self, options: SearchOptions) -> None:
        """A request's own parameters, checked with no query to search (a 422 when they are wrong)."""
        with self._lease() as searcher:
            await self._checked_kwargs(searcher, 0, options, explain=False)

    async def search(self, queries: Sequence[str], options: SearchOptions, *, explain: bool = False,
                     isolate: bool = False) -> Answers:
        """Search `queries` with the request's options through the micro-batcher.

        The request holds the generation it started on (a newer one swapped in meanwhile leaves
        it open until then). isolate: a query the search itself refuses (InvalidParameterError,
        after the request's checks) is kept in `Answers.refused` and the others are answered;
        without it the refusal is raised (a 422 of the request). Any other failure is raised, or,
        with isolate, logged with its traceback and kept in `Answers.failed`.
        """
        with self._lease() as searcher:
            kwargs = await self._checked_kwargs(searcher, len(queries), options, explain)
            if isolate:
                results, answered, refused, failed = _isolated(await self.batcher.submit_each(queries, kwargs))
            else:
                results, answered, refused, failed = await self.batcher.submit_many(queries, kwargs), [], {}, []
            engine = searcher.reader.engine
        documents: Optional[dict[str, Document]] = None
        if options.return_text:
            wanted = sorted({hit.doc_id for item in results for hit in item.result.hits})
            documents = await asyncio.to_thread(self._documents, wanted)
        # The next loop turn: after this request's answer is written (the route sends it in this one).
        asyncio.get_running_loop().call_soon(self._observe_queries, results)
        return Answers(results, documents, engine, answered, refused, failed)

    def _observe_queries(self, results: list[BatchedResult[QueryResult]]) -> None:
        for item in results:
            stats = item.result.stats
            self.metrics.observe_query(queue_ms=item.queue_ms, hit_rate=stats.hit_rate, prefetched=stats.prefetched,
                                       missed=stats.missed, bytes_read=stats.bytes_read, ios=stats.ios)

    def _run_inline(self, n_queries: int) -> bool:
        """Whether a call about to start runs on the event loop: a lone query, no other request in
        progress on this worker (nothing else waits on the loop meanwhile), and one-query calls
        have been quick (a slow index or device keeps the loop free of them)."""
        return (n_queries == 1 and self._lone_call_ms < self.settings.inline_search_ms
                and busy_connections() <= 1)

    def _observe_batches(self, size: int, seconds: float) -> None:
        """The batcher's on_batch (on the loop, once the batch's answers are out): what the search
        calls measured, into the metrics."""
        if size == 1:
            self._lone_call_ms += 0.25 * (seconds * 1000.0 - self._lone_call_ms)
        self.metrics.queued.set(self.batcher.pending)
        while self._measured:
            calls, reader, prefetch = self._measured.popleft()
            for queries, stage_ms, waves, skipped in calls:
                self.metrics.observe_batch(queries, stage_ms)
                self.metrics.observe_waves(waves, skipped)
            self.metrics.set_record_cache(reader.get("record_cache"), reader.get("ram"))
            self.metrics.set_prefetch(prefetch)

    async def document(self, doc_id: str) -> Document:
        """One passage by its external id (DocumentNotFoundError: a 404)."""
        with self._lease() as searcher:
            # Reads passage text from disk: keep it off the event loop.
            return await asyncio.to_thread(searcher.document, doc_id)

    async def _checked_kwargs(self, searcher: Searcher, n_queries: int, options: SearchOptions,
                              explain: bool) -> dict[str, Any]:
        """The request's own checks (bounds, mode, explain, budget, filter), before it queues: a refused
        request costs nothing and is a 422 of the whole request, whatever its queries hold. Returns
        the batcher's keyword arguments."""
        kwargs = options.search_kwargs()
        modes = options.mode_kwargs()
        params = searcher.params(**{key: value for key, value in kwargs.items() if key not in modes})
        searcher.check_request(searcher.hybrid_params(**modes), explain)  # a 422 before the request queues
        settings = self.settings
        check_budget(params, n_queries, searcher.num_documents, self.text_bytes, options.return_text,
                     max_work=settings.max_request_work, max_response_bytes=settings.max_response_bytes)
        if options.filter is not None:
            # Validated (a bad filter is a 422 naming the problem) and compiled into the searcher's
            # cache off the event loop; the batch key carries its canonical text, so requests with
            # the same filter share a batch and different filters never do.
            await asyncio.to_thread(searcher.filtered_docs, options.filter)
            kwargs["filter"] = canonical_filter(options.filter)
        if explain:
            kwargs["explain"] = True
        return kwargs

    def _documents(self, doc_ids: Sequence[str]) -> dict[str, Document]:
        """The hits' passages from the newest generation (the batch may have run on a newer one
        than the request started on); a hit deleted since is left without text."""
        out = {}
        with self.live.lease() as searcher:
            for doc_id in doc_ids:
                try:
                    out[doc_id] = searcher.document(doc_id)
                except DocumentNotFoundError:
                    continue
        return out

    def _search_many(self, groups: list[tuple[list[str], Mapping[str, Any]]]) -> list[Any]:
        """The batcher's call (in a search thread): the newest generation's Searcher is leased for
        it, so a write that swaps in a newer one meanwhile closes this one only when it is done."""
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
                # One query's refusal is only that query's (its waiter gets it); the others are answered.
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
