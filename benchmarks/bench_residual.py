"""Residual records (2 and 4 bits) against int8 on one index: bytes, build time, fidelity, speed.

    python -m benchmarks.bench_centroid_reads --work .espn/pf      # SciFact through MiniLM as PyLate, once
    python -m benchmarks.bench_residual --index .espn/pf/index --queries .espn/pf/queries.npz \
        --work .espn/residual --rounds 5

From an int8 index with the centroid first stage (the build's default for ColBERT and PyLate
models) each residual arm is made the way a build makes it: a copy of the index whose records
are re-encoded against its centroids (`espn.store.recode.recode_residual`, timed). With
`--centroids N` every arm, int8 included, first gets a centroid index of N centroids (a
residual codes against the first stage's centroids, so more of them means smaller residuals).

Fidelity, per split of the qrels (train to choose, test to report): the recall of the int8
index's exhaustive MaxSim top 10, by each arm's exhaustive MaxSim (what its records keep) and
by its default search (what a user gets), and nDCG@10. Speed: per round one child process per
arm, in turn: single-query p50 over `--queries-n` queries, batch-32 QPS over all queries, and
bytes read per query, for the posix and memory readers; medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import SCIFACT, machine, machine_line, markdown_table, median, write_results

ARMS = ("int8", "residual4", "residual2")
READERS = ("posix", "memory")


def _queries(path: Path) -> Any:
    """Padded query embeddings (bench_centroid_reads' .npz: cls, bow, mask) or the flat ones
    `espn search --query-embeddings` reads (make_synthetic's: cls, bow, counts)."""
    from espn.encoders import QueryEmbeddings
    from espn.encoders.precomputed import load_query_embeddings

    stored = np.load(path)
    if "mask" not in stored.files:
        ids, queries = load_query_embeddings(path)
        return queries, ids
    return QueryEmbeddings(stored["cls"], stored["bow"], stored["mask"]), [str(i) for i in stored["ids"]]


def make_arm(index: Path, work: Path, arm: str, centroids: int | None) -> tuple[Path, float]:
    """The arm's index directory (made once) and the seconds its re-encoding took (0 for int8 as given)."""
    from espn.first_stage.build import build_first_stage
    from espn.index import read_manifest, write_manifest
    from espn.store import StoreLayout
    from espn.store.recode import recode_residual

    if arm == "int8" and centroids is None:
        return index, 0.0
    out = work / (arm if centroids is None else f"{arm}-c{centroids}")
    if (out / "manifest.json").is_file():
        return out, float(json.loads((out / "recode.json").read_text())["seconds"])
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(index, out)
    manifest = read_manifest(out)
    layout = StoreLayout.from_manifest(manifest["store"])
    records = np.load(out / "records.npy")
    if centroids is not None:
        manifest["first_stage"] = build_first_stage(out, records, layout, "centroids", previous=manifest["first_stage"],
                                                    n_centroids=centroids)
    started = time.perf_counter()
    if arm != "int8":
        recoded, size = recode_residual(out, layout, arm)
        manifest["store"] = {**manifest["store"], **recoded.manifest(), "file_bytes": size}
    seconds = time.perf_counter() - started
    write_manifest(out, {key: value for key, value in manifest.items() if key != "files"})
    (out / "recode.json").write_text(json.dumps({"seconds": seconds}))
    return out, seconds


def fidelity(arms: dict[str, Path], queries: Any, ids: list[str], qrels: dict[str, dict], limit: int) -> dict[str, Any]:
    """Per split and arm: recall of int8's exhaustive top 10 (exhaustive and default search), nDCG@10."""
    from espn import Searcher
    from espn.evaluation import evaluate

    out: dict[str, Any] = {}
    for split, judged in qrels.items():
        rows = np.array([i for i, q in enumerate(ids) if q in judged])[:limit]
        subset = queries[rows]
        tops: dict[str, list[list[str]]] = {}
        found: dict[str, list[list[tuple[str, float]]]] = {}
        for arm, path in arms.items():
            with Searcher.open(path, with_encoder=False, verify="none") as searcher:
                tops[arm] = [[h.doc_id for h in hits] for hits in searcher.search_maxsim_exhaustive(subset, k=10)]
                found[arm] = [[(h.doc_id, h.score) for h in r.hits] for r in searcher.search_embeddings(subset, k=10)]
        reference = tops["int8"]
        out[split] = {}
        for arm in arms:
            def recall(lists: list[list[str]]) -> float:
                return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(lists, reference)]))

            run = {ids[r]: dict(hits) for r, hits in zip(rows, found[arm])}
            out[split][arm] = {"queries": len(rows), "exhaustive_recall": recall(tops[arm]),
                               "search_recall": recall([[d for d, _ in hits] for hits in found[arm]]),
                               "nDCG@10": evaluate(run, {q: judged[q] for q in run})["nDCG@10"]}
    return out


