"""Query encoding by backend and precision, 1 and 2 threads side by side; int8's fidelity on SciFact.

    python -m benchmarks.bench_query_encoders --queries 100            # BERT-base and ModernBERT-base
    python -m benchmarks.bench_query_encoders --fidelity-index /tmp/minilm-pylate-scifact
    python -m benchmarks.bench_query_encoders --quick                  # tiny backbones, the sample data

Speed: two seeded checkpoints of base size (no download; espn's PyLate loader, `colbert:`): a
BERT-base and a ModernBERT-base with MiniLM's WordPiece tokenizer and a Dense 768 -> 128, queries
expanded to 32 tokens. Each query (SciFact test queries, one at a time) runs through every path in
a shuffled order — torch, ONNX Runtime fp32 and ONNX Runtime int8 (espn.encoders.int8), each with
1 and 2 threads — so a burst of load on this shared machine falls on all of them alike; the table
gives each path's p50 and its ratio to torch at the same thread count.

Fidelity (`--fidelity-index`, built here when missing): MiniLM as a PyLate checkpoint
(benchmarks.make_colbert_checkpoint) indexing SciFact in fp32; its test queries encoded in fp32
and in int8, each searched exhaustively: the mean overlap of the two top 10s.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .common import SCIFACT, machine, machine_line, markdown_table, set_omp_env, write_results

set_omp_env()  # before torch is imported: see benchmarks.common.OMP_ENV

from .bench_st_encoders import base_backbone  # noqa: E402
from .make_colbert_checkpoint import write_checkpoint  # noqa: E402

THREADS = (1, 2)
BACKENDS = ("torch", "onnx fp32", "onnx int8")
QUERY_LENGTH = 32


def _checkpoint(work: Path, arch: str, tiny: bool) -> Path:
    base = base_backbone(work / f"{arch}-base", arch, seed=0, tiny=tiny)
    path = write_checkpoint(work / f"{arch}-pylate", fmt="pylate", dim=32 if tiny else 128, seed=1, source=base)
    settings = json.loads((path / "config_sentence_transformers.json").read_text())
    settings.update(query_length=QUERY_LENGTH, document_length=180)
    (path / "config_sentence_transformers.json").write_text(json.dumps(settings))
    return path


def _encoders(path: Path, threads: int) -> dict[str, Any]:
    """The three paths with `threads` intra-op threads (an ONNX graph takes torch's setting when made)."""
    import torch

    from espn.encoders.colbert import ColBERTEncoder

    torch.set_num_threads(threads)
    out = {"torch": ColBERTEncoder(path, device="cpu", query_backend="torch"),
           "onnx fp32": ColBERTEncoder(path, device="cpu", query_backend="onnx"),
           "onnx int8": ColBERTEncoder(path, device="cpu", query_backend="onnx", precision="int8-unchecked")}
    for encoder in out.values():
        encoder.prepare_precision()
        encoder.encode_queries(["a first query makes the graph"])
    return out


def _time_interleaved(paths: dict[tuple[str, int], Callable[[str], Any]], queries: list[str],
                      warmup: int) -> dict[tuple[str, int], list[float]]:
    import torch

    for text in queries[:warmup]:
        for (_, threads), encode in paths.items():
            torch.set_num_threads(threads)
            encode(text)
    times: dict[tuple[str, int], list[float]] = {key: [] for key in paths}
    order = list(paths)
    rng = random.Random(0)
    for text in queries:
        rng.shuffle(order)
        for key in order:
            torch.set_num_threads(key[1])  # the torch path's threads; a graph keeps its own
            start = time.perf_counter()
            paths[key](text)
            times[key].append((time.perf_counter() - start) * 1e3)
    return times


def measure_speed(arch: str, work: Path, queries: list[str], warmup: int, tiny: bool) -> list[dict[str, Any]]:
    path = _checkpoint(work, arch, tiny)
    encoders = {threads: _encoders(path, threads) for threads in THREADS}
    fidelity = encoders[1]["onnx int8"].int8_fidelity
    paths = {(backend, threads): (lambda text, e=encoders[threads][backend]: e.encode_queries([text]))
             for threads in THREADS for backend in BACKENDS}
    times = _time_interleaved(paths, queries, warmup)
    rows = []
    for threads in THREADS:
        torch_p50 = float(np.percentile(times[("torch", threads)], 50))
        for backend in BACKENDS:
            p50 = float(np.percentile(times[(backend, threads)], 50))
            rows.append({"model": arch, "threads": threads, "backend": backend, "p50_ms": round(p50, 2),
                         "p99_ms": round(float(np.percentile(times[(backend, threads)], 99)), 2),
                         "vs_torch": round(p50 / torch_p50, 3),
                         "probe_overlap": fidelity.overlap if backend == "onnx int8" and fidelity else None})
    return rows


def measure_fidelity(index: Path, queries_path: Path, qrels_path: Path, corpus: Path, limit: int) -> dict[str, Any]:
    """int8 against fp32 queries on an fp32 index of MiniLM as a PyLate checkpoint: top-10 overlap."""
    from espn.corpus import read_qrels, read_queries
    from espn.encoders.colbert import ColBERTEncoder
    from espn.search.searcher import Searcher
    from espn_indexing.build import BuildConfig, build_index

    from .make_colbert_checkpoint import write_checkpoint as minilm_checkpoint

    model = index.parent / f"{index.name}-model"
    if not (model / "modules.json").is_file():
        minilm_checkpoint(model, fmt="pylate")
    if not (index / "manifest.json").is_file():
        build_index(BuildConfig(corpus=corpus, out=index, encoder=f"colbert:{model}", bow_dtype="float16",
                                progress=False, text_index=None, device="cpu"))
    qrels = read_qrels(qrels_path) if qrels_path.is_file() else None
    texts = [text for qid, text in read_queries(queries_path) if qrels is None or qid in qrels][:limit]
    int8 = ColBERTEncoder(model, device="cpu", precision="int8-unchecked")
    int8.prepare_precision()
    with Searcher.open(index) as searcher:
        n = searcher.num_documents
        exact = searcher.search_exhaustive(searcher.encode(texts), k=10, rerank_count=n)
        quantised = searcher.search_exhaustive(int8.encode_queries(texts), k=10, rerank_count=n)
    overlaps = [len({h.doc_id for h in a} & {h.doc_id for h in b}) / 10 for a, b in zip(exact, quantised)]
    return {"queries": len(texts), "documents": n, "top10_overlap": round(float(np.mean(overlaps)), 4),
            "probe": None if int8.int8_fidelity is None else int8.int8_fidelity.to_json()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queries", type=int, default=100, help="SciFact test queries timed (one at a time)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--models", default="bert,modernbert")
    p.add_argument("--fidelity-index", type=Path, help="MiniLM-as-PyLate SciFact index (built here when missing)")
    p.add_argument("--fidelity-queries", type=int, default=300)
    p.add_argument("--quick", action="store_true", help="tiny backbones and the sample queries: a smoke run")
    p.add_argument("--name", default="query_encoders")
    args = p.parse_args(argv)
    data = Path(__file__).resolve().parents[1] / "espn" / "data"
    queries_path = data / "sample_queries.jsonl" if args.quick else SCIFACT / "queries.jsonl"
    qrels_path = data / "sample_qrels.tsv" if args.quick else SCIFACT / "qrels" / "test.tsv"
    from espn.corpus import read_qrels, read_queries

    qrels = read_qrels(qrels_path)
    texts = [text for qid, text in read_queries(queries_path) if qid in qrels]
    texts = texts[: 8 if args.quick else args.queries]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as work:
        for arch in [name for name in args.models.split(",") if name]:
            rows += measure_speed(arch, Path(work), texts, 1 if args.quick else args.warmup, args.quick)
    fidelity = None
    if args.fidelity_index is not None:
        corpus = data / "sample_corpus.jsonl" if args.quick else SCIFACT / "corpus.jsonl.gz"
        fidelity = measure_fidelity(args.fidelity_index, queries_path, qrels_path, corpus,
                                    8 if args.quick else args.fidelity_queries)
    info = machine()
    print(f"# Query encoding, one query at a time ({len(texts)} queries, paths interleaved)")
    print(machine_line(info))
    print(markdown_table(["model", "threads", "backend", "p50 ms", "p99 ms", "÷ torch"],
                         [[r["model"], r["threads"], r["backend"], r["p50_ms"], r["p99_ms"], r["vs_torch"]]
                          for r in rows]))
    if fidelity is not None:
        print(f"int8 against fp32 queries, exhaustive top 10 over {fidelity['documents']} documents, "
              f"{fidelity['queries']} queries: mean overlap {fidelity['top10_overlap']}")
    write_results(args.name, {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                              "fidelity": fidelity})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
