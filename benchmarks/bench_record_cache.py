"""Hot-record cache: hit rate, bytes read and latency against the plain posix reader.

    python -m benchmarks.bench_record_cache --index .espn/scifact-index --cache-mb 16
    python -m benchmarks.bench_record_cache --index /tmp/espn-synth --queries-npz /tmp/espn-synth.queries.npz --zipf 1.1

A stream of `--n` queries, batch 1, no prefetch (every read on the critical path): with
`--zipf S` query i of the set is drawn with probability ~ 1 / rank^S (a skewed stream, as
production traffic), else the set in order, repeated. The first `--warmup` queries of the
stream fill the cache and are not measured. Both configurations (cache off, cache on) see
the same stream; rounds alternate them. Reports the cache's hit rate over the measured
stream, mean KiB read per query and the median over rounds of each round's p50.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.bench_readers import encode_scifact_queries  # noqa: E402
from benchmarks.common import (SCIFACT, SCIFACT_INDEX, load_queries, machine, machine_line,  # noqa: E402
                               markdown_table, median, take_queries, write_results)


def stream(n_queries: int, length: int, zipf: float | None, seed: int = 0) -> np.ndarray:
    """[length] query rows: Zipf-ranked over a shuffled set, or the set repeated in order."""
    if not zipf:
        return np.resize(np.arange(n_queries), length)
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_queries + 1) ** zipf
    return rng.permutation(n_queries)[rng.choice(n_queries, size=length, p=weights / weights.sum())]


def run(searcher, queries, rows: np.ndarray, params: dict) -> tuple[list[float], list[int]]:
    latencies, read = [], []
    for row in rows.tolist():
        t = time.perf_counter()
        out = searcher.search_embeddings(take_queries(queries, np.array([row])), **params)
        latencies.append((time.perf_counter() - t) * 1000)
        read.append(out[0].stats.bytes_read)
    return latencies, read


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, default=SCIFACT_INDEX)
    p.add_argument("--queries", type=Path, default=SCIFACT / "queries.jsonl")
    p.add_argument("--qrels", type=Path, default=SCIFACT / "qrels" / "test.tsv")
    p.add_argument("--queries-npz", type=Path)
    p.add_argument("--cache-mb", type=float, default=16)
    p.add_argument("--zipf", type=float, default=None, help="Zipf exponent of the query stream (default: in order)")
    p.add_argument("--n", type=int, default=600, help="measured queries per round")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=100)
    args = p.parse_args(argv)

    from espn import Searcher
    from espn.corpus import read_qrels

    plain = Searcher.open(args.index, reader="posix", verify="none", with_encoder=args.queries_npz is None)
    if args.queries_npz is not None:
        queries = load_queries(args.queries_npz)
    else:
        _, queries = encode_scifact_queries(plain, args.queries, read_qrels(args.qrels) if args.qrels.is_file() else None)
    rows = stream(len(queries.cls), args.warmup + args.n, args.zipf)
    params = {"k": args.k, "prefetch": False}
    cells: dict[str, dict[str, list[float]]] = {"off": {"p50": [], "kib": []}, "on": {"p50": [], "kib": []}}
    hit_rates = []
    for _ in range(args.repeats):
        cached = Searcher.open(args.index, reader="posix", verify="none", with_encoder=False,
                               reader_options={"record_cache_mb": args.cache_mb})
        for name, searcher in (("off", plain), ("on", cached)):
            run(searcher, queries, rows[: args.warmup], params)
            before = searcher.reader.describe().get("record_cache", {"requests": 0, "hits": 0})
            lat, read = run(searcher, queries, rows[args.warmup:], params)
            cells[name]["p50"].append(float(np.percentile(lat, 50)))
            cells[name]["kib"].append(float(np.mean(read)) / 1024)
            if name == "on":
                after = searcher.reader.describe()["record_cache"]
                hit_rates.append((after["hits"] - before["hits"]) / max(1, after["requests"] - before["requests"]))
                footprint = after["bytes"]
        cached.close()
    plain.close()
    load = os.getloadavg()
    table = markdown_table(["record cache", "hit rate", "KiB read per query", "p50 ms"],
                           [["off", "", median(cells["off"]["kib"]), median(cells["off"]["p50"])],
                            [f"{args.cache_mb:g} MiB ({footprint / 2**20:.1f} MiB held)", median(hit_rates),
                             median(cells["on"]["kib"]), median(cells["on"]["p50"])]])
    info = machine()
    print(f"Index {args.index}; stream of {args.n} queries (+{args.warmup} warm-up) from {len(queries.cls)}, "
          f"{'Zipf ' + str(args.zipf) if args.zipf else 'in order, repeated'}; batch 1, k={args.k}, posix, no prefetch; "
          f"{args.repeats} rounds; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}. "
          f"Machine: {machine_line(info)}\n\n{table}")
    write_results("record_cache", {"machine": info, "index": str(args.index), "cells": cells, "hit_rates": hit_rates,
                                   "table_md": table, "load": load})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
