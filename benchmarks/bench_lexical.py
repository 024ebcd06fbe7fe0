"""Is espn's lexical side as good as a well-tuned BM25? Tantivy (espn.text) against bm25s on SciFact.

    python -m benchmarks.bench_lexical                       # SciFact train and test ($ESPN_SCIFACT)
    python -m benchmarks.bench_lexical --splits test --limit 100   # a quick look

Effectiveness only (bench_text_engines times the engines). No espn index is needed: the
passages are read from the BEIR corpus and indexed here, title and text joined as espn
indexes them (`espn.corpus.passage_text`). Runs, each nDCG@10 over the split's judged queries:

- espn (Tantivy): espn's full-text index and its plain query reading, as `--mode lexical`
  searches (Tantivy's BM25: k1 1.2, b 0.75);
- bm25s, k1 0.9 / b 0.4 (Pyserini's constants), tokenised by bm25s itself (PyStemmer's
  Snowball English stemmer, bm25s's English stop words): an off-the-shelf BM25;
- bm25s, k1 0.9 / b 0.4, and bm25s, k1 1.2 / b 0.75, on espn's own analysed terms (the same
  tokenizer, stemmer and stop words as espn), so what differs from espn is the scoring only.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from benchmarks.common import SCIFACT, machine, machine_line, markdown_table, write_results


def _corpus(data: Path) -> Iterator[tuple[str, str, str]]:
    path = data / "corpus.jsonl.gz"
    opener = gzip.open if path.is_file() else open
    with opener(path if path.is_file() else data / "corpus.jsonl", "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            yield str(doc["_id"]), doc.get("title") or "", doc.get("text") or ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=SCIFACT, help="BEIR directory (corpus, queries.jsonl, qrels/)")
    p.add_argument("--splits", default="train,test")
    p.add_argument("--limit", type=int, default=None, help="first N judged queries per split")
    p.add_argument("--name", default="lexical_vs_bm25s")
    args = p.parse_args(argv)
    import bm25s
    import Stemmer

    from espn.corpus import passage_text, read_qrels, read_queries
    from espn.evaluation import evaluate
    from espn.text import TextConfig, parse_query
    from espn.text.engine import TextDocument, TextIndex, build_text_index

    ids, texts = [], []
    for doc_id, title, text in _corpus(args.data):
        ids.append(doc_id)
        texts.append(passage_text(title, text))
    config = TextConfig()
    analyzer = config.analyzer()
    espn_tokens = [list(analyzer.analyze(text)) for text in texts]
    stemmer = Stemmer.Stemmer("english")
    own_tokens = bm25s.tokenize(texts, stopwords="en", stemmer=stemmer, show_progress=False)
    engines: dict[str, Any] = {}
    for label, tokens, k1, b in (("bm25s k1 0.9 b 0.4, bm25s tokens", own_tokens, 0.9, 0.4),
                                 ("bm25s k1 0.9 b 0.4, espn terms", espn_tokens, 0.9, 0.4),
                                 ("bm25s k1 1.2 b 0.75, espn terms", espn_tokens, 1.2, 0.75)):
        retriever = bm25s.BM25(k1=k1, b=b)
        retriever.index(tokens, show_progress=False)
        engines[label] = retriever
    scratch = Path(tempfile.mkdtemp(prefix="bench-lexical-"))
    rows: dict[str, dict[str, float]] = {}
    try:
        build_text_index(scratch / "text", (TextDocument(n, "", text) for n, text in enumerate(texts)), config)
        tantivy = TextIndex(scratch / "text", config)
        all_queries = read_queries(args.data / "queries.jsonl")
        sizes = {}
        for split in args.splits.split(","):
            qrels = read_qrels(args.data / "qrels" / f"{split}.tsv")
            queries = [(qid, text) for qid, text in all_queries if qid in qrels][: args.limit]
            sizes[split] = len(queries)
            runs: dict[str, dict[str, dict[str, float]]] = {"espn (Tantivy k1 1.2 b 0.75)": {}}
            for qid, text in queries:
                hits = tantivy.search(parse_query(text), 100)
                runs["espn (Tantivy k1 1.2 b 0.75)"][qid] = {ids[n]: float(s) for n, s in
                                                              zip(hits.doc_numbers.tolist(), hits.scores.tolist())}
            for label, retriever in engines.items():
                run = runs.setdefault(label, {})
                for qid, text in queries:
                    if "bm25s tokens" in label:
                        q = bm25s.tokenize([text], stopwords="en", stemmer=stemmer, show_progress=False)
                    else:
                        q = [list(analyzer.analyze(text))]
                    if not (q.ids[0] if hasattr(q, "ids") else q[0]):
                        run[qid] = {}
                        continue
                    found, scores = retriever.retrieve(q, k=100, show_progress=False, n_threads=1)
                    run[qid] = {ids[int(n)]: float(s) for n, s in zip(found[0], scores[0]) if s > 0}
            for label, run in runs.items():
                rows.setdefault(label, {})[split] = evaluate(run, qrels)["nDCG@10"]
        tantivy.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    splits = args.splits.split(",")
    espn_label = "espn (Tantivy k1 1.2 b 0.75)"
    table = markdown_table(["run"] + [f"{s} nDCG@10 ({sizes[s]} q)" for s in splits]
                           + [f"espn - this, {s}" for s in splits],
                           [[label] + [rows[label][s] for s in splits]
                            + [rows[espn_label][s] - rows[label][s] for s in splits] for label in rows])
    print(f"{args.data}: {len(ids)} passages (title and text), top 100. Machine: {machine_line(machine())}\n\n{table}")
    write_results(args.name, {"machine": machine(), "data": str(args.data), "queries": sizes, "nDCG@10": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
