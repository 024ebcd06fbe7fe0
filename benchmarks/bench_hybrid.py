"""Hybrid retrieval on SciFact: effectiveness of every fusion, and hybrid against dense latency.

    python -m benchmarks.bench_hybrid effectiveness          # train and test, index $ESPN_SCIFACT_INDEX
    python -m benchmarks.bench_hybrid latency --n 100 --repeats 3
    python -m benchmarks.bench_hybrid latency --index SYNTH --query-embeddings SYNTH.queries.npz \\
        --query-texts queries.jsonl                          # a synthetic index with text (make_synthetic --text)
    python -m benchmarks.bench_hybrid effectiveness --quick  # 40 queries per split
    python -m benchmarks.bench_hybrid collections            # test collections made from SciFact, offline
    espn index .espn/collections/no-titles/corpus.jsonl --out .espn/scifact-no-titles-index
    python -m benchmarks.bench_hybrid generalise             # every fusion on every collection

    # The figures of docs/guides/hybrid-search.md: a 1,024-passage SciFact subset (2 encodes)
    python -m benchmarks.bench_hybrid collections --subset 1024 --collections .espn/subset-collections
    espn index .espn/subset-collections/corpus.jsonl --out .espn/subset-index
    espn index .espn/subset-collections/no-titles/corpus.jsonl --out .espn/subset-no-titles-index
    python -m benchmarks.bench_hybrid generalise --index .espn/subset-index --limit 100 \\
        --no-titles-index .espn/subset-no-titles-index --collections .espn/subset-collections

Effectiveness: for each split the queries are searched once in dense mode (nDCG@10 as
`espn search` gives it) and once in hybrid mode per candidate setting (with and without
`union`), asking for the whole fusion pool with both sides' scores. Lexical-only, RRF
and the mix at every weight on a 0.05 grid are then fused from those pools with
`espn.search.hybrid.fuse`, the function the Searcher itself calls, so they equal what a search
with those parameters returns. The default is chosen on train; test is reported with it.

Generalise: the same pools on every collection `collections` writes (see
`write_collections`), every candidate (RRF k 60 and 20, mix and zscore on a 0.05 grid) as
a gain over dense on the same index; the default is the best worst gain over the train
splits, then the best mean (the test splits are only reported).

Latency: single queries (one per call), dense and hybrid interleaved query by query so
both see the same machine load; p50 / p99 per mode over `--repeats` passes, and the
ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import ROOT, SCIFACT, SCIFACT_INDEX, machine, machine_line, markdown_table, percentiles, write_results

WEIGHTS = np.round(np.arange(0.0, 1.0001, 0.05), 2)
FUSION_GRID = ("mix", "zscore")


def _run(ranked: dict[str, list[tuple[str, float]]]) -> dict[str, dict[str, float]]:
    from espn.evaluation import strictly_decreasing

    return {qid: dict(strictly_decreasing(hits)) for qid, hits in ranked.items()}


def _pools(searcher: Any, queries: list[tuple[str, str]], union: bool, batch: int) -> dict[str, tuple]:
    """Per query the hybrid pool: (doc ids [m] object, dense [m], lexical [m]) float32, NaN where absent."""
    hybrid = searcher.hybrid_params(mode="hybrid", union=union)
    depth = searcher.defaults.rerank_count + hybrid.lexical_k
    pools = {}
    for start in range(0, len(queries), batch):
        chunk = queries[start : start + batch]
        results = searcher.search([t for _, t in chunk], k=depth, mode="hybrid", union=union)
        for (qid, _), result in zip(chunk, results):
            nan = float("nan")
            pools[qid] = (np.array([h.doc_id for h in result.hits], dtype=object),
                          np.array([nan if h.dense_score is None else h.dense_score for h in result.hits], np.float32),
                          np.array([nan if h.lexical_score is None else h.lexical_score for h in result.hits],
                                   np.float32))
    return pools


def _fused_run(pools: dict[str, tuple], params: Any, k: int = 10) -> dict[str, dict[str, float]]:
    from espn.search.hybrid import fuse

    ranked = {}
    for qid, (docs, dense, lexical) in pools.items():
        fused = fuse(docs, dense, lexical, params)
        ranked[qid] = [(str(d), float(s)) for d, s in zip(fused.doc[:k], fused.score[:k])]
    return _run(ranked)


def _lexical_run(pools: dict[str, tuple], k: int = 10) -> dict[str, dict[str, float]]:
    ranked = {}
    for qid, (docs, _, lexical) in pools.items():
        present = np.flatnonzero(~np.isnan(lexical))
        order = present[np.argsort(-lexical[present], kind="stable")][:k]
        ranked[qid] = [(str(docs[i]), float(lexical[i])) for i in order]
    return _run(ranked)


def effectiveness(args: argparse.Namespace) -> dict[str, Any]:
    from espn import Searcher
    from espn.corpus import read_qrels, read_queries
    from espn.evaluation import evaluate

    all_queries = read_queries(args.data / "queries.jsonl")
    splits: dict[str, dict[str, Any]] = {}
    with Searcher.open(args.index, reader="posix", verify="none") as searcher:
        base = searcher.hybrid_params(mode="hybrid")
        for split in args.splits.split(","):
            qrels = read_qrels(args.data / "qrels" / f"{split}.tsv")
            queries = [(qid, text) for qid, text in all_queries if qid in qrels][: args.limit]
            started = time.perf_counter()
            dense: dict[str, list[tuple[str, float]]] = {}
            for start in range(0, len(queries), args.batch):
                chunk = queries[start : start + args.batch]
                for (qid, _), r in zip(chunk, searcher.search([t for _, t in chunk], k=10, mode="dense")):
                    dense[qid] = [(h.doc_id, h.score) for h in r.hits]
            rows = {"dense": evaluate(_run(dense), qrels)["nDCG@10"]}
            for union in (True, False):
                pools = _pools(searcher, queries, union, args.batch)
                tag = "union" if union else "lists"
                if union:
                    rows["lexical"] = evaluate(_lexical_run(pools), qrels)["nDCG@10"]
                rows[f"rrf/{tag}"] = evaluate(_fused_run(pools, base.replace(fusion="rrf")), qrels)["nDCG@10"]
                for weight in WEIGHTS:
                    params = base.replace(fusion="mix", mix_weight=float(weight))
                    rows[f"mix {weight:.2f}/{tag}"] = evaluate(_fused_run(pools, params), qrels)["nDCG@10"]
            splits[split] = {"queries": len(queries), "nDCG@10": rows, "seconds": time.perf_counter() - started}
            print(f"{split}: {len(queries)} queries in {splits[split]['seconds']:.0f}s", file=sys.stderr)
    first = args.splits.split(",")[0]
    train_rows = splits[first]["nDCG@10"]
    best = max((key for key in train_rows if key.startswith(("rrf", "mix"))), key=lambda key: train_rows[key])
    table_rows = []
    for tag in ("union", "lists"):
        best_mix = max((key for key in train_rows if key.startswith("mix") and key.endswith(tag)),
                       key=lambda key: train_rows[key])
        for key in (f"rrf/{tag}", best_mix):
            table_rows.append([key] + [splits[s]["nDCG@10"][key] for s in splits])
    table = markdown_table(["run"] + [f"{s} nDCG@10 ({splits[s]['queries']} q)" for s in splits],
                           [["dense"] + [splits[s]["nDCG@10"]["dense"] for s in splits],
                            ["lexical (BM25)"] + [splits[s]["nDCG@10"]["lexical"] for s in splits]] + table_rows)
    print(f"SciFact, index {args.index}; weights of the mix chosen on {first}; best on {first}: {best}. "
          f"Machine: {machine_line(machine())}\n\n{table}")
    return {"splits": splits, "best_on_first_split": best}


def _texts(path: Path, n: int) -> list[str]:
    from espn.corpus import read_queries

    return [text for _, text in read_queries(path)][:n]


# ---------------------------------------------------------------------------------------
# Does the default travel? Collections built offline from SciFact, every fusion on each.

#: (collection, index option, queries file under --collections, qrels directory under --collections)
COLLECTIONS = (
    ("scifact", "index", "scifact/queries.jsonl", "scifact/qrels"),
    ("short-queries", "index", "short-queries/queries.jsonl", "scifact/qrels"),
    ("cited-paragraphs", "index", "cited-paragraphs/queries.jsonl", "scifact/qrels"),
    ("scifact-no-titles", "no_titles_index", "scifact/queries.jsonl", "scifact/qrels"),
    ("title-keywords", "no_titles_index", "title-keywords/queries.jsonl", "title-keywords/qrels"),
)
KEYWORDS = 4  # words of a title kept as a keyword query


def write_collections(data: Path, out: Path, subset: int | None = None) -> None:
    """BEIR-format test collections made from SciFact, without a network:

    scifact/            SciFact's own queries and qrels (train and test)
    corpus.jsonl        with `subset`: every judged passage and the first others, `subset` in
                        all (the index of the scifact, short-queries and cited-paragraphs
                        collections; without `subset`, index SciFact's own corpus)
    no-titles/          the corpus with every title removed (index it for scifact-no-titles
                        and title-keywords: the text alone must carry the match)
    title-keywords/     per document judged in a split, a short keyword query: the first
                        KEYWORDS words of its title that are not stop words; that document is
                        its one relevant answer (searched against no-titles, where the title is
                        not indexed)
    short-queries/      each SciFact claim cut to its first KEYWORDS words that are not stop
                        words (a keyword query; SciFact's qrels)
    cited-paragraphs/   each claim inside a citing paragraph, as users paste them: authors, a
                        quoted title of another (random) passage, a journal, volume:page
                        (SciFact's qrels; the lexical side reads the off-topic words too)
    """
    import gzip
    import re

    from espn.corpus import read_qrels
    from espn.text import TextConfig

    analyzer = TextConfig(stemmer=False).analyzer()  # espn's English chain: what it drops is a stop word
    (out / "scifact" / "qrels").mkdir(parents=True, exist_ok=True)
    (out / "no-titles").mkdir(parents=True, exist_ok=True)
    (out / "title-keywords" / "qrels").mkdir(parents=True, exist_ok=True)
    (out / "scifact" / "queries.jsonl").write_bytes((data / "queries.jsonl").read_bytes())
    corpus = data / "corpus.jsonl.gz"
    with (gzip.open(corpus, "rt", encoding="utf-8") if corpus.is_file() else open(data / "corpus.jsonl")) as src:
        docs = [json.loads(line) for line in src]
    if subset is not None:
        judged = {doc for split in ("train", "test")
                  for answers in read_qrels(data / "qrels" / f"{split}.tsv").values() for doc in answers}
        kept = [doc for doc in docs if doc["_id"] in judged]
        docs = kept + [doc for doc in docs if doc["_id"] not in judged][: max(0, subset - len(kept))]
        with open(out / "corpus.jsonl", "w", encoding="utf-8") as dst:
            dst.writelines(json.dumps(doc) + "\n" for doc in docs)
    titles = {doc["_id"]: doc.get("title", "") for doc in docs}
    with open(out / "no-titles" / "corpus.jsonl", "w", encoding="utf-8") as dst:
        dst.writelines(json.dumps({"_id": doc["_id"], "title": "", "text": doc["text"]}) + "\n" for doc in docs)
    queries = []
    for split in ("train", "test"):
        (out / "scifact" / "qrels" / f"{split}.tsv").write_bytes((data / "qrels" / f"{split}.tsv").read_bytes())
        docs = sorted({doc for judged in read_qrels(data / "qrels" / f"{split}.tsv").values() for doc in judged})
        lines = ["query-id\tcorpus-id\tscore"]
        for doc in docs:
            words = [w for w in re.findall(r"[\w-]+", titles.get(doc, "")) if analyzer.analyze(w)][:KEYWORDS]
            if len(words) < 2:
                continue
            queries.append({"_id": f"{split}-{doc}", "text": " ".join(words)})
            lines.append(f"{split}-{doc}\t{doc}\t1")
        (out / "title-keywords" / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    with open(out / "title-keywords" / "queries.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(q) + "\n" for q in queries)
    _write_query_variants(data, out, analyzer, list(titles.values()))


def _write_query_variants(data: Path, out: Path, analyzer: Any, titles: list[str]) -> None:
    import random
    import re

    from espn.corpus import read_queries

    rng = random.Random(32)
    authors = ["Smith, J.", "Kato, T.", "Nguyen, L. and Park, S.", "Müller, A. et al.", "O'Brien, K."]
    journals = ["SIAM J. Numer. Anal.", "Nature Med.", "J. Biol. Chem.", "Cell", "N. Engl. J. Med."]
    short, cited = [], []
    for qid, text in read_queries(data / "queries.jsonl"):
        words = [w for w in re.findall(r"[\w-]+", text) if analyzer.analyze(w)][:KEYWORDS]
        short.append({"_id": qid, "text": " ".join(words) or text})
        paragraph = (f'{text} As {rng.choice(authors)} report in "{rng.choice(titles).rstrip(".")}", '
                     f"{rng.choice(journals)} {rng.randint(1, 60)}:{rng.randint(1, 999)}-{rng.randint(1, 999)} "
                     f"({rng.randint(1990, 2020)}); see also -{rng.choice(titles).split(' ')[0]} +ref. [{rng.randint(1, 40)}]")
        cited.append({"_id": qid, "text": paragraph})
    for name, rows in (("short-queries", short), ("cited-paragraphs", cited)):
        (out / name).mkdir(parents=True, exist_ok=True)
        with open(out / name / "queries.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(q) + "\n" for q in rows)


def _candidates(base: Any) -> dict[str, Any]:
    """Every fusion setting compared: RRF (two constants), the min-max mix and the z-score mix
    over a weight grid."""
    out = {"rrf k=60": base.replace(fusion="rrf", rrf_k=60), "rrf k=20": base.replace(fusion="rrf", rrf_k=20)}
    for fusion in FUSION_GRID:
        for weight in np.round(np.arange(0.3, 0.9501, 0.05), 2):
            out[f"{fusion} {weight:.2f}"] = base.replace(fusion=fusion, mix_weight=float(weight))
    return out


def generalise(args: argparse.Namespace) -> dict[str, Any]:
    """Dense, lexical and every candidate fusion on every collection and split; the default
    chosen on the train splits by the worst gain over dense, then the mean."""
    from espn import Searcher
    from espn.corpus import read_qrels, read_queries
    from espn.evaluation import evaluate

    indexes = {"index": args.index, "no_titles_index": args.no_titles_index}
    rows: dict[str, dict[str, float]] = {}  # "collection/split" -> run -> nDCG@10
    sizes: dict[str, int] = {}
    for name, index_option, queries_file, qrels_dir in COLLECTIONS:
        if not (indexes[index_option] / "manifest.json").is_file():
            print(f"{name}: skipped, no index at {indexes[index_option]}", file=sys.stderr)
            continue
        with Searcher.open(indexes[index_option], reader="posix", verify="none") as searcher:
            base = searcher.hybrid_params(mode="hybrid")
            candidates = _candidates(base)
            all_queries = read_queries(args.collections / queries_file)
            for split in args.splits.split(","):
                qrels = read_qrels(args.collections / qrels_dir / f"{split}.tsv")
                queries = [(qid, text) for qid, text in all_queries if qid in qrels][: args.limit]
                started = time.perf_counter()
                dense = {}
                for start in range(0, len(queries), args.batch):
                    chunk = queries[start : start + args.batch]
                    for (qid, _), r in zip(chunk, searcher.search([t for _, t in chunk], k=10, mode="dense")):
                        dense[qid] = [(h.doc_id, h.score) for h in r.hits]
                pools = _pools(searcher, queries, True, args.batch)
                key = f"{name}/{split}"
                rows[key] = {"dense": evaluate(_run(dense), qrels)["nDCG@10"],
                             "lexical": evaluate(_lexical_run(pools), qrels)["nDCG@10"]}
                for label, params in candidates.items():
                    rows[key][label] = evaluate(_fused_run(pools, params), qrels)["nDCG@10"]
                sizes[key] = len(queries)
                print(f"{key}: {len(queries)} queries in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    train = [key for key in rows if key.endswith("/" + args.splits.split(",")[0])]
    labels = [label for label in next(iter(rows.values())) if label not in ("dense", "lexical")]

    def gains(label: str, keys: list[str]) -> list[float]:
        return [rows[key][label] - rows[key]["dense"] for key in keys]

    chosen = max(labels, key=lambda label: (round(min(gains(label, train)), 3), float(np.mean(gains(label, train)))))
    keys = list(rows)
    shown = ["rrf k=60", "mix 0.65", chosen] + [max((lb for lb in labels if lb.startswith(f)),
                                                    key=lambda lb: float(np.mean(gains(lb, train))))
                                                for f in FUSION_GRID]
    shown = list(dict.fromkeys(shown))
    table_rows = [["dense"] + [rows[k]["dense"] for k in keys] + ["", ""],
                  ["lexical"] + [rows[k]["lexical"] for k in keys] + ["", ""]]
    for label in shown:
        all_gains = gains(label, keys)
        table_rows.append([label + (" (chosen)" if label == chosen else "")] + [rows[k][label] for k in keys]
                          + [min(all_gains), float(np.mean(all_gains))])
    table = markdown_table(["run"] + [f"{k} ({sizes[k]} q)" for k in keys] + ["worst gain", "mean gain"], table_rows)
    print(f"nDCG@10 per collection; gain = fused - dense on the same index. Chosen on the {args.splits.split(',')[0]} "
          f"splits by worst gain, then mean: {chosen}. Machine: {machine_line(machine())}\n\n{table}")
    return {"nDCG@10": rows, "queries": sizes, "chosen": chosen}


def latency(args: argparse.Namespace) -> dict[str, Any]:
    from espn import Searcher
    from espn.encoders.precomputed import load_query_embeddings

    with Searcher.open(args.index, reader="posix", verify="none",
                       with_encoder=args.query_embeddings is None) as searcher:
        texts = _texts(args.query_texts, args.n)
        embeddings = None
        if args.query_embeddings is not None:
            _, embeddings = load_query_embeddings(args.query_embeddings)
            if len(embeddings) < len(texts):
                raise SystemExit(f"{args.query_embeddings}: {len(embeddings)} queries, fewer than --n {len(texts)}")

        def one(i: int, mode: str) -> float:
            if embeddings is None:
                result = searcher.search([texts[i]], k=10, mode=mode)[0]
            else:
                result = searcher.search_embeddings(embeddings[i : i + 1], k=10, mode=mode, texts=[texts[i]])[0]
            return result.stats.stage_ms["total"]

        for i in range(min(args.warmup, len(texts))):
            one(i, "dense"), one(i, "hybrid")
        times: dict[str, list[float]] = {"dense": [], "hybrid": [], "lexical": []}
        for _ in range(args.repeats):
            for i in range(len(texts)):
                order = ("dense", "hybrid", "lexical") if i % 2 == 0 else ("hybrid", "dense", "lexical")
                for mode in order:
                    times[mode].append(one(i, mode))
        text_section = searcher.manifest.get("text") or {}
    stats = {mode: percentiles(values) for mode, values in times.items()}
    ratio = stats["hybrid"]["p50"] / stats["dense"]["p50"]
    table = markdown_table(["mode", "p50 ms", "p99 ms", "p50 / dense p50"],
                           [[mode, stats[mode]["p50"], stats[mode]["p99"], stats[mode]["p50"] / stats["dense"]["p50"]]
                            for mode in ("dense", "hybrid", "lexical")])
    print(f"{args.index}: {len(texts)} single queries x {args.repeats}, interleaved; hybrid p50 / dense p50 = "
          f"{ratio:.3f} (target <= 1.15). Machine: {machine_line(machine())}\n\n{table}")
    return {"stats": stats, "ratio_p50": ratio, "queries": len(texts), "repeats": args.repeats,
            "text_index": text_section}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("effectiveness", "latency", "collections", "generalise"))
    p.add_argument("--index", type=Path, default=SCIFACT_INDEX)
    p.add_argument("--data", type=Path, default=SCIFACT, help="BEIR SciFact directory (queries, qrels)")
    p.add_argument("--splits", default="train,test", help="the first one chooses the defaults")
    p.add_argument("--limit", type=int, default=None, help="first N judged queries per split")
    p.add_argument("--batch", type=int, default=16, help="queries per search call (effectiveness)")
    p.add_argument("--query-texts", type=Path, default=None, help="query texts (default: SciFact queries.jsonl)")
    p.add_argument("--query-embeddings", type=Path, help="latency: queries encoded elsewhere (.npz)")
    p.add_argument("--n", type=int, default=100, help="latency: queries")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="40 queries per split; latency 5 queries x 1")
    p.add_argument("--name", default=None)
    p.add_argument("--collections", type=Path, default=ROOT / ".espn" / "collections",
                   help="collections / generalise: the directory of the collections made from --data")
    p.add_argument("--subset", type=int, default=None,
                   help="collections: a corpus of every judged passage and the first others, this many in all")
    p.add_argument("--no-titles-index", type=Path, default=ROOT / ".espn" / "scifact-no-titles-index",
                   help="generalise: the index of COLLECTIONS/no-titles/corpus.jsonl")
    args = p.parse_args(argv)
    if args.part == "collections":
        write_collections(args.data, args.collections, args.subset)
        print(f"wrote {args.collections}: index {args.collections / 'no-titles' / 'corpus.jsonl'} for --no-titles-index")
        return 0
    if args.quick:
        args.limit, args.n, args.repeats, args.warmup = args.limit or 40, min(args.n, 5), 1, 1
    args.query_texts = args.query_texts or args.data / "queries.jsonl"
    if not (args.index / "manifest.json").is_file():
        print(f"no index at {args.index}", file=sys.stderr)
        return 2
    parts = {"effectiveness": effectiveness, "latency": latency, "generalise": generalise}
    payload = parts[args.part](args)
    write_results(args.name or f"hybrid_{args.part}", {"machine": machine(), "index": str(args.index), **payload})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
