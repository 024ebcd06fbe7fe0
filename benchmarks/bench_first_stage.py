"""Candidate generation for a model without a trained CLS vector, measured against exhaustive MaxSim.

    python -m benchmarks.bench_first_stage --work .espn/first-stage            # SciFact, tune on train, report test
    python -m benchmarks.bench_first_stage --quick --work /tmp/fs              # the bundled 300-passage sample

The model: MiniLM's own token vectors through a seeded 384 -> 128 projection, L2-normalised
(a ColBERT-shaped model whose token vectors mean something, built offline); its "CLS" is the
normalised mean of a text's token vectors, as the colbert encoder makes it (never trained to
find documents). The corpus is written as precomputed shards (pure MaxSim: bow_reduction
"sum", w = 0), indexed with `build_from_embeddings(first_stage="centroids")` (fp16, unpooled).

Every first stage's candidates are re-ranked by the exact MaxSim of every document (computed
once, exhaustively, from the records), so nDCG@10 and the recall of the exhaustive top 10 in
the candidates are exact for every setting; the p50 latency of the kinds the Searcher serves
is measured end to end (`search_embeddings`, one query per call, posix reader). Settings are
chosen on train queries; the table reports test. With `--baseline-index` (an index built by
plain `espn index`: MiniLM's trained CLS in the IVF) its p50 is printed beside, as today's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import ROOT, SCIFACT, machine, machine_line, markdown_table, median, read_jsonl, write_results

PROJECTION_DIM = 128
PROJECTION_SEED = 30


def encode_collection(work: Path, corpus: Path, queries: Sequence[tuple[str, str]], limit: int | None) -> Path:
    """Precomputed shards of the corpus and an .npz of the queries, made once into `work`."""
    import torch

    from espn.corpus import passage_text
    from espn.encoders.hf import HFEncoder, default_model_dir

    emb = work / "emb"
    if (emb / "embeddings.json").is_file():
        return emb
    rng = np.random.default_rng(PROJECTION_SEED)
    projection = (rng.standard_normal((384, PROJECTION_DIM)) / np.sqrt(PROJECTION_DIM)).astype(np.float32)
    encoder = HFEncoder(default_model_dir(), bow_dim=PROJECTION_DIM, projection=projection, device="cpu",
                        name="minilm-colbert-128", query_backend="torch")
    docs = read_jsonl(corpus, limit)
    cls_parts, bow_parts, count_parts = [], [], []
    started = time.perf_counter()
    order = np.argsort([len(d.get("text", "")) for d in docs], kind="stable")  # length buckets: little padding
    per_doc: list[Any] = [None] * len(docs)
    for start in range(0, len(docs), 32):
        rows = order[start : start + 32]
        texts = [passage_text(docs[i].get("title") or "", docs[i]["text"]) for i in rows]
        out = encoder.embed_documents(encoder.tokenize(texts, is_query=False))
        bounds = np.concatenate([[0], np.cumsum(out.counts)])
        for j, i in enumerate(rows):
            per_doc[i] = out.bow[bounds[j] : bounds[j + 1]]
        if start % 1024 == 0:
            print(f"encoded {start}/{len(docs)} in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    for bow in per_doc:
        pooled = bow.sum(0)
        cls_parts.append(pooled / max(np.linalg.norm(pooled), 1e-12))
        bow_parts.append(bow)
        count_parts.append(len(bow))
    for folder in ("cls", "bow", "counts", "ids"):
        (emb / folder).mkdir(parents=True, exist_ok=True)
    np.save(emb / "cls" / "0.npy", np.stack(cls_parts).astype(np.float16))
    np.save(emb / "bow" / "0.npy", np.concatenate(bow_parts).astype(np.float16))
    np.save(emb / "counts" / "0.npy", np.asarray(count_parts, dtype=np.int64))
    (emb / "ids" / "0.txt").write_text("".join(f"{d['_id']}\n" for d in docs), encoding="utf-8")
    with open(work / "corpus.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    with torch.inference_mode():
        q = encoder.embed_queries(encoder.tokenize([text for _, text in queries], is_query=True))
    pooled = (q.bow * q.mask[..., None]).sum(1)
    q_cls = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
    np.savez(work / "queries.npz", ids=np.array([qid for qid, _ in queries]), cls=q_cls.astype(np.float32),
             bow=q.bow.astype(np.float32), mask=q.mask)
    (emb / "embeddings.json").write_text(json.dumps({
        "format": "espn-precomputed", "version": 1, "d_cls": PROJECTION_DIM, "d_bow": PROJECTION_DIM,
        "bow_reduction": "sum", "score_weight": 0.0}))
    print(f"encoded {len(docs)} documents and {len(queries)} queries in {time.perf_counter() - started:.0f}s",
          file=sys.stderr)
    return emb


def select_documents(corpus: Path, qrels: dict[str, dict], docs: int) -> list[dict[str, Any]]:
    """Every judged document and then the corpus in order until `docs` in all (0: the whole
    corpus), in corpus order: a slice a loaded 2-core machine can encode in minutes."""
    rows = read_jsonl(corpus)
    if not docs or docs >= len(rows):
        return rows
    judged = {doc for split in qrels.values() for rel in split.values() for doc in rel}
    keep = np.array([row["_id"] in judged for row in rows])
    extra = np.flatnonzero(~keep)[: max(0, docs - int(keep.sum()))]
    keep[extra] = True
    return [row for row, kept in zip(rows, keep) if kept]


def build_colbert(work: Path, docs: list[dict[str, Any]], queries: Sequence[tuple[str, str]]) -> Path:
    """MiniLM written as a PyLate checkpoint (benchmarks.make_colbert_checkpoint), the documents
    indexed with `--encoder colbert:` (fp16, unpooled: the model's own MaxSim; the first stage is
    the build's default for a model without a trained CLS), the queries encoded into an .npz."""
    from benchmarks.make_colbert_checkpoint import write_checkpoint
    from espn_indexing.build import BuildConfig, build_index

    index = work / "index"
    if not (index / "manifest.json").is_file():
        checkpoint = work / "minilm-colbert"
        if not (checkpoint / "modules.json").is_file():
            write_checkpoint(checkpoint)
        corpus = work / "corpus.jsonl"
        with open(corpus, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
        started = time.perf_counter()
        build_index(BuildConfig(corpus=corpus, out=index, encoder=f"colbert:{checkpoint}", pool_factor=1,
                                bow_dtype="float16", loader_workers=0, progress=False, device="cpu", force=True))
        print(f"indexed {len(docs)} documents in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    if not (work / "queries.npz").is_file():
        save_query_embeddings(index, queries, work / "queries.npz")
    return index


def save_query_embeddings(index: Path, queries: Sequence[tuple[str, str]], out: Path) -> None:
    """The queries encoded by the index's own encoder, as an .npz (ids, cls, bow, mask)."""
    from espn import Searcher
    from espn.encoders import QueryEmbeddings

    with Searcher.open(index, verify="none") as searcher:
        parts = [searcher.encode([text for _, text in queries[a : a + 256]]) for a in range(0, len(queries), 256)]
    width = max(p.bow.shape[1] for p in parts)
    q = QueryEmbeddings(np.concatenate([p.cls for p in parts]),
                        np.concatenate([np.pad(p.bow, ((0, 0), (0, width - p.bow.shape[1]), (0, 0))) for p in parts]),
                        np.concatenate([np.pad(p.mask, ((0, 0), (0, width - p.mask.shape[1]))) for p in parts]))
    np.savez(out, ids=np.array([qid for qid, _ in queries]), cls=q.cls, bow=q.bow, mask=q.mask)


def exhaustive_scores(searcher: Any, queries: Any, block: int = 1024) -> np.ndarray:
    """[Q, N] float32: the score (w = 0: MaxSim) of every (query, document), from the records."""
    n = searcher.num_documents
    full = np.zeros((len(queries), n), dtype=np.float32)
    for start in range(0, len(queries), 64):
        part = queries[start : start + 64]
        for first in range(0, n, block):
            numbers = np.arange(first, min(first + block, n))
            cls, bow = searcher.score_documents(part, numbers)
            full[start : start + len(part), numbers] = searcher.weight * cls + (1 - searcher.weight) * bow
    return full


def rerank_metrics(candidates: list[np.ndarray], full: np.ndarray, qids: Sequence[str], doc_ids: list[str],
                   qrels: dict, exhaustive_top: np.ndarray) -> dict[str, float]:
    """nDCG@10 of the candidates re-ranked by exact MaxSim, and the recall of the exhaustive top 10."""
    from espn.evaluation import evaluate

    run, recall = {}, []
    for i, docs in enumerate(candidates):
        docs = np.asarray(docs, dtype=np.int64)
        top = docs[np.argsort(-full[i, docs], kind="stable")[:10]]
        run[qids[i]] = {doc_ids[d]: float(full[i, d]) for d in top}
        recall.append(len(set(top.tolist()) & set(exhaustive_top[i].tolist())) / 10)
    return {"nDCG@10": evaluate(run, qrels)["nDCG@10"], "recall@10": float(np.mean(recall)),
            "candidates": float(np.mean([len(c) for c in candidates]))}


def p50_ms(search: Callable[[int], Any], n: int) -> float:
    times = []
    for i in range(n):
        started = time.perf_counter()
        search(i)
        times.append((time.perf_counter() - started) * 1000)
    return median(times)


def candidate_sets(searcher: Any, queries: Any, texts: Sequence[str], setting: dict[str, Any]) -> list[np.ndarray]:
    """One first stage's candidates per query (doc numbers)."""
    from espn.ann import coarse_assign, search_preassigned
    from espn.search.lexical import search_batch
    from espn.text.query import parse_query

    kind = setting["kind"]
    parts: list[list[np.ndarray]] = []
    if kind in ("centroids", "union", "centroids+text"):
        parts.append(searcher.centroids.candidates(queries.bow, queries.mask, setting["probe"], setting["candidates"]))
    if kind in ("ivf", "union"):
        xq = np.ascontiguousarray(queries.cls, dtype=np.float32)
        scores, lists = coarse_assign(searcher.ann, xq, setting.get("nprobe", searcher.defaults.nprobe))
        _, labels = search_preassigned(searcher.ann, xq, setting.get("rerank", 100), lists, scores)
        parts.append([row[row >= 0] for row in labels])
    if kind in ("text", "centroids+text"):
        hits = search_batch(searcher.text, [parse_query(t) for t in texts], setting.get("lexical_k", 100), None)
        parts.append([h.doc_numbers for h in hits])
    return [np.unique(np.concatenate([p[i] for p in parts])) for i in range(len(queries))]


SETTINGS_TRAIN: list[dict[str, Any]] = ([{"kind": "centroids", "probe": p, "candidates": c} for p in (2, 4, 8, 16) for c in (64, 128, 256, 512)]
                  + [{"kind": "ivf", "rerank": r} for r in (100, 256, 1000)]
                  + [{"kind": "text", "lexical_k": r} for r in (100, 256, 1000)]
                  + [{"kind": "union", "probe": 4, "candidates": 128, "rerank": 100},
                     {"kind": "centroids+text", "probe": 4, "candidates": 128, "lexical_k": 100}])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=ROOT / ".espn" / "first-stage", help="encodings and the index go here")
    p.add_argument("--data", type=Path, default=SCIFACT, help="BEIR SciFact directory")
    p.add_argument("--baseline-index", type=Path, default=None, help="today's default MiniLM index, for its p50")
    p.add_argument("--latency-queries", type=int, default=100)
    p.add_argument("--train-limit", type=int, default=300, help="train queries used for tuning (the first N judged)")
    p.add_argument("--quick", action="store_true", help="the bundled sample corpus, a few settings")
    p.add_argument("--model", choices=("colbert", "tokens"), default="colbert",
                   help="colbert: MiniLM as a PyLate checkpoint through `colbert:`; tokens: MiniLM's token "
                        "vectors through a seeded projection, as precomputed shards")
    p.add_argument("--docs", type=int, default=0, help="index the judged documents plus the first others up to "
                   "this many (0: the whole corpus)")
    args = p.parse_args(argv)
    from espn import Searcher
    from espn.corpus import read_qrels, read_queries
    from espn.encoders import QueryEmbeddings
    from espn_indexing.build import build_from_embeddings

    if args.quick:
        data = ROOT / "espn" / "data"
        corpus, queries_file = data / "sample_corpus.jsonl", data / "sample_queries.jsonl"
        qrels = {"train": read_qrels(data / "sample_qrels.tsv"), "test": read_qrels(data / "sample_qrels.tsv")}
        settings: list[dict[str, Any]] = [{"kind": "centroids", "probe": 4, "candidates": 32}, {"kind": "ivf", "rerank": 32},
                    {"kind": "text", "lexical_k": 32}]
        args.latency_queries = min(args.latency_queries, 5)
    else:
        if not (args.data / "corpus.jsonl.gz").is_file():
            print(f"no SciFact at {args.data} (give --data or set ESPN_SCIFACT)", file=sys.stderr)
            return 2
        corpus, queries_file = args.data / "corpus.jsonl.gz", args.data / "queries.jsonl"
        qrels = {split: read_qrels(args.data / "qrels" / f"{split}.tsv") for split in ("train", "test")}
        settings = SETTINGS_TRAIN
    texts = dict(read_queries(queries_file))
    judged = [(qid, texts[qid]) for split in ("train", "test") for qid in qrels[split] if qid in texts]
    judged = list(dict(judged).items())
    args.work.mkdir(parents=True, exist_ok=True)
    if args.model == "colbert":
        index = build_colbert(args.work, select_documents(corpus, qrels, args.docs), judged)
    else:
        emb = encode_collection(args.work, corpus, judged, None)
        index = args.work / "index"
        if not (index / "manifest.json").is_file():
            build_from_embeddings(emb, index, corpus=args.work / "corpus.jsonl", first_stage="centroids", force=True)
    stored = np.load(args.work / "queries.npz")
    all_ids = [str(q) for q in stored["ids"]]
    info = machine()
    results: dict[str, Any] = {"machine": info, "index": str(index), "splits": {}}
    with Searcher.open(index, reader="posix", verify="none", with_encoder=False) as searcher:
        doc_ids = searcher.ids.external(np.arange(searcher.num_documents))
        if searcher.centroids is None:
            raise SystemExit(f"{index} has no centroid index (built before first stages existed? remove it)")
        stage_ram = searcher.centroids.nbytes
        for split in ("train", "test"):
            rows = np.array([i for i, q in enumerate(all_ids) if q in qrels[split]])
            if split == "train":
                rows = rows[: args.train_limit]
            queries = QueryEmbeddings(stored["cls"][rows], stored["bow"][rows], stored["mask"][rows])
            qids = [all_ids[i] for i in rows]
            started = time.perf_counter()
            full = exhaustive_scores(searcher, queries)
            print(f"{split}: exhaustive MaxSim of {len(rows)} queries in {time.perf_counter() - started:.0f}s",
                  file=sys.stderr)
            top = np.argsort(-full, axis=1, kind="stable")[:, :10]
            everything = [np.arange(searcher.num_documents)] * len(rows)
            exhaustive = rerank_metrics(everything, full, qids, doc_ids, qrels[split], top)
            rows_out = [{"setting": {"kind": "exhaustive"}, **exhaustive}]
            for setting in settings:
                if "text" in setting["kind"] and searcher.text is None:  # e.g. an index assembled from chunks
                    print(f"{split} {setting}: skipped, the index has no full-text side", file=sys.stderr)
                    continue
                found = candidate_sets(searcher, queries, [texts[q] for q in qids], setting)
                rows_out.append({"setting": setting, **rerank_metrics(found, full, qids, doc_ids, qrels[split], top)})
                print(f"{split} {setting}: {rows_out[-1]}", file=sys.stderr)
            results["splits"][split] = {"queries": len(rows), "rows": rows_out, "exhaustive_nDCG@10": exhaustive["nDCG@10"]}
        # latency on test queries, one query per call, of what the Searcher serves
        test_rows = np.array([i for i, q in enumerate(all_ids) if q in qrels["test"]])[: args.latency_queries]
        q = QueryEmbeddings(stored["cls"][test_rows], stored["bow"][test_rows], stored["mask"][test_rows])
        default = searcher.first_stage
        served: list[tuple[str, dict[str, Any]]] = [("centroids (default)", {}),
                  ("ivf, rerank 100", {"first_stage": "ivf", "rerank_count": 100}),
                  ("ivf, rerank 1000", {"first_stage": "ivf", "rerank_count": 1000}),
                  ("union", {"first_stage": "union", "rerank_count": 100})]
        latency = {}
        for name, overrides in served:
            searcher.search_embeddings(q[0:1], k=10, **overrides)  # warm
            latency[name] = p50_ms(lambda i: searcher.search_embeddings(q[i : i + 1], k=10, **overrides), len(q))
        latency["exhaustive MaxSim"] = p50_ms(lambda i: searcher.search_maxsim_exhaustive(q[i : i + 1], k=10),
                                              min(len(q), 10))
        results["latency_p50_ms"] = latency
        results["first_stage_ram_bytes"] = stage_ram
        results["default"] = default.to_json()
    if args.baseline_index is not None:
        with Searcher.open(args.baseline_index, reader="posix", verify="none") as base:
            texts_test = [texts[all_ids[i]] for i in test_rows]
            base.search(texts_test[:1], k=10)
            emb_q = base.encode(texts_test)
            results["baseline_p50_ms"] = p50_ms(lambda i: base.search_embeddings(emb_q[i : i + 1], k=10), len(texts_test))
    print(report(results))
    write_results("first_stage_quick" if args.quick else "first_stage", results)
    return 0


def _label(setting: dict[str, Any]) -> str:
    kind = setting["kind"]
    if kind == "centroids":
        return f"centroids probe {setting['probe']}, {setting['candidates']} cand."
    if kind == "ivf":
        return f"pooled-vector IVF, top {setting['rerank']}"
    if kind == "text":
        return f"full-text (BM25), top {setting['lexical_k']}"
    if kind == "union":
        return f"centroids {setting['probe']}/{setting['candidates']} ∪ IVF top {setting['rerank']}"
    if kind == "centroids+text":
        return f"centroids {setting['probe']}/{setting['candidates']} ∪ BM25 top {setting['lexical_k']}"
    return "exhaustive MaxSim"


def report(results: dict[str, Any]) -> str:
    lines = [f"Machine: {machine_line(results['machine'])}; index {results['index']}"]
    for split, part in results["splits"].items():
        ref = part["exhaustive_nDCG@10"]
        table = markdown_table(["first stage", "nDCG@10", "÷ exhaustive", "recall of exh. top 10", "candidates"],
                               [[_label(r["setting"]), r["nDCG@10"], r["nDCG@10"] / ref, r["recall@10"], r["candidates"]]
                                for r in part["rows"]])
        lines.append(f"\n{split} ({part['queries']} queries)\n\n{table}")
    latency = dict(results["latency_p50_ms"])
    if "baseline_p50_ms" in results:
        latency["today: default MiniLM index (CLS IVF)"] = results["baseline_p50_ms"]
    lines.append("\np50 latency, one query per call (ms)\n\n" + markdown_table(["search", "p50 ms"], list(latency.items())))
    lines.append(f"\nfirst stage RAM (centroids + postings): {results['first_stage_ram_bytes'] / 1e6:.2f} MB; "
                 f"default {results['default']}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
