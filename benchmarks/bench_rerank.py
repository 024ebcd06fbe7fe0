"""Partial re-ranking (the paper's Fig. 6): effectiveness against rerank count on SciFact.

    python -m benchmarks.bench_rerank                     # SciFact test, index .espn/scifact-index
    python -m benchmarks.bench_rerank --quick             # 60 queries, 4 counts

nDCG@10 and MRR@10 (ir_measures) of the 300 SciFact test queries, re-ranking only the
top `rerank_count` ANN candidates with MaxSim (below it the CLS order is kept), for
counts 16 ... 1000, normalised to the value at 1000; plus the SSD traffic per query
(bytes read), which partial re-ranking cuts. Queries are encoded once, then searched
with every count (search_embeddings), all at the index's default nprobe.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import SCIFACT, SCIFACT_INDEX, machine, machine_line, markdown_table, write_results

COUNTS = (16, 32, 64, 128, 256, 512, 1000)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, default=SCIFACT_INDEX)
    p.add_argument("--data", type=Path, default=SCIFACT, help="BEIR SciFact directory (queries, qrels)")
    p.add_argument("--split", default="test")
    p.add_argument("--counts", default=None, help="comma list (default 16,32,64,128,256,512,1000)")
    p.add_argument("--params", default="{}", help="JSON overrides (nprobe)")
    p.add_argument("--quick", action="store_true", help="60 queries, counts 16,64,128,1000")
    p.add_argument("--batch", type=int, default=1, help="queries per search call (traffic is per call)")
    p.add_argument("--limit", type=int, default=None, help="first N judged queries only")
    p.add_argument("--name", default="rerank")
    args = p.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")] if args.counts else list(COUNTS)
    if args.quick:
        counts, args.limit = (counts if args.counts else [16, 64, 128, 1000]), args.limit or 60
    if not (args.index / "manifest.json").is_file():
        print(f"no index at {args.index}: build one with `espn index {args.data}/corpus.jsonl.gz --out {args.index}`",
              file=sys.stderr)
        return 2
    from espn import Searcher
    from espn.corpus import read_qrels, read_queries
    from espn.evaluation import evaluate

    qrels = read_qrels(args.data / "qrels" / f"{args.split}.tsv")
    queries = [(qid, text) for qid, text in read_queries(args.data / "queries.jsonl") if qid in qrels]
    if args.limit:
        queries = queries[: args.limit]
    extra = json.loads(args.params)
    info = machine()
    rows = []
    with Searcher.open(args.index, reader="posix", verify="none") as s:
        if s.encoder is None:
            raise SystemExit(f"{args.index} has no text encoder")
        tokens = s.encoder.tokenize([t for _, t in queries], is_query=True)
        emb = s.encoder.embed_queries(tokens)
        for count in counts:
            # One call per `--batch` queries: a large batch reads each shared document once,
            # which would hide the per-query SSD traffic that partial re-ranking saves.
            results = []
            for start in range(0, len(queries), args.batch):
                results += s.search_embeddings(emb[start : start + args.batch], k=10, rerank_count=count,
                                               prefetch_k=count, **extra)
            run = {qid: {h.doc_id: h.score for h in r.hits} for (qid, _), r in zip(queries, results)}
            scores = evaluate(run, qrels)
            rows.append({"rerank_count": count, "nDCG@10": scores["nDCG@10"], "MRR@10": scores["RR@10"],
                         "bytes_per_query": float(np.mean([r.stats.bytes_read for r in results]))})
            print(f"rerank {count}: {rows[-1]}", file=sys.stderr)
    ref = next((r for r in rows if r["rerank_count"] == max(counts)), rows[-1])
    table = markdown_table(
        ["rerank count", "nDCG@10", f"% of {ref['rerank_count']}", "MRR@10", f"% of {ref['rerank_count']}",
         "KB read/query", "traffic ÷"],
        [[r["rerank_count"], r["nDCG@10"], 100 * r["nDCG@10"] / ref["nDCG@10"], r["MRR@10"],
          100 * r["MRR@10"] / ref["MRR@10"], r["bytes_per_query"] / 1024, ref["bytes_per_query"] / max(1, r["bytes_per_query"])]
         for r in rows])
    print(f"SciFact {args.split} ({len(queries)} queries, {args.batch} per call), index {args.index}. Machine: {machine_line(info)}\n\n{table}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = [r["rerank_count"] for r in rows]
    for key in ("nDCG@10", "MRR@10"):
        ax.plot(xs, [100 * r[key] / ref[key] for r in rows], "o-", label=key)
    ax.set_xscale("log")
    ax.set_xlabel("rerank count")
    ax.set_ylabel(f"% of the value at {ref['rerank_count']}")
    ax.legend()
    write_results(args.name, {"machine": info, "index": str(args.index), "queries": len(queries), "rows": rows}, fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
