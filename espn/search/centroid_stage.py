"""The first stages that score every candidate exactly, at query time: the centroid stages
(the index format and its build: `espn.first_stage.centroids`) and exact.

For models without a trained CLS vector: each query token's nearest centroids give
candidates (`TokenCentroids.candidates`), every candidate is read and scored with exact
MaxSim; "union" adds the IVF's top `rerank_count`. A live generation searches the base's
centroid index plus the postings of each delta segment, computed once per segment. "exact"
takes every live document as a candidate: the search of an index too small for a fitted
first stage (espn.live.fitting), which ranks as the brute-force reference does.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ..ann import bitmap_selector, coarse_assign, search_preassigned
from ..encoders import QueryEmbeddings
from ..errors import InvalidParameterError
from ..first_stage.centroids import FirstStageConfig, Postings, TokenCentroids, assign_documents, postings_from_pairs
from ..maxsim import QueryScoring
from ..params import MAX_CANDIDATES, SearchParams
from ..results import QueryResult, SearchStats
from ..generation.segments import LiveView, RecordTable
from ..store import PendingRead, Reader
from .context import SearchContext, Timer
from .filtered import FilteredDocs
from .scoring import ExtraDocs, Scored, rank_hits, score_pairs, share

__all__ = ["open_centroids", "search_centroids"]

#: shared(key, make, close): one object per live-index base (`GenerationResources.shared`)
Share = Callable[[str, Callable[[], Any], Callable[[Any], None]], Any]


def open_centroids(shared: Share, index_path: Path, view: LiveView | None, records: np.ndarray | RecordTable,
                   reader: Reader) -> TokenCentroids:
    """The base's centroid index (shared by every generation over the base) plus the postings
    of each delta segment, computed once per segment from its records (segments never change)."""
    base: TokenCentroids = shared("first-stage", lambda: TokenCentroids.open(index_path), lambda _: None)
    if view is None or not view.segments:
        return base
    extra: list[Postings] = []
    for name, segment in view.segments.items():
        first, stop = segment.info.first, segment.info.stop

        def make(first: int = first, stop: int = stop) -> Postings:
            return segment_postings(base, records, reader, first, stop)

        extra.append(view.shared.attached(f"first-stage:{name}", make, lambda _: None))
    return base.with_parts(extra)


def segment_postings(base: TokenCentroids, records: np.ndarray | RecordTable, reader: Reader, first: int,
                     stop: int, block: int = 4096) -> Postings:
    """centroid -> doc CSR of a delta's documents (first .. stop-1) against the base's centroids."""
    numbers = np.arange(first, stop, dtype=np.int64)
    numbers = numbers[records[numbers]["n_bow"] > 0]  # holes of merged deltas hold nothing
    pairs = [assign_documents(base.centroids, batch.vectors.float().cpu().numpy(), batch.offsets, part)
             for part in np.array_split(numbers, max(1, -(-len(numbers) // block)))
             for batch in [reader.read(part)] if len(part)]
    if not pairs:
        return postings_from_pairs(np.zeros(0, np.int64), np.zeros(0, np.int64), len(base.centroids))
    return postings_from_pairs(np.concatenate([c for c, _ in pairs]), np.concatenate([d for _, d in pairs]),
                               len(base.centroids))


def search_centroids(context: SearchContext, q: QueryEmbeddings, params: SearchParams, stage: FirstStageConfig,
                     timer: Timer, allowed: np.ndarray | None, filtered: FilteredDocs | None,
                     extra: ExtraDocs | None,
                     pools: list[Scored] | None) -> list[QueryResult]:
    """The centroid first stage, then exact MaxSim of every candidate read from the records.
    Same contract as `espn.search.dense.search_dense`.

    With a reader that waits on storage (`Reader.io_bound`) and `prefetch` on, each query's
    candidates may start reading as soon as the stage has ranked them, best estimate first:
    a batch's query in one read while the stage ranks the next, a single query in waves of
    `wave_size` scored while the later ones are still in flight. The prefetch model's
    outcome check (`espn.prefetch`) keeps this arm only while its searches are not slower
    than those that read every candidate in one read after the stage (the other arm, and
    prefetch=False). Both score the same candidates exactly, so they rank alike."""
    if stage.uses_centroids and context.centroids is None:
        raise InvalidParameterError(f"first_stage {stage.kind!r} needs a centroid index, and this index has "
                                    f"none (build it with `espn index --first-stage centroids`)")
    batch = len(q)
    xq = np.ascontiguousarray(q.cls, dtype=np.float32)
    queries = QueryScoring.from_arrays(xq, q.bow, q.mask)
    # Reads beside the stage, where the reader waits on storage and the outcome check
    # (`PrefetchModel.may_wave`) has not found them slower than one read after it.
    followed = context.prefetch.may_wave() if params.prefetch and params.wave_size > 0 and \
        context.reader.io_bound else None
    reads = CandidateReads(context, (params.wave_size if batch == 1 else MAX_CANDIDATES) if followed else 0)
    started = time.perf_counter()
    try:
        per_query = []
        for docs in centroid_candidates(context, q, xq, params, stage,
                                        _candidate_mask(context, allowed, filtered), timer):
            per_query.append(docs)
            reads.take(docs)
        reads.stage_ended()
        if extra is not None:  # hybrid's lexical documents: scored with the rest (read again: one read)
            extra_docs, extra_records = extra.result()
            if extra_records is not None:
                extra_records.release()
            per_query = [np.union1d(docs, np.asarray(more, dtype=np.int64))
                         for docs, more in zip(per_query, list(extra_docs) + [np.zeros(0, np.int64)] * batch)]
        for docs in per_query:
            reads.take(docs)
        scores = reads.score(queries, per_query, timer)
    except BaseException:
        reads.discard()
        raise
    if followed is not None:
        context.prefetch.observe_outcome(followed, (time.perf_counter() - started) * 1000 / batch)
    bounds = np.cumsum([0] + [len(d) for d in per_query])
    out = []
    for i, found in enumerate(per_query):
        cls_scores, bow_scores = scores[0, bounds[i]:bounds[i + 1]], scores[1, bounds[i]:bounds[i + 1]]
        out.append(rank_hits(context, np.zeros(len(found), np.float32), found, found, cls_scores, bow_scores,
                             params.k))
        if pools is not None:
            pools.append((np.asarray(found, dtype=np.int64), cls_scores, bow_scores))
    timer.lap("aggregate")
    stage_ms = timer.total()
    read = len(reads.submitted)
    return [QueryResult(hits=hits, stats=SearchStats(
        stage_ms=stage_ms, hit_rate=reads.prefetched / max(1, read), bytes_read=share(reads.bytes_read, i, batch),
        ios=share(reads.ios, i, batch), prefetched=share(reads.prefetched, i, batch),
        missed=share(read - reads.prefetched, i, batch), waves=reads.n_waves if reads.wave_size else 0,
        engine=context.reader.engine,
        matched=None if filtered is None else filtered.matches,
        filter_path=None if filtered is None else "all" if filtered.matches >= context.live_count else
        "exact" if stage.kind == "exact" else "centroids"))
        for i, hits in enumerate(out)]


#: Bytes of records one search holds in read buffers at once, where its reader reads into
#: buffers of its own (`Reader.reads_into_buffers`): a batch's candidates are read in waves of at
#: most half of it, the next read while one is scored. (One read of the candidates of 32 SciFact
#: queries held about 190 MB.)
READ_BYTES_IN_FLIGHT = 32 << 20


@dataclasses.dataclass
class _Wave:
    docs: np.ndarray  # sorted doc numbers
    nbytes: int  # the bytes of their records' blocks, at most
    read: PendingRead | None = None  # None: waiting for room under READ_BYTES_IN_FLIGHT


class CandidateReads:
    """The candidates' reads, in waves of documents in the order the stage ranked them, each
    scored as soon as it has arrived while the later ones are still in flight; within a wave, a
    record cache's hits are scored while its misses are read.

    `prefetched` counts the documents whose reads started while the stage was still ranking
    (the batch's later queries); with one query the waves overlap the scoring only."""

    def __init__(self, context: SearchContext, wave_size: int) -> None:
        self.context = context
        self.wave_size = wave_size  # 0: one read of every candidate, once the stage has ended
        self.waves: list[_Wave] = []
        self.bytes_cap = READ_BYTES_IN_FLIGHT if context.reader.reads_into_buffers else None
        self.in_flight = 0  # bytes of the waves started and not scored yet
        self.submitted = np.zeros(0, dtype=np.int64)  # sorted
        self.held: list[np.ndarray] = []  # wave_size 0: the candidates, read at the stage's end
        self.stage_over = False
        self.before_last_query = self.prefetched = self.bytes_read = self.ios = self.n_waves = 0

    def take(self, docs: np.ndarray) -> None:
        """Read the candidates not read yet (`docs` best first)."""
        docs = np.asarray(docs, dtype=np.int64)
        if self.wave_size == 0 and not self.stage_over:
            self.held.append(docs)
            return
        if not self.stage_over:
            self.before_last_query = len(self.submitted)
        new = docs[~np.isin(docs, self.submitted)]
        step = self.wave_size or max(1, len(new))
        for at in range(0, len(new), step):
            self._submit(np.unique(new[at: at + step]))

    def stage_ended(self) -> None:
        """The stage has ranked every query: what was read so far was read beside it."""
        self.prefetched = self.before_last_query  # the last query's reads started after the stage
        self.stage_over = True
        if self.held:
            held, self.held = self.held, []
            self.take(np.concatenate(held))

    def _submit(self, docs: np.ndarray) -> None:
        if not len(docs):
            return
        # What a read into a buffer takes: each record's whole blocks (at most 2 more than its bytes).
        lengths = np.asarray(self.context.records[docs]["length"], dtype=np.int64) + 2 * self.context.layout.block_size
        ends = np.cumsum(lengths)
        if self.bytes_cap is None or ends[-1] <= self.bytes_cap // 2:
            self.waves.append(_Wave(docs, int(ends[-1])))
        else:
            cuts = np.flatnonzero(np.diff((ends - 1) // (self.bytes_cap // 2))) + 1
            self.waves.extend(_Wave(part, int(size.sum()))
                              for part, size in zip(np.split(docs, cuts), np.split(lengths, cuts)))
        self.n_waves += 1
        self.submitted = np.union1d(self.submitted, docs)
        self._start_waiting()

    def _start_waiting(self) -> None:
        """Start the waiting waves, in order, while their bytes fit under the cap (at least one)."""
        for wave in self.waves:
            if wave.read is not None:
                continue
            if self.bytes_cap is not None and self.in_flight and self.in_flight + wave.nbytes > self.bytes_cap:
                return
            wave.read = self.context.reader.submit(wave.docs)
            self.in_flight += wave.nbytes

    def score(self, queries: QueryScoring, per_query: list[np.ndarray], timer: Timer) -> np.ndarray:
        """[2, P] exact CLS and MaxSim of every (query, candidate) pair in order, wave by wave."""
        n_docs = self.context.num_documents
        keys = np.concatenate([i * n_docs + np.asarray(docs, dtype=np.int64) for i, docs in enumerate(per_query)]
                              + [np.zeros(0, np.int64)])
        scores = np.zeros((2, len(keys)), dtype=np.float32)
        if not len(keys):
            return scores
        wave_docs = np.concatenate([wave.docs for wave in self.waves] + [np.zeros(0, np.int64)])
        wave_ids = np.repeat(np.arange(len(self.waves)), [len(wave.docs) for wave in self.waves])
        order = np.argsort(wave_docs, kind="stable")
        wave_of_key = wave_ids[order][np.searchsorted(wave_docs[order], keys % n_docs)]
        for index in range(len(self.waves)):
            self._start_waiting()  # this wave, if it waited, and the next ones that fit beside it
            wave = self.waves.pop(0)  # its read is handed over: released by its RecordBatch, whatever happens
            assert wave.read is not None
            picked = np.flatnonzero(wave_of_key == index)
            parts = wave.read.split_in_memory()  # a cache's hits first: scored while its misses are read
            try:
                while parts:
                    part_docs, read = parts.pop(0)
                    with read.records() as records:
                        timer.lap("miss_read")
                        self.bytes_read, self.ios = self.bytes_read + records.bytes_read, self.ios + records.ios
                        mine = picked if not parts and len(part_docs) == len(wave.docs) else \
                            picked[np.isin(keys[picked] % n_docs, part_docs)]
                        if len(mine):
                            scores[:, mine] = score_pairs(self.context, queries, records, keys[mine], n_docs)
                        timer.lap("maxsim")
            except BaseException:
                for _, read in parts:
                    read.discard()
                raise
            self.in_flight -= wave.nbytes
        return scores

    def discard(self) -> None:
        """A search that failed part-way: wait for its reads without using them."""
        waves, self.waves = self.waves, []
        for wave in waves:
            if wave.read is not None:
                wave.read.discard()


def _candidate_mask(context: SearchContext, allowed: np.ndarray | None,
                    filtered: FilteredDocs | None) -> np.ndarray | None:
    """[N] bool: live, allowed and matching the filter (None: every document)."""
    mask = context.live
    if allowed is not None:
        mask = allowed if mask is None else allowed & mask
    if filtered is not None and filtered.matches < context.live_count:
        mask = filtered.mask if mask is None else filtered.mask & mask
    return mask


def centroid_candidates(context: SearchContext, q: QueryEmbeddings, xq: np.ndarray, params: SearchParams,
                        stage: FirstStageConfig, mask: np.ndarray | None, timer: Timer) -> Iterator[np.ndarray]:
    """Per query, as each is ranked, the doc numbers to score, best estimate first: the centroid
    estimate's top, and for "union" the IVF's after them; for "exact", every document the mask admits."""
    if stage.kind == "exact":
        every = np.arange(context.num_documents, dtype=np.int64) if mask is None else np.flatnonzero(mask)
        for _ in range(len(q)):
            yield every
        timer.lap("first_stage")
        return
    assert context.centroids is not None
    labels = None
    if stage.kind == "union" and params.rerank_count > 0:
        selector = None if mask is None else (context.live_selector if mask is context.live
                                              else bitmap_selector(mask))
        coarse_scores, lists = coarse_assign(context.ann, xq, params.nprobe)
        _, labels = search_preassigned(context.ann, xq, params.rerank_count, lists, coarse_scores, selector)
        timer.lap("ann")
    depth = max(stage.candidates, params.k)
    ranked = context.centroids.iter_candidates(np.asarray(q.bow, dtype=np.float32), np.asarray(q.mask, dtype=bool),
                                               stage.probe, depth, mask, context.num_documents)
    for i, docs in enumerate(ranked):
        if labels is not None:
            found = labels[i][labels[i] >= 0]
            docs = np.concatenate([docs, found[~np.isin(found, docs)]])
        yield docs
    timer.lap("first_stage")
