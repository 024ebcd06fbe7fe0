"""Reads beside the centroid stage (waves scored as they arrive) against one read after it,
and this checkout against an older one, side by side.

    python -m benchmarks.bench_centroid_reads --index .espn/pf/index --queries .espn/pf/queries.npz
    git worktree add /tmp/base <commit>
    python -m benchmarks.bench_centroid_reads --index .espn/pf/index --queries .espn/pf/queries.npz \
        --baseline /tmp/base

The index: SciFact through MiniLM written as a PyLate checkpoint (`benchmarks.make_colbert_checkpoint`),
built with `--encoder colbert:` and the build's defaults (int8 records, the centroid first
stage), into `--work` once; the queries: their embeddings in an .npz (ids, cls, bow, mask),
so encoding is excluded. `--index` and `--queries` take any other pair.
Per reader (posix, memory), one process measures both arms interleaved, round by round
(`prefetch=True` with the default wave size, `prefetch=False`): single-query p50 over the
first `--queries-n` queries, batch-32 throughput, bytes read per query, and whether the two
arms rank alike (they must: both score the same candidates exactly).

With `--baseline CHECKOUT` each round also runs one child process per checkout (the older
one first, then this one), each timing the default search (single-query p50 and batch-32
QPS per reader) on the same index and queries: the ratio is taken round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import SCIFACT, machine, machine_line, markdown_table, median, write_results

ARMS = {"beside the stage": True, "after the stage": False}


def _queries(path: Path) -> Any:
    from espn.encoders import QueryEmbeddings

    stored = np.load(path)
    return QueryEmbeddings(stored["cls"], stored["bow"], stored["mask"])


def measure(index: Path, reader: str, queries: Any, n: int, rounds: int) -> dict[str, Any]:
    from espn import Searcher

    out: dict[str, Any] = {arm: {"single_ms": [], "batch_qps": [], "bytes": [], "hit_rate": []} for arm in ARMS}
    # min_hidden_ms=0: the prefetch model takes every wave (no outcome check), so the arm is measured itself
    with Searcher.open(index, reader=reader, verify="none", with_encoder=False, min_hidden_ms=0) as searcher:
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


def prepare(work: Path, data: Path) -> tuple[Path, Path]:
    """SciFact indexed through the MiniLM PyLate checkpoint, and its queries' embeddings (once)."""
    from benchmarks.bench_first_stage import save_query_embeddings
    from benchmarks.make_colbert_checkpoint import write_checkpoint
    from espn.corpus import read_queries
    from espn_indexing.build import BuildConfig, build_index

    index, npz, checkpoint = work / "index", work / "queries.npz", work / "minilm-colbert"
    if not (checkpoint / "modules.json").is_file():
        write_checkpoint(checkpoint)
    if not (index / "manifest.json").is_file():
        build_index(BuildConfig(corpus=data / "corpus.jsonl.gz", out=index, encoder=f"colbert:{checkpoint}",
                                loader_workers=0, progress=False, device="cpu", force=True))
    if not npz.is_file():
        save_query_embeddings(index, read_queries(data / "queries.jsonl"), npz)
    return index, npz


def child(index: Path, queries: Any, n: int) -> dict[str, Any]:
    """The default search of whichever espn is imported: per reader, single-query p50 and batch-32 QPS."""
    from espn import Searcher

    out: dict[str, Any] = {}
    for reader in ("posix", "memory"):
        with Searcher.open(index, reader=reader, verify="none", with_encoder=False) as searcher:
            searcher.search_embeddings(queries[np.arange(min(n, len(queries)))], k=10)  # warm-up
            times = []
            for i in range(n):
                started = time.perf_counter()
                searcher.search_embeddings(queries[np.arange(i, i + 1)], k=10)
                times.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            for a in range(0, len(queries), 32):
                searcher.search_embeddings(queries[np.arange(a, min(a + 32, len(queries)))], k=10)
            out[reader] = {"p50_ms": median(times), "qps": len(queries) / (time.perf_counter() - started)}
    return out


def side_by_side(baseline: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Round by round, a child on the baseline checkout and one on this checkout."""
    here = Path(__file__).resolve().parents[1]
    rounds: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        got = {}
        for name, checkout in (("baseline", baseline.resolve()), ("this", here)):
            env = {**os.environ, "PYTHONPATH": f"{checkout}{os.pathsep}{here}", "OMP_WAIT_POLICY": "PASSIVE"}
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "--index", str(args.index.resolve()),
                                   "--queries", str(args.queries.resolve()), "--queries-n", str(args.queries_n)],
                                  env=env, cwd=checkout, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                raise SystemExit(f"{name} child failed: {proc.stderr[-800:]}")
            got[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        rounds.append(got)
    summary: dict[str, Any] = {"rounds": rounds}
    for reader in ("posix", "memory"):
        summary[reader] = {
            "baseline_p50_ms": median([r["baseline"][reader]["p50_ms"] for r in rounds]),
            "this_p50_ms": median([r["this"][reader]["p50_ms"] for r in rounds]),
            "p50_ratio": median([r["this"][reader]["p50_ms"] / r["baseline"][reader]["p50_ms"] for r in rounds]),
            "baseline_qps": median([r["baseline"][reader]["qps"] for r in rounds]),
            "this_qps": median([r["this"][reader]["qps"] for r in rounds]),
            "qps_ratio": median([r["this"][reader]["qps"] / r["baseline"][reader]["qps"] for r in rounds])}
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=None, help="build SciFact's index and query file here once")
    p.add_argument("--data", type=Path, default=SCIFACT, help="BEIR SciFact directory (with --work)")
    p.add_argument("--index", type=Path, default=None)
    p.add_argument("--queries", type=Path, default=None, help=".npz of query embeddings (ids, cls, bow, mask)")
    p.add_argument("--queries-n", type=int, default=100, help="queries timed one by one per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--baseline", type=Path, default=None, help="a checkout of an older espn (git worktree add)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.work is not None:
        if not (args.data / "corpus.jsonl.gz").is_file():
            print(f"no SciFact at {args.data} (give --data or set ESPN_SCIFACT)", file=sys.stderr)
            return 2
        args.index, args.queries = prepare(args.work, args.data)
    if args.index is None or args.queries is None:
        p.error("give --work, or --index and --queries")
    queries = _queries(args.queries)
    if args.child:
        print(json.dumps(child(args.index, queries, args.queries_n)))
        return 0
    info = machine()
    results: dict[str, Any] = {"machine": info, "index": str(args.index), "readers": {}}
    if args.baseline is not None:
        results["side_by_side"] = side_by_side(args.baseline, args)
        print(machine_line(info))
        print(markdown_table(["reader", "baseline p50 ms", "this p50 ms", "p50 ratio (median of rounds)",
                              "baseline QPS", "this QPS", "QPS ratio"],
                             [[reader, got["baseline_p50_ms"], got["this_p50_ms"], got["p50_ratio"],
                               got["baseline_qps"], got["this_qps"], got["qps_ratio"]]
                              for reader, got in results["side_by_side"].items() if reader != "rounds"]))
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
