"""Does prefetching pay? The same queries through each reader, prefetch on and off, side by side.

    python -m benchmarks.bench_readers --index .espn/scifact-index --repeats 5
    python -m benchmarks.bench_readers --index /data/synth2m --queries-npz /data/synth2m/queries.npz

Queries are encoded once, before anything is timed (the stage measured is the search,
not the encoder). Each round runs every configuration (reader × prefetch × batch size)
once over all queries, in a shuffled order, and the tables give per-query latency
percentiles pooled over rounds and the median over rounds of each round's p50, so that
one noisy round cannot move the result. Ratios are taken within this one run. With
`--qrels` the effectiveness of each configuration is printed too (all must agree).

`--every-wave` adds two posix searchers with the prefetch cost model off (`min_hidden_ms=0`:
every wave is taken), whatever the model would decide: one submits each wave from the
scanning thread (the CPU default), one hands it to a worker that reads and scores it while
the scan goes on (`early_rerank`, the GPU default). Their ANN ms against the plain posix
row is what waves cost the scan on this machine; their read wait ms, what they hide.
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

from benchmarks.common import (SCIFACT, SCIFACT_INDEX, cpu_load, load_queries, machine, machine_line, markdown_table,
                               median, percentiles, take_queries, write_results)

READERS = ("memory", "posix")
#: --every-wave: (name, early_rerank) of the posix searchers that take every wave.
EVERY_WAVE = (("posix, every wave", False), ("posix, every wave on a worker", True))


def encode_scifact_queries(searcher, path: Path, qrels: dict | None):
    """(query ids, QueryEmbeddings) of the BEIR queries that have judgements (all if no qrels)."""
    from espn.corpus import read_queries

    rows = [(qid, text) for qid, text in read_queries(path) if qrels is None or qid in qrels]
    return [qid for qid, _ in rows], searcher.encoder.encode_queries([text for _, text in rows])


def run_config(searcher, queries, batch: int, prefetch: bool, k: int) -> tuple[list[float], list, list]:
    """Per-query latency (ms; a batch's latency divided by nothing: one value per call), results, stats."""
    latencies, results = [], []
    for start in range(0, len(queries), batch):
        chunk = take_queries(queries, np.arange(start, min(start + batch, len(queries))))
        t = time.perf_counter()
        out = searcher.search_embeddings(chunk, k=k, prefetch=prefetch)
        latencies.append((time.perf_counter() - t) * 1000)
        results.extend(out)
    return latencies, results, [r.stats for r in results]


def measure_rounds(searchers, queries, qids, qrels, configs, repeats: int, k: int) -> dict[tuple, dict]:
    """Every configuration once per round over all queries, in a shuffled order."""
    from espn.evaluation import evaluate

    raw: dict[tuple, dict] = {c: {"latencies": [], "round_p50": [], "round_p99": [], "round_qps": []} for c in configs}
    rng = random.Random(0)
    for _ in range(repeats):
        order = configs[:]
        rng.shuffle(order)
        for reader, prefetch, batch in order:
            lat, results, stats = run_config(searchers[reader], queries, batch, prefetch, k)
            cell = raw[(reader, prefetch, batch)]
            cell["latencies"] += lat
            cell["round_p50"].append(float(np.percentile(lat, 50)))
            cell["round_p99"].append(float(np.percentile(lat, 99)))
            cell["round_qps"].append(len(results) / (sum(lat) / 1000))
            cell["hit_rate"] = float(np.mean([s.hit_rate for s in stats]))
            cell["amplification"] = float(np.mean([s.read_amplification for s in stats]))
            cell["engine"] = stats[0].engine
            cell["waves"] = float(np.mean([s.waves for s in stats]))
            for stage in ("ann", "prefetch_wait", "miss_read", "maxsim"):
                cell.setdefault(f"{stage}_ms", []).append(float(np.median([s.stage_ms.get(stage, 0.0) for s in stats])))
            if qrels is not None:
                run = {qid: {h.doc_id: h.score for h in r.hits} for qid, r in zip(qids, results)}
                cell["ndcg10"] = evaluate(run, qrels)["nDCG@10"]
    return raw


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, default=SCIFACT_INDEX)
    p.add_argument("--queries", type=Path, default=SCIFACT / "queries.jsonl", help="BEIR queries (SciFact)")
    p.add_argument("--qrels", type=Path, default=SCIFACT / "qrels" / "test.tsv")
    p.add_argument("--queries-npz", type=Path, help="pre-encoded queries (synthetic index) instead of --queries")
    p.add_argument("--n", type=int, default=300, help="queries used")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--io-engine", default=None, help="posix read engine (default: best available)")
    p.add_argument("--cpu-load", type=int, default=0, help="CPU-bound processes running beside the benchmark")
    p.add_argument("--quick", action="store_true", help="20 queries, 2 rounds")
    p.add_argument("--every-wave", action="store_true",
                   help="also posix searchers that take every prefetch wave (the cost model off)")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.repeats = min(args.n, 20), 2

    from espn import Searcher
    from espn.corpus import read_qrels

    options = {"io_engine": args.io_engine} if args.io_engine else {}
    searchers = {name: Searcher.open(args.index, reader=name, verify="none", with_encoder=name == "posix"
                                     and args.queries_npz is None,
                                     reader_options=options if name == "posix" else None)
                 for name in READERS}
    waving = EVERY_WAVE if args.every_wave else ()
    for name, early in waving:
        searchers[name] = Searcher.open(args.index, reader="posix", verify="none", with_encoder=False,
                                        reader_options=options, min_hidden_ms=0, early_rerank=early)
    qrels = read_qrels(args.qrels) if args.queries_npz is None and args.qrels and args.qrels.is_file() else None
    if args.queries_npz is not None:
        queries = load_queries(args.queries_npz)
        qids = [str(i) for i in range(len(queries))]
    else:
        qids, queries = encode_scifact_queries(searchers["posix"], args.queries, qrels)
    n = min(args.n, len(queries))
    queries, qids = take_queries(queries, np.arange(n)), qids[:n]
    batches = [int(b) for b in args.batches.split(",")]
    configs = [(r, pf, b) for b in batches for r in READERS for pf in (True, False)]
    configs += [(name, True, b) for b in batches for name, _ in waving]
    for searcher in searchers.values():  # warm up: first calls pay allocation and page-in
        run_config(searcher, take_queries(queries, np.arange(min(16, n))), 1, True, args.k)

    info = machine()
    with cpu_load(args.cpu_load) as load:
        raw = measure_rounds(searchers, queries, qids, qrels, configs, args.repeats, args.k)

    rows = []
    for reader, prefetch, batch in configs:
        cell = raw[(reader, prefetch, batch)]
        pooled = percentiles(cell["latencies"])
        rows.append([batch, reader, "on" if prefetch else "off", cell["engine"], median(cell["round_p50"]),
                     median(cell["round_p99"]), pooled["mean"], median(cell["round_qps"]),
                     cell["hit_rate"] if prefetch else "n/a",
                     cell["amplification"] if prefetch else "n/a", cell["waves"] if prefetch else "n/a",
                     median(cell["ann_ms"]), median(cell["prefetch_wait_ms"]) + median(cell["miss_read_ms"]),
                     median(cell["maxsim_ms"]),
                     f"{cell['ndcg10']:.4f}" if "ndcg10" in cell else "n/a"])
    print(f"# Readers, prefetch on/off: {args.index} ({n} queries, k={args.k}, {args.repeats} rounds; load: {load})")
    print(machine_line(info))
    print(markdown_table(["batch", "reader", "prefetch", "engine", "p50 ms/call", "p99 ms/call", "mean ms/call",
                          "QPS", "hit rate", "read amplification", "waves", "ANN ms", "read wait ms", "MaxSim ms",
                          "nDCG@10"], rows))
    ratio_rows = []
    for batch in batches:
        def p50(reader: str, prefetch: bool) -> float:
            return median(raw[(reader, prefetch, batch)]["round_p50"])

        def p99(reader: str, prefetch: bool) -> float:
            return median(raw[(reader, prefetch, batch)]["round_p99"])

        ratio_rows.append([batch, p50("posix", True) / p50("posix", False), p99("posix", True) / p99("posix", False),
                           p50("posix", True) / p50("memory", False), p50("posix", False) / p50("memory", False)]
                          + [p50(name, True) / p50("memory", False) for name, _ in waving])
    print()
    print(markdown_table(["batch", "posix on ÷ off (p50; target <= 1)", "posix on ÷ off (p99; target <= 1)",
                          "posix+prefetch ÷ memory (p50)", "posix no prefetch ÷ memory (p50)"]
                         + [f"{name} ÷ memory (p50)" for name, _ in waving], ratio_rows))
    write_results("readers", {"machine": info, "load": load, "args": {k: str(v) for k, v in vars(args).items()},
                              "configs": {f"{r}/{'on' if pf else 'off'}/B{b}": raw[(r, pf, b)]
                                          for r, pf, b in configs}})
    for searcher in searchers.values():
        searcher.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
