"""Batches (the paper's Figs. 8-10): critical-path embedding access, latency and QPS vs batch size.

    python -m benchmarks.bench_batch --index /tmp/espn-synth-2m
    python -m benchmarks.bench_batch --index /tmp/espn-synth --quick

For full re-ranking (rerank_count 1000) and partial re-ranking (64, 128), with the posix
reader and prefetching (prefetch_k = rerank_count), one `search_embeddings` call per
batch of B queries, B = 1, 2, 4 ... 256:

- critical-path embedding access = prefetch_wait + miss_read (ms per call): the time the
  query thread spends waiting for embeddings after the ANN search;
- end-to-end latency of the call (ms) and QPS = B / latency.

Every (rerank, B) configuration is measured in each of `--repeats` rounds, in a shuffled
order, over about `--queries` queries (at least 2 calls); the tables give medians over
rounds. The SSD's random-read bandwidth is measured first in the same run (posix reader,
random documents, no cache: O_DIRECT).

The batch threshold (the paper's equation (4)): prefetching hides the SSD only while a
batch's prefetch reads fit in the ANN time left after the first wave,

    B · prefetch_k · S / BW  <=  T_λ(B)        S = mean bytes read per document

so B* = BW · T_λ / (prefetch_k · S). On a GPU T_λ barely grows with B and B* is a real
threshold; on this CPU the ANN time grows ~linearly with B, so both sides grow together.
We report B* with T_λ of a single query (the paper's form) and the first measured B
where the reads exceed T_λ(B).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import load_queries, machine, machine_line, markdown_table, median, take_queries, write_results

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RERANKS = (1000, 64, 128)


def measure_bandwidth(searcher, docs: int = 4000, rounds: int = 3, seed: int = 0) -> dict:
    """Random-document read bandwidth of the searcher's reader (bytes/s, median of rounds)."""
    rng = np.random.default_rng(seed)
    rates, per_doc = [], []
    for _ in range(rounds):
        picks = np.unique(rng.integers(0, searcher.num_documents, docs))
        t = time.perf_counter()
        batch = searcher.reader.read(picks)
        dt = time.perf_counter() - t
        rates.append(batch.bytes_read / dt)
        per_doc.append(batch.bytes_read / len(picks))
    return {"bytes_per_s": median(rates), "bytes_per_doc": median(per_doc), "rounds": rates}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, required=True)
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--reranks", default=",".join(map(str, RERANKS)))
    p.add_argument("--queries", type=int, default=256, help="queries per configuration (>= 2 calls each)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reader", default="posix")
    p.add_argument("--params", default="{}", help="JSON overrides (nprobe, prefetch_step)")
    p.add_argument("--quick", action="store_true", help="batches 1,4,16; 1 round; 32 queries")
    p.add_argument("--name", default="batch")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    reranks = [int(r) for r in args.reranks.split(",")]
    if args.quick:
        batches, args.repeats, args.queries = [1, 4, 16], 1, 32
    extra = json.loads(args.params)
    from espn import Searcher

    info = machine()
    searcher = Searcher.open(args.index, reader=args.reader, verify="none")
    queries = load_queries(args.index.with_name(args.index.name + ".queries.npz"))
    nq = len(queries.cls)
    bw = measure_bandwidth(searcher, docs=500 if args.quick else 4000)
    print(f"random-read bandwidth {bw['bytes_per_s'] / 1e6:.0f} MB/s, {bw['bytes_per_doc']:.0f} B/doc", file=sys.stderr)
    step = searcher.params(**extra).prefetch_step

    runs = []
    rng = np.random.default_rng(0)
    for r in range(args.repeats):
        plan = [(rr, b) for rr in reranks for b in batches]
        random.Random(r).shuffle(plan)
        for rr, b in plan:
            params = {**extra, "rerank_count": rr, "prefetch_k": rr, "k": 10}
            calls = max(2, math.ceil(args.queries / b))
            order = rng.permutation(max(nq, calls * b))[: calls * b] % nq
            searcher.search_embeddings(take_queries(queries, order[:b]), **params)  # warm this shape
            lat, crit, ann, read, hit = [], [], [], [], []
            for c in range(calls):
                rows = order[c * b : (c + 1) * b]
                t = time.perf_counter()
                res = searcher.search_embeddings(take_queries(queries, rows), **params)
                lat.append((time.perf_counter() - t) * 1000)
                st = res[0].stats.stage_ms
                crit.append(st.get("prefetch_wait", 0.0) + st.get("miss_read", 0.0))
                ann.append(st.get("ann", 0.0))
                read.append(sum(x.stats.bytes_read for x in res))
                hit.append(float(np.mean([x.stats.hit_rate for x in res])))
            runs.append({"round": r, "rerank": rr, "batch": b, "calls": calls, "latency_ms": median(lat),
                         "critical_ms": median(crit), "ann_ms": median(ann), "bytes_per_call": median(read),
                         "hit_rate": float(np.mean(hit)), "qps": b / (median(lat) / 1000)})
            print(f"round {r} rerank {rr} batch {b}: {runs[-1]['latency_ms']:.1f} ms, crit {runs[-1]['critical_ms']:.1f}",
                  file=sys.stderr)
    searcher.close()

    def agg(rr: int, b: int, key: str) -> float:
        return median([x[key] for x in runs if x["rerank"] == rr and x["batch"] == b])

    thresholds = {}
    for rr in reranks:
        t_lambda_1 = agg(rr, batches[0], "ann_ms") * (1 - step) / batches[0]
        paper = bw["bytes_per_s"] * t_lambda_1 / 1000 / (rr * bw["bytes_per_doc"])
        measured = None
        for b in batches:
            reads_ms = b * rr * bw["bytes_per_doc"] / bw["bytes_per_s"] * 1000
            if reads_ms > agg(rr, b, "ann_ms") * (1 - step):
                measured = b
                break
        thresholds[rr] = {"paper_eq4": paper, "first_b_reads_exceed_ann": measured, "t_lambda_1_ms": t_lambda_1}

    out = [f"Index {args.index}, reader {args.reader}, prefetch_k = rerank_count, prefetch_step {step}; "
           f"{args.repeats} round(s), ~{args.queries} queries per point; random-read bandwidth "
           f"{bw['bytes_per_s'] / 1e6:.0f} MB/s ({bw['bytes_per_doc']:.0f} B/doc). Machine: {machine_line(info)}"]
    for rr in reranks:
        th = thresholds[rr]
        out.append(f"**rerank_count {rr}** — eq. (4) threshold B* = {th['paper_eq4']:.1f} (T_λ of one query "
                   f"{th['t_lambda_1_ms']:.1f} ms); first measured B with reads > T_λ(B): {th['first_b_reads_exceed_ann']}\n")
        out.append(markdown_table(["batch", "latency ms", "critical-path embedding ms", "ANN ms", "QPS", "hit rate",
                                   "MB read/call"],
                                  [[b, agg(rr, b, "latency_ms"), agg(rr, b, "critical_ms"), agg(rr, b, "ann_ms"),
                                    agg(rr, b, "qps"), agg(rr, b, "hit_rate"), agg(rr, b, "bytes_per_call") / 1e6]
                                   for b in batches]))
    print("\n\n".join(out))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for rr in reranks:
        for ax, key in zip(axes, ("critical_ms", "latency_ms", "qps")):
            ax.plot(batches, [agg(rr, b, key) for b in batches], "o-", label=f"rerank {rr}")
    for ax, title in zip(axes, ("critical-path embedding access (ms)", "end-to-end latency (ms)", "QPS")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_title(title)
        for rr in reranks:
            b_star = thresholds[rr]["paper_eq4"]
            if np.isfinite(b_star) and batches[0] <= b_star <= batches[-1]:
                ax.axvline(b_star, ls=":", lw=1, color="grey")
        ax.legend()
    write_results(args.name, {"machine": info, "index": str(args.index), "bandwidth": bw, "prefetch_step": step,
                              "thresholds": thresholds, "runs": runs}, fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
