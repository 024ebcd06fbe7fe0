"""What a search reads: one generation's opened parts, handed to every stage explicitly.

A `SearchContext` is built once per generation (`espn.search.generation.open_context`) and
passed to the dense pipeline, the centroid first stage, the lexical and hybrid modes,
explain, the filter cache and the exhaustive references. They take what they need from it
and nothing else: none of them sees the `Searcher`, so none reaches into it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import faiss
import numpy as np

from ..encoders import Encoder, QueryEmbeddings
from ..errors import InvalidParameterError
from ..first_stage.centroids import FirstStageConfig, TokenCentroids
from ..index import DocStore, IdMap, IndexDirectory
from ..metadata import MetadataColumns, SegmentedColumns
from ..prefetch import PrefetchModel
from ..generation.segments import LiveView, RecordTable, SegmentedDocStore, SegmentedIdMap
from ..store import Reader
from ..store.format import StoreLayout
from ..store.projection import project
from ..text.engine import TextIndex
from .validation import check_texts

__all__ = ["SearchContext", "Timer"]


@dataclasses.dataclass(eq=False)
class SearchContext:
    """One generation's state as the search stages read it (shared by concurrent searches).

    records [N] structured (offset, length, n_bow); live [N] bool, the documents not deleted
    or replaced (None: all), ANDed into every search, with `live_selector` its FAISS form,
    packed once per generation; list_sizes [nlist] int64, codes per IVF list.
    """

    #: the index directory (a live index's base) and the live-index generation served (None: no live index)
    index: IndexDirectory
    view: LiveView | None
    manifest: Mapping[str, Any]
    layout: StoreLayout
    records: np.ndarray | RecordTable
    ann: faiss.IndexIVF
    ids: IdMap | SegmentedIdMap
    docs: DocStore | SegmentedDocStore
    live: np.ndarray | None
    live_selector: faiss.IDSelector | None
    live_count: int
    list_sizes: np.ndarray
    reader: Reader
    #: the score `weight · cls + (1 − weight) · bow`; bow_reduction "mean" divides MaxSim by Lq
    weight: float
    bow_reduction: str
    encoder: Encoder | None
    #: fast tokenizers refuse concurrent calls that change padding ("Already borrowed")
    tokenizer_lock: threading.Lock
    #: the prefetch workers (early waves, hybrid's lexical side), shared by a live index's generations
    pool: ThreadPoolExecutor
    #: what waves cost and win, measured as searches go (`espn.prefetch`)
    prefetch: PrefetchModel
    #: re-rank waves on a worker while the ANN scans (pays where MaxSim runs on a GPU)
    early_rerank: bool
    metadata: MetadataColumns | SegmentedColumns
    #: the generation's full-text index (None: the index has none)
    text: TextIndex | None
    #: the candidate generator and, for the centroid first stage, its index (None: not built)
    first_stage: FirstStageConfig
    centroids: TokenCentroids | None
    #: the projection the base stores its token vectors through ([model dim, stored dim]; None:
    #: none), which a query's go through too (espn.store.projection)
    projection: np.ndarray | None = None

    @property
    def num_documents(self) -> int:
        """Doc numbers in use (in a live index, deleted and replaced ones included)."""
        return int(len(self.records))

    @property
    def nlist(self) -> int:
        return int(self.ann.nlist)

    def encode(self, queries: Sequence[str]) -> QueryEmbeddings:
        """Encode query texts with the index's encoder (tokenised and run as one batch)."""
        check_texts(queries)
        if self.encoder is None:
            raise InvalidParameterError("this Searcher was opened without an encoder; use search_embeddings")
        with self.tokenizer_lock:
            tokens = self.encoder.tokenize(list(queries), is_query=True)
        return self.as_stored(self.encoder.embed_queries(tokens))

    def as_stored(self, queries: QueryEmbeddings) -> QueryEmbeddings:
        """Queries in the space the records are stored in: the model's own vectors through the
        base's projection where it has one; others as they are (check_embeddings judges them)."""
        if self.projection is None or queries.bow.shape[-1] != len(self.projection):
            return queries
        return dataclasses.replace(queries, bow=project(queries.bow, self.projection))


class Timer:
    """Milliseconds per pipeline stage: `lap(stage)` adds the time since the previous lap."""

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
