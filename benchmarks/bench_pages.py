"""Page indexes at scale: the posix reader against the memory reader, and each first stage's recall of
the exhaustive MaxSim top 10 (issue 47); the same for ColBERT-class token indexes (issue 46).

    python -m benchmarks.make_synthetic --out .espn/pages50k/index --pages 50000 --queries 50
    python -m benchmarks.bench_pages --index .espn/pages50k/index
    python -m benchmarks.make_synthetic --out .espn/tok100k/index --tokens --docs 100000 --source .espn/pf/index
    python -m benchmarks.bench_pages --index .espn/tok100k/index --name tokens_100k

The index: a synthetic ColPali-class page index (`make_synthetic --pages`: ~1,030 int8 patch vectors
a page, pure MaxSim, no trained CLS vector, so the build gives it the default first stage of such
models); the queries: the .npz make_synthetic writes beside it (`INDEX.queries.npz`), the first
`--queries-n`.

Recall: every query is scored exactly against every page (the records, read block by block: the
exhaustive MaxSim), and each first stage's candidates are re-ranked by those exact scores, so the
recall of the exhaustive top 10 is exact for every setting: the token-centroid stage at several
probe/candidate settings, the IVF over the pooled page vectors (the CLS, the mean of the patches),
and their union. The default is also searched end to end (`search_embeddings`) and its top 10
compared. Latency: the default search, one query per call, with the posix reader and the memory
reader side by side (interleaved, `--rounds` rounds; p50 and p95 per round, the median of rounds).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.bench_first_stage import candidate_sets
from benchmarks.common import machine, machine_line, markdown_table, median, write_results
from espn import Searcher
from espn.encoders import QueryEmbeddings
from espn.encoders.precomputed import load_query_embeddings

READERS = ("posix", "memory")

SETTINGS: list[dict[str, Any]] = (
    [{"kind": "centroids", "probe": p, "candidates": c} for p in (4, 8, 16, 32) for c in (256, 512, 1024)]
    + [{"kind": "ivf", "rerank": r} for r in (100, 256, 1000)]
    + [{"kind": "union", "probe": 8, "candidates": 256, "rerank": 100},
       {"kind": "union", "probe": 16, "candidates": 512, "rerank": 256}])
QUICK_SETTINGS: list[dict[str, Any]] = [{"kind": "centroids", "probe": 8, "candidates": 16},
                                        {"kind": "ivf", "rerank": 16},
                                        {"kind": "union", "probe": 8, "candidates": 16, "rerank": 16}]


def exhaustive_scores(searcher: Any, queries: QueryEmbeddings, block: int) -> np.ndarray:
    """[Q, N] float32: the exact score of every (query, page), `block` pages read at a time."""
    n = searcher.num_documents
    full = np.zeros((len(queries), n), dtype=np.float32)
    for first in range(0, n, block):
        numbers = np.arange(first, min(first + block, n))
        cls, bow = searcher.score_documents(queries, numbers)
        full[:, numbers] = searcher.weight * cls + (1 - searcher.weight) * bow
    return full


def recall_at_10(candidates: Sequence[np.ndarray], full: np.ndarray, top: np.ndarray) -> float:
    """Mean share of the exhaustive top 10 among the candidates' 10 best by the exact score."""
    found = []
    for i, docs in enumerate(candidates):
        docs = np.asarray(docs, dtype=np.int64)
        best = docs[np.argsort(-full[i, docs], kind="stable")[:10]]
        found.append(len(set(best.tolist()) & set(top[i].tolist())) / 10)
    return float(np.mean(found))


def label(setting: dict[str, Any]) -> str:
    kind = setting["kind"]
    if kind == "centroids":
        return f"token centroids, probe {setting['probe']}, {setting['candidates']} candidates"
    if kind == "ivf":
        return f"pooled page vectors (IVF), top {setting['rerank']}"
    return f"union: centroids {setting['probe']}/{setting['candidates']} + IVF top {setting['rerank']}"


def candidate_count(found: Sequence[np.ndarray]) -> float:
    return float(np.mean([len(c) for c in found]))


def measure_recall(searcher: Any, queries: QueryEmbeddings, settings: list[dict[str, Any]],
                   block: int) -> dict[str, Any]:
    """The exhaustive top 10, then every setting's recall of it, and the served default's."""
    started = time.perf_counter()
    full = exhaustive_scores(searcher, queries, block)
    exhaustive_s = time.perf_counter() - started
    print(f"exhaustive MaxSim of {len(queries)} queries in {exhaustive_s:.0f}s", file=sys.stderr)
    top = np.argsort(-full, axis=1, kind="stable")[:, :10]
    rows = []
    for setting in settings:
        found = candidate_sets(searcher, queries, [""] * len(queries), setting)
        rows.append({"setting": setting, "recall@10": recall_at_10(found, full, top),
                     "candidates": candidate_count(found)})
        print(f"{label(setting)}: {rows[-1]['recall@10']:.3f}", file=sys.stderr)
    served = searcher.search_embeddings(queries, k=10)
    numbers = {doc_id: i for i, doc_id in enumerate(searcher.ids.external(np.arange(searcher.num_documents)))}
    served_recall = float(np.mean([len({numbers[h.doc_id] for h in r.hits} & set(top[i].tolist())) / 10
                                   for i, r in enumerate(served)]))
    return {"exhaustive_s": exhaustive_s, "exhaustive_ms_per_query": 1000 * exhaustive_s / len(queries),
            "rows": rows, "default_served_recall@10": served_recall}


#: Per-search overrides timed beside the default (same readers, same rounds): more probes at the
#: same candidates cost stage time only; more candidates cost reads.
ALTERNATIVES: dict[str, dict[str, Any]] = {"probe 16": {"first_stage_probe": 16},
                                           "512 candidates": {"first_stage_candidates": 512}}


