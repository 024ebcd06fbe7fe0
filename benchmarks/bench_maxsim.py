"""The compiled MaxSim kernel against the torch fallback, on the records of real searches.

    python -m benchmarks.bench_maxsim --index .espn/scifact-index --n 60
    python -m benchmarks.bench_maxsim --index .espn/sample-index --queries espn/data/sample_queries.jsonl --n 5

Each search runs as served (`search_embeddings`, one query per call, memory reader); its
final scoring call (`espn.search.scoring.score_records`) is intercepted, and both paths score
the very records and pairs that call was given, twice each in alternation, while the records
are alive. Reported: the median milliseconds per call of each path, their ratio, and the
largest difference between their scores (the torch path is the reference).
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

from benchmarks.common import (SCIFACT, SCIFACT_INDEX, machine, machine_line, markdown_table, median,
                               take_queries, write_results)


def measure(index: Path, queries_file: Path, n: int, k: int) -> dict[str, Any]:
    from espn import Searcher
    from espn.corpus import read_queries
    from espn.maxsim_native import load_kernel
    from espn.search import scoring

    if load_kernel() is None:
        raise SystemExit("the native MaxSim kernel is not built here (pip install needs a C compiler)")
    score_records = scoring.score_records
    times: dict[bool, list[float]] = {True: [], False: []}
    worst = 0.0
    pairs: list[int] = []

    def both_paths(*args: Any, **kwargs: Any) -> np.ndarray:
        nonlocal worst
        out = {}
        for native in (True, False, True, False):
            started = time.perf_counter()
            out[native] = score_records(*args, **{**kwargs, "native": native})
            times[native].append((time.perf_counter() - started) * 1000)
        worst = max(worst, float(np.abs(out[True] - out[False]).max(initial=0.0)))
        pairs.append(len(args[3]))
        return out[True]

    texts = [text for _, text in read_queries(queries_file)][:n]
    scoring.score_records = both_paths  # the Searcher's own scoring call, timed both ways
    try:
        with Searcher.open(index, reader="memory") as searcher:
            queries = searcher.encoder.encode_queries(texts)
            for i in range(len(texts)):
                searcher.search_embeddings(take_queries(queries, np.array([i])), k=k)
    finally:
        scoring.score_records = score_records
    kernel, torch_ms = median(times[True]), median(times[False])
    return {"index": str(index), "queries": len(texts), "k": k, "calls": len(pairs), "pairs_per_call": median(pairs),
            "kernel_ms": round(kernel, 3), "torch_ms": round(torch_ms, 3),
            "torch_over_kernel": round(torch_ms / kernel, 2) if kernel else None, "max_abs_difference": worst,
            "machine": machine()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, default=SCIFACT_INDEX)
    p.add_argument("--queries", type=Path, default=SCIFACT / "queries.jsonl", help="BEIR queries (JSONL)")
    p.add_argument("--n", type=int, default=60, help="queries searched")
    p.add_argument("--k", type=int, default=10)
    args = p.parse_args(argv)
    if not (args.index / "manifest.json").is_file():
        print(f"no index at {args.index} (build one with `espn index`)", file=sys.stderr)
        return 1
    result = measure(args.index, args.queries, args.n, args.k)
    print(f"# MaxSim kernel against torch: {args.index} ({result['queries']} queries, k={args.k}, "
          f"{result['pairs_per_call']:.0f} pairs per call)")
    print(machine_line(result["machine"]))
    print(markdown_table(["path", "median ms per scoring call"],
                         [["native kernel", result["kernel_ms"]], ["torch (native=False)", result["torch_ms"]],
                          ["torch ÷ kernel", result["torch_over_kernel"]],
                          ["largest score difference", f"{result['max_abs_difference']:.2g}"]]))
    write_results("maxsim_kernel", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
