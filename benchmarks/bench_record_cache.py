"""Record cache admission: the hit rate of each policy on uniform and skewed query streams.

    python -m benchmarks.bench_record_cache --index .espn/pf/index --queries .espn/pf/queries.npz
    python -m benchmarks.bench_record_cache --index .espn/tok100k/index --queries .espn/tok100k/index.queries.npz

Each query's candidates are what the search asks its reader for: recorded once per query by
searching every query with a reader that notes each request (the memory reader underneath).
Streams of `--n` queries are then replayed through the record cache itself (`RecordCache` on
a private segment, the same lookup and admission code a server runs; the bytes admitted are
zeros, only which records are held matters), once per policy and budget:

- uniform: every query equally likely, drawn with replacement;
- zipf: "Zipf over topics": the queries clustered into `--topics` topics (k-means of their
  mean token vector), a topic drawn with probability ~ 1 / rank^`--zipf` (ranks shuffled),
  then a query of that topic uniformly.

The first `--warmup` queries of each stream fill the cache and are not counted. Reports the
share of records (and of bytes) served from the cache per policy, budget (of the record
table) and stream; the default policy (`espn.store.cache_policy.DEFAULT_POLICY`) is the one
these tables chose.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import load_queries, machine, machine_line, markdown_table, take_queries, write_results  # noqa: E402

BUDGETS = (0.05, 0.25, 0.5, 1.0)
STREAMS = ("uniform", "zipf")


def record_candidates(index: Path, queries: Any, k: int = 10) -> list[np.ndarray]:
    """[queries] the doc numbers each query's search asks its reader for (duplicates dropped)."""
    from espn import Searcher
    from espn.store import Reader
    from espn.store.pending import FetchPart

    asked: list[np.ndarray] = []

    class Noting(Reader):
        """The memory reader, noting every request (no waves: io_bound False, as the memory reader)."""

        name = "memory"
        io_bound = False

        def __init__(self, inner: Reader) -> None:
            super().__init__(inner.path, inner.records, inner.layout, inner.device)
            self.inner = inner

        def start_fetches(self, doc_numbers: np.ndarray) -> list[FetchPart]:
            asked.append(np.asarray(doc_numbers, dtype=np.int64))
            return self.inner.start_fetches(doc_numbers)

    out = []
    with Searcher.open(index, reader="memory", verify="none", with_encoder=False) as searcher:
        searcher.context.reader = Noting(searcher.context.reader)
        for row in range(len(queries.cls)):
            asked.clear()
            searcher.search_embeddings(take_queries(queries, np.array([row])), k=k)
            out.append(np.unique(np.concatenate(asked + [np.zeros(0, np.int64)])))
    return out


def topics_of(queries: Any, n_topics: int, seed: int = 0) -> np.ndarray:
    """[queries] topic of each query: k-means of the queries' mean token vectors."""
    import faiss

    mask = np.asarray(queries.mask, dtype=np.float32)
    means = (np.asarray(queries.bow, dtype=np.float32) * mask[:, :, None]).sum(1) / np.maximum(1, mask.sum(1))[:, None]
    means = np.ascontiguousarray(means / np.maximum(1e-6, np.linalg.norm(means, axis=1, keepdims=True)))
    kmeans = faiss.Kmeans(means.shape[1], min(n_topics, len(means)), niter=20, seed=seed, verbose=False)
    kmeans.train(means)
    return kmeans.index.search(means, 1)[1][:, 0]


def stream(kind: str, n_queries: int, length: int, topics: np.ndarray | None = None, zipf: float = 1.1,
           seed: int = 0) -> np.ndarray:
    """[length] query rows: uniform, or Zipf over topics (a topic by Zipf rank, then a query of it)."""
    rng = np.random.default_rng(seed)
    if kind == "uniform" or topics is None:
        return rng.integers(0, n_queries, size=length)
    names = np.unique(topics)
    weights = 1.0 / np.arange(1, len(names) + 1) ** zipf
    drawn = rng.permutation(names)[rng.choice(len(names), size=length, p=weights / weights.sum())]
    members = {t: np.flatnonzero(topics == t) for t in names.tolist()}
    return np.array([rng.choice(members[t]) for t in drawn.tolist()], dtype=np.int64)


