"""Reads beside the centroid stage (waves scored as they arrive) against one read after it.

    python -m benchmarks.bench_centroid_reads --index .espn/pf/index --queries .espn/pf/queries.npz

The index: SciFact through a ColBERT checkpoint with the centroid first stage (the one
`benchmarks.bench_first_stage --model colbert` builds, with the build's default records);
the queries: their embeddings in an .npz (ids, cls, bow, mask), so encoding is excluded.
Per reader (posix, memory), one process measures both arms interleaved, round by round
(`prefetch=True` with the default wave size, `prefetch=False`): single-query p50 over the
first `--queries-n` queries, batch-32 throughput, bytes read per query, and whether the two
arms rank alike (they must: both score the same candidates exactly).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import machine, machine_line, markdown_table, median, write_results

ARMS = {"beside the stage": True, "after the stage": False}


def _queries(path: Path) -> Any:
    from espn.encoders import QueryEmbeddings

    stored = np.load(path)
    return QueryEmbeddings(stored["cls"], stored["bow"], stored["mask"])


def measure(index: Path, reader: str, queries: Any, n: int, rounds: int) -> dict[str, Any]:
    from espn import Searcher

    out: dict[str, Any] = {arm: {"single_ms": [], "batch_qps": [], "bytes": [], "hit_rate": []} for arm in ARMS}
    with Searcher.open(index, reader=reader, verify="none", with_encoder=False) as searcher:
        rankings: dict[str, list[list[str]]] = {}
        for arm, prefetch in ARMS.items():  # warm-up, and the rankings compared
            results = searcher.search_embeddings(queries[np.arange(min(n, len(queries)))], k=10, prefetch=prefetch)
            rankings[arm] = [[h.doc_id for h in r.hits] for r in results]
        for _ in range(rounds):
            for arm, prefetch in ARMS.items():
                times = []
                for i in range(n):
                    started = time.perf_counter()
                    result = searcher.search_embeddings(queries[np.arange(i, i + 1)], k=10, prefetch=prefetch)[0]
                    times.append((time.perf_counter() - started) * 1000)
                    out[arm]["bytes"].append(result.stats.bytes_read)
                out[arm]["single_ms"].append(median(times))
                started = time.perf_counter()
                done = 0
                for a in range(0, len(queries), 32):
                    results = searcher.search_embeddings(queries[np.arange(a, min(a + 32, len(queries)))], k=10,
                                                         prefetch=prefetch)
                    done += len(results)
                    out[arm]["hit_rate"].append(results[0].stats.hit_rate)
                out[arm]["batch_qps"].append(done / (time.perf_counter() - started))
    return {"alike": rankings["beside the stage"] == rankings["after the stage"],
            **{arm: {"single_p50_ms": median(v["single_ms"]), "batch32_qps": median(v["batch_qps"]),
                     "bytes_per_query": float(np.mean(v["bytes"])), "batch_hit_rate": median(v["hit_rate"]),
                     "rounds_single_ms": v["single_ms"], "rounds_qps": v["batch_qps"]}
               for arm, v in out.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, required=True)
    p.add_argument("--queries", type=Path, required=True, help=".npz of query embeddings (ids, cls, bow, mask)")
    p.add_argument("--queries-n", type=int, default=100, help="queries timed one by one per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    queries = _queries(args.queries)
    info = machine()
    results: dict[str, Any] = {"machine": info, "index": str(args.index), "readers": {}}
    rows = []
    for reader in ("posix", "memory"):
        got = measure(args.index, reader, queries, args.queries_n, args.rounds)
        results["readers"][reader] = got
        for arm in ARMS:
            rows.append([reader, arm, got[arm]["single_p50_ms"], got[arm]["batch32_qps"],
                         got[arm]["bytes_per_query"] / 1e6, got[arm]["batch_hit_rate"], got["alike"]])
    print(machine_line(info))
    print(markdown_table(["reader", "reads", "p50 ms (1 query)", "batch-32 QPS", "MB read/query",
                          "hit rate (batch)", "same ranking"], rows))
    write_results("centroid_reads", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
