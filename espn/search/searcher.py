"""`Searcher`: one opened index generation, the facade the server, the CLI and the
benchmarks call. It opens the generation (`espn.search.generation`), checks each call's
arguments (`espn.search.validation`, `espn.params`) and runs the stages over the
generation's `SearchContext`: `espn.search.dense` (candidates -> prefetch waves -> re-rank
-> aggregate), `espn.search.modes` (lexical, hybrid), `espn.search.explain`, the filter
cache and the exhaustive references. It holds no retrieval logic of its own.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import faiss
import numpy as np
import torch

from ..encoders import Encoder, QueryEmbeddings, load_encoder
from ..encoders.base import reads_pages
from ..encoders.precomputed import PrecomputedEncoder
from ..errors import DocumentNotFoundError, InvalidParameterError
from ..first_stage.centroids import FirstStageConfig, TokenCentroids
from ..index import DocStore, IdMap, IndexDirectory
from ..metadata import MetadataColumns, SegmentedColumns
from ..pages.images import media_type, thumbnail
from ..params import SearchParams
from ..prefetch import PrefetchEstimates
from ..results import Document, Hit, QueryResult
from ..generation.format import current_token
from ..generation.segments import LiveView, RecordTable, SegmentedDocStore, SegmentedIdMap, open_view
from ..pages.stored import open_index_images
from ..store import Reader
from ..store.format import StoreLayout
from ..text.engine import TextIndex
from ..text.query import parse_query
from .context import Timer
from .dense import search_dense
from .exhaustive import score_documents, search_exhaustive, search_maxsim_exhaustive
from .explain import can_explain, explain_results
from .long_queries import mark_truncated
from .filter_cache import CompiledFilters
from .filtered import FilteredDocs
from .generation import GenerationResources, open_context
from ..params import HybridParams
from .lexical import require_text
from .modes import search_modes
from .validation import MAX_BATCH, MAX_QUERY_CHARS, check_embeddings, check_explain, check_texts

__all__ = ["Searcher", "MAX_QUERY_CHARS", "MAX_BATCH"]

log = logging.getLogger(__name__)


class Searcher:
    """One opened index, safe to share between threads. Open with `Searcher.open(path)`."""

    def __init__(self, index: IndexDirectory, encoder: Encoder | None, reader_name: str | None = None,
                 device: str | None = None, prefetch_threads: int = 4, early_rerank: bool | None = None,
                 reader_options: Mapping[str, Any] | None = None, min_hidden_ms: float = 0.2,
                 filter_cache_bytes: int = 512 << 20, view: LiveView | None = None,
                 token: tuple[int, int] = (0, 0)) -> None:
        """view: a generation of a live index (espn.generation.segments.open_view); `index` is its base.
        token: live/CURRENT's `current_token` when `view` was opened (`refresh` compares it)."""
        # A wave costs the scanning thread ~0.1 ms (bookkeeping, handing it to a prefetch
        # thread) and can only hide reads behind the scan still to come.
        if not (isinstance(min_hidden_ms, (int, float)) and min_hidden_ms >= 0):
            raise InvalidParameterError(f"min_hidden_ms must be a number >= 0, got {min_hidden_ms!r}")
        # Compiled filters (mask + the matches' own IVF), least recently used out first.
        self._filters = CompiledFilters(filter_cache_bytes)
        self.index, self.view, self.manifest, self.encoder = index, view, index.manifest, encoder
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.min_hidden_ms = float(min_hidden_ms)
        # Early re-ranking in the prefetch thread pays where MaxSim runs on a GPU. On a CPU it
        # would take cores from the ANN scan it overlaps, so there waves only read (I/O
        # releases the GIL and needs no core) and MaxSim runs once the ANN is done.
        early = self.device.startswith("cuda") if early_rerank is None else early_rerank
        self._resources = GenerationResources(view)
        try:
            self.context = open_context(index, view, encoder, self._resources, reader_name, reader_options or {},
                                        self.device, prefetch_threads, early, self.min_hidden_ms)
            self.defaults = SearchParams.from_manifest(self.manifest["search_defaults"]).validate(
                self.nlist, self.num_documents)
            #: The hybrid defaults (mode, fusion), from the manifest.
            self.hybrid_defaults = HybridParams.from_manifest(self.manifest.get("hybrid"))
        except BaseException:  # what this generation opened for itself closes with it
            self._resources.close()
            raise
        self._token = token
        #: What `refresh` opens the next generation with.
        self._reopen: dict[str, Any] = dict(
            reader_name=reader_name, device=device, prefetch_threads=prefetch_threads, early_rerank=early_rerank,
            reader_options=reader_options, min_hidden_ms=min_hidden_ms, filter_cache_bytes=filter_cache_bytes)

    @classmethod
    def open(cls, path: str | Path, reader: str | None = None, device: str | None = None, verify: str = "auto",
             with_encoder: bool = True, early_rerank: bool | None = None,
             reader_options: Mapping[str, Any] | None = None, min_hidden_ms: float = 0.2,
             filter_cache_bytes: int = 512 << 20, trust_remote_code: bool = False,
             encoder_loader: Callable[[Path, Mapping[str, Any]], Encoder] | None = None) -> "Searcher":
        """Open and validate an index. reader: posix, kvikio, mmap or memory (None = best available).

        reader_options go to the reader: for posix `io_engine` ("io_uring", "aio", "threads",
        None = best available), `io_depth`, `max_extent_bytes`, `direct`; for kvikio `nthreads`,
        `gds_threshold`, `task_size`, `bounce_buffer_size`, `compat_mode`, `max_extent_bytes`.
        min_hidden_ms: a prefetch wave is taken only when the time it is expected to save
        (`espn.prefetch.PrefetchModel`: reads the scan still to come hides, less the wave's
        own costs) is at least this (0: always).
        filter_cache_bytes: budget of the compiled-filter cache (masks and sub-indexes).
        trust_remote_code: let an index built with --trust-remote-code run its model's code
        (espn.encoders.load_encoder refuses it otherwise).
        encoder_loader: called with the index's `encoder/` directory and manifest entry instead of
        `espn.encoders.load_encoder` (a server holding several indexes of one model hands out
        the one it loaded; it checks trust_remote_code itself).
        """
        view = open_view(path, verify=verify)
        try:
            index = view.base
            encoder = None
            if with_encoder and encoder_loader is not None:
                encoder = encoder_loader(index.file("encoder"), index.manifest["encoder"])
            elif with_encoder:
                encoder = load_encoder(index.file("encoder"), index.manifest["encoder"], device=device,
                                       trust_remote_code=trust_remote_code)
            return cls(index, encoder, reader_name=reader, device=device, early_rerank=early_rerank,
                       reader_options=reader_options, min_hidden_ms=min_hidden_ms,
                       filter_cache_bytes=filter_cache_bytes, view=view, token=current_token(Path(path)))
        except BaseException:
            view.close()
            raise

    def published_token(self) -> tuple[int, int]:
        """The token of the generation published now (one stat of live/CURRENT); `refresh` opens
        a newer Searcher when it differs from this one's. This one's own without a live index."""
        return current_token(self.view.root) if self.view is not None else self._token

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
            return type(self)(view.base, self.encoder, **self._reopen, view=view, token=token)
        except BaseException:
            view.close()
            raise

    # -- what the generation holds (its SearchContext) ----------------------------------
    @property
    def layout(self) -> StoreLayout:
        return self.context.layout

    @property
    def records(self) -> np.ndarray | RecordTable:
        """[N] per document: byte offset, byte length, number of BOW vectors."""
        return self.context.records

    @property
    def ann(self) -> faiss.IndexIVF:
        """The FAISS IVF over CLS vectors."""
        return self.context.ann

    @property
    def ids(self) -> IdMap | SegmentedIdMap:
        return self.context.ids

    @property
    def docs(self) -> DocStore | SegmentedDocStore:
        return self.context.docs

    @property
    def live(self) -> np.ndarray | None:
        """[N] bool, the documents not deleted or replaced (None: all); ANDed into every search."""
        return self.context.live

    @property
    def reader(self) -> Reader:
        return self.context.reader

    @property
    def weight(self) -> float:
        """w of the score `w · cls + (1 − w) · bow`."""
        return self.context.weight

    @weight.setter
    def weight(self, value: float) -> None:
        self.context.weight = value

    @property
    def bow_reduction(self) -> str:
        return self.context.bow_reduction

    @property
    def early_rerank(self) -> bool:
        return self.context.early_rerank

    @property
    def metadata(self) -> MetadataColumns | SegmentedColumns:
        return self.context.metadata

    @property
    def text(self) -> TextIndex | None:
        """The generation's full-text index (None: the index has none)."""
        return self.context.text

    @property
    def first_stage(self) -> FirstStageConfig:
        """The candidate generator (espn.first_stage.centroids): the IVF over CLS vectors, or for models
        without a trained CLS vector the token-level centroid index."""
        return self.context.first_stage

    @property
    def centroids(self) -> TokenCentroids | None:
        return self.context.centroids

    @property
    def prefetch_estimates(self) -> PrefetchEstimates | None:
        """What the prefetch cost model has measured so far (`espn.prefetch`), for /metrics; None
        for a reader whose reads are CPU work (memory, mmap), which never takes a wave."""
        return self.context.prefetch.estimates if self.context.reader.io_bound else None

    @property
    def num_documents(self) -> int:
        """Doc numbers in use (in a live index, deleted and replaced ones included)."""
        return self.context.num_documents

    @property
    def searchable_documents(self) -> int:
        """Documents a search can find: deleted and replaced ones (numbered until a compaction) not counted."""
        return int(self.view.generation.live_documents) if self.view is not None else self.num_documents

    @property
    def generation(self) -> int:
        """The live-index generation this Searcher serves (0: never written to)."""
        return self.view.generation.number if self.view is not None else 0

    @property
    def nlist(self) -> int:
        return self.context.nlist

    @property
    def reader_name(self) -> str:
        return self.reader.name

    def close(self) -> None:
        """Release what this Searcher holds; what it shares with other generations closes with
        the last of them. Call it once no search runs on it (espn.search.live_searcher.LiveSearcher does)."""
        self._resources.close()
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
        union tune hybrid search (`espn.params.HybridParams`). syntax: how the lexical side
        reads the queries, "plain" text (default: never an operator, never an error) or
        "simple" (phrases, +required, -excluded; lenient, see `espn.text.query`).
        embeddings: these queries already encoded by `encode` (the server encodes concurrent
        requests of different parameters in one call); stage "encode" is then 0 here. In
        hybrid mode they must be the encodings of the queries' dense text (`dense_queries`).
        """
        check_explain(explain)
        hybrid = self.hybrid_params(mode, fusion, lexical_k, rrf_k, mix_weight, union, syntax)
        if explain and hybrid.mode != "lexical":
            can_explain(self.encoder)
        check_texts(queries)
        params = self.params(k, **overrides)
        filtered = self.filtered_docs(filter)
        if not queries:
            return []
        if embeddings is not None and len(embeddings) != len(queries):
            raise InvalidParameterError(f"embeddings hold {len(embeddings)} queries for {len(queries)} texts")
        if embeddings is not None:  # perhaps by an older generation's Searcher, before the projection was fitted
            embeddings = self.context.as_stored(embeddings)
        if hybrid.mode != "dense":
            return search_modes(self.context, queries, params, hybrid, filtered, explain, Timer(), embeddings)
        timer = Timer()
        if embeddings is None:
            embeddings = self.encode(queries)
        timer.lap("encode")
        results = mark_truncated(self.encoder, queries, embeddings,
                                 search_dense(self.context, embeddings, params, timer, filtered=filtered))
        return self._explain(queries, embeddings, results) if explain else results

    def check_request(self, hybrid: HybridParams, explain: bool = False) -> None:
        """What `search` in these modes would refuse on this index whatever the queries, raised
        now (InvalidParameterError): lexical or hybrid without a full-text index, explain with an
        encoder that cannot map its vectors back. A server checks a request before it queues, the
        CLI a run before its first batch."""
        if hybrid.mode != "dense":
            require_text(self.text, hybrid.mode)
        if explain and hybrid.mode != "lexical":
            can_explain(self.encoder)

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
        return self.context.encode(queries)

    def _explain(self, queries: Sequence[str], embeddings: QueryEmbeddings, results: list[QueryResult]) -> list[QueryResult]:
        started = time.perf_counter()
        results = explain_results(self.context, queries, embeddings, results)
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
        queries = self.context.as_stored(queries)
        check_embeddings(queries, self.layout)
        if hybrid.mode != "dense":
            if texts is None or len(texts) != len(queries):
                raise InvalidParameterError(f"mode {hybrid.mode!r} needs texts: one query string per embedding")
            return search_modes(self.context, texts, params, hybrid, filtered, False, Timer(), embeddings=queries)
        return search_dense(self.context, queries, params, Timer(), filtered=filtered)

    def filtered_docs(self, filter: Any) -> FilteredDocs | None:
        """A filter validated against this index's fields and compiled (cached per distinct filter).

        None for no filter (and for `{}`); a filter every document satisfies is searched unfiltered.
        Raises FilterError (an InvalidParameterError) naming the problem.
        """
        return self._filters.compiled(self.context, filter)

    def document(self, doc_id: str) -> Document:
        """The stored passage of an external id; raises DocumentNotFoundError."""
        return self.docs.document(doc_id, self.ids.internal(doc_id))

    def mean_document_bytes(self) -> float:
        """Mean stored bytes per passage of the base (title and text as JSON, docs.jsonl): what a
        response with the passages' text costs per hit, for a server's response-size budget."""
        return self.index.file("docs.jsonl").stat().st_size / max(1, self.num_documents)

    def page_image(self, doc_id: str, max_side: int | None = None) -> tuple[bytes, str]:
        """The stored image of a page (espn.pages.images) -> (bytes, media type), or with `max_side`
        a thumbnail at most that many px a side ([16, 1600], InvalidParameterError outside).
        DocumentNotFoundError for an unknown id and for a document stored without an image (a
        text index, a page indexed before images were kept)."""
        number = self.ids.internal(doc_id)
        data = open_index_images(self.index, self.view).of(number)
        if not data:
            raise DocumentNotFoundError(f"document {doc_id!r} has no stored page image"
                                        + ("" if self.is_page_index else " (this index holds text, not pages)"))
        if max_side is not None:
            data = thumbnail(data, max_side)
        return data, media_type(data)

    @property
    def is_page_index(self) -> bool:
        """Whether the index's documents are page images (a visual encoder's index)."""
        return reads_pages(self.manifest["encoder"])

    def warmup(self) -> None:
        """One search end to end, so the first user request pays no start-up cost.

        An index of precomputed embeddings has no tokenizer: a zero query warms it instead.
        """
        if self.encoder is not None and not isinstance(self.encoder, PrecomputedEncoder):
            # A lone query of a user's length, then a batch of two lengths: the query encoder
            # runs a batch in groups of similar length (espn.encoders.hf), a path no lone
            # query takes, and each new input shape sizes the encoder's buffers once.
            self.search(["how does the warm-up search prepare the query encoder"], k=1)
            self.search(["warm up", "how does the warm-up search prepare the query encoder for batches"], k=1)
            return
        d_cls, d_bow = self.layout.d_cls, self.layout.d_bow
        zero = QueryEmbeddings(np.zeros((1, d_cls), np.float32), np.zeros((1, 1, d_bow), np.float32), np.ones((1, 1), bool))
        self.search_embeddings(zero, k=1)

    # -- reference -------------------------------------------------------------------
    def score_documents(self, queries: QueryEmbeddings, doc_numbers: np.ndarray) -> np.ndarray:
        """[2, B, n] float32: exact CLS and MaxSim of every query against documents `doc_numbers` [n]."""
        return score_documents(self.context, self.context.as_stored(queries), doc_numbers)

    def search_maxsim_exhaustive(self, queries: QueryEmbeddings, k: int, block: int = 4096) -> list[list[Hit]]:
        """Brute-force MaxSim reference: every live document read and scored, the top k kept
        (score `w·cls + (1−w)·bow` as every search's). What a first stage is measured against."""
        return search_maxsim_exhaustive(self.context, self.context.as_stored(queries), k, block)

    def search_exhaustive(self, queries: QueryEmbeddings, k: int, rerank_count: int = 1000,
                          block: int = 65536, allowed: np.ndarray | None = None) -> list[list[Hit]]:
        """Brute-force reference: exact CLS over every document (or the `allowed` [N] bool ones),
        MaxSim over the top `rerank_count`. Deleted and replaced documents are never allowed."""
        return search_exhaustive(self.context, self.context.as_stored(queries), k, rerank_count, block, allowed)
