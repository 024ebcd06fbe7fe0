"""The full-text engine, chosen by measurement: Tantivy (espn.text) against bm25s.

    python -m benchmarks.bench_text_engines                          # SciFact: index $ESPN_SCIFACT_INDEX
    python -m benchmarks.bench_text_engines --index SYNTH --queries SYNTH.query_texts.jsonl --no-qrels
    python -m benchmarks.bench_text_engines --quick                  # 2,000 passages, 20 queries

Both engines index the passages of an index directory (`docs.jsonl`, title and text) with
the same analysis: Snowball English stemming and English stop words (Tantivy's analyzer
chain of espn.text; bm25s with PyStemmer and its English list). Per engine: build time
(passages already in memory for bm25s, streamed for Tantivy, so the figures favour
bm25s), size on disk, single-query latency of the top 100 (p50, p99; the engines
alternate query by query, so both see the same load), and nDCG@10 on SciFact test.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()

from benchmarks.common import SCIFACT, SCIFACT_INDEX, machine, machine_line, markdown_table, percentiles, write_results


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file() and not p.name.startswith("."))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, default=SCIFACT_INDEX, help="index directory whose passages are indexed")
    p.add_argument("--queries", type=Path, default=None, help="queries (default: SciFact's)")
    p.add_argument("--qrels", type=Path, default=None, help="qrels for nDCG@10 (default: SciFact test)")
    p.add_argument("--no-qrels", action="store_true")
    p.add_argument("--n", type=int, default=300, help="queries timed")
    p.add_argument("--limit-docs", type=int, default=None, help="first N passages only")
    p.add_argument("--scratch", type=Path, default=None, help="where the engines write (default: a temp dir)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--name", default="text_engines")
    args = p.parse_args(argv)
    if args.quick:
        args.limit_docs, args.n = args.limit_docs or 2000, min(args.n, 20)
    queries_path = args.queries or SCIFACT / "queries.jsonl"
    qrels_path = None if args.no_qrels else (args.qrels or SCIFACT / "qrels" / "test.tsv")
    if not (args.index / "docs.jsonl").is_file():
        print(f"no index at {args.index}", file=sys.stderr)
        return 2
    import bm25s
    import Stemmer

    from espn.corpus import passage_text, read_qrels, read_queries
    from espn.evaluation import evaluate
    from espn.text import TextConfig, parse_query
    from espn.text.engine import TextIndex, build_text_index
    from espn.text.directory import passages

    ids = np.load(args.index / "ids.npy", mmap_mode="r")
    qrels = read_qrels(qrels_path) if qrels_path is not None and qrels_path.is_file() else None
    queries = read_queries(queries_path)
    if qrels is not None:
        queries = [(qid, text) for qid, text in queries if qid in qrels]
    queries = queries[: args.n]
    limit = args.limit_docs

    def docs():
        for doc in passages(args.index):
            if limit is not None and doc.doc_number >= limit:
                return
            yield doc

    scratch = Path(tempfile.mkdtemp(prefix="text-engines-", dir=args.scratch))
    rows: list[dict[str, Any]] = []
    try:
        started = time.perf_counter()
        section = build_text_index(scratch / "tantivy", docs(), TextConfig())
        tantivy_build = time.perf_counter() - started
        n_docs = section["documents"]
        tantivy = TextIndex(scratch / "tantivy", TextConfig())

        texts = [passage_text(d.title, d.text) for d in docs()]
        started = time.perf_counter()
        stemmer = Stemmer.Stemmer("english")
        tokens = bm25s.tokenize(texts, stopwords="en", stemmer=stemmer, show_progress=False)
        retriever = bm25s.BM25()  # Lucene's BM25: k1 1.2, b 0.75, as Tantivy
        retriever.index(tokens, show_progress=False)
        retriever.save(str(scratch / "bm25s"))
        bm25s_build = time.perf_counter() - started
        del texts, tokens

        parsed = [parse_query(text) for _, text in queries]
        times: dict[str, list[float]] = {"tantivy": [], "bm25s": []}
        runs: dict[str, dict[str, dict[str, float]]] = {"tantivy": {}, "bm25s": {}}

        def run_tantivy(i: int) -> None:
            t = time.perf_counter()
            hits = tantivy.search(parsed[i], 100)
            times["tantivy"].append((time.perf_counter() - t) * 1000)
            runs["tantivy"][queries[i][0]] = dict(zip((bytes(ids[n]).decode() for n in hits.doc_numbers.tolist()),
                                                      hits.scores.tolist()))

        def run_bm25s(i: int) -> None:
            t = time.perf_counter()
            q = bm25s.tokenize([queries[i][1]], stopwords="en", stemmer=stemmer, show_progress=False)
            found, scores = retriever.retrieve(q, k=min(100, n_docs), show_progress=False, n_threads=1)
            times["bm25s"].append((time.perf_counter() - t) * 1000)
            runs["bm25s"][queries[i][0]] = {bytes(ids[int(n)]).decode(): float(s)
                                            for n, s in zip(found[0], scores[0]) if s > 0}

        for i in range(len(queries)):
            for run in ((run_tantivy, run_bm25s) if i % 2 == 0 else (run_bm25s, run_tantivy)):
                run(i)
        for engine, build_s, size in (("tantivy", tantivy_build, _size(scratch / "tantivy")),
                                      ("bm25s", bm25s_build, _size(scratch / "bm25s"))):
            row = {"engine": engine, "documents": n_docs, "build_s": build_s, "bytes": size,
                   "latency_ms": percentiles(times[engine]),
                   "live_updates": engine == "tantivy"}
            if qrels is not None:
                row["nDCG@10"] = evaluate(runs[engine], qrels)["nDCG@10"]
            rows.append(row)
        tantivy.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    headers = ["engine", "passages", "build s", "size MB", "p50 ms", "p99 ms", "adds/deletes"]
    if qrels is not None:
        headers.append("nDCG@10")
    table = markdown_table(headers, [
        [r["engine"], r["documents"], r["build_s"], r["bytes"] / 1e6, r["latency_ms"]["p50"], r["latency_ms"]["p99"],
         "yes" if r["live_updates"] else "rebuild"] + ([r["nDCG@10"]] if qrels is not None else []) for r in rows])
    print(f"{args.index}: {len(queries)} single queries, top 100, engines interleaved. "
          f"Machine: {machine_line(machine())}\n\n{table}")
    write_results(args.name, {"machine": machine(), "index": str(args.index), "queries": len(queries), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
