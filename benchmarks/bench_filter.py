"""Filtered search: latency and recall@10 at selectivities 0.1% .. 100%, prefetch on and off.

    python -m benchmarks.make_synthetic --add-metadata /data/synth2m     # once: the `shard` and `rank` fields
    python -m benchmarks.bench_filter --index /data/synth2m --queries-npz /data/synth2m.queries.npz

Filters: a keyword filter `{"shard": {"in": [m of the 1,000 values]}}` and an integer range
`{"rank": {"lt": s * 10^6}}`, both drawn independently of the vectors (the hard case: the
matches are spread over every IVF list). Queries are pre-encoded and searched one at a
time (batch 1). Each round takes the queries in a shuffled order and runs every
configuration (filter × prefetch) on a query, in a shuffled order, before the next query,
so all configurations see the same machine load. The table gives the median over rounds
of each round's p50 and p99, and of the ratio of its p50 to the unfiltered p50 (same
prefetch setting) of that round. "compile ms" is the
first use of a filter (mask and sub-index); later uses hit the cache.

Recall@10 is measured against the exhaustive filtered reference
(`Searcher.search_exhaustive(..., allowed=mask)`: exact CLS over every matching document,
MaxSim over its top `rerank_count`, the pipeline's own re-rank depth), over all queries.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import (load_queries, machine, machine_line, markdown_table, median, percentiles,  # noqa: E402
                               take_queries, write_results)

SHARDS = 1000
RANK_RANGE = 1_000_000


def make_filter(field: str, selectivity: float) -> dict:
    if field == "shard":
        m = max(1, round(selectivity * SHARDS))
        return {"shard": {"in": [f"s{i:03d}" for i in range(m)]}}
    return {"rank": {"lt": int(round(selectivity * RANK_RANGE))}}


def run(searcher, queries, k: int, prefetch: bool, spec: dict | None,
        nprobe: int | None = None) -> tuple[list[float], list]:
    """Per-query latency (ms) and results, one query per call."""
    latencies, results = [], []
    for i in range(len(queries)):
        q = take_queries(queries, np.array([i]))
        t = time.perf_counter()
        out = searcher.search_embeddings(q, k=k, prefetch=prefetch, filter=spec, nprobe=nprobe)
        latencies.append((time.perf_counter() - t) * 1000)
        results += out
    return latencies, results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, required=True, help="an index with the synthetic `shard` and `rank` fields")
    p.add_argument("--queries-npz", type=Path, required=True)
    p.add_argument("--n", type=int, default=100, help="queries")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--nprobe", type=int, default=None, help="IVF lists (default: the index's); a filtered search "
                   "scans as many matches as the unfiltered search at this nprobe scans codes")
    p.add_argument("--selectivities", default="0.001,0.01,0.1,0.5,1.0")
    p.add_argument("--fields", default="shard,rank")
    p.add_argument("--no-recall", action="store_true", help="latency only (the reference reads every match)")
    p.add_argument("--quick", action="store_true", help="10 queries, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.repeats = 10, 1

    from espn import Searcher

    searcher = Searcher.open(args.index, reader="posix", verify="none", with_encoder=False)
    queries = load_queries(args.queries_npz)
    n = min(args.n, len(queries))
    queries = take_queries(queries, np.arange(n))
    selectivities = [float(s) for s in args.selectivities.split(",")]
    fields = args.fields.split(",")
    filters: dict[str, dict | None] = {"unfiltered": None}
    for field in fields:
        for s in selectivities:
            filters[f"{field} {s:.1%}"] = make_filter(field, s)
    compile_ms, matched = {}, {}
    for name, spec in filters.items():
        t = time.perf_counter()
        compiled = searcher.filtered_docs(spec)
        compile_ms[name] = (time.perf_counter() - t) * 1000
        matched[name] = searcher.num_documents if compiled is None else compiled.matches
    run(searcher, take_queries(queries, np.arange(min(8, n))), args.k, True, None)  # warm up

    configs = [(name, pf) for name in filters for pf in (True, False)]
    raw = {c: {"p50": [], "p99": [], "ratio": [], "latencies": []} for c in configs}
    results: dict[str, list] = {name: [None] * n for name in filters}
    rng = random.Random(0)
    for _ in range(args.repeats):
        # Interleaved per query: every configuration runs on query i, in a shuffled order, before
        # query i+1, so all of them see the same machine load (it swings a lot on a shared box).
        lat: dict[tuple, list[float]] = {c: [] for c in configs}
        for i in rng.sample(range(n), n):
            order = configs[:]
            rng.shuffle(order)
            for name, prefetch in order:
                t, out = run(searcher, take_queries(queries, np.array([i])), args.k, prefetch, filters[name],
                             args.nprobe)
                lat[(name, prefetch)] += t
                results[name][i] = out[0]
        for (name, prefetch), values in lat.items():
            cell = raw[(name, prefetch)]
            cell["p50"].append(float(np.percentile(values, 50)))
            cell["p99"].append(float(np.percentile(values, 99)))
            cell["ratio"].append(cell["p50"][-1] / float(np.percentile(lat[("unfiltered", prefetch)], 50)))
            cell["latencies"] += values
    paths = {name: ",".join(sorted({r.stats.filter_path or "-" for r in out})) for name, out in results.items()}

    recall: dict[str, float] = {}
    if not args.no_recall:
        for name, spec in filters.items():
            compiled = searcher.filtered_docs(spec)
            mask = None if compiled is None or compiled.matches == searcher.num_documents else compiled.mask
            t = time.perf_counter()
            reference = searcher.search_exhaustive(queries, k=args.k, rerank_count=searcher.defaults.rerank_count,
                                                   allowed=mask)
            got = results[name]
            recall[name] = float(np.mean([len({h.doc_id for h in g.hits} & {h.doc_id for h in r}) / max(1, len(r))
                                          for g, r in zip(got, reference)]))
            print(f"reference for {name}: {time.perf_counter() - t:.1f} s, recall@{args.k} {recall[name]:.4f}",
                  flush=True)

    rows = []
    for name, prefetch in configs:
        cell = raw[(name, prefetch)]
        p50, p99 = median(cell["p50"]), median(cell["p99"])
        rows.append([name, f"{matched[name] / searcher.num_documents:.2%}", paths[name], "on" if prefetch else "off",
                     p50, p99, median(cell["ratio"]), recall.get(name, "n/a"), compile_ms[name]])
    nprobe = args.nprobe or searcher.defaults.nprobe
    print(f"# Filtered search: {args.index} ({n} queries, batch 1, k={args.k}, nprobe {nprobe} of {searcher.nlist}, "
          f"{args.repeats} rounds)")
    print(machine_line(machine()))
    print(markdown_table(["filter", "matches", "path", "prefetch", "p50 ms", "p99 ms", "p50 / unfiltered",
                          f"recall@{args.k}", "compile ms"], rows))
    write_results("bench_filter", {
        "machine": machine(), "index": str(args.index), "queries": n, "k": args.k, "repeats": args.repeats,
        "nprobe": nprobe,
        "rows": [dict(zip(["filter", "matches", "path", "prefetch", "p50_ms", "p99_ms", "ratio", "recall",
                           "compile_ms"], row)) for row in rows],
        "pooled": {f"{name}|{pf}": percentiles(raw[(name, pf)]["latencies"]) for name, pf in configs},
    })
    searcher.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
