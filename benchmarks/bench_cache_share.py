"""Two workers, one record cache: its RAM counted once (PSS) and the same answers as one worker.

    python -m benchmarks.bench_cache_share --index .espn/pf/index --ram-mib 200

Starts `espn serve INDEX --workers 2 --ram-mib N`, sends every query of `--queries` (text;
SciFact's test queries by default) `--passes` times over fresh connections, so both workers
search and fill the one cache, then reads each worker's mappings (/proc/PID/smaps through
psutil): the segment's RSS in each worker and its PSS (each shared page divided by the
processes mapping it). One copy means the workers' PSS of the segment sum to about one
worker's RSS of it, and each worker's RSS of it is about the segment's resident size. Then
`espn serve INDEX --workers 1 --ram-mib N` answers the same queries: ids and scores must
match the two-worker server's, query by query.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_server import load_queries, serve, worker_processes
from benchmarks.common import SCIFACT, http, machine, machine_line, markdown_table, write_results
from espn.store.cache_segment import SEGMENT_PREFIX


def answers(base: str, queries: list[str], k: int) -> list[list[tuple[str, float]]]:
    out = []
    for query in queries:
        response = http().post(f"{base}/v1/search", json={"query": query, "k": k}, timeout=120,
                               headers={"Connection": "close"})  # a fresh connection: either worker answers
        response.raise_for_status()
        out.append([(hit["id"], hit["score"]) for hit in response.json()["results"]])
    return out


def segment_memory(process: Any) -> dict[str, int]:
    """RSS and PSS (bytes) of the record cache segments one process maps."""
    rss = pss = 0
    for mapping in process.memory_maps(grouped=True):
        if os.path.basename(mapping.path).startswith(SEGMENT_PREFIX):
            rss, pss = rss + mapping.rss, pss + mapping.pss
    return {"rss": rss, "pss": pss}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, required=True)
    p.add_argument("--ram-mib", type=float, required=True, help="as `espn serve --ram-mib`")
    p.add_argument("--queries", type=Path, default=SCIFACT / "queries.jsonl")
    p.add_argument("--qrels", type=Path, default=SCIFACT / "qrels" / "test.tsv")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="20 queries, one pass")
    p.add_argument("--name", default="cache_share")
    args = p.parse_args(argv)
    queries = load_queries(args.queries, args.qrels)
    if args.quick:
        queries, args.passes = queries[:20], 1
    logs = Path(tempfile.mkdtemp(prefix="espn-share-"))
    flags = ["--ram-mib", str(args.ram_mib), "--batch-wait-ms", "0"]
    with serve(args.index, 2, flags, logs / "two.log") as (base, supervisor):
        for _ in range(args.passes):
            two = answers(base, queries, args.k)
        workers = worker_processes(supervisor)
        memory = [segment_memory(w) for w in workers]
        ready = http().get(f"{base}/readyz", timeout=60).json()["reader"]
    with serve(args.index, 1, flags, logs / "one.log") as (base, _):
        one = answers(base, queries, args.k)
    same_ids = sum(a == b for a, b in zip([[i for i, _ in q] for q in one], [[i for i, _ in q] for q in two]))
    worst = max((abs(x[1] - y[1]) for a, b in zip(one, two) for x, y in zip(a, b)), default=0.0)
    cache = ready["record_cache"]
    rows = [[f"worker {i + 1} (pid {w.pid})", m["rss"] / 2**20, m["pss"] / 2**20] for i, (w, m) in enumerate(zip(workers, memory))]
    rows.append(["sum over workers", sum(m["rss"] for m in memory) / 2**20, sum(m["pss"] for m in memory) / 2**20])
    table_md = markdown_table(["process", "segment RSS MiB", "segment PSS MiB"], rows)
    info = machine()
    print(f"Index {args.index}, --ram-mib {args.ram_mib:g}: record cache {cache['bytes'] / 2**20:.1f} MiB "
          f"({cache['entries']} records held, {cache['record_bytes'] / 2**20:.1f} MiB of slots in use, shared: "
          f"{cache['shared']}); {len(queries)} queries x {args.passes} passes over 2 workers. Machine: "
          f"{machine_line(info)}\n\n{table_md}\n\nAgainst one worker: {same_ids}/{len(queries)} queries with the "
          f"same ids in the same order; largest score difference {worst:.2e}.", file=sys.stdout)
    write_results(args.name, {"machine": info, "index": str(args.index), "memory": memory, "cache": cache,
                              "same_ids": same_ids, "queries": len(queries), "max_score_difference": worst,
                              "table_md": table_md})
    return 0 if same_ids == len(queries) else 1


if __name__ == "__main__":
    raise SystemExit(main())
