"""What an explanation costs: the same single-query searches with and without `explain`.

    python -m benchmarks.bench_explain --index .espn/scifact-index --n 100 --repeats 3
    python -m benchmarks.bench_explain --index /tmp/espn-sample --quick

Each round runs the same queries (SciFact test queries with judgements) one at a time,
twice each, in a shuffled order: `Searcher.search([text], k)` and the same call with
`explain=True`. The table gives, per configuration, the median over rounds of each round's
p50 of the whole call, and for the explained calls the p50 of their `explain` stage alone;
the ratio the documentation quotes is explain p50 ÷ search p50 (the explanation's own
time against the search it explains). Only the public API is used.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.bench_query import read_texts  # noqa: E402
from benchmarks.common import SCIFACT, SCIFACT_INDEX, machine, machine_line, markdown_table, median, write_results  # noqa: E402


def run(searcher, texts: list[str], k: int, explain: bool) -> tuple[list[float], list[float]]:
    """Per query: wall ms of the whole call, and ms of its explain stage (0 without)."""
    total, stage = [], []
    for text in texts:
        t = time.perf_counter()
        (result,) = searcher.search([text], k=k, explain=explain)
        total.append((time.perf_counter() - t) * 1000)
        stage.append(float(result.stats.stage_ms.get("explain", 0.0)))
    return total, stage


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, default=SCIFACT_INDEX)
    p.add_argument("--queries", type=Path, default=SCIFACT / "queries.jsonl", help="BEIR queries")
    p.add_argument("--qrels", type=Path, default=SCIFACT / "qrels" / "test.tsv", help="'' for none")
    p.add_argument("--n", type=int, default=100, help="queries per round")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--reader", default="posix")
    p.add_argument("--quick", action="store_true", help="10 queries, 1 round")
    p.add_argument("--name", default="explain")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.repeats = min(args.n, 10), 1

    from espn import Searcher
    from espn.corpus import read_qrels

    qrels = read_qrels(args.qrels) if str(args.qrels) and args.qrels.is_file() else None
    _, texts = read_texts(args.queries, qrels, args.n)
    if not texts:
        p.error(f"no queries with judgements in {args.queries}")
    searcher = Searcher.open(args.index, reader=args.reader, verify="none")
    run(searcher, texts[:8], args.k, explain=False)  # warm up: first calls pay allocation and page-in
    run(searcher, texts[:8], args.k, explain=True)
    raw: dict[str, dict[str, list[float]]] = {c: {"p50": [], "p99": [], "explain_p50": []}
                                              for c in ("search", "search + explain")}
    info = machine()
    rng = random.Random(0)
    for _ in range(args.repeats):
        order = list(raw)
        rng.shuffle(order)
        for config in order:
            total, stage = run(searcher, texts, args.k, explain=config != "search")
            raw[config]["p50"].append(float(np.percentile(total, 50)))
            raw[config]["p99"].append(float(np.percentile(total, 99)))
            raw[config]["explain_p50"].append(float(np.percentile(stage, 50)))
    searcher.close()

    search_p50 = median(raw["search"]["p50"])
    explain_p50 = median(raw["search + explain"]["explain_p50"])
    rows = [[config, median(cell["p50"]), median(cell["p99"]),
             median(cell["explain_p50"]) if config != "search" else "n/a"] for config, cell in raw.items()]
    print(f"# Explanations: {args.index} ({len(texts)} queries one at a time, k={args.k}, reader {args.reader}, "
          f"{args.repeats} rounds)")
    print(machine_line(info))
    print(markdown_table(["configuration", "p50 ms", "p99 ms", "explain stage p50 ms"], rows))
    print(f"explain p50 / search p50: {explain_p50 / search_p50:.2f}")
    write_results(args.name, {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "configs": raw,
                              "ratio": explain_p50 / search_p50})
    return 0


if __name__ == "__main__":
    sys.exit(main())