def replay(records: np.ndarray, path: Path, candidates: list[np.ndarray], rows: np.ndarray, warmup: int,
           budget_bytes: int, policy: str) -> dict[str, float]:
    """Hit rates of a fresh cache over the stream `rows` (after `warmup` of them)."""
    from espn.store.record_cache import RecordCache

    offsets, lengths = np.asarray(records["offset"], np.int64), np.asarray(records["length"], np.int64)
    zeros = np.zeros(int(lengths.max()) * 2, dtype=np.uint8)
    cache = RecordCache.open(path, records, budget_bytes, None, policy)
    hits = asked = hit_bytes = asked_bytes = 0
    started = time.perf_counter()
    try:
        for i, row in enumerate(rows.tolist()):
            docs = candidates[row]
            hit, _, read = cache.lookup(docs, offsets[docs])
            cache.end_read(read)
            miss = docs[~hit]
            cache.admit(miss, offsets[miss], lengths[miss], zeros, np.zeros(len(miss), np.int64))
            if i >= warmup:
                hits, asked = hits + int(hit.sum()), asked + len(docs)
                hit_bytes, asked_bytes = hit_bytes + int(lengths[docs[hit]].sum()), asked_bytes + int(lengths[docs].sum())
        entries = cache.stats()["entries"]
    finally:
        cache.close()
    return {"hit_rate": hits / max(1, asked), "byte_hit_rate": hit_bytes / max(1, asked_bytes), "entries": entries,
            "ms_per_query": (time.perf_counter() - started) * 1000 / max(1, len(rows))}


def main(argv: list[str] | None = None) -> int:
    from espn.store.cache_policy import DEFAULT_POLICY, POLICIES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, required=True)
    p.add_argument("--queries", type=Path, default=None, help="query embeddings (.npz); default INDEX.queries.npz")
    p.add_argument("--n", type=int, default=3000, help="queries per stream, measured")
    p.add_argument("--warmup", type=int, default=1000, help="queries per stream that fill the cache first")
    p.add_argument("--topics", type=int, default=32)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="fractions of the record table")
    p.add_argument("--quick", action="store_true", help="300 + 100 queries per stream, two budgets")
    p.add_argument("--name", default="record_cache_policy")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.warmup, args.budgets = 300, 100, "0.05,0.5"
    queries = load_queries(args.queries or args.index.with_name(args.index.name + ".queries.npz"))
    records = np.load(args.index / "records.npy")
    table = int((args.index / "embeddings.bin").stat().st_size)
    started = time.perf_counter()
    candidates = record_candidates(args.index, queries)
    record_s = time.perf_counter() - started
    topics = topics_of(queries, args.topics)
    rows: list[list[Any]] = []
    cells: dict[str, dict[str, Any]] = {}
    for kind in STREAMS:
        order = stream(kind, len(candidates), args.warmup + args.n, topics, args.zipf)
        for fraction in [float(f) for f in args.budgets.split(",")]:
            for policy in POLICIES:
                got = replay(records, args.index / "embeddings.bin", candidates, order, args.warmup,
                             int(fraction * table), policy)
                cells[f"{kind}/{fraction:g}/{policy}"] = got
                rows.append([kind, f"{fraction:.0%}", policy + (" (default)" if policy == DEFAULT_POLICY else ""),
                             got["hit_rate"], got["byte_hit_rate"], got["entries"], got["ms_per_query"]])
    info = machine()
    table_md = markdown_table(["stream", "budget (of table)", "policy", "hit rate", "byte hit rate", "records held",
                               "replay ms/query"], rows)
    print(f"Index {args.index}: {len(records)} documents, {table / 2**20:.1f} MiB of records; {len(candidates)} "
          f"queries, {np.mean([len(c) for c in candidates]):.0f} records asked per query (recorded in {record_s:.1f} s); "
          f"streams of {args.n} queries after {args.warmup} warm-up; Zipf s={args.zipf} over {args.topics} topics. "
          f"Machine: {machine_line(info)}\n\n{table_md}")
    write_results(args.name, {"machine": info, "index": str(args.index), "cells": cells, "table_md": table_md,
                              "records_per_query": float(np.mean([len(c) for c in candidates]))})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
