"""Prometheus metrics of one server, single- or multi-process.

With `--workers N > 1`, `espn serve` points PROMETHEUS_MULTIPROC_DIR at a fresh temporary
directory before the workers start: each worker then writes its samples to files there
(prometheus_client picks its value class from that variable when it is first imported)
and /metrics, whichever worker answers it, aggregates all of them. With one worker the
metrics live in a private registry of the app, so several apps in one process (tests)
do not collide.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
    multiprocess,
    values,
)

__all__ = ["ServerMetrics", "MULTIPROC_ENV", "CONTENT_TYPE_LATEST"]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


class ServerMetrics:
    """The metrics the server exports; `render()` gives the /metrics body."""

    def __init__(self) -> None:
        self.multiprocess = MULTIPROC_ENV in os.environ
        if self.multiprocess:
            # prometheus_client chooses its value class when first imported. A worker forked
            # from `espn serve` inherits that choice, made before PROMETHEUS_MULTIPROC_DIR was
            # set if any module imported prometheus_client early; choose again (allowed while
            # no metric of ours exists, which is the case here).
            values.ValueClass = values.get_value_class()
        # In multiprocess mode samples go to files, not to a registry; /metrics collects them.
        self.registry: Optional[CollectorRegistry] = None if self.multiprocess else CollectorRegistry()
        if self.registry is not None:
            ProcessCollector(registry=self.registry)
        self._add_http_metrics(self.registry)
        self._add_search_metrics(self.registry)
        self._add_storage_metrics(self.registry)
        self._add_replication_metrics(self.registry)
        self._add_index_metrics(self.registry)
        self.ready = Gauge(
            "espn_ready", "1 when the index is open and warmed", multiprocess_mode="livemin", registry=self.registry
        )

    def _add_index_metrics(self, reg: Optional[CollectorRegistry]) -> None:
        """Per named index (`--index NAME=PATH`): open or closed, its documents, its requests."""
        self.index_open = Gauge(
            "espn_index_open", "1 while the index is open (workers holding it open)", ["index"],
            multiprocess_mode="livesum", registry=reg,
        )
        self.index_documents = Gauge(
            "espn_index_documents", "documents searchable in the index (when it last opened, wrote or closed)",
            ["index"], multiprocess_mode="livemax", registry=reg,
        )
        self.index_requests = Counter(
            "espn_index_requests", "requests to /v1/indexes/{name}/...", ["index"], registry=reg,
        )
        self.compactions = Counter(
            "espn_compactions", "compactions swapped in per index: merge (deltas merged) or rewrite (a new base, "
            "fitted on the index's documents again: a re-fit)", ["index", "kind"], registry=reg,
        )
        self.compaction_seconds = Histogram(
            "espn_compaction_seconds", "time of a compaction from its start to its swap, per kind",
            ["kind"], buckets=(0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600), registry=reg,
        )
        self.index_memory = Gauge(
            "espn_index_memory_bytes", "estimated memory the open index holds, summed over the workers holding it "
            "(what --index-memory-budget counts; 0 when closed)", ["index"], multiprocess_mode="livesum", registry=reg,
        )

    def set_index(self, name: str, is_open: bool, documents: int) -> None:
        self.index_open.labels(name).set(1 if is_open else 0)
        self.index_documents.labels(name).set(documents)
        if not is_open:
            self.index_memory.labels(name).set(0)

    def set_index_memory(self, name: str, estimated_bytes: int) -> None:
        self.index_memory.labels(name).set(estimated_bytes)

    def observe_compaction(self, name: str, kind: str, seconds: float) -> None:
        self.compactions.labels(name, kind).inc()
        self.compaction_seconds.labels(kind).observe(seconds)

    def count_index_request(self, name: str) -> None:
        self.index_requests.labels(name).inc()

    def set_ready(self, ready: bool) -> None:
        self.ready.set(1 if ready else 0)

    def set_queued(self, queries: int) -> None:
        self.queued.set(queries)

    def forget_index(self, name: str) -> None:
        """A deleted index: closed, nothing held (a series of a worker's metric file cannot be removed)."""
        for gauge in (self.index_open, self.index_documents, self.index_memory):
            gauge.labels(name).set(0)

    def _add_http_metrics(self, reg: Optional[CollectorRegistry]) -> None:
        """The requests, their latency and those in flight, per endpoint."""
        self.requests = Counter(
            "espn_http_requests", "HTTP requests answered", ["endpoint", "method", "status"], registry=reg
        )
        self.request_seconds = Histogram(
            "espn_http_request_duration_seconds", "HTTP request latency", ["endpoint"],
            buckets=_LATENCY_BUCKETS, registry=reg,
        )
        self.in_flight = Gauge(
            "espn_http_requests_in_flight", "HTTP requests being handled", ["endpoint"],
            multiprocess_mode="livesum", registry=reg,
        )

    def _add_search_metrics(self, reg: Optional[CollectorRegistry]) -> None:
        """The queries, micro-batches, pipeline stages and prefetch waves."""
        self.queries = Counter("espn_search_queries", "queries searched", registry=reg)
        self.batch_size = Histogram(
            "espn_search_batch_size", "queries per Searcher.search call (micro-batch)",
            buckets=_BATCH_BUCKETS, registry=reg,
        )
        self.queue_seconds = Histogram(
            "espn_search_queue_duration_seconds", "time a query waited for its micro-batch",
            buckets=_STAGE_BUCKETS, registry=reg,
        )
        self.stage_seconds = Histogram(
            "espn_search_stage_duration_seconds", "time per pipeline stage, per Searcher.search call",
            ["stage"], buckets=_STAGE_BUCKETS, registry=reg,
        )
        self.hit_rate = Histogram(
            "espn_prefetch_hit_rate", "per query: prefetched ∩ final candidates / final candidates",
            buckets=_RATE_BUCKETS, registry=reg,
        )
        self.prefetched = Counter("espn_prefetched_documents", "documents read by prefetch waves", registry=reg)
        self.missed = Counter("espn_missed_documents", "final candidates read in the critical path", registry=reg)
        self.waves = Counter("espn_prefetch_waves", "prefetch waves the cost model took (espn.prefetch)", registry=reg)
        self.waves_skipped = Counter(
            "espn_prefetch_waves_skipped", "prefetch waves the cost model declined: the scan still to come could not "
            "hide their reads here (too little scan left, or reads that steal the scan's cores)", registry=reg)
        self.waves_pay = Gauge(
            "espn_prefetch_waves_pay", "the prefetch outcome check's verdict: 1 while the searches that follow the "
            "wave model are not slower than those that read after the scan; 0 while waves are stopped (this machine "
            "cannot overlap reads with the scan at a gain; one search in 16 still tries), and for a reader without "
            "I/O to hide (memory, mmap)", multiprocess_mode="livemin", registry=reg)
        self.prefetch_estimate_ms = Gauge(
            "espn_prefetch_estimate_ms", "the prefetch cost model's measured terms in ms (espn.prefetch): "
            "submit_call (a submission's fixed cost), read_latency (a read's fixed cost), outcome_model and "
            "outcome_plain (scan start to last read per query, of searches that followed the model and of plain "
            "ones)", ["term"], multiprocess_mode="livemax", registry=reg)

    def _add_storage_metrics(self, reg: Optional[CollectorRegistry]) -> None:
        """The reads of the embedding store, the reader in use and the hot-record cache."""
        self.bytes_read = Counter("espn_read_bytes", "bytes read from the embedding store", registry=reg)
        self.ios = Counter("espn_read_ios", "read requests issued to the embedding store", registry=reg)
        self.queued = Gauge(
            "espn_search_queued_queries", "queries waiting for a micro-batch", multiprocess_mode="livesum",
            registry=reg,
        )
        self.reader_info = Gauge(
            "espn_reader_info", "1 for the embedding reader and I/O engine in use", ["reader", "engine"],
            multiprocess_mode="max", registry=reg,
        )
        self.record_cache_requests = Gauge(
            "espn_record_cache_requests", "records asked of the hot-record cache since the worker opened its index "
            "(--record-cache-mb)", multiprocess_mode="livesum", registry=reg)
        self.record_cache_hits = Gauge(
            "espn_record_cache_hits", "records the hot-record cache served from RAM (hit rate: hits / requests)",
            multiprocess_mode="livesum", registry=reg)
        self.record_cache_bytes = Gauge(
            "espn_record_cache_bytes", "RAM the record cache may hold (arena and tables; one copy, shared by the "
            "workers of a server)", multiprocess_mode="livemax", registry=reg)
        self.record_cache_entries = Gauge(
            "espn_record_cache_entries", "records the record cache holds now", multiprocess_mode="livemax",
            registry=reg)
        self.ram_bytes = Gauge(
            "espn_ram_bytes", "the index's RAM as planned (--ram-mib): resident (first stage and tables its searches "
            "map), record_cache, table (the memory reader's copy)", ["part"], multiprocess_mode="livemax",
            registry=reg)

    def _add_replication_metrics(self, reg: Optional[CollectorRegistry]) -> None:
        """The a follower's lag or a publishing writer's backlog."""
        self.replication_lag = Gauge(
            "espn_replication_lag_generations",
            "a follower's generations behind its source (--follow); a writer's not yet published (--publish)",
            multiprocess_mode="livemax", registry=reg,
        )
        self.replication_lag_seconds = Gauge(
            "espn_replication_lag_seconds",
            "a follower: age of the newest source generation it does not serve yet; a writer: time since its last "
            "publish while behind",
            multiprocess_mode="livemax", registry=reg,
        )
        self.replication_stale = Gauge(
            "espn_replication_stale",
            "1 while a follower has not reached its source lately, or a writer's last publish failed",
            multiprocess_mode="livemax",
            registry=reg,
        )

    def set_replication(self, status: Mapping[str, Any]) -> None:
        """A follower's status (espn.live.replication.follower.Follower.status) as gauges."""
        self.replication_lag.set(status["lag_generations"])
        self.replication_lag_seconds.set(status["lag_seconds"])
        self.replication_stale.set(1 if status["stale"] else 0)

    def set_reader(self, reader: str, engine: str) -> None:
        """The reader and I/O engine as labels (the engine is chosen at open: io_uring, aio, threads)."""
        self.reader_info.labels(reader, engine).set(1)

    def observe_waves(self, waves: int, skipped: int) -> None:
        """Once per Searcher.search call: the prefetch waves it took and those the cost model declined."""
        self.waves.inc(waves)
        self.waves_skipped.inc(skipped)

    def set_prefetch(self, estimates: Any) -> None:
        """The prefetch cost model's verdict and terms (`Searcher.prefetch_estimates`; None: a reader
        that takes no waves)."""
        if estimates is None:
            self.waves_pay.set(0)
            return
        self.waves_pay.set(1 if estimates.waves_pay else 0)
        model, plain = estimates.outcome_ms
        for term, value in (("submit_call", estimates.call_ms), ("read_latency", estimates.read_latency_ms),
                            ("outcome_model", model), ("outcome_plain", plain)):
            if value is not None:
                self.prefetch_estimate_ms.labels(term).set(value)

    def set_record_cache(self, stats: Optional[Mapping[str, Any]], ram: Optional[Mapping[str, Any]] = None) -> None:
        """The reader's record cache counters (`CachedReader.stats`; None: no cache) and the RAM plan it
        was opened with (`RamPlan.to_json`; None: none)."""
        if stats is not None:
            self.record_cache_requests.set(stats["requests"])
            self.record_cache_hits.set(stats["hits"])
            self.record_cache_bytes.set(stats["bytes"])
            self.record_cache_entries.set(stats["entries"])
        if ram is not None:
            for part, key in (("resident", "resident_bytes"), ("record_cache", "record_cache_bytes"),
                              ("table", "table_in_ram_bytes")):
                self.ram_bytes.labels(part).set(ram[key])

    def observe_request(self, endpoint: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, method, str(status)).inc()
        self.request_seconds.labels(endpoint).observe(seconds)

    def observe_batch(self, size: int, stage_ms: Mapping[str, float]) -> None:
        """Once per Searcher.search call: its size and its per-stage times (shared by its queries)."""
        self.batch_size.observe(size)
        self.queries.inc(size)
        for stage, ms in stage_ms.items():
            self.stage_seconds.labels(stage).observe(ms / 1000.0)

    def observe_query(self, *, queue_ms: float, hit_rate: float, prefetched: int, missed: int,
                      bytes_read: int, ios: int) -> None:
        self.queue_seconds.observe(queue_ms / 1000.0)
        self.hit_rate.observe(hit_rate)
        self.prefetched.inc(prefetched)
        self.missed.inc(missed)
        self.bytes_read.inc(bytes_read)
        self.ios.inc(ios)

    def render(self) -> bytes:
        """The Prometheus text exposition (CONTENT_TYPE_LATEST)."""
        if self.registry is not None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)

    def close(self) -> None:
        """Drop this process's live gauges from the multiprocess directory (worker exit)."""
        if self.multiprocess:
            multiprocess.mark_process_dead(os.getpid())
