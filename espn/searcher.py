"""The query pipeline: encode -> coarse quantizer -> ANN over cluster segments, with prefetch
waves reading the current top candidates while the ANN goes on -> read the misses ->
aggregate `w · cls + (1 − w) · bow` over the re-ranked top.

After every segment of δ clusters but the last, a wave takes the top `prefetch_k`
candidates found so far that no earlier wave took and reads them on a worker thread
(FAISS, torch and preadv release the GIL, so the ANN search really goes on). On a GPU
the wave also re-ranks them (MaxSim on the device); on a CPU MaxSim would take a core
from the ANN scan, so the waves only read and one MaxSim call scores what they read
once the ANN is done. Several waves instead of the paper's single one: the first
clusters hold few of the final candidates, and the later waves catch the rest off the
critical path. `prefetch=False` is the sequential reference path; all paths give the
same ranking.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .ann import coarse_assign, load_ivf, merge_topk, search_preassigned, segment_bounds
from .encoders import Encoder, QueryEmbeddings, load_encoder
from .errors import InvalidParameterError
from .index import DocStore, IdMap, IndexDirectory
from .maxsim import cls_scores, maxsim
from .params import SearchParams
from .results import Document, Hit, QueryResult, SearchStats
from .store import ReadBatch, open_reader
from .store.format import StoreLayout

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
                 reader_options: Mapping[str, Any] | None = None) -> None:
        self.index = index
        self.manifest = index.manifest
        self.encoder = encoder
        store = self.manifest["store"]
        self.layout = StoreLayout(store["d_cls"], store["d_bow"], store["block_size"])
        self.records = index.load_array("records.npy")
        self.ann = load_ivf(index.file("ann.faiss"))
        if self.ann.ntotal != index.num_documents or len(self.records) != index.num_documents:
            raise InvalidParameterError(f"{index.path}: ann/records/manifest disagree on the document count")
        self.ids = IdMap(index.load_array("ids.npy"), index.load_array("ids_sorted.npy"))
        self.docs = DocStore(index.file("docs.jsonl"), index.load_array("docs_offsets.npy"))
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.reader = open_reader(reader_name, index.file("embeddings.bin"), self.records, self.layout,
                                  device=self.device, **dict(reader_options or {}))
        score = self.manifest["score"]
        self.weight = float(score["w"])
        self.bow_reduction = score.get("bow_reduction", "mean")
        self.defaults = SearchParams.from_manifest(self.manifest["search_defaults"]).validate(
            self.nlist, self.num_documents)
        # Early re-ranking in the prefetch thread pays where MaxSim runs on a GPU. On a CPU it
        # would take cores from the ANN scan it overlaps, so there waves only read (I/O
        # releases the GIL and needs no core) and MaxSim runs once the ANN is done.
        self.early_rerank = self.device.startswith("cuda") if early_rerank is None else early_rerank
        self._pool = ThreadPoolExecutor(max_workers=prefetch_threads, thread_name_prefix="espn-prefetch")
        # Fast tokenizers refuse concurrent calls that change padding ("Already borrowed").
        self._tokenizer_lock = threading.Lock()

    @classmethod
    def open(cls, path: str | Path, reader: str | None = None, device: str | None = None, verify: str = "auto",
             with_encoder: bool = True, early_rerank: bool | None = None,
             reader_options: Mapping[str, Any] | None = None) -> "Searcher":
        """Open and validate an index. reader: posix, kvikio, mmap or memory (None = best available).

        reader_options go to the reader: for posix `io_engine` ("io_uring", "aio", "threads",
        None = best available), `io_depth`, `max_extent_bytes`, `direct`.
        """
        index = IndexDirectory.open(path, verify=verify)
        encoder = load_encoder(index.file("encoder"), index.manifest["encoder"], device=device) if with_encoder else None
        return cls(index, encoder, reader_name=reader, device=device, early_rerank=early_rerank,
                   reader_options=reader_options)

    # -- properties ------------------------------------------------------------------
    @property
    def num_documents(self) -> int:
        return self.index.num_documents

    @property
    def nlist(self) -> int:
        return int(self.ann.nlist)

    @property
    def reader_name(self) -> str:
        return self.reader.name

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.reader.close()

    def __enter__(self) -> "Searcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public search ---------------------------------------------------------------
    def params(self, k: int | None = None, **overrides: Any) -> SearchParams:
        """The defaults with per-call overrides, validated against this index."""
        return self.defaults.replace(k=k, **overrides).validate(self.nlist, self.num_documents)

    def search(self, queries: Sequence[str], k: int | None = None, **overrides: Any) -> list[QueryResult]:
        """Search a batch of query strings; one QueryResult per query, in order."""
        if isinstance(queries, str) or not isinstance(queries, Sequence):
            raise InvalidParameterError("queries must be a list of strings")
        if len(queries) > MAX_BATCH:
            raise InvalidParameterError(f"a batch holds at most {MAX_BATCH} queries, got {len(queries)}")
        for i, query in enumerate(queries):
            if not isinstance(query, str) or not query.strip():
                raise InvalidParameterError(f"query {i} must be a non-empty string")
            if len(query) > MAX_QUERY_CHARS:
                raise InvalidParameterError(f"query {i} has {len(query)} characters; at most {MAX_QUERY_CHARS}")
        params = self.params(k, **overrides)
        if not queries:
            return []
        if self.encoder is None:
            raise InvalidParameterError("this Searcher was opened without an encoder; use search_embeddings")
        timer = _Timer()
        with self._tokenizer_lock:
            tokens = self.encoder.tokenize(list(queries), is_query=True)
        embeddings = self.encoder.embed_queries(tokens)
        timer.lap("encode")
        return self._search(embeddings, params, timer)

    def search_embeddings(self, queries: QueryEmbeddings, k: int | None = None, **overrides: Any) -> list[QueryResult]:
        """Search queries encoded elsewhere: cls [B, d_cls], bow [B, L, d_bow], mask [B, L]."""
        params = self.params(k, **overrides)
        if queries.cls.ndim != 2 or queries.cls.shape[1] != self.layout.d_cls or queries.bow.shape[-1] != self.layout.d_bow:
            raise InvalidParameterError(
                f"query embeddings must have d_cls={self.layout.d_cls}, d_bow={self.layout.d_bow}; "
                f"got cls {queries.cls.shape}, bow {queries.bow.shape}")
        return self._search(queries, params, _Timer())

    def document(self, doc_id: str) -> Document:
        """The stored passage of an external id; raises DocumentNotFoundError."""
        return self.docs.document(doc_id, self.ids.internal(doc_id))

    def warmup(self) -> None:
        """One search end to end, so the first user request pays no start-up cost.

        An index of precomputed embeddings has no tokenizer: a zero query warms it instead.
        """
        from .encoders.precomputed import PrecomputedEncoder

        if self.encoder is not None and not isinstance(self.encoder, PrecomputedEncoder):
            self.search(["warm up"], k=1)
            return
        d_cls, d_bow = self.layout.d_cls, self.layout.d_bow
        zero = QueryEmbeddings(np.zeros((1, d_cls), np.float32), np.zeros((1, 1, d_bow), np.float32), np.ones((1, 1), bool))
        self.search_embeddings(zero, k=1)

    # -- the pipeline ----------------------------------------------------------------
    def _search(self, q: QueryEmbeddings, params: SearchParams, timer: _Timer) -> list[QueryResult]:
        batch = len(q)
        xq = np.ascontiguousarray(q.cls, dtype=np.float32)
        q_cls = torch.from_numpy(xq)
        q_bow = torch.from_numpy(np.ascontiguousarray(q.bow, dtype=np.float32))
        q_mask = torch.from_numpy(np.asarray(q.mask, dtype=bool))
        candidates = params.candidates
        coarse_scores, lists = coarse_assign(self.ann, xq, params.nprobe)
        timer.lap("quantizer")

        segments = segment_bounds(params.nprobe, params.prefetch_step)
        use_prefetch = params.prefetch and params.wave_size > 0 and params.rerank_count > 0 and len(segments) > 1
        waves: list[tuple[list[np.ndarray], Future]] = []
        submitted = [np.zeros(0, dtype=np.int64) for _ in range(batch)]
        top: tuple[np.ndarray, np.ndarray] = (np.zeros((batch, 0), np.float32), np.zeros((batch, 0), np.int64))
        for a, b in segments:
            part = search_preassigned(self.ann, xq, candidates, lists[:, a:b], coarse_scores[:, a:b])
            top = merge_topk(top, part, candidates)
            if use_prefetch and b < params.nprobe and len(waves) < (params.prefetch_waves or len(segments)):
                wave = []
                for i in range(batch):
                    current = top[1][i, : params.wave_size]
                    new = current[(current >= 0) & ~np.isin(current, submitted[i])]
                    submitted[i] = np.concatenate([submitted[i], new])
                    wave.append(new)
                task = self._score if self.early_rerank else self._read
                waves.append((wave, self._pool.submit(task, q_cls, q_bow, q_mask, wave)))
        timer.lap("ann")

        rerank = [row[row >= 0][: params.rerank_count] for row in top[1]]
        scored: list[list[Scored]] = [[] for _ in range(batch)]
        bytes_read = ios = 0
        fetched_waves: list[tuple[list[np.ndarray], _Fetched]] = []
        for wave, future in waves:
            outcome = future.result()  # re-raises a worker failure here
            if isinstance(outcome, _Fetched):
                fetched_waves.append((wave, outcome))
                fetched = outcome
            else:
                result, fetched = outcome
                for i in range(batch):
                    scored[i].append(result[i])
            bytes_read, ios = bytes_read + fetched.bytes_read, ios + fetched.ios
        timer.lap("prefetch_wait")
        # Read-only waves: score now, only what made the final list, in one MaxSim call.
        if fetched_waves:
            merged = _merge_fetched([fetched for _, fetched in fetched_waves])
            final = [np.concatenate([wave[i] for wave, _ in fetched_waves]) for i in range(batch)]
            final = [docs[np.isin(docs, rerank[i])] for i, docs in enumerate(final)]
            for i, item in enumerate(self._maxsim(q_cls, q_bow, q_mask, final, merged)):
                scored[i].append(item)
        timer.lap("prefetch_maxsim")

        misses = [docs[~np.isin(docs, submitted[i])] for i, docs in enumerate(rerank)]
        result, fetched = self._score(q_cls, q_bow, q_mask, misses)
        bytes_read, ios = bytes_read + fetched.bytes_read, ios + fetched.ios
        for i in range(batch):
            scored[i].append(result[i])
        timer.ms["miss_read"] = fetched.read_ms
        timer.lap("miss_maxsim")
        timer.ms["miss_maxsim"] -= fetched.read_ms

        out = []
        for i in range(batch):
            hits = self._aggregate(top[0][i], top[1][i], rerank[i], scored[i], params.k)
            n_final = len(rerank[i])
            hit_rate = float(np.isin(rerank[i], submitted[i]).sum() / n_final) if n_final else 1.0
            out.append((hits, hit_rate, len(submitted[i]), len(misses[i])))
        timer.lap("aggregate")
        stage_ms = timer.total()
        return [
            QueryResult(hits=hits, stats=SearchStats(
                stage_ms=stage_ms, hit_rate=hit_rate,
                bytes_read=_share(bytes_read, i, batch), ios=_share(ios, i, batch),
                prefetched=prefetched, missed=missed))
            for i, (hits, hit_rate, prefetched, missed) in enumerate(out)
        ]

    def _read(self, q_cls: torch.Tensor, q_bow: torch.Tensor, q_mask: torch.Tensor,
              docs: list[np.ndarray]) -> "_Fetched":
        """Read the union of every query's documents once (the query tensors are unused; the
        signature matches `_score` so either can be a prefetch task)."""
        union = np.unique(np.concatenate(docs)) if docs else np.zeros(0, np.int64)
        if len(union) == 0:
            return _Fetched(union, None, 0, 0, 0.0)
        started = time.perf_counter()
        data = self.reader.read(union)
        return _Fetched(union, data, data.bytes_read, data.ios, (time.perf_counter() - started) * 1000)

    def _maxsim(self, q_cls: torch.Tensor, q_bow: torch.Tensor, q_mask: torch.Tensor,
                docs: list[np.ndarray], fetched: "_Fetched") -> list[Scored]:
        """Exact CLS and MaxSim of each query's documents, all present in `fetched`."""
        empty = np.zeros(0, np.float32)
        scored: list[Scored] = []
        for i, mine in enumerate(docs):
            if len(mine) == 0 or fetched.data is None:
                scored.append((mine, empty, empty))
                continue
            data = fetched.data
            rows = torch.from_numpy(np.searchsorted(fetched.union, mine)).to(data.bow.device)
            bow = maxsim(q_bow[i], q_mask[i], data.bow[rows], data.mask[rows], self.bow_reduction)
            cls = cls_scores(q_cls[i], data.cls[rows])
            scored.append((mine, cls.cpu().numpy(), bow.cpu().numpy()))
        return scored

    def _score(self, q_cls: torch.Tensor, q_bow: torch.Tensor, q_mask: torch.Tensor,
               docs: list[np.ndarray]) -> tuple[list[Scored], "_Fetched"]:
        """Read, then score: per query (docs, cls, bow), and what the read cost."""
        fetched = self._read(q_cls, q_bow, q_mask, docs)
        return self._maxsim(q_cls, q_bow, q_mask, docs, fetched), fetched

    def _aggregate(self, ann_scores: np.ndarray, ann_docs: np.ndarray, rerank: np.ndarray,
                   scored: list[Scored], k: int) -> list[Hit]:
        """Re-ranked head by `w·cls + (1−w)·bow`, then the rest in CLS order, k in all."""
        valid = ann_docs >= 0
        ann_scores, ann_docs = ann_scores[valid], ann_docs[valid]
        head_n = len(rerank)
        docs = np.concatenate([s[0] for s in scored])
        cls = np.concatenate([s[1] for s in scored])
        bow = np.concatenate([s[2] for s in scored])
        where = {int(d): j for j, d in enumerate(docs)}  # a few hundred entries per query
        pick = np.array([where[int(d)] for d in rerank], dtype=np.int64)
        head_cls, head_bow = cls[pick], bow[pick]
        combined = self.weight * head_cls + (1 - self.weight) * head_bow
        order = np.argsort(-combined, kind="stable")
        hits = [
            Hit(doc_id, float(combined[j]), float(head_cls[j]), float(head_bow[j]))
            for doc_id, j in zip(self.ids.external(rerank[order[:k]]), order[:k])
        ]
        tail = slice(head_n, min(len(ann_docs), k))
        if tail.start < tail.stop:
            tail_cls = ann_scores[tail]
            # Below the re-ranked head, keep CLS order; scores stay under the head's so that
            # tools that sort by score (trec_eval) see the same ranking.
            floor = float(combined.min()) if head_n else float(tail_cls[0])
            tail_scores = floor - self.weight * (float(tail_cls[0]) - tail_cls) - (1e-6 if head_n else 0.0)
            hits += [
                Hit(doc_id, float(s), float(c), None)
                for doc_id, s, c in zip(self.ids.external(ann_docs[tail]), tail_scores, tail_cls)
            ]
        return hits

    # -- reference -------------------------------------------------------------------
    def search_exhaustive(self, queries: QueryEmbeddings, k: int, rerank_count: int = 1000,
                          block: int = 65536) -> list[list[Hit]]:
        """Brute-force reference: exact CLS over every document, MaxSim over the top `rerank_count`."""
        xq = torch.from_numpy(np.ascontiguousarray(queries.cls, dtype=np.float32))
        keep = max(k, rerank_count)
        best_scores = torch.full((len(queries), 0), float("-inf"))
        best_docs = torch.zeros((len(queries), 0), dtype=torch.int64)
        for start in range(0, self.num_documents, block):
            numbers = np.arange(start, min(start + block, self.num_documents))
            cls = self.reader.read(numbers).cls.float().cpu()
            scores = torch.cat([best_scores, xq @ cls.T], dim=1)
            docs = torch.cat([best_docs, torch.from_numpy(numbers).expand(len(queries), -1)], dim=1)
            best_scores, idx = scores.topk(min(keep, scores.shape[1]), dim=1)
            best_docs = docs.gather(1, idx)
        q_bow = torch.from_numpy(np.ascontiguousarray(queries.bow, dtype=np.float32))
        q_mask = torch.from_numpy(np.asarray(queries.mask, dtype=bool))
        results = []
        for i in range(len(queries)):
            ann_docs, ann_scores = best_docs[i].numpy(), best_scores[i].numpy()
            rerank = ann_docs[: min(rerank_count, len(ann_docs))]
            scored, _ = self._score(xq, q_bow, q_mask, [rerank if j == i else np.zeros(0, np.int64)
                                                              for j in range(len(queries))])
            results.append(self._aggregate(ann_scores, ann_docs, rerank, [scored[i]], k))
        return results