def child(index: Path, queries_path: Path, n: int) -> dict[str, Any]:
    """One arm in a fresh process: per reader, single-query p50, batch-32 QPS and bytes per query."""
    from espn import Searcher

    queries, _ = _queries(queries_path)
    out: dict[str, Any] = {}
    for reader in READERS:
        with Searcher.open(index, reader=reader, verify="none", with_encoder=False) as searcher:
            searcher.search_embeddings(queries[np.arange(min(n, len(queries)))], k=10)  # warm-up
            times, read = [], []
            for i in range(n):
                started = time.perf_counter()
                result = searcher.search_embeddings(queries[np.arange(i, i + 1)], k=10)[0]
                times.append((time.perf_counter() - started) * 1000)
                read.append(result.stats.bytes_read)
            started = time.perf_counter()
            for a in range(0, len(queries), 32):
                searcher.search_embeddings(queries[np.arange(a, min(a + 32, len(queries)))], k=10)
            out[reader] = {"p50_ms": median(times), "qps": len(queries) / (time.perf_counter() - started),
                           "bytes_per_query": float(np.mean(read))}
    return out


def speed(arms: dict[str, Path], queries: Path, n: int, rounds: int) -> dict[str, Any]:
    """Round by round, one child per arm in turn; medians over the rounds."""
    got: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for _ in range(rounds):
        for arm, path in arms.items():
            proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_residual", "--child", "--index", str(path),
                                   "--queries", str(queries), "--queries-n", str(n)],
                                  capture_output=True, text=True, timeout=3600, cwd=Path(__file__).resolve().parents[1])
            if proc.returncode != 0:
                raise SystemExit(f"{arm} child failed: {proc.stderr[-800:]}")
            got[arm].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {arm: {reader: {key: median([r[reader][key] for r in runs]) for key in runs[0][reader]}
                  for reader in READERS} for arm, runs in got.items()}


def report(results: dict[str, Any]) -> str:
    arms = results["arms"]
    lines = [machine_line(results["machine"]), "",
             markdown_table(["arm", "bytes/token", "file MB", "re-encode s"],
                            [[a, arms[a]["bytes_per_token"], arms[a]["file_bytes"] / 1e6, arms[a]["recode_s"]]
                             for a in arms]), ""]
    for split, by_arm in results["fidelity"].items():
        lines += [f"{split} queries ({next(iter(by_arm.values()))['queries']}):",
                  markdown_table(["arm", "exhaustive recall of int8 top 10", "search recall", "nDCG@10"],
                                 [[a, v["exhaustive_recall"], v["search_recall"], v["nDCG@10"]]
                                  for a, v in by_arm.items()]), ""]
    if results.get("speed"):
        rows = [[a, r, v["p50_ms"], v["qps"], v["bytes_per_query"] / 1e6]
                for a, by_reader in results["speed"].items() for r, v in by_reader.items()]
        lines.append(markdown_table(["arm", "reader", "p50 ms", "batch-32 QPS", "MB read/query"], rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, required=True, help="an int8 index with the centroid first stage")
    p.add_argument("--queries", type=Path, required=True,
                   help=".npz of query embeddings (ids, cls, bow, mask; or cls, bow, counts as make_synthetic writes)")
    p.add_argument("--work", type=Path, default=Path(".espn/residual"), help="where the arms' indexes are made")
    p.add_argument("--data", type=Path, default=SCIFACT, help="BEIR directory with qrels/{train,test}.tsv")
    p.add_argument("--centroids", type=int, default=None, help="retrain every arm's first stage with this many")
    p.add_argument("--fidelity-n", type=int, default=400, help="queries per split for fidelity (0: none)")
    p.add_argument("--queries-n", type=int, default=100, help="queries timed one by one per round")
    p.add_argument("--rounds", type=int, default=5, help="speed rounds (0: fidelity only)")
    p.add_argument("--quick", action="store_true", help="1 round, 5 timed queries, 20 per split for fidelity")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.queries_n, args.fidelity_n = min(args.rounds, 1), min(args.queries_n, 5), min(args.fidelity_n, 20)
    if args.child:
        print(json.dumps(child(args.index, args.queries, args.queries_n)))
        return 0
    from espn.corpus import read_qrels
    from espn.index import read_manifest

    args.work.mkdir(parents=True, exist_ok=True)
    arms, info = {}, {}
    for arm in ARMS:
        arms[arm], seconds = make_arm(args.index.resolve(), args.work.resolve(), arm, args.centroids)
        manifest = read_manifest(arms[arm])
        info[arm] = {"recode_s": seconds, "file_bytes": manifest["store"]["file_bytes"],
                     "bytes_per_token": manifest["store"]["file_bytes"] / manifest["counts"]["bow_vectors"],
                     "centroids": manifest["first_stage"]["centroids"], "residual": manifest["store"].get("residual")}
    queries, ids = _queries(args.queries)
    qrels = {split: read_qrels(args.data / "qrels" / f"{split}.tsv") for split in ("train", "test")}
    results = {"machine": machine(), "arms": info,
               "fidelity": fidelity(arms, queries, ids, qrels, args.fidelity_n) if args.fidelity_n else {},
               "speed": speed(arms, args.queries.resolve(), args.queries_n, args.rounds) if args.rounds else None,
               "args": {k: str(v) for k, v in vars(args).items()}}
    text = report(results)
    print(text)
    name = "residual" if args.centroids is None else f"residual-c{args.centroids}"
    write_results(name if args.fidelity_n else f"{name}-speed", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