def measure_latency(index: Path, queries: QueryEmbeddings, rounds: int,
                    alternatives: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One query per call, per reader and per arm (the default, then each alternative), interleaved
    round by round: {reader: default's p50/p95}, {"reader, alternative": its p50/p95}."""
    searchers = {name: Searcher.open(index, reader=name, verify="none", with_encoder=False) for name in READERS}
    arms = [(name, label, overrides) for name in READERS for label, overrides in [("", {}), *alternatives.items()]]
    try:
        for searcher in searchers.values():
            searcher.search_embeddings(queries[0:1], k=10)  # warm
        per_round: dict[str, list[dict[str, float]]] = {}
        for _ in range(rounds):
            for name, label, overrides in arms:
                searcher, times = searchers[name], []
                for i in range(len(queries)):
                    started = time.perf_counter()
                    searcher.search_embeddings(queries[i : i + 1], k=10, **overrides)
                    times.append(1000 * (time.perf_counter() - started))
                per_round.setdefault(f"{name}, {label}" if label else name, []).append(
                    {"p50": float(np.percentile(times, 50)), "p95": float(np.percentile(times, 95))})
    finally:
        for searcher in searchers.values():
            searcher.close()
    return {name: {"p50_ms": median([r["p50"] for r in runs]), "p95_ms": median([r["p95"] for r in runs]),
                   "rounds": runs} for name, runs in per_round.items()}


def footprint(index: Path, searcher: Any) -> dict[str, float]:
    """Bytes per page: on SSD (the records, the whole index) and in RAM (the first stage)."""
    n = searcher.num_documents
    files = [f for f in index.rglob("*") if f.is_file()]
    stage = searcher.centroids.nbytes if searcher.centroids is not None else 0
    ivf = (index / "ann.faiss").stat().st_size if (index / "ann.faiss").is_file() else 0
    return {"pages": n, "records_bytes_per_page": (index / "embeddings.bin").stat().st_size / n,
            "index_bytes_per_page": sum(f.stat().st_size for f in files) / n,
            "centroid_stage_ram_bytes_per_page": stage / n, "ivf_file_bytes_per_page": ivf / n,
            "record_table_bytes_per_page": (index / "records.npy").stat().st_size / n,
            "centroids": int(len(searcher.centroids.centroids)) if searcher.centroids is not None else 0}


def report(results: dict[str, Any]) -> str:
    foot, rec = results["footprint"], results["recall"]
    lines = [f"Machine: {machine_line(results['machine'])}; index {results['index']} ({foot['pages']:,} pages, "
             f"{results['queries']} queries); default first stage {results['default']}",
             "", markdown_table(["first stage", "recall of exhaustive top 10", "candidates (mean)"],
                                [[label(r["setting"]), r["recall@10"], r["candidates"]] for r in rec["rows"]]),
             "", "served default, end to end: recall of the exhaustive top 10 = "
                 f"{rec['default_served_recall@10']:.3f}; exhaustive MaxSim {rec['exhaustive_ms_per_query']:.0f} ms/query",
             "", markdown_table(["reader", "p50 ms", "p95 ms"],
                                [[f"{name} (default)", part["p50_ms"], part["p95_ms"]]
                                 for name, part in results["latency"].items()]
                                + [[name, part["p50_ms"], part["p95_ms"]]
                                   for name, part in results.get("latency_alternatives", {}).items()]),
             "", f"records {foot['records_bytes_per_page']:,.0f} B/page on SSD "
                 f"(index {foot['index_bytes_per_page']:,.0f}); "
                 f"centroid stage {foot['centroid_stage_ram_bytes_per_page']:,.0f} B/page in RAM "
                 f"({foot['centroids']} centroids); IVF (ann.faiss) {foot['ivf_file_bytes_per_page']:,.0f} B/page; "
                 f"record table {foot['record_table_bytes_per_page']:,.0f} B/page"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, required=True, help="a page index (make_synthetic --pages)")
    p.add_argument("--queries", type=Path, default=None, help="query .npz (default: INDEX.queries.npz)")
    p.add_argument("--queries-n", type=int, default=50, help="queries measured (the first N)")
    p.add_argument("--rounds", type=int, default=3, help="latency rounds (readers interleaved)")
    p.add_argument("--block", type=int, default=256, help="pages scored at a time by the exhaustive MaxSim")
    p.add_argument("--quick", action="store_true", help="three small settings, one round (a smoke run)")
    p.add_argument("--name", default=None, help="results name (default pages, pages_quick with --quick)")
    args = p.parse_args(argv)
    index = args.index.absolute()
    if not (index / "manifest.json").is_file():
        print(f"no index at {index} (make one: python -m benchmarks.make_synthetic --out DIR --pages N)",
              file=sys.stderr)
        return 2
    queries_file = args.queries or index.with_name(index.name + ".queries.npz")
    _, queries = load_query_embeddings(queries_file)
    queries = queries[: args.queries_n]
    settings = QUICK_SETTINGS if args.quick else SETTINGS
    results: dict[str, Any] = {"machine": machine(), "index": str(index), "queries": len(queries)}
    with Searcher.open(index, reader="posix", verify="none", with_encoder=False) as searcher:
        results["default"] = searcher.first_stage.to_json()
        results["footprint"] = footprint(index, searcher)
        results["recall"] = measure_recall(searcher, queries, settings, args.block)
    timed = measure_latency(index, queries, 1 if args.quick else args.rounds, ALTERNATIVES)
    results["latency"] = {name: timed.pop(name) for name in READERS}
    results["latency_alternatives"] = timed
    print(report(results))
    write_results(args.name or ("pages_quick" if args.quick else "pages"), results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