@dataclasses.dataclass
class _Fetched:
    """Documents read for one wave or for the misses: sorted doc numbers and their embeddings."""

    union: np.ndarray
    data: ReadBatch | None
    bytes_read: int
    ios: int
    read_ms: float


def _merge_fetched(parts: list[_Fetched]) -> _Fetched:
    """One sorted `_Fetched` from several waves' (their documents are disjoint)."""
    present = [p for p in parts if p.data is not None]
    if len(present) <= 1:
        return present[0] if present else parts[0]
    union = np.concatenate([p.union for p in present])
    batches = [p.data for p in present if p.data is not None]
    order_np = np.argsort(union, kind="stable")
    order = torch.from_numpy(order_np).to(batches[0].cls.device)
    # Flat form (vectors + offsets): each document's rows of the concatenated vectors, in sorted order.
    bases = np.cumsum([0] + [len(b.vectors) for b in batches[:-1]])
    starts = np.concatenate([b.offsets[:-1] - b.offsets[0] + base for b, base in zip(batches, bases)])
    counts = np.concatenate([b.n_bow for b in batches])[order_np]
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    gather = np.repeat(starts[order_np] - offsets[:-1], counts) + np.arange(offsets[-1])
    vectors = torch.cat([b.vectors for b in batches])
    data = ReadBatch(
        cls=torch.cat([b.cls for b in batches])[order],
        vectors=vectors[torch.from_numpy(gather).to(vectors.device)],
        offsets=offsets,
        bytes_read=sum(b.bytes_read for b in batches),
        ios=sum(b.ios for b in batches),
    )
    return _Fetched(union[order_np], data, data.bytes_read, data.ios, sum(p.read_ms for p in present))


def _share(total: int, i: int, n: int) -> int:
    """Split a batch total over its queries so that per-query numbers add up to it."""
    return total // n + (1 if i < total % n else 0)
