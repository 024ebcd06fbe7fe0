"""Text in, hits out: what a user feels, one query at a time, and where the time goes.

    python -m benchmarks.bench_query --index scifact-index --repeats 3
    python -m benchmarks.bench_query --index scifact-index --repeats 3 --cpu-load 1
    python -m benchmarks.bench_query --index /tmp/espn-synth --quick

Each round runs every configuration once over the same queries (SciFact test queries with
judgements), in a shuffled order: `Searcher.search([text], k)` through each reader with its
default prefetch setting, and the query encoder alone (`encoder.encode_queries([text])`).
The tables give the median over rounds of each round's p50 and p99, the encoder's share of
the end-to-end time (its stage time ÷ the call's, per query, median), the search part (the
call's time less its encode stage, per query) and nDCG@10 of the
ranked hits. Only the public API is used, so the same script measures an older checkout.
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

from benchmarks.common import (SCIFACT, SCIFACT_INDEX, cpu_load, machine, machine_line, markdown_table, median,
                               write_results)

READERS = ("posix", "memory")


def read_texts(queries: Path, qrels: dict | None, n: int) -> tuple[list[str], list[str]]:
    from espn.corpus import read_queries

    rows = [(qid, text) for qid, text in read_queries(queries) if qrels is None or qid in qrels]
    rows = rows[:n]
    return [qid for qid, _ in rows], [text for _, text in rows]


def run_text(searcher, texts: list[str], k: int) -> tuple[list[float], list[float], list]:
    """Per query: wall ms of the whole call, ms of its encode stage, and the hits."""
    total, encode, hits = [], [], []
    for text in texts:
        t = time.perf_counter()
        (result,) = searcher.search([text], k=k)
        total.append((time.perf_counter() - t) * 1000)
        encode.append(float(result.stats.stage_ms.get("encode", 0.0)))
        hits.append(result.hits)
    return total, encode, hits


def run_encoder(encoder, texts: list[str]) -> list[float]:
    out = []
    for text in texts:
        t = time.perf_counter()
        encoder.encode_queries([text])
        out.append((time.perf_counter() - t) * 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, default=SCIFACT_INDEX)
    p.add_argument("--queries", type=Path, default=SCIFACT / "queries.jsonl", help="BEIR queries")
    p.add_argument("--qrels", type=Path, default=SCIFACT / "qrels" / "test.tsv", help="'' for none")
    p.add_argument("--n", type=int, default=300, help="queries per round")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--readers", default=",".join(READERS))
    p.add_argument("--cpu-load", type=int, default=0, help="CPU-bound processes running beside the benchmark")
    p.add_argument("--quick", action="store_true", help="20 queries, 1 round")
    p.add_argument("--name", default="query")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.repeats = min(args.n, 20), 1

    from espn import Searcher
    from espn.corpus import read_qrels
    from espn.evaluation import evaluate

    qrels = read_qrels(args.qrels) if str(args.qrels) and args.qrels.is_file() else None
    qids, texts = read_texts(args.queries, qrels, args.n)
    if not texts:
        p.error(f"no queries with judgements in {args.queries}")
    readers = args.readers.split(",")
    searchers = {name: Searcher.open(args.index, reader=name, verify="none") for name in readers}
    encoder = searchers[readers[0]].encoder
    for searcher in searchers.values():  # warm up: first calls pay allocation and page-in
        run_text(searcher, texts[:16], args.k)
    configs = [f"text/{name}" for name in readers] + ["encoder only"]
    raw: dict[str, dict] = {c: {"round_p50": [], "round_p99": [], "encode_p50": [], "search_p50": [], "share": []}
                            for c in configs}
    info = machine()
    with cpu_load(args.cpu_load) as load:
        rng = random.Random(0)
        for _ in range(args.repeats):
            order = configs[:]
            rng.shuffle(order)
            for config in order:
                cell = raw[config]
                if config == "encoder only":
                    lat = run_encoder(encoder, texts)
                    cell["round_p50"].append(float(np.percentile(lat, 50)))
                    cell["round_p99"].append(float(np.percentile(lat, 99)))
                    continue
                total, encode, hits = run_text(searchers[config.split("/")[1]], texts, args.k)
                cell["round_p50"].append(float(np.percentile(total, 50)))
                cell["round_p99"].append(float(np.percentile(total, 99)))
                cell["encode_p50"].append(float(np.percentile(encode, 50)))
                cell["search_p50"].append(float(np.percentile(np.asarray(total) - np.asarray(encode), 50)))
                cell["share"].append(float(np.median(np.asarray(encode) / np.asarray(total))))
                if qrels is not None:
                    run = {qid: {h.doc_id: h.score for h in ranked} for qid, ranked in zip(qids, hits)}
                    cell["ndcg10"] = evaluate(run, qrels)["nDCG@10"]
    for searcher in searchers.values():
        searcher.close()

    rows = [[config, median(cell["round_p50"]), median(cell["round_p99"]),
             median(cell["encode_p50"]) if cell["encode_p50"] else "n/a",
             median(cell["search_p50"]) if cell["search_p50"] else "n/a",
             f"{100 * median(cell['share']):.0f}%" if cell["share"] else "n/a",
             f"{cell['ndcg10']:.4f}" if "ndcg10" in cell else "n/a"] for config, cell in raw.items()]
    print(f"# Text in, hits out: {args.index} ({len(texts)} queries one at a time, k={args.k}, "
          f"{args.repeats} rounds; load: {load})")
    print(machine_line(info))
    print(f"encoder: {describe_encoder(encoder)}")
    print(markdown_table(["configuration", "p50 ms", "p99 ms", "encode p50 ms", "search p50 ms", "encoder share",
                          "nDCG@10"], rows))
    write_results(args.name, {"machine": info, "load": load, "encoder": describe_encoder(encoder),
                              "args": {k: str(v) for k, v in vars(args).items()}, "configs": raw})
    return 0


def describe_encoder(encoder) -> str:
    """The encoder and how it runs (backend and threads where the encoder says)."""
    describe = getattr(encoder, "describe", None)
    if callable(describe):
        return str(describe())
    import torch

    return f"{type(encoder).__name__} (torch {torch.__version__}, {torch.get_num_threads()} threads)"


if __name__ == "__main__":
    sys.exit(main())
