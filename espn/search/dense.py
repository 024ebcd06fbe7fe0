"""The dense pipeline, stage by stage: select -> candidates -> scan with prefetch waves ->
re-rank -> aggregate `w · cls + (1 − w) · bow` over the re-ranked top.

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
on, as in the paper (`espn.search.waves`). `prefetch=False` is the sequential reference
path; all paths give the same ranking.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import faiss
import numpy as np

from ..ann import bitmap_selector, coarse_assign, merge_topk, search_preassigned, segment_bounds
from ..encoders import QueryEmbeddings
from ..maxsim import QueryScoring
from ..params import SearchParams
from ..prefetch import ScanProgress, segment_codes
from ..results import QueryResult, SearchStats
from ..store import PendingRead
from .centroid_stage import search_centroids
from .context import SearchContext, Timer
from .filtered import FilteredDocs, probe_matching
from .scoring import ExtraDocs, Scored, rank_hits, score_pairs, share
from .waves import EarlyWave, start_early_wave

__all__ = ["search_dense", "select_documents", "probe_candidates", "scan_with_waves", "rerank_head",
           "aggregate_results", "Probe", "DenseScan", "Head"]

log = logging.getLogger(__name__)



def search_dense(context: SearchContext, q: QueryEmbeddings, params: SearchParams, timer: Timer,
                 allowed: np.ndarray | None = None, filtered: FilteredDocs | None = None,
                 extra: ExtraDocs | None = None,
                 pools: list[Scored] | None = None) -> list[QueryResult]:
    """One QueryResult per query of `q` (cls [B, d_cls], bow [B, L, d_bow], mask [B, L]).

    allowed: [N] bool, the documents a search may return (None: all); applied inside
    FAISS, so excluded documents are never read, re-ranked or counted against k.
    filtered: a compiled filter (`espn.search.filter_cache`), ANDed with `allowed`: the search
    runs over its sub-index, probing lists until it has scanned as many matches as the
    unfiltered search scans codes (`espn.search.filtered`).
    extra: a future of (per query, doc numbers to score besides the re-ranked head; those
    documents read already, or None to read them): hybrid search's lexical side, still
    running when the scan starts. As soon as it is done a worker scores them while the
    scan goes on (the scan takes one core, so this is work the other core hides); those
    that make the head are not read or scored again.
    pools: filled with one Scored per query: the head and the extra documents, exact CLS
    and MaxSim (`espn.search.modes` fuses them)."""
    stage = context.first_stage.replace(params.first_stage, params.first_stage_probe, params.first_stage_candidates)
    if stage.scores_every_candidate:
        return search_centroids(context, q, params, stage, timer, allowed, filtered, extra, pools)
    restricted = filtered if filtered is not None and filtered.matches < context.live_count else None
    selector = select_documents(context, allowed, restricted)
    xq = np.ascontiguousarray(q.cls, dtype=np.float32)
    queries = QueryScoring.from_arrays(xq, q.bow, q.mask)
    probe = probe_candidates(context, xq, params, restricted)
    timer.lap("quantizer")
    scan = DenseScan(context, queries, len(q), extra)
    try:
        scan_with_waves(scan, xq, probe, params, selector)
        timer.lap("ann")
        head = rerank_head(scan, params, timer)
    finally:  # a failure part-way: no read may outlive the search, nor hide its error
        scan.abandon()
    return aggregate_results(scan, head, probe, params, filtered, restricted, timer, pools)


# -- select ----------------------------------------------------------------------------
def select_documents(context: SearchContext, allowed: np.ndarray | None,
                     restricted: FilteredDocs | None) -> faiss.IDSelector | None:
    """The selector FAISS applies inside the scan (None: every document of the scanned index).
    Deleted and replaced documents are out whatever the caller allows; a filter's mask and
    sub-index exclude them already."""
    if allowed is not None:
        if context.live is not None:
            allowed = allowed & context.live
        if restricted is not None and restricted.ivf is None:
            allowed = allowed & restricted.mask
        return bitmap_selector(allowed)
    if restricted is None:
        return context.live_selector
    if restricted.ivf is None:
        return bitmap_selector(restricted.mask)
    return None  # the sub-index holds the filter's live matches only


# -- candidates ------------------------------------------------------------------------
@dataclasses.dataclass
class Probe:
    """What the coarse quantizer chose: per query the lists to scan [B, p] and their
    scores, best first; the codes per list the scan sees; the index scanned (the full IVF
    or a filter's sub-index); exact [B] bool, the queries whose filter matches all fit."""

    ann: faiss.IndexIVF
    coarse_scores: np.ndarray
    lists: np.ndarray
    sizes: np.ndarray
    exact: np.ndarray


def probe_candidates(context: SearchContext, xq: np.ndarray, params: SearchParams,
                     restricted: FilteredDocs | None) -> Probe:
    """The η = nprobe nearest lists per query; under a filter, lists in coarse order until
    as many matching codes as the unfiltered search would score (`probe_matching`)."""
    exact = np.zeros(len(xq), dtype=bool)
    if restricted is None:
        coarse_scores, lists = coarse_assign(context.ann, xq, params.nprobe)
        return Probe(context.ann, coarse_scores, lists, context.list_sizes, exact)
    all_scores, all_lists = coarse_assign(context.ann, xq, context.nlist)
    # The unfiltered search would score this many codes; scan as many matching ones.
    target = np.maximum(context.list_sizes[all_lists[:, : params.nprobe]].sum(axis=1), params.candidates)
    coarse_scores, lists, exact = probe_matching(all_scores, all_lists, restricted.list_counts, target)
    ann = restricted.ivf if restricted.ivf is not None else context.ann
    return Probe(ann, coarse_scores, lists, restricted.list_counts, exact)


# -- scan with prefetch waves ----------------------------------------------------------
class DenseScan:
    """One dense search in flight: its reads (the waves', then the misses'), the waves
    re-ranked early, the scan's running top and hybrid's extra documents."""

    def __init__(self, context: SearchContext, queries: QueryScoring, batch: int,
                 extra: ExtraDocs | None) -> None:
        self.context, self.queries, self.batch = context, queries, batch
        self.n_docs = context.num_documents
        self.rows = np.arange(batch, dtype=np.int64)[:, None] * self.n_docs
        self.group = PendingRead(context.reader)  # every read of this search: the waves, then the misses
        self.early: list[EarlyWave] = []  # waves read and re-ranked on a worker (GPU)
        self.n_waves = self.skipped = 0
        self.followed_model: bool | None = None  # whether the waves' arm searched (None: prefetch not in play)
        self.started = 0.0  # perf_counter at the start of the scan
        self.submitted = np.zeros(0, dtype=np.int64)  # sorted (query, doc) keys: query · N + doc
        self.top: tuple[np.ndarray, np.ndarray] = (np.zeros((batch, 0), np.float32), np.zeros((batch, 0), np.int64))
        self.extra = extra
        self.extra_keys = np.zeros(0, dtype=np.int64)
        self.extra_scores = np.zeros((2, 0), dtype=np.float32)
        self.extra_wave: EarlyWave | None = None

    def start_extra(self) -> None:
        """Score the extra documents on a worker, once they are known."""
        assert self.extra is not None
        docs, records = self.extra.result()
        self.extra, self.extra_keys = None, _extra_keys(docs, self.n_docs)
        if len(self.extra_keys):
            self.extra_wave = start_early_wave(self.context, self.extra_keys, self.n_docs, self.queries, records)
        elif records is not None:
            records.release()

    def abandon(self) -> None:
        """Discard whatever the search did not take: no read may outlive it, nor hide its error."""
        try:
            self.group.discard()
        except Exception:
            log.warning("a read failed while its search was being abandoned", exc_info=True)
        for wave in self.early:
            wave.discard()
        if self.extra_wave is not None:
            self.extra_wave.discard()
        extra = self.extra
        if extra is not None and not extra.cancel() and extra.exception() is None:
            _, unused = extra.result()  # waited for: its reads must not outlive the search
            if unused is not None:
                unused.release()


def scan_with_waves(scan: DenseScan, xq: np.ndarray, probe: Probe, params: SearchParams,
                    selector: faiss.IDSelector | None) -> None:
    """The ANN scan over the probed lists, δ clusters at a time, into `scan.top`. After each
    segment but the last a wave may submit the reads of the pairs that entered the top
    `wave_size` since the last wave, when the cost model expects it to pay. A search that can
    take no wave (prefetch off, a reader without I/O to hide, waves declined by the model) and
    has no lexical side to start mid-scan scans every list in one call."""
    context, prefetch = scan.context, scan.context.prefetch
    n_probe = probe.lists.shape[1]
    segments = segment_bounds(n_probe, params.prefetch_step)
    use_prefetch = (params.prefetch and params.wave_size > 0 and params.rerank_count > 0 and len(segments) > 1
                    and context.reader.io_bound)
    max_waves = params.prefetch_waves or len(segments)
    if use_prefetch:
        # The model's arm or plain reads (see espn.prefetch): judged by the time to the last read.
        use_prefetch = scan.followed_model = prefetch.may_wave()
        if not use_prefetch and not prefetch.waves_pay:
            scan.skipped += 1  # declined by the outcome check: /metrics counts it with the model's
    scan.started = time.perf_counter()
    if not use_prefetch and scan.extra is None:
        # No wave can be taken and nothing waits for the scan's progress: one call over every
        # probed list (each further call and merge cost ~30 us: 0.12 ms of a 0.37 ms SciFact scan).
        scan.top = search_preassigned(probe.ann, xq, params.candidates, probe.lists, probe.coarse_scores, selector)
        return
    progress = ScanProgress(segment_codes(probe.lists, probe.sizes, segments))
    for segment, (a, b) in enumerate(segments):
        if scan.extra is not None and scan.extra.done():
            scan.start_extra()
        part = search_preassigned(probe.ann, xq, params.candidates, probe.lists[:, a:b],
                                  probe.coarse_scores[:, a:b], selector)
        scan.top = merge_topk(scan.top, part, params.candidates)
        if not use_prefetch or b >= n_probe or scan.n_waves >= max_waves:
            continue
        scan_left = progress.left_ms(segment)
        if not prefetch.may_pay(scan_left):  # too little scan left to hide anything
            scan.skipped += 1
            continue
        head = scan.top[1][:, : params.wave_size]
        keys = (scan.rows + head)[head >= 0]
        new = keys[~np.isin(keys, scan.submitted)]
        if len(new) == 0:
            continue
        docs = np.unique(new % scan.n_docs)
        if not prefetch.wave_pays(scan_left, len(docs), int(context.records[docs]["length"].sum())):
            scan.skipped += 1
            continue
        scan.submitted = np.union1d(scan.submitted, new)
        scan.n_waves += 1
        if context.early_rerank:
            scan.early.append(start_early_wave(context, new, scan.n_docs, scan.queries))
        else:
            # Submitted from this thread: the engine has the reads in flight when submit
            # returns, the scan goes on, and they are reaped after it, here.
            started = time.perf_counter()
            scan.group.submit(docs)
            ended = time.perf_counter()
            prefetch.observe_submit(len(docs), (ended - started) * 1000)
            progress.waved(segment, len(docs), started, ended)
    slowdown = progress.slowdown()
    if slowdown is not None and not context.early_rerank:
        prefetch.observe_slowdown(*slowdown)


# -- re-rank ---------------------------------------------------------------------------
@dataclasses.dataclass
class Head:
    """The re-ranked top: rerank [B, r] doc numbers (-1: none), valid [B, r], final [F] the
    valid (query, doc) keys in rank order per query, and per final key its exact CLS and
    MaxSim (scores [2, F]) once `scored`; in_waves [F]: read by a wave."""

    rerank: np.ndarray
    valid: np.ndarray
    final: np.ndarray
    in_waves: np.ndarray
    scores: np.ndarray = dataclasses.field(init=False)
    scored: np.ndarray = dataclasses.field(init=False)
    bytes_read: int = 0
    ios: int = 0
    missed_bytes: int = 0

    def __post_init__(self) -> None:
        self.scores = np.zeros((2, len(self.final)), dtype=np.float32)
        self.scored = np.zeros(len(self.final), dtype=bool)


def rerank_head(scan: DenseScan, params: SearchParams, timer: Timer) -> Head:
    """Re-rank the scan's top `rerank_count`: submit the misses (what no wave read), take the
    early waves' and the extra documents' scores, reap every read, score the rest in place."""
    context = scan.context
    rerank = scan.top[1][:, : params.rerank_count]
    valid = rerank >= 0
    final = (scan.rows + rerank)[valid]  # every query's re-ranked keys, in rank order per query
    head = Head(rerank, valid, final, np.isin(final, scan.submitted))
    if scan.extra is not None:
        scan.start_extra()  # the lexical side's documents: known by now (BM25 ran beside the scan)
    in_extra = np.isin(final, scan.extra_keys)  # read and scored by the extra wave
    misses = np.unique(final[~head.in_waves & ~in_extra] % scan.n_docs)
    started = time.perf_counter()
    scan.group.submit(misses)  # in flight beside the waves' tails while early waves are collected
    in_flight = time.perf_counter()
    if context.reader.io_bound:
        context.prefetch.observe_submit(len(misses), (in_flight - started) * 1000)
    _collect_early_waves(scan, head)
    _collect_extra_wave(scan, head, in_extra)
    timer.lap("prefetch_wait")
    scan.group.wait()
    reaped = time.perf_counter()
    if scan.followed_model is not None:
        context.prefetch.observe_outcome(scan.followed_model, (reaped - scan.started) * 1000 / scan.batch)
    head.missed_bytes = int(context.records[misses]["length"].sum())
    if len(misses) and context.reader.io_bound:  # what the device took (after waves: or their tail, if later)
        context.prefetch.observe_read(head.missed_bytes, (reaped - in_flight) * 1000)
    timer.lap("miss_read")
    todo = np.flatnonzero(~head.scored)
    need = np.unique(final[todo] % scan.n_docs)
    # The final candidates' records where the reads left them: scored in place, not gathered.
    with scan.group.records(select=need) as records:
        head.bytes_read, head.ios = head.bytes_read + records.bytes_read, head.ios + records.ios
        timer.lap("gather")
        head.scores[:, todo] = score_pairs(context, scan.queries, records, final[todo], scan.n_docs)
    timer.lap("maxsim")
    return head


def _collect_early_waves(scan: DenseScan, head: Head) -> None:
    """The scores of the final keys that waves re-ranked on a worker (GPU)."""
    final = head.final
    final_sorted = np.argsort(final, kind="stable") if scan.early else final
    for wave in scan.early:
        (wave_bytes, wave_ios), wave_scores = wave.finish()
        head.bytes_read, head.ios = head.bytes_read + wave_bytes, head.ios + wave_ios
        wanted = np.isin(wave.keys, final)
        where = final_sorted[np.searchsorted(final, wave.keys[wanted], sorter=final_sorted)]
        head.scores[:, where] = wave_scores[:, wanted]
        head.scored[where] = True
    scan.early = []


def _collect_extra_wave(scan: DenseScan, head: Head, in_extra: np.ndarray) -> None:
    """The extra documents' scores: those in the head taken (read them no more), the rest kept."""
    if scan.extra_wave is None:
        return
    (extra_bytes, extra_ios), extra_scores = scan.extra_wave.finish()
    scan.extra_wave = None
    head.bytes_read, head.ios = head.bytes_read + extra_bytes, head.ios + extra_ios
    in_head = np.isin(scan.extra_keys, head.final)  # scored already: take them, read them no more
    where = np.flatnonzero(in_extra)
    head.scores[:, where] = extra_scores[:, in_head][:, np.argsort(np.argsort(head.final[where]))]
    head.scored[where] = True
    scan.extra_keys, scan.extra_scores = scan.extra_keys[~in_head], extra_scores[:, ~in_head]


# -- aggregate -------------------------------------------------------------------------
def aggregate_results(scan: DenseScan, head: Head, probe: Probe, params: SearchParams,
                      filtered: FilteredDocs | None, restricted: FilteredDocs | None, timer: Timer,
                      pools: list[Scored] | None) -> list[QueryResult]:
    """Rank each query's hits (`rank_hits`), fill hybrid's pools, and report the stats."""
    context, batch, n_docs = scan.context, scan.batch, scan.n_docs
    n_final = head.valid.sum(axis=1)
    prefetched = np.bincount(scan.submitted // n_docs, minlength=batch)
    hits_in_final = np.bincount(head.final[head.in_waves] // n_docs, minlength=batch)
    if scan.n_waves:
        context.prefetch.observe_waves(len(scan.submitted), int(head.in_waves.sum()), head.missed_bytes)
    missed = n_final - hits_in_final
    rerank, valid = head.rerank, head.valid
    cls_grid = np.full(rerank.shape, np.nan, dtype=np.float32)
    bow_grid = np.full(rerank.shape, np.nan, dtype=np.float32)
    cls_grid[valid], bow_grid[valid] = head.scores[0], head.scores[1]
    out = [rank_hits(context, scan.top[0][i], scan.top[1][i], rerank[i][valid[i]], cls_grid[i][valid[i]],
                     bow_grid[i][valid[i]], params.k) for i in range(batch)]
    if pools is not None:
        extra_query = scan.extra_keys // n_docs
        for i in range(batch):
            mine = extra_query == i
            pools.append((np.concatenate([rerank[i][valid[i]], scan.extra_keys[mine] % n_docs]),
                          np.concatenate([cls_grid[i][valid[i]], scan.extra_scores[0][mine]]),
                          np.concatenate([bow_grid[i][valid[i]], scan.extra_scores[1][mine]])))
    timer.lap("aggregate")
    stage_ms = timer.total()
    engine = context.reader.engine
    return [
        QueryResult(hits=hits, stats=SearchStats(
            stage_ms=stage_ms,
            hit_rate=float(hits_in_final[i] / n_final[i]) if n_final[i] else 1.0,
            bytes_read=share(head.bytes_read, i, batch), ios=share(head.ios, i, batch),
            prefetched=int(prefetched[i]), missed=int(missed[i]),
            read_amplification=float((prefetched[i] + missed[i]) / n_final[i]) if n_final[i] else 1.0,
            engine=engine, waves=scan.n_waves, waves_skipped=scan.skipped,
            matched=None if filtered is None else filtered.matches,
            filter_path=None if filtered is None else (
                "all" if restricted is None else "exact" if probe.exact[i] else "ivf")))
        for i, hits in enumerate(out)
    ]


def _extra_keys(extra: Sequence[np.ndarray] | None, n_docs: int) -> np.ndarray:
    """Sorted unique (query · N + doc) keys of the extra documents per query."""
    if not extra:
        return np.zeros(0, dtype=np.int64)
    keys = [i * n_docs + np.asarray(docs, dtype=np.int64) for i, docs in enumerate(extra)]
    return np.unique(np.concatenate(keys)) if keys else np.zeros(0, dtype=np.int64)
