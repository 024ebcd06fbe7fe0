"""Record order: reads per query with records in IVF-list order against doc-number order.

    python -m benchmarks.bench_record_order --index .espn/scifact-index --repeats 5
    python -m benchmarks.bench_record_order --index /tmp/espn-synth --queries-npz /tmp/espn-synth.queries.npz

The index given is the one a build writes (records in IVF-list order, `espn.store.record_order`).
Its twin in doc-number order is made beside it (`--twin`, default INDEX.docorder: every file
hard-linked except embeddings.bin and records.npy, rewritten by `write_in_order` with the
identity order), so both hold the same records and rank identically; only where the
records lie differs. Each round runs both, posix reader, without prefetch (the reads are
all on the critical path), over the same queries in a shuffled order; the table gives the
mean read requests (ios) and bytes per query, and the median over rounds of each round's
p50 latency. `--rerank-counts` also runs the IVF-order index at other re-rank depths.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.bench_readers import encode_scifact_queries  # noqa: E402
from benchmarks.common import (SCIFACT, SCIFACT_INDEX, load_queries, machine, machine_line,  # noqa: E402
                               markdown_table, median, take_queries, write_results)


def make_doc_order_twin(index: Path, twin: Path) -> None:
    """`twin`: `index` with its records rewritten in doc-number order (other files hard-linked)."""
    from espn.store.record_order import write_in_order

    if twin.exists():
        shutil.rmtree(twin)
    shutil.copytree(index, twin, copy_function=os.link, ignore=shutil.ignore_patterns("embeddings.bin", "records.npy"))
    records = np.load(index / "records.npy", mmap_mode="r")
    block = int(json.loads((index / "manifest.json").read_text())["store"]["block_size"])
    new, _ = write_in_order(index / "embeddings.bin", records, np.arange(len(records)), block, twin / "embeddings.bin")
    np.save(twin / "records.npy", new)


def run(searcher, queries, params: dict) -> tuple[list[float], list]:
    latencies, stats = [], []
    for row in range(len(queries.cls)):
        t = time.perf_counter()
        out = searcher.search_embeddings(take_queries(queries, np.array([row])), **params)
        latencies.append((time.perf_counter() - t) * 1000)
        stats.append(out[0].stats)
    return latencies, stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, default=SCIFACT_INDEX)
    p.add_argument("--twin", type=Path, default=None, help="where the doc-order twin goes (default INDEX.docorder)")
    p.add_argument("--queries", type=Path, default=SCIFACT / "queries.jsonl")
    p.add_argument("--qrels", type=Path, default=SCIFACT / "qrels" / "test.tsv")
    p.add_argument("--queries-npz", type=Path, help="pre-encoded queries (synthetic index)")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--rerank-counts", default="", help="comma list of extra re-rank depths for the IVF-order index")
    p.add_argument("--keep-twin", action="store_true")
    args = p.parse_args(argv)

    from espn import Searcher
    from espn.corpus import read_qrels

    twin = args.twin or args.index.with_name(args.index.name + ".docorder")
    make_doc_order_twin(args.index, twin)
    try:
        searchers = {"IVF-list order": Searcher.open(args.index, reader="posix", verify="none",
                                                     with_encoder=args.queries_npz is None),
                     "doc order": Searcher.open(twin, reader="posix", verify="none", with_encoder=False)}
        if args.queries_npz is not None:
            queries = load_queries(args.queries_npz)
        else:
            qrels = read_qrels(args.qrels) if args.qrels.is_file() else None
            _, queries = encode_scifact_queries(searchers["IVF-list order"], args.queries, qrels)
        queries = take_queries(queries, np.arange(min(args.n, len(queries.cls))))
        base = {"k": args.k, "prefetch": False}
        configs = [(name, None) for name in searchers]
        configs += [("IVF-list order", int(r)) for r in args.rerank_counts.split(",") if r]
        cells: dict = {c: {"p50": [], "ios": [], "bytes": []} for c in configs}
        for searcher in searchers.values():
            run(searcher, take_queries(queries, np.arange(min(16, len(queries.cls)))), base)
        rng = random.Random(0)
        for _ in range(args.repeats):
            order = configs[:]
            rng.shuffle(order)
            for name, depth in order:
                params = {**base, **({"rerank_count": depth} if depth else {})}
                lat, stats = run(searchers[name], queries, params)
                cells[(name, depth)]["p50"].append(float(np.percentile(lat, 50)))
                cells[(name, depth)]["ios"].append(float(np.mean([s.ios for s in stats])))
                cells[(name, depth)]["bytes"].append(float(np.mean([s.bytes_read for s in stats])))
        for searcher in searchers.values():
            searcher.close()
    finally:
        if not args.keep_twin:
            shutil.rmtree(twin, ignore_errors=True)
    info = machine()
    rerank = searchers["doc order"].defaults.rerank_count
    rows = [[name, depth or rerank, median(c["ios"]), median(c["bytes"]) / 1024, median(c["p50"])]
            for (name, depth), c in cells.items()]
    table = markdown_table(["records", "rerank_count", "reads per query", "KiB per query", "p50 ms"], rows)
    load = os.getloadavg()
    print(f"Index {args.index}; {len(queries.cls)} queries, batch 1, k={args.k}, posix, no prefetch; {args.repeats} "
          f"rounds; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}. Machine: {machine_line(info)}\n\n{table}")
    write_results("record_order", {"machine": info, "index": str(args.index), "cells": {f"{k[0]}|{k[1]}": v for k, v
                                                                                      in cells.items()},
                                   "table_md": table, "load": load})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
