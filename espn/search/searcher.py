"""The query pipeline: encode -> coarse quantizer -> ANN over cluster segments, with prefetch
waves submitting reads of the current top candidates while the ANN goes on -> read the
misses -> aggregate `w · cls + (1 − w) · bow` over the re-ranked top.

After every segment of δ clusters but the last, a wave takes the (query, document) pairs
that entered the current top `prefetch_k` since the last wave and submits their reads from
the scanning thread itself (`PendingRead.submit`): with the posix reader the read engine
(io_uring) has them in flight when the call returns, so the scan goes straight on, no
second thread competes with FAISS for a core or the GIL, and the completions are reaped
after the scan on the same thread. A cost model measured online (`espn.prefetch`) takes a
wave only when the reads the scan still to come can hide outweigh the wave's submission
and wasted reads; readers whose reads are CPU work (memory, mmap) take no waves at all.
Once the ANN is done the misses are submitted, every read is reaped, and the final
candidates are scored in one call straight from the records where the reads left them
(`espn.maxsim.score_records`: no gather, no decode).

On a GPU (`early_rerank`) a worker thread reads and re-ranks each wave while the ANN goes
on, as in the paper. `prefetch=False` is the sequential reference path; all paths give
the same ranking.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import faiss
import numpy as np
import torch

from ..ann import bitmap_selector, coarse_assign, list_sizes, load_ivf, merge_topk, search_preassigned, segment_bounds
from ..encoders import Encoder, QueryEmbeddings, load_encoder
from ..errors import InvalidParameterError
from .explain import can_explain, explain_results
from .filtered import FilteredDocs, matches_per_list, probe_matching, subset_ivf
from ..filters import FilterCache, canonical_filter, compile_filter, parse_filter
from ..first_stage import FirstStageConfig, Postings, TokenCentroids, assign_documents, postings_from_pairs
from .hybrid import HybridParams
from ..index import DocStore, IdMap, IndexDirectory
from .lexical import open_text_index
from ..maxsim import QueryScoring, score_records
from ..metadata import MetadataColumns
from .modes import search_modes
from ..params import SearchParams, has_text
from ..prefetch import PrefetchModel, ScanProgress, segment_codes
from ..results import Document, Hit, QueryResult, SearchStats
from ..segments import LiveView, SegmentedDocStore, SegmentedIdMap, current_token, open_view
from ..store import PendingRead, RecordBatch, Reader, open_reader
from ..store.format import StoreLayout
from ..text.query import parse_query

__all__ = ["Searcher", "MAX_QUERY_CHARS", "MAX_BATCH"]

log = logging.getLogger(__name__)

MAX_QUERY_CHARS = 10_000
MAX_BATCH = 1024

#: One query's scored candidates: doc numbers [m] int64, exact CLS [m] and BOW [m] float32.
Scored = tuple[np.ndarray, np.ndarray, np.ndarray]


class _Timer:
    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self._start = time.perf_counter()
        self._last = self._start

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.ms[stage] = self.ms.get(stage, 0.0) + (now - self._last) * 1000
        self._last = now

    def total(self) -> dict[str, float]:
        self.ms["total"] = (time.perf_counter() - self._start) * 1000
        return {key: round(value, 3) for key, value in self.ms.items()}


class Searcher:
    """One opened index, safe to share between threads. Open with `Searcher.open(path)`."""

    def __init__(self, index: IndexDirectory, encoder: Encoder | None, reader_name: str | None = None,
                 device: str | None = None, prefetch_threads: int = 4, early_rerank: bool | None = None,
                 reader_options: Mapping[str, Any] | None = None, min_hidden_ms: float = 0.2,
                 filter_cache_bytes: int = 512 << 20, view: LiveView | None = None) -> None:
        """view: a generation of a live index (espn.segments.open_view); `index` is its base."""
        self.index = index
        self.view = view
        self.manifest = index.manifest
        self.encoder = encoder
        store = self.manifest["store"]
        self.layout = StoreLayout.from_manifest(store)
        self.ids: IdMap | SegmentedIdMap
        self.docs: DocStore | SegmentedDocStore
        #: [N] bool, the documents not deleted or replaced (None: all); ANDed into every search.
        self.live: np.ndarray | None = None
        if view is not None:
            self.records, self.ann, self.ids, self.docs, self.live = view.records, view.ann, view.ids, view.docs, view.live
        else:
            self.records = index.load_array("records.npy")
            self.ann = load_ivf(index.file("ann.faiss"))
            if self.ann.ntotal != index.num_documents or len(self.records) != index.num_documents:
                raise InvalidParameterError(f"{index.path}: ann/records/manifest disagree on the document count")
            self.ids = IdMap(index.load_array("ids.npy"), index.load_array("ids_sorted.npy"))
            self.docs = DocStore(index.file("docs.jsonl"), index.load_array("docs_offsets.npy"))
        # The live bitmap is packed for FAISS once per generation, not once per search.
        self._live_selector = None if self.live is None else bitmap_selector(self.live)
        self._live_count = len(self.records) if self.live is None else int(np.count_nonzero(self.live))
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._reopen: dict[str, Any] = {}
        self._token = (0, 0)
        #: What this Searcher closes itself; what it shares with other generations closes with their base.
        self._owned: list[Callable[[], None]] = []
        self.reader = self._open_reader(reader_name, dict(reader_options or {}))
        score = self.manifest["score"]
        self.weight = float(score["w"])
        self.bow_reduction = score.get("bow_reduction", "mean")
        self.defaults = SearchParams.from_manifest(self.manifest["search_defaults"]).validate(
            self.nlist, self.num_documents)
        # Early re-ranking in the prefetch thread pays where MaxSim runs on a GPU. On a CPU it
        # would take cores from the ANN scan it overlaps, so there waves only read (I/O
        # releases the GIL and needs no core) and MaxSim runs once the ANN is done.
        self.early_rerank = self.device.startswith("cuda") if early_rerank is None else early_rerank
        # A wave costs the scanning thread ~0.1 ms (bookkeeping, handing it to a prefetch
        # thread) and can only hide reads behind the scan still to come.
        if not (isinstance(min_hidden_ms, (int, float)) and min_hidden_ms >= 0):
            raise InvalidParameterError(f"min_hidden_ms must be a number >= 0, got {min_hidden_ms!r}")
        self.min_hidden_ms = float(min_hidden_ms)
        self._prefetch = PrefetchModel(self.min_hidden_ms)  # what waves cost and win, measured as we go
        self._list_sizes = list_sizes(self.ann)
        self.metadata = view.metadata if view is not None else MetadataColumns.open(index.path, self.manifest)
        if isinstance(filter_cache_bytes, bool) or not isinstance(filter_cache_bytes, int) or filter_cache_bytes < 0:
            raise InvalidParameterError(f"filter_cache_bytes must be an integer >= 0, got {filter_cache_bytes!r}")
        # Compiled filters (mask + the matches' own IVF), least recently used out first.
        self._filters: FilterCache[str, FilteredDocs] = FilterCache(filter_cache_bytes, lambda f: f.nbytes)
        self._pool = self._shared("prefetch-pool", lambda: ThreadPoolExecutor(
            max_workers=prefetch_threads, thread_name_prefix="espn-prefetch"), lambda pool: pool.shutdown(wait=True))
        #: The generation's full-text index (None: the index has none) and the hybrid defaults.
        self.text = open_text_index(index.path, self.manifest, view)
        if self.text is not None:
            self._owned.append(self.text.close)
        self.hybrid_defaults = HybridParams.from_manifest(self.manifest.get("hybrid"))
        #: The candidate generator (espn.first_stage): the IVF over CLS vectors, or for models
        #: without a trained CLS vector the token-level centroid index (None: not built).
        self.first_stage = FirstStageConfig.from_manifest(self.manifest.get("first_stage"))
        self.centroids = self._open_centroids() if (self.index.path / "first_stage").is_dir() else None
        if self.first_stage.uses_centroids and self.centroids is None:
            raise InvalidParameterError(f"{index.path}: the manifest's first stage is {self.first_stage.kind!r} "
                                        f"but the index has no first_stage/ (rebuild it)")
        # Fast tokenizers refuse concurrent calls that change padding ("Already borrowed").
        self._tokenizer_lock = threading.Lock()

    def _shared(self, key: str, make: Callable[[], Any], close: Callable[[Any], None]) -> Any:
        """One object for every generation over this live-index base (closed with the base),
        or this Searcher's own without a view."""
        if self.view is not None:
            return self.view.shared.attached(key, make, close)
        value = make()
        self._owned.append(lambda: close(value))
        return value

    def _open_reader(self, name: str | None, options: dict[str, Any]) -> Reader:
        """The reader of embeddings.bin. The Searchers of one live-index base share one: a newer
        generation only extends its records table (the rows of older doc numbers never change),
        so a write costs no new descriptors, rings or threads. Readers that hold a copy or a
        map of the file (memory, mmap) cannot follow appends: there each generation has its own."""
        def make() -> Reader:
            return open_reader(name, self.index.file("embeddings.bin"), self.records, self.layout,  # type: ignore[arg-type]
                               device=self.device, **options)

        reader: Reader = self._shared("reader", make, lambda r: r.close())
        if reader.extend_records(self.records):  # type: ignore[arg-type]  # a RecordTable reads like one
            return reader
        reader = make()
        self._owned.append(reader.close)
        return reader

    def _open_centroids(self) -> TokenCentroids:
        """The base's centroid index (shared by every generation over the base) plus the postings
        of each delta segment, computed once per segment from its records (segments never change)."""
        base: TokenCentroids = self._shared("first-stage", lambda: TokenCentroids.open(self.index.path), lambda _: None)
        if self.view is None or not self.view.segments:
            return base
        shared = self.view.shared
        extra: list[Postings] = []
        for name, segment in self.view.segments.items():
            first, stop = segment.info.first, segment.info.stop

            def make(first: int = first, stop: int = stop) -> Postings:
                return self._segment_postings(base, first, stop)

            extra.append(shared.attached(f"first-stage:{name}", make, lambda _: None))
        return base.with_parts(extra)

    def _segment_postings(self, base: TokenCentroids, first: int, stop: int, block: int = 4096) -> Postings:
        """centroid -> doc CSR of a delta's documents (first .. stop-1) against the base's centroids."""
        numbers = np.arange(first, stop, dtype=np.int64)
        numbers = numbers[self.records[numbers]["n_bow"] > 0]  # holes of merged deltas hold nothing
        pairs = [assign_documents(base.centroids, batch.vectors.float().cpu().numpy(), batch.offsets, part)
                 for part in np.array_split(numbers, max(1, -(-len(numbers) // block)))
                 for batch in [self.reader.read(part)] if len(part)]
        if not pairs:
            return postings_from_pairs(np.zeros(0, np.int64), np.zeros(0, np.int64), len(base.centroids))
        return postings_from_pairs(np.concatenate([c for c, _ in pairs]), np.concatenate([d for _, d in pairs]),
                                   len(base.centroids))

    @classmethod
    def open(cls, path: str | Path, reader: str | None = None, device: str | None = None, verify: str = "auto",
             with_encoder: bool = True, early_rerank: bool | None = None,
             reader_options: Mapping[str, Any] | None = None, min_hidden_ms: float = 0.2,
             filter_cache_bytes: int = 512 << 20) -> "Searcher":
        """Open and validate an index. reader: posix, kvikio, mmap or memory (None = best available).

        reader_options go to the reader: for posix `io_engine` ("io_uring", "aio", "threads",
        None = best available), `io_depth`, `max_extent_bytes`, `direct`; for kvikio `nthreads`,
        `gds_threshold`, `task_size`, `bounce_buffer_size`, `compat_mode`, `max_extent_bytes`.
        min_hidden_ms: a prefetch wave is taken only when the time it is expected to save
        (`espn.prefetch.PrefetchModel`: reads the scan still to come hides, less the wave's
        own costs) is at least this (0: always).
        filter_cache_bytes: budget of the compiled-filter cache (masks and sub-indexes).
        """
        view = open_view(path, verify=verify)
        try:
            index = view.base
            encoder = load_encoder(index.file("encoder"), index.manifest["encoder"], device=device) if with_encoder else None
            searcher = cls(index, encoder, reader_name=reader, device=device, early_rerank=early_rerank,
                           reader_options=reader_options, min_hidden_ms=min_hidden_ms,
                           filter_cache_bytes=filter_cache_bytes, view=view)
        except BaseException:
            view.close()
            raise
        searcher._reopen = dict(reader_name=reader, device=device, early_rerank=early_rerank,
                                reader_options=reader_options, min_hidden_ms=min_hidden_ms,
                                filter_cache_bytes=filter_cache_bytes)
        searcher._token = current_token(Path(path))
        return searcher

    def refresh(self) -> "Searcher | None":
        """A Searcher over the live index's newest generation, sharing this one's encoder, or None
        when none was published since this one opened (one stat of live/CURRENT). The caller
        closes this one once its in-flight searches are done."""
        if self.view is None:
            return None
        root = self.view.root
        token = current_token(root)
        if token == self._token:
            return None
        # The files were verified at start or fsynced by the writer; what the generations share
        # (the base, its reader, the segments) is taken over from this one.
        view = open_view(root, verify="none", previous=self.view)
        try:
            searcher = type(self)(view.base, self.encoder, view=view, **self._reopen)
        except BaseException:
            view.close()
            raise
        searcher._reopen, searcher._token = self._reopen, token
        return searcher

    # -- properties ------------------------------------------------------------------
    @property
    def num_documents(self) -> int:
        """Doc numbers in use (in a live index, deleted and replaced ones included)."""
        return int(len(self.records))

    @property
    def generation(self) -> int:
        """The live-index generation this Searcher serves (0: never written to)."""
        return self.view.generation.number if self.view is not None else 0

    @property
    def nlist(self) -> int:
        return int(self.ann.nlist)

    @property
    def reader_name(self) -> str:
        return self.reader.name

    def close(self) -> None:
        """Release what this Searcher holds; what it shares with other generations closes with
        the last of them. Call it once no search runs on it (espn.lease.LiveSearcher does)."""
        owned, self._owned = self._owned, []
        for close in reversed(owned):
            close()
        if self.view is not None:
            self.view.close()

    def __enter__(self) -> "Searcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public search ---------------------------------------------------------------
    def params(self, k: int | None = None, **overrides: Any) -> SearchParams:
        """The defaults with per-call overrides, validated against this index."""
        return self.defaults.replace(k=k, **overrides).validate(self.nlist, self.num_documents)

    def hybrid_params(self, mode: str | None = None, fusion: str | None = None, lexical_k: int | None = None,
                      rrf_k: int | None = None, mix_weight: float | None = None,
                      union: bool | None = None, syntax: str | None = None) -> HybridParams:
        """The index's mode and fusion defaults with per-call overrides, validated."""
        return self.hybrid_defaults.replace(mode=mode, fusion=fusion, lexical_k=lexical_k, rrf_k=rrf_k,
                                            mix_weight=mix_weight, union=union, syntax=syntax)

    def search(self, queries: Sequence[str], k: int | None = None, filter: Any = None, explain: bool = False,
               mode: str | None = None, fusion: str | None = None, lexical_k: int | None = None,
               rrf_k: int | None = None, mix_weight: float | None = None, union: bool | None = None,
               syntax: str | None = None,
               embeddings: QueryEmbeddings | None = None, **overrides: Any) -> list[QueryResult]:
        """Search a batch of query strings; one QueryResult per query, in order.

        filter: a filter (JSON object or its text; see `espn.filters`) every hit must satisfy.
        explain: give every re-ranked hit an Explanation (per query token: its MaxSim
        contribution and the passage span it matched) and, in lexical and hybrid modes, its
        lexical matches; computed after the search, for the returned hits only, and timed as
        stage "explain". False costs nothing.
        mode: dense (default), lexical or hybrid; fusion, lexical_k, rrf_k, mix_weight and
        union tune hybrid search (`espn.search.hybrid.HybridParams`). syntax: how the lexical side
        reads the queries, "plain" text (default: never an operator, never an error) or
        "simple" (phrases, +required, -excluded; lenient, see `espn.text.query`).
        embeddings: these queries already encoded by `encode` (the server encodes concurrent
        requests of different parameters in one call); stage "encode" is then 0 here. In
        hybrid mode they must be the encodings of the queries' dense text (`dense_queries`).
        """
        if not isinstance(explain, bool):
            raise InvalidParameterError(f"explain must be true or false, got {explain!r}")
        hybrid = self.hybrid_params(mode, fusion, lexical_k, rrf_k, mix_weight, union, syntax)
        if explain and hybrid.mode != "lexical":
            can_explain(self.encoder)
        self._check_texts(queries)
        params = self.params(k, **overrides)
        filtered = self.filtered_docs(filter)
        if not queries:
            return []
        if embeddings is not None and len(embeddings) != len(queries):
            raise InvalidParameterError(f"embeddings hold {len(embeddings)} queries for {len(queries)} texts")
        if hybrid.mode != "dense":
            return search_modes(self, queries, params, hybrid, filtered, explain, _Timer(), embeddings)
        timer = _Timer()
        if embeddings is None:
            embeddings = self.encode(queries)
        timer.lap("encode")
        results = self._search(embeddings, params, timer, filtered=filtered)
        return self._explain(queries, embeddings, results) if explain else results

    def dense_queries(self, queries: Sequence[str], mode: str | None = None,
                      syntax: str | None = None) -> list[str] | None:
        """What `encode` takes for these queries in `mode` (None: the index's default): the
        queries as typed (dense, and hybrid in plain syntax), their words without the simple
        syntax's quotes, operators and excluded clauses (hybrid, syntax simple), or None
        (lexical: nothing is encoded)."""
        hybrid = self.hybrid_params(mode, syntax=syntax)
        if hybrid.mode == "lexical":
            return None
        if hybrid.mode == "hybrid":
            return [parse_query(query, hybrid.syntax).dense_text() for query in queries]
        return list(queries)

    def encode(self, queries: Sequence[str]) -> QueryEmbeddings:
        """Encode query texts with the index's encoder (tokenised and run as one batch)."""
        self._check_texts(queries)
        if self.encoder is None:
            raise InvalidParameterError("this Searcher was opened without an encoder; use search_embeddings")
        with self._tokenizer_lock:
            tokens = self.encoder.tokenize(list(queries), is_query=True)
        return self.encoder.embed_queries(tokens)

    @staticmethod
    def _check_texts(queries: Sequence[str]) -> None:
        if isinstance(queries, str) or not isinstance(queries, Sequence):
            raise InvalidParameterError("queries must be a list of strings")
        if len(queries) > MAX_BATCH:
            raise InvalidParameterError(f"a batch holds at most {MAX_BATCH} queries, got {len(queries)}")
        for i, query in enumerate(queries):
            which = f"query {i}" if len(queries) > 1 else "the query"
            if not isinstance(query, str) or not has_text(query):
                raise InvalidParameterError(f"{which} must be a non-empty string (it has no text: only "
                                            "whitespace or control characters)")
            if len(query) > MAX_QUERY_CHARS:
                raise InvalidParameterError(f"{which} has {len(query)} characters; at most {MAX_QUERY_CHARS}")

    def _explain(self, queries: Sequence[str], embeddings: QueryEmbeddings, results: list[QueryResult]) -> list[QueryResult]:
        started = time.perf_counter()
        results = explain_results(self, queries, embeddings, results)
        ms = (time.perf_counter() - started) * 1000
        for result in results:  # the batch shares one stage_ms dict: give each its own copy
            stage_ms = dict(result.stats.stage_ms)
            total = stage_ms.pop("total")
            result.stats.stage_ms = {**stage_ms, "explain": round(ms, 3), "total": round(total + ms, 3)}
        return results

    def search_embeddings(self, queries: QueryEmbeddings, k: int | None = None, filter: Any = None,
                          mode: str | None = None, texts: Sequence[str] | None = None, fusion: str | None = None,
                          lexical_k: int | None = None, rrf_k: int | None = None, mix_weight: float | None = None,
                          union: bool | None = None, syntax: str | None = None,
                          **overrides: Any) -> list[QueryResult]:
        """Search queries encoded elsewhere: cls [B, d_cls], bow [B, L, d_bow], mask [B, L].

        mode hybrid also needs `texts`, the B query strings for the lexical side.
        """
        params = self.params(k, **overrides)
        hybrid = self.hybrid_params(mode, fusion, lexical_k, rrf_k, mix_weight, union, syntax)
        filtered = self.filtered_docs(filter)
        if queries.cls.ndim != 2 or queries.cls.shape[1] != self.layout.d_cls or queries.bow.shape[-1] != self.layout.d_bow:
            raise InvalidParameterError(
                f"query embeddings must have d_cls={self.layout.d_cls}, d_bow={self.layout.d_bow}; "
                f"got cls {queries.cls.shape}, bow {queries.bow.shape}")
        if hybrid.mode != "dense":
            if texts is None or len(texts) != len(queries):
                raise InvalidParameterError(f"mode {hybrid.mode!r} needs texts: one query string per embedding")
            return search_modes(self, texts, params, hybrid, filtered, False, _Timer(), embeddings=queries)
        return self._search(queries, params, _Timer(), filtered=filtered)

    def filtered_docs(self, filter: Any) -> FilteredDocs | None:
        """A filter validated against this index's fields and compiled (cached per distinct filter).

        None for no filter (and for `{}`); a filter every document satisfies is searched unfiltered.
        Raises FilterError (an InvalidParameterError) naming the problem.
        """
        if filter is None:
            return None
        node = parse_filter(filter, self.metadata.schema)
        if node is None:
            return None
        key = canonical_filter(filter)
        found = self._filters.get(key)
        if found is not None:
            return found
        mask = compile_filter(node, self.metadata)
        if self.live is not None:  # deleted and replaced documents match nothing
            mask &= self.live
        matches = int(np.count_nonzero(mask))
        if matches == self._live_count:  # searched unfiltered; kept to report the count
            compiled = FilteredDocs(mask, matches, self._list_sizes, None)
        elif matches * (self.ann.code_size + 8) + mask.nbytes <= self._filters.max_bytes:
            sub, counts = subset_ivf(self.ann, mask)
            compiled = FilteredDocs(mask, matches, counts, sub)
        else:  # too large to copy: the bitmap over the full index, probed by the same rule
            compiled = FilteredDocs(mask, matches, matches_per_list(self.ann, mask), None)
        self._filters.put(key, compiled)
        return compiled

    def document(self, doc_id: str) -> Document:
        """The stored passage of an external id; raises DocumentNotFoundError."""
        return self.docs.document(doc_id, self.ids.internal(doc_id))

    def warmup(self) -> None:
        """One search end to end, so the first user request pays no start-up cost.

        An index of precomputed embeddings has no tokenizer: a zero query warms it instead.
        """
        from ..encoders.precomputed import PrecomputedEncoder

        if self.encoder is not None and not isinstance(self.encoder, PrecomputedEncoder):
            self.search(["warm up"], k=1)
            return
        d_cls, d_bow = self.layout.d_cls, self.layout.d_bow
        zero = QueryEmbeddings(np.zeros((1, d_cls), np.float32), np.zeros((1, 1, d_bow), np.float32), np.ones((1, 1), bool))
        self.search_embeddings(zero, k=1)

    # -- the pipeline ----------------------------------------------------------------
    def _search(self, q: QueryEmbeddings, params: SearchParams, timer: _Timer,
                allowed: np.ndarray | None = None, filtered: FilteredDocs | None = None,
                extra: "Future[tuple[Sequence[np.ndarray], RecordBatch | None]] | None" = None,
                pools: list[Scored] | None = None) -> list[QueryResult]:
        """allowed: [N] bool, the documents a search may return (None: all); applied inside
        FAISS, so excluded documents are never read, re-ranked or counted against k.
        filtered: a compiled filter (`filtered_docs`), ANDed with `allowed`: the search runs
        over its sub-index, probing lists until it has scanned as many matches as the
        unfiltered search scans codes (`espn.search.filtered`).
        extra: a future of (per query, doc numbers to score besides the re-ranked head; those
        documents read already, or None to read them): hybrid search's lexical side, still
        running when the scan starts. As soon as it is done a worker scores them while the
        scan goes on (the scan takes one core, so this is work the other core hides); those
        that make the head are not read or scored again.
        pools: filled with one Scored per query: the head and the extra documents, exact CLS
        and MaxSim (`espn.search.modes` fuses them)."""
        stage = self.first_stage.replace(params.first_stage, params.first_stage_probe, params.first_stage_candidates)
        if stage.uses_centroids:
            return self._search_centroids(q, params, stage, timer, allowed, filtered, extra, pools)
        batch, n_docs = len(q), self.num_documents
        ann = self.ann
        restricted = filtered if filtered is not None and filtered.matches < self._live_count else None
        # Deleted and replaced documents are out whatever the caller allows; a filter's mask and
        # sub-index exclude them already.
        selector: faiss.IDSelector | None
        if allowed is not None:
            if self.live is not None:
                allowed = allowed & self.live
            if restricted is not None and restricted.ivf is None:
                allowed = allowed & restricted.mask
            selector = bitmap_selector(allowed)
        elif restricted is None:
            selector = self._live_selector
        elif restricted.ivf is None:
            selector = bitmap_selector(restricted.mask)
        else:
            selector = None  # the sub-index holds the filter's live matches only
        xq = np.ascontiguousarray(q.cls, dtype=np.float32)
        queries = QueryScoring.from_arrays(xq, q.bow, q.mask)
        candidates = params.candidates
        sizes = self._list_sizes
        exact = np.zeros(batch, dtype=bool)
        if restricted is None:
            coarse_scores, lists = coarse_assign(self.ann, xq, params.nprobe)
        else:
            all_scores, all_lists = coarse_assign(self.ann, xq, self.nlist)
            # The unfiltered search would score this many codes; scan as many matching ones.
            target = np.maximum(sizes[all_lists[:, : params.nprobe]].sum(axis=1), candidates)
            coarse_scores, lists, exact = probe_matching(all_scores, all_lists, restricted.list_counts, target)
            sizes = restricted.list_counts
            if restricted.ivf is not None:
                ann = restricted.ivf
        timer.lap("quantizer")

        n_probe = lists.shape[1]
        segments = segment_bounds(n_probe, params.prefetch_step)
        use_prefetch = (params.prefetch and params.wave_size > 0 and params.rerank_count > 0 and len(segments) > 1
                        and self.reader.io_bound)
        max_waves = params.prefetch_waves or len(segments)
        group = PendingRead(self.reader)  # every read of this search: the waves, then the misses
        early: list[_Wave] = []  # waves read and re-ranked on a worker (GPU)
        n_waves = skipped = 0
        submitted = np.zeros(0, dtype=np.int64)  # sorted (query, doc) keys: query · N + doc
        rows = np.arange(batch, dtype=np.int64)[:, None] * n_docs
        top: tuple[np.ndarray, np.ndarray] = (np.zeros((batch, 0), np.float32), np.zeros((batch, 0), np.int64))
        use_prefetch = use_prefetch and not self._prefetch.explore()  # now and then a plain read, to measure
        progress = ScanProgress(segment_codes(lists, sizes, segments))
        extra_keys = np.zeros(0, dtype=np.int64)
        extra_scores = np.zeros((2, 0), dtype=np.float32)
        extra_wave: _Wave | None = None

        def start_extra() -> None:  # score the extra documents on a worker, once they are known
            nonlocal extra, extra_keys, extra_wave
            assert extra is not None
            docs, records = extra.result()
            extra, extra_keys = None, _extra_keys(docs, n_docs)
            if len(extra_keys):
                extra_wave = self._start_early_wave(extra_keys, n_docs, queries, records)
            elif records is not None:
                records.release()

        try:
            for segment, (a, b) in enumerate(segments):
                if extra is not None and extra.done():
                    start_extra()
                part = search_preassigned(ann, xq, candidates, lists[:, a:b], coarse_scores[:, a:b], selector)
                top = merge_topk(top, part, candidates)
                if not use_prefetch or b >= n_probe or n_waves >= max_waves:
                    continue
                scan_left = progress.left_ms(segment)
                if not self._prefetch.may_pay(scan_left):  # too little scan left to hide anything
                    skipped += 1
                    continue
                head = top[1][:, : params.wave_size]
                keys = (rows + head)[head >= 0]
                new = keys[~np.isin(keys, submitted)]
                if len(new) == 0:
                    continue
                docs = np.unique(new % n_docs)
                if not self._prefetch.wave_pays(scan_left, len(docs), int(self.records[docs]["length"].sum())):
                    skipped += 1
                    continue
                submitted = np.union1d(submitted, new)
                n_waves += 1
                if self.early_rerank:
                    early.append(self._start_early_wave(new, n_docs, queries))
                else:
                    # Submitted from this thread: the engine has the reads in flight when submit
                    # returns, the scan goes on, and they are reaped after it, here.
                    started = time.perf_counter()
                    group.submit(docs)
                    ended = time.perf_counter()
                    self._prefetch.observe_submit(len(docs), (ended - started) * 1000)
                    progress.waved(segment, len(docs), started, ended)
            slowdown = progress.slowdown()
            if slowdown is not None and not self.early_rerank:
                self._prefetch.observe_slowdown(*slowdown)
            timer.lap("ann")

            rerank = top[1][:, : params.rerank_count]
            valid = rerank >= 0
            final = (rows + rerank)[valid]  # every query's re-ranked keys, in rank order per query
            scores = np.zeros((2, len(final)), dtype=np.float32)  # exact CLS, MaxSim per final key
            scored = np.zeros(len(final), dtype=bool)
            bytes_read = ios = 0
            in_waves = np.isin(final, submitted)
            if extra is not None:
                start_extra()  # the lexical side's documents: known by now (BM25 ran beside the scan)
            in_extra = np.isin(final, extra_keys)  # read and scored by the extra wave
            misses = np.unique(final[~in_waves & ~in_extra] % n_docs)
            started = time.perf_counter()
            group.submit(misses)  # in flight beside the waves' tails while early waves are collected
            in_flight = time.perf_counter()
            if self.reader.io_bound:
                self._prefetch.observe_submit(len(misses), (in_flight - started) * 1000)
            final_sorted = np.argsort(final, kind="stable") if early else final
            for wave in early:
                (wave_bytes, wave_ios), wave_scores = wave.finish()
                bytes_read, ios = bytes_read + wave_bytes, ios + wave_ios
                wanted = np.isin(wave.keys, final)
                where = final_sorted[np.searchsorted(final, wave.keys[wanted], sorter=final_sorted)]
                scores[:, where] = wave_scores[:, wanted]
                scored[where] = True
            early = []
            if extra_wave is not None:
                (extra_bytes, extra_ios), extra_scores = extra_wave.finish()
                extra_wave = None
                bytes_read, ios = bytes_read + extra_bytes, ios + extra_ios
                in_head = np.isin(extra_keys, final)  # scored already: take them, read them no more
                where = np.flatnonzero(in_extra)
                scores[:, where] = extra_scores[:, in_head][:, np.argsort(np.argsort(final[where]))]
                scored[where] = True
                extra_keys, extra_scores = extra_keys[~in_head], extra_scores[:, ~in_head]
            timer.lap("prefetch_wait")

            group.wait()
            missed_bytes = int(self.records[misses]["length"].sum())
            if len(misses) and self.reader.io_bound:  # what the device took (after waves: or their tail, if later)
                self._prefetch.observe_read(missed_bytes, (time.perf_counter() - in_flight) * 1000)
            timer.lap("miss_read")
            todo = np.flatnonzero(~scored)
            need = np.unique(final[todo] % n_docs)
            # The final candidates' records where the reads left them: scored in place, not gathered.
            with group.records(select=need) as records:
                bytes_read, ios = bytes_read + records.bytes_read, ios + records.ios
                timer.lap("gather")
                scores[:, todo] = self._score_pairs(queries, records, final[todo], n_docs)
            timer.lap("maxsim")
        finally:  # a failure part-way: no read may outlive the search, nor hide its error
            try:
                group.discard()
            except Exception:
                log.warning("a read failed while its search was being abandoned", exc_info=True)
            for wave in early:
                wave.discard()
            if extra_wave is not None:
                extra_wave.discard()
            if extra is not None and not extra.cancel() and extra.exception() is None:
                _, unused = extra.result()  # waited for: its reads must not outlive the search
                if unused is not None:
                    unused.release()

        n_final = valid.sum(axis=1)
        prefetched = np.bincount(submitted // n_docs, minlength=batch)
        hits_in_final = np.bincount(final[in_waves] // n_docs, minlength=batch)
        if n_waves:
            self._prefetch.observe_waves(len(submitted), int(in_waves.sum()), missed_bytes)
        missed = n_final - hits_in_final
        cls_grid = np.full(rerank.shape, np.nan, dtype=np.float32)
        bow_grid = np.full(rerank.shape, np.nan, dtype=np.float32)
        cls_grid[valid], bow_grid[valid] = scores[0], scores[1]
        out = [self._aggregate(top[0][i], top[1][i], rerank[i][valid[i]], cls_grid[i][valid[i]],
                               bow_grid[i][valid[i]], params.k) for i in range(batch)]
        if pools is not None:
            extra_query = extra_keys // n_docs
            for i in range(batch):
                mine = extra_query == i
                pools.append((np.concatenate([rerank[i][valid[i]], extra_keys[mine] % n_docs]),
                              np.concatenate([cls_grid[i][valid[i]], extra_scores[0][mine]]),
                              np.concatenate([bow_grid[i][valid[i]], extra_scores[1][mine]])))
        timer.lap("aggregate")
        stage_ms = timer.total()
        engine = self.reader.engine
        return [
            QueryResult(hits=hits, stats=SearchStats(
                stage_ms=stage_ms,
                hit_rate=float(hits_in_final[i] / n_final[i]) if n_final[i] else 1.0,
                bytes_read=_share(bytes_read, i, batch), ios=_share(ios, i, batch),
                prefetched=int(prefetched[i]), missed=int(missed[i]),
                read_amplification=float((prefetched[i] + missed[i]) / n_final[i]) if n_final[i] else 1.0,
                engine=engine, waves=n_waves, waves_skipped=skipped,
                matched=None if filtered is None else filtered.matches,
                filter_path=None if filtered is None else (
                    "all" if restricted is None else "exact" if exact[i] else "ivf")))
            for i, hits in enumerate(out)
        ]

    def _search_centroids(self, q: QueryEmbeddings, params: SearchParams, stage: FirstStageConfig, timer: _Timer,
                          allowed: np.ndarray | None, filtered: FilteredDocs | None,
                          extra: "Future[tuple[Sequence[np.ndarray], RecordBatch | None]] | None",
                          pools: list[Scored] | None) -> list[QueryResult]:
        """The centroid first stage (espn.first_stage), then exact MaxSim of every candidate read
        from the records; "union" adds the IVF's top `rerank_count`. Same contract as `_search`."""
        if self.centroids is None:
            raise InvalidParameterError(f"first_stage {stage.kind!r} needs a centroid index, and this index has "
                                        f"none (build it with `espn index --first-stage centroids`)")
        batch, n_docs = len(q), self.num_documents
        mask = self.live
        if allowed is not None:
            mask = allowed if mask is None else allowed & mask
        if filtered is not None and filtered.matches < self._live_count:
            mask = filtered.mask if mask is None else filtered.mask & mask
        xq = np.ascontiguousarray(q.cls, dtype=np.float32)
        queries = QueryScoring.from_arrays(xq, q.bow, q.mask)
        depth = max(stage.candidates, params.k)
        per_query = self.centroids.candidates(np.asarray(q.bow, dtype=np.float32), np.asarray(q.mask, dtype=bool),
                                              stage.probe, depth, mask)
        timer.lap("first_stage")
        if stage.kind == "union" and params.rerank_count > 0:
            selector = None if mask is None else (self._live_selector if mask is self.live else bitmap_selector(mask))
            coarse_scores, lists = coarse_assign(self.ann, xq, params.nprobe)
            _, labels = search_preassigned(self.ann, xq, params.rerank_count, lists, coarse_scores, selector)
            per_query = [np.union1d(docs, found[found >= 0]) for docs, found in zip(per_query, labels)]
            timer.lap("ann")
        if extra is not None:  # hybrid's lexical documents: scored with the rest (read again: one read)
            extra_docs, extra_records = extra.result()
            if extra_records is not None:
                extra_records.release()
            per_query = [np.union1d(docs, np.asarray(more, dtype=np.int64))
                         for docs, more in zip(per_query, list(extra_docs) + [np.zeros(0, np.int64)] * batch)]
        keys = np.concatenate([i * n_docs + np.asarray(docs, dtype=np.int64) for i, docs in enumerate(per_query)])
        docs = np.unique(keys % n_docs)
        scores = np.zeros((2, len(keys)), dtype=np.float32)
        bytes_read = ios = 0
        if len(keys):
            with self.reader.submit(docs).records() as records:
                timer.lap("miss_read")
                bytes_read, ios = records.bytes_read, records.ios
                scores = self._score_pairs(queries, records, keys, n_docs)
        timer.lap("maxsim")
        bounds = np.cumsum([0] + [len(d) for d in per_query])
        out = []
        for i, found in enumerate(per_query):
            cls_scores, bow_scores = scores[0, bounds[i]:bounds[i + 1]], scores[1, bounds[i]:bounds[i + 1]]
            out.append(self._aggregate(np.zeros(len(found), np.float32), found, found, cls_scores, bow_scores, params.k))
            if pools is not None:
                pools.append((np.asarray(found, dtype=np.int64), cls_scores, bow_scores))
        timer.lap("aggregate")
        stage_ms = timer.total()
        # No prefetcher runs beside this stage (every candidate is read after it): hit rate 0.
        return [QueryResult(hits=hits, stats=SearchStats(
            stage_ms=stage_ms, hit_rate=0.0, bytes_read=_share(bytes_read, i, batch), ios=_share(ios, i, batch),
            prefetched=0, missed=len(per_query[i]), engine=self.reader.engine,
            matched=None if filtered is None else filtered.matches,
            filter_path=None if filtered is None else "all" if filtered.matches >= self._live_count else "centroids"))
            for i, hits in enumerate(out)]

    def _start_early_wave(self, keys: np.ndarray, n_docs: int, queries: QueryScoring,
                          records: RecordBatch | None = None) -> "_Wave":
        """Read and re-rank a wave on a worker while the ANN goes on (the GPU path); the worker
        both submits and waits, as ring-based engines require. records: the wave's documents,
        read already (only scored here; the wave releases them, also when it is cancelled)."""
        docs = np.unique(keys % n_docs)

        def read_and_score() -> tuple[tuple[int, int], np.ndarray]:
            batch = self.reader.submit(docs).records() if records is None else records
            with batch:
                return (batch.bytes_read, batch.ios), self._score_pairs(queries, batch, keys, n_docs)

        return _Wave(keys, self._pool.submit(read_and_score), records)

    def _score_pairs(self, queries: QueryScoring, records: RecordBatch, keys: np.ndarray, n_docs: int) -> np.ndarray:
        """[2, P] float32: exact CLS and MaxSim of the (query, doc) `keys`, whose records `records` holds."""
        return score_records(queries, records, self.layout, keys // n_docs, records.rows_of(keys % n_docs),
                             self.bow_reduction)

    def _aggregate(self, ann_scores: np.ndarray, ann_docs: np.ndarray, rerank: np.ndarray, head_cls: np.ndarray,
                   head_bow: np.ndarray, k: int) -> list[Hit]:
        """Re-ranked head by `w·cls + (1−w)·bow`, then the rest in CLS order, k in all."""
        valid = ann_docs >= 0
        ann_scores, ann_docs = ann_scores[valid], ann_docs[valid]
        head_n = len(rerank)
        combined = self.weight * head_cls + (1 - self.weight) * head_bow
        order = np.argsort(-combined, kind="stable")
        hits = [
            Hit(doc_id, float(combined[j]), float(head_cls[j]), float(head_bow[j]))
            for doc_id, j in zip(self.ids.external(rerank[order[:k]]), order[:k])
        ]
        tail = slice(head_n, min(len(ann_docs), k))
        if tail.start < tail.stop:
            tail_cls = ann_scores[tail]
            # Below the re-ranked head, keep CLS order; scores stay under the head's and fall
            # strictly (a 1e-6 step per rank, so w = 0 or equal CLS scores cannot tie), so tools
            # that sort by score (trec_eval) see the same ranking.
            floor = float(combined.min()) if head_n else float(tail_cls[0])
            steps = np.arange(1 if head_n else 0, len(tail_cls) + (1 if head_n else 0), dtype=np.float64) * 1e-6
            tail_scores = floor - self.weight * (float(tail_cls[0]) - tail_cls) - steps
            hits += [
                Hit(doc_id, float(s), float(c), None)
                for doc_id, s, c in zip(self.ids.external(ann_docs[tail]), tail_scores, tail_cls)
            ]
        return hits

    # -- reference -------------------------------------------------------------------
    def score_documents(self, queries: QueryEmbeddings, doc_numbers: np.ndarray) -> np.ndarray:
        """[2, B, n] float32: exact CLS and MaxSim of every query against documents `doc_numbers` [n]."""
        numbers = np.asarray(doc_numbers, dtype=np.int64)
        n_docs, batch = self.num_documents, len(queries)
        if len(numbers) == 0:
            return np.zeros((2, batch, 0), dtype=np.float32)
        tensors = QueryScoring.from_arrays(np.ascontiguousarray(queries.cls, dtype=np.float32), queries.bow, queries.mask)
        keys = (np.arange(batch, dtype=np.int64)[:, None] * n_docs + numbers).ravel()
        with self.reader.submit(np.unique(numbers)).records() as records:
            return self._score_pairs(tensors, records, keys, n_docs).reshape(2, batch, len(numbers))

    def search_maxsim_exhaustive(self, queries: QueryEmbeddings, k: int, block: int = 4096) -> list[list[Hit]]:
        """Brute-force MaxSim reference: every live document read and scored, the top k kept
        (score `w·cls + (1−w)·bow` as every search's). What a first stage is measured against."""
        batch = len(queries)
        best = [(np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32)) for _ in range(batch)]
        for start in range(0, self.num_documents, block):
            numbers = np.arange(start, min(start + block, self.num_documents), dtype=np.int64)
            if self.live is not None:
                numbers = numbers[self.live[numbers]]
            if len(numbers) == 0:
                continue
            scored = self.score_documents(queries, numbers)
            for i in range(batch):
                docs = np.concatenate([best[i][0], numbers])
                cls, bow = np.concatenate([best[i][1], scored[0, i]]), np.concatenate([best[i][2], scored[1, i]])
                combined = self.weight * cls + (1 - self.weight) * bow
                keep = np.argsort(-combined, kind="stable")[:k]
                best[i] = (docs[keep], cls[keep], bow[keep])
        return [self._aggregate(np.zeros(len(d), np.float32), d, d, c, b, k) for d, c, b in best]

    def search_exhaustive(self, queries: QueryEmbeddings, k: int, rerank_count: int = 1000,
                          block: int = 65536, allowed: np.ndarray | None = None) -> list[list[Hit]]:
        """Brute-force reference: exact CLS over every document (or the `allowed` [N] bool ones),
        MaxSim over the top `rerank_count`. Deleted and replaced documents are never allowed."""
        if self.live is not None:
            allowed = self.live if allowed is None else allowed & self.live
        xq = torch.from_numpy(np.ascontiguousarray(queries.cls, dtype=np.float32))
        keep = max(k, rerank_count)
        best_scores = torch.full((len(queries), 0), float("-inf"))
        best_docs = torch.zeros((len(queries), 0), dtype=torch.int64)
        for start in range(0, self.num_documents, block):
            numbers = np.arange(start, min(start + block, self.num_documents))
            if allowed is not None:
                numbers = numbers[allowed[numbers]]
                if len(numbers) == 0:
                    continue
            cls = self.reader.read(numbers).cls.float().cpu()
            scores = torch.cat([best_scores, xq @ cls.T], dim=1)
            merged = torch.cat([best_docs, torch.from_numpy(numbers).expand(len(queries), -1)], dim=1)
            best_scores, idx = scores.topk(min(keep, scores.shape[1]), dim=1)
            best_docs = merged.gather(1, idx)
        tensors = QueryScoring.from_arrays(queries.cls, queries.bow, queries.mask)
        n_docs = self.num_documents
        head = best_docs[:, : min(rerank_count, best_docs.shape[1])].numpy()
        if head.shape[1] == 0:
            return [[] for _ in range(len(queries))]
        keys = (np.arange(len(queries))[:, None] * n_docs + head).ravel()
        docs = np.unique(head)
        with self.reader.submit(docs).records() as records:
            scored = self._score_pairs(tensors, records, keys, n_docs).reshape(2, *head.shape)
        return [self._aggregate(best_scores[i].numpy(), best_docs[i].numpy(), head[i], scored[0, i], scored[1, i], k)
                for i in range(len(queries))]


@dataclasses.dataclass
class _Wave:
    """A wave re-ranked early: the (query, doc) keys it took and the worker reading and scoring them."""

    keys: np.ndarray
    future: Future
    owned: RecordBatch | None = None  # read before the wave: released by the worker, or here if it never ran

    def finish(self) -> tuple[tuple[int, int], np.ndarray]:
        """(bytes read, ios) and the wave's pair scores [2, len(keys)]; re-raises a worker failure."""
        cost, scores = self.future.result()
        return cost, scores

    def discard(self) -> None:
        """Wait for the wave without using it (its search failed), logging its own error."""
        if self.future.cancel():
            if self.owned is not None:
                self.owned.release()
        elif self.future.exception() is not None:
            log.warning("a prefetch wave failed while its search was being abandoned",
                        exc_info=self.future.exception())


def _extra_keys(extra: Sequence[np.ndarray] | None, n_docs: int) -> np.ndarray:
    """Sorted unique (query · N + doc) keys of the extra documents per query."""
    if not extra:
        return np.zeros(0, dtype=np.int64)
    keys = [i * n_docs + np.asarray(docs, dtype=np.int64) for i, docs in enumerate(extra)]
    return np.unique(np.concatenate(keys)) if keys else np.zeros(0, dtype=np.int64)


def _share(total: int, i: int, n: int) -> int:
    """Split a batch total over its queries so that per-query numbers add up to it."""
    return total // n + (1 if i < total % n else 0)
