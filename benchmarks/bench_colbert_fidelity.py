"""What compact records cost a ColBERT checkpoint: pooling and int8 against its fp16 MaxSim.

    python -m benchmarks.make_colbert_checkpoint /tmp/minilm-colbert
    espn index corpus.jsonl.gz --out /tmp/scifact-colbert --encoder colbert:/tmp/minilm-colbert \\
        --pool-factor 1 --bow-dtype float16
    python -m benchmarks.bench_colbert_fidelity --index /tmp/scifact-colbert --work /tmp/colbert-fidelity

From the unpooled fp16 index the build's assemble stage writes one index per setting (the
corpus is encoded once, as in bench_compact). Every index answers SciFact's test queries
with an exhaustive MaxSim (every document scored: the first stage plays no part), so the
table shows the records' fidelity alone: nDCG@10, the overlap of each query's top 10 with
the fp16 index's, and the mean relative change of the top hit's score.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.bench_compact import assemble_setting, export_chunks  # noqa: E402
from benchmarks.common import SCIFACT, machine, machine_line, markdown_table, write_results  # noqa: E402

SETTINGS = ("1:float16", "1:int8", "2:float16", "2:int8")


def exhaustive_run(index: Path, qids: list[str], texts: list[str], k: int = 10,
                   batch: int = 16) -> tuple[dict[str, list[tuple[str, float]]], float]:
    """Top-k (doc id, score) per query, every document scored by MaxSim; and the index's MiB of records."""
    from espn.search.searcher import Searcher

    run: dict[str, list[tuple[str, float]]] = {}
    with Searcher.open(index) as searcher:
        assert searcher.encoder is not None
        n = searcher.num_documents
        for start in range(0, len(texts), batch):
            q = searcher.encoder.encode_queries(texts[start:start + batch])
            for qid, hits in zip(qids[start:start + batch], searcher.search_exhaustive(q, k=k, rerank_count=n)):
                run[qid] = [(hit.doc_id, float(hit.score)) for hit in hits]
        size = (index / "embeddings.bin").stat().st_size / 2**20
    return run, size


def main(argv: list[str] | None = None) -> int:
    from espn.corpus import read_qrels, read_queries
    from espn.evaluation import evaluate, strictly_decreasing

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--index", type=Path, required=True, help="a ColBERT index with --pool-factor 1 --bow-dtype float16")
    p.add_argument("--work", type=Path, required=True, help="scratch directory for the other settings' indexes")
    p.add_argument("--queries", type=Path, default=SCIFACT / "queries.jsonl")
    p.add_argument("--qrels", type=Path, default=SCIFACT / "qrels" / "test.tsv")
    p.add_argument("--limit", type=int, default=None, help="the first N judged queries only")
    p.add_argument("--settings", default=",".join(SETTINGS), help="pool:dtype list, 1:float16 first")
    args = p.parse_args(argv)
    qrels = read_qrels(args.qrels)
    rows = [(qid, text) for qid, text in read_queries(args.queries) if qid in qrels]
    rows = rows[: args.limit] if args.limit else rows
    qids, texts = [q for q, _ in rows], [t for _, t in rows]
    encoded = export_chunks(args.index, args.work / "encoded.partial")
    runs, table = {}, []
    for setting in args.settings.split(","):
        factor, dtype = setting.split(":")
        if setting == "1:float16":
            path = args.index
        else:
            path = args.work / f"pool{factor}-{dtype}"
            if not (path / "manifest.json").is_file():
                assemble_setting(encoded, path, int(factor), dtype)
        started = time.perf_counter()
        run, size = exhaustive_run(path, qids, texts)
        seconds = time.perf_counter() - started
        runs[setting] = run
        base = runs["1:float16"]
        overlap = np.mean([len({d for d, _ in run[q]} & {d for d, _ in base[q]}) / 10 for q in qids])
        top = np.mean([abs(run[q][0][1] - base[q][0][1]) / abs(base[q][0][1]) for q in qids])
        ndcg = evaluate({q: dict(strictly_decreasing(h)) for q, h in run.items()}, qrels)["nDCG@10"]
        table.append([setting, round(size, 2), round(ndcg, 4), round(float(overlap), 3), f"{100 * top:.2f}%",
                      round(seconds, 1)])
        print(setting, table[-1], flush=True)
    headers = ["pool:dtype", "embeddings.bin MiB", "nDCG@10 (exhaustive)", "top-10 overlap with fp16",
               "top score change", "search s"]
    print(markdown_table(headers, table))
    print(machine_line(machine()))
    write_results("colbert_fidelity", {"index": str(args.index), "rows": table, "headers": headers,
                                       "manifest": json.loads((args.index / "manifest.json").read_text())["encoder"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
