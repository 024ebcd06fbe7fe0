"""Prefetcher (the paper's Fig. 7): hit rate against prefetch step, for two nprobe values.

    python -m benchmarks.bench_prefetch --index /data/synth2m --scifact .espn/scifact-index
    python -m benchmarks.bench_prefetch --index /tmp/espn-synth --quick

Hit rate = |prefetched ∩ re-ranked| / |re-ranked| per query, averaged over queries. A
prefetch wave starts after every δ = ceil(step·η) probed clusters and reads the current
top `prefetch_k` candidates not yet taken, so a small step means more, earlier waves.
Waves are measured with the cost model off (`min_hidden_ms=0`: every wave is taken), so
the figure depends on the ANN's progression, not on timing, and one pass per configuration
is exact (no repeats needed); at the defaults the cost model may skip a late wave that the
remaining scan cannot hide (bench_readers and bench_memory report the hit rate then). The docs read per query are reported too, because a high hit
rate bought by reading many extra documents costs SSD bandwidth (read amplification =
prefetched documents / re-ranked documents).

On the synthetic index the queries are `INDEX.queries.npz`; on SciFact the 300 test
queries encoded by the index's own encoder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import SCIFACT, SCIFACT_INDEX, load_queries, machine, machine_line, markdown_table, \
    take_queries, write_results

STEPS = (0.05, 0.1, 0.2, 0.3)


def measure(searcher, queries, nprobes, steps, batch: int, seed: int, extra: dict) -> list[dict]:
    """queries: QueryEmbeddings or list of strings. One row per (nprobe, step)."""
    n = len(queries) if isinstance(queries, list) else len(queries.cls)
    order = np.random.default_rng(seed).permutation(n)
    rows = []
    for nprobe in nprobes:
        for step in steps:
            hits: list[float] = []
            prefetched: list[int] = []
            misses: list[int] = []
            for i in range(0, n, batch):
                rows_i = order[i : i + batch]
                params = dict(nprobe=nprobe, prefetch_step=step, prefetch=True, **extra)
                if isinstance(queries, list):
                    results = searcher.search([queries[j] for j in rows_i], **params)
                else:
                    results = searcher.search_embeddings(take_queries(queries, rows_i), **params)
                for r in results:
                    hits.append(r.stats.hit_rate)
                    prefetched.append(r.stats.prefetched)
                    misses.append(r.stats.missed)
            rr = searcher.params(**extra).rerank_count
            rows.append({"nprobe": nprobe, "step": step, "hit_rate": float(np.mean(hits)),
                         "hit_rate_p10": float(np.percentile(hits, 10)), "prefetched": float(np.mean(prefetched)),
                         "missed": float(np.mean(misses)), "rerank_count": rr,
                         "amplification": float(np.mean(prefetched)) / rr, "queries": n})
            print(f"nprobe {nprobe} step {step}: hit {rows[-1]['hit_rate']:.3f}", file=sys.stderr)
    return rows


def default_nprobes(searcher) -> list[int]:
    d = searcher.defaults.nprobe
    return sorted({max(1, d // 2), d})


def scifact_queries(scifact: Path, limit: int | None) -> list[str]:
    qrels = {line.split("\t")[0] for line in (scifact / "qrels" / "test.tsv").read_text().splitlines()[1:]}
    texts = []
    with open(scifact / "queries.jsonl") as f:
        for line in f:
            q = json.loads(line)
            if q["_id"] in qrels:
                texts.append(q["text"])
    return texts[:limit] if limit else texts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, help="large (synthetic) index; its queries at INDEX.queries.npz")
    p.add_argument("--scifact", type=Path, default=SCIFACT_INDEX, help="built SciFact index ('' to skip)")
    p.add_argument("--scifact-data", type=Path, default=SCIFACT)
    p.add_argument("--nprobe", default="auto", help="comma list, or auto = (default/2, default) of each index")
    p.add_argument("--steps", default=",".join(str(s) for s in STEPS))
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--params", default="{}", help="JSON overrides (prefetch_k, rerank_count)")
    p.add_argument("--quick", action="store_true", help="40 queries")
    p.add_argument("--name", default="prefetch")
    p.add_argument("--reader", default="posix", help="reader for both indexes (bench_gpu: kvikio)")
    args = p.parse_args(argv)
    if args.quick:
        args.queries = 40
    steps = [float(s) for s in args.steps.split(",")]
    extra = json.loads(args.params)
    from espn import Searcher

    info = machine()
    studies: dict[str, list[dict]] = {}
    if args.index:
        with Searcher.open(args.index, reader=args.reader, verify="none", min_hidden_ms=0) as s:
            q = load_queries(args.index.with_name(args.index.name + ".queries.npz"))
            q = take_queries(q, np.arange(min(args.queries, len(q.cls))))
            nprobes = default_nprobes(s) if args.nprobe == "auto" else [int(x) for x in args.nprobe.split(",")]
            studies[f"large ({s.num_documents:,} docs, nlist {s.nlist})"] = measure(s, q, nprobes, steps, args.batch, 0, extra)
    if args.scifact and str(args.scifact) and (args.scifact / "manifest.json").is_file():
        with Searcher.open(args.scifact, reader=args.reader, verify="none", min_hidden_ms=0) as s:
            q = scifact_queries(args.scifact_data, args.queries)
            nprobes = default_nprobes(s) if args.nprobe == "auto" else [int(x) for x in args.nprobe.split(",")]
            studies[f"SciFact ({s.num_documents:,} docs, nlist {s.nlist})"] = measure(s, q, nprobes, steps, args.batch, 0, extra)
    elif args.scifact and str(args.scifact) != ".":
        print(f"SciFact index not found at {args.scifact}; skipped", file=sys.stderr)

    out = [f"Machine: {machine_line(info)}"]
    for name, rows in studies.items():
        out.append(f"**{name}**, prefetch_k {extra.get('prefetch_k', 'default')}, rerank_count "
                   f"{rows[0]['rerank_count']}, {rows[0]['queries']} queries\n")
        out.append(markdown_table(
            ["nprobe η", "step", "hit rate", "hit rate p10", "docs prefetched/query", "misses/query", "read amplification"],
            [[r["nprobe"], f"{int(r['step'] * 100)}%", r["hit_rate"], r["hit_rate_p10"], r["prefetched"], r["missed"],
              r["amplification"]] for r in rows]))
    print("\n\n".join(out))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(1, len(studies)), figsize=(5 * max(1, len(studies)), 3.6), squeeze=False)
    for ax, (name, rows) in zip(axes[0], studies.items()):
        for nprobe in sorted({r["nprobe"] for r in rows}):
            mine = [r for r in rows if r["nprobe"] == nprobe]
            ax.plot([100 * r["step"] for r in mine], [100 * r["hit_rate"] for r in mine], "o-", label=f"nprobe {nprobe}")
        ax.axhline(90, color="grey", ls=":", lw=1)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("prefetch step (% of nprobe)")
        ax.set_ylabel("hit rate (%)")
        ax.legend()
    write_results(args.name, {"machine": info, "studies": studies, "params": extra, "reader": args.reader}, fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
