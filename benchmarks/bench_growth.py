"""An index that grows: written from empty to N documents, against fresh builds of the same documents.

    python -m benchmarks.bench_growth growth --source COLBERT_INDEX --sizes 1000,10000,100000 --work DIR
    python -m benchmarks.bench_growth exact --source COLBERT_INDEX --text-source MINILM_384_INDEX \
        --sizes 250,500,1000,2000,4000,8000,16000 --work DIR
    python -m benchmarks.bench_growth growth --quick      # both studies small, for the CI smoke test

The documents are synthetic (benchmarks.growth_corpus: real vectors' geometry and real document
lengths from `--source`), written through the library's write path with precomputed vectors
(`IndexWriter.publish` of `EncodedDocuments`, one generation per `--batch` documents), so
100,000 of them cost minutes, not the hours encoding would.

growth: an index created empty (espn.live.create, the model's first stage once fitted, int8
records, no text index) takes the documents in batches while the compaction policy runs as a
server runs it (espn.engine.writing.Writing: a background thread at lowered priority past the
policy's thresholds, its swap on the publishing thread): each base rewrite fits it again. At
each size the writes stop, the compactions the policy asks for run to the end, and the grown
index (as the policy leaves it: a base and its deltas) is compared with a fresh build of the same documents
(`espn index`'s assembler over the same vectors): recall of the exhaustive MaxSim top 10, and
single-query search latency, both searchers interleaved query by query in shuffled rounds.
Then, after the sizes in `--throughput-at` (the largest by default: the windows' writes carry
the index past the next size), write throughput with and without a re-fit running:
`--refit-rounds` pairs of windows, one of `--window` batches with no compaction, one of the
batches written while a re-fit (`Writing.refit`) runs (at most `--window`).

exact: for each size, a fresh build of the first N documents of each kind (a ColBERT-class
token model around `--source`; the default text model around `--text-source`, an index of
unprojected MiniLM vectors), searched with its fitted first stage and with "exact" (every
document's MaxSim), interleaved: the curve that chooses espn.live.fitting.EXACT_MAX_DOCUMENTS.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import ROOT, machine, machine_line, markdown_table, median, take_queries, write_results
from benchmarks.growth_corpus import CHUNK, SyntheticCorpus

#: The bundled sample index (`make serve-sample` builds it): the geometry of --quick runs.
SAMPLE_INDEX = ROOT / ".espn" / "sample-index"


def fresh_build(corpus: SyntheticCorpus, n: int, out: Path) -> float:
    """The first n documents through the build's assembler (`espn index --embeddings` minus the
    import), stored and fitted as a created index stores them once fitted; seconds."""
    from espn.encoders.precomputed import PrecomputedEncoder
    from espn.files.durable import write_json_atomic
    from espn_indexing.build import merge_index
    from espn_indexing.chunks import write_chunk
    from espn_indexing.workdir import WorkDir

    started = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    work = WorkDir(out)
    work.remove()
    with work.locked():
        encoder = PrecomputedEncoder(**corpus.encoder_settings())
        encoder.save(work.encoder_dir)
        config = {**encoder.config(), "learned_weight": encoder.learned_weight, "bow_reduction": encoder.bow_reduction}
        write_json_atomic(work.job_file, {"corpus": f"synthetic:{n}", "block_size": 4096, "nlist": None,
                                          "ann": "flat", "pq_m": 32, "text_index": None, "encoder_config": config,
                                          "bow_dtype": "int8", "first_stage": corpus.first_stage})
        chunks = 0
        for ids, cls, bow, counts in corpus.documents(0, n, CHUNK):
            write_chunk(work.path, chunks, cls, bow, counts, ids)
            chunks += 1
        write_json_atomic(work.marker(0, 1), {"shard": 0, "num_shards": 1, "documents": n, "chunks": chunks})
    merge_index(out)
    return time.perf_counter() - started


def create_grown(corpus: SyntheticCorpus, out: Path) -> Path:
    from espn.encoders.precomputed import PrecomputedEncoder
    from espn.live.create import NewIndex, create_index

    shutil.rmtree(out, ignore_errors=True)
    return create_index(out, PrecomputedEncoder(**corpus.encoder_settings()),
                        NewIndex(first_stage=corpus.first_stage, text_index=None))


class Grower:
    """Writes the corpus into the created index, batch by batch, one generation each, with the
    server's compaction (espn.engine.writing.Writing) started past the policy's thresholds."""

    def __init__(self, corpus: SyntheticCorpus, index: Path, batch: int) -> None:
        from espn.engine.config import IndexConfig
        from espn.engine.writing import Writing
        from espn.live.live_index import LiveIndex

        self.corpus, self.index, self.batch = corpus, index, batch
        self.writer = LiveIndex(index)  # takes the writer lock for each publish, as the committer does
        self.config = IndexConfig(write_wait_s=600.0)
        self.new_writing = lambda: Writing(index, self.config, on_publish=lambda generation: None)
        self.writing = self.new_writing()
        self.written = 0
        self.publish_s = 0.0

    def write(self, stop: int, compact: bool = True) -> int:
        """Documents up to number `stop` (exclusive); batches published."""
        from espn.live.checks import NewDocument
        from espn.live.encoding import EncodedDocuments

        batches = 0
        for ids, cls, bow, counts in self.corpus.documents(self.written, stop, self.batch):
            upserts = [NewDocument(doc_id, f"document {doc_id}") for doc_id in ids]
            lines = [b'{"title": "", "text": "document %s"}' % doc_id.encode() for doc_id in ids]
            started = time.perf_counter()
            (outcome,) = self.writer.publish([self.writer.check(upserts, [])],
                                             [EncodedDocuments(list(ids), lines, cls, bow, counts)], wait_s=600.0)
            self.publish_s += time.perf_counter() - started
            if isinstance(outcome, Exception):
                raise outcome
            self.written += len(ids)
            batches += 1
            if compact:
                self.writing.maybe_compact()
        return batches

    def settle(self) -> None:
        """The writes stopped: the compaction the policy asks for runs, and those it chains (as a
        server's would, writes or none), until none is due; then a new Writing for what follows."""
        self.writing.maybe_compact()
        self.writing.wait_idle()
        self.writing.close()
        self.writing = self.new_writing()

    def compacting(self) -> bool:
        from espn.live.status import fit_status

        return fit_status(self.index)["refit_running"] is not None

    def throughput(self, window: int, during_refit: bool) -> dict[str, Any]:
        """docs/s of `window` batches with no compaction running, or of the batches written while one
        re-fit runs (from when it holds the compaction lock until it has been swapped in, at most
        `window` of them: a re-fit starved of CPU would otherwise grow the index without bound); then
        the re-fit is left to finish."""
        if during_refit:
            assert self.writing.refit()
            deadline = time.monotonic() + 60
            while not self.compacting() and time.monotonic() < deadline:
                time.sleep(0.005)
        before, started, batches = self.written, time.perf_counter(), 0
        while batches < window and (self.compacting() if during_refit else True):
            batches += self.write(self.written + self.batch, compact=False)
        seconds = time.perf_counter() - started
        refit_running_after = during_refit and self.compacting()
        self.settle()
        return {"docs": self.written - before, "seconds": seconds, "docs_per_s": (self.written - before) / seconds,
                "batches": batches, "window_ended_before_refit": refit_running_after}

    def close(self) -> None:
        self.writing.close()
        self.writer.close()


def recall_and_latency(paths: dict[str, Path], queries, rounds: int, overrides: dict[str, dict[str, Any]] | None = None,
                       seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per configuration (a searcher of `paths[name]`, with `overrides[name]` search parameters):
    recall of the exhaustive MaxSim top 10 (computed on the first path) and single-query latency,
    interleaved query by query in `rounds` shuffled rounds (the median of the rounds' p50)."""
    from espn import Searcher

    overrides = overrides or {}
    searchers = {name: Searcher.open(path, verify="none") for name, path in paths.items()}
    try:
        first = next(iter(searchers.values()))
        exhaustive = [{h.doc_id for h in hits} for hits in first.search_maxsim_exhaustive(queries, 10)]
        out: dict[str, dict[str, Any]] = {}
        for name, searcher in searchers.items():
            found = searcher.search_embeddings(queries, k=10, **overrides.get(name, {}))
            recall = np.mean([len({h.doc_id for h in r.hits} & truth) / max(1, len(truth))
                              for r, truth in zip(found, exhaustive)])
            out[name] = {"recall@10": float(recall), "round_p50_ms": [], "documents": searcher.searchable_documents}
        rng = np.random.default_rng(seed)
        for _ in range(rounds):
            times: dict[str, list[float]] = {name: [] for name in searchers}
            for row in rng.permutation(len(queries.cls)):
                one = take_queries(queries, [row])
                for name in rng.permutation(list(searchers)):
                    started = time.perf_counter()
                    searchers[name].search_embeddings(one, k=10, **overrides.get(name, {}))
                    times[name].append((time.perf_counter() - started) * 1000)
            for name, values in times.items():
                out[name]["round_p50_ms"].append(float(np.percentile(values, 50)))
        for row in out.values():
            row["p50_ms"] = median(row["round_p50_ms"])
        return out
    finally:
        for searcher in searchers.values():
            searcher.close()


def run_growth(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from espn.live.status import live_stats

    corpus = SyntheticCorpus(args.source, "tokens")
    queries = corpus.queries(args.queries)
    grown = create_grown(corpus, work / "grown")
    grower = Grower(corpus, grown, args.batch)
    rows = []
    started = time.perf_counter()
    try:
        for size in args.sizes:
            began = time.perf_counter()
            batches = grower.write(size)  # none when the throughput windows wrote past it already
            write_s = time.perf_counter() - began
            grower.settle()
            stats = live_stats(grown)
            n = grower.written  # the fresh build takes exactly the documents the grown index holds
            build_s = fresh_build(corpus, n, work / f"fresh-{size}")
            measured = recall_and_latency({"grown": grown, "fresh build": work / f"fresh-{size}"}, queries,
                                          args.rounds)
            row = {"documents": n, "stats": stats, "write_s": write_s, "batches": batches,
                   "fresh_build_s": build_s, "search": measured,
                   "p50_ratio": measured["grown"]["p50_ms"] / measured["fresh build"]["p50_ms"]}
            if args.refit_rounds and size in args.throughput_at:
                pairs = [(grower.throughput(args.window, False), grower.throughput(args.window, True))
                         for _ in range(args.refit_rounds)]
                row["throughput"] = {"without": [a for a, _ in pairs], "during_refit": [b for _, b in pairs]}
                row["throughput_ratio"] = median([b["docs_per_s"] for _, b in pairs]) / \
                    median([a["docs_per_s"] for a, _ in pairs])
                row["documents_after"] = grower.written
            rows.append(row)
            shutil.rmtree(work / f"fresh-{size}", ignore_errors=True)
            print(f"{n} documents: {json.dumps(row)}", file=sys.stderr, flush=True)
    finally:
        grower.close()
    return {"rows": rows, "total_s": time.perf_counter() - started, "batch": args.batch,
            "queries": args.queries, "rounds": args.rounds, "window": args.window}


def run_exact(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    kinds = {kind: source for kind, source in (("tokens", args.source), ("text", args.text_source))
             if kind in args.kinds.split(",")}
    out: dict[str, Any] = {}
    for kind, source in kinds.items():
        if source is None:
            continue
        corpus = SyntheticCorpus(source, kind)
        queries = corpus.queries(args.queries)
        rows = []
        for size in args.sizes:
            path = work / f"{kind}-{size}"
            build_s = fresh_build(corpus, size, path)
            measured = recall_and_latency({"fitted": path, "exact": path}, queries, args.rounds,
                                          {"exact": {"first_stage": "exact"}})
            rows.append({"documents": size, "build_s": build_s, "search": measured,
                         "exact_over_fitted": measured["exact"]["p50_ms"] / measured["fitted"]["p50_ms"]})
            shutil.rmtree(path, ignore_errors=True)
            print(f"{kind} {size}: {measured}", file=sys.stderr, flush=True)
        out[kind] = {"source": str(source), "d_bow": corpus.d_bow, "first_stage": corpus.first_stage, "rows": rows}
    return out


def report_growth(out: dict[str, Any]) -> str:
    rows = []
    for row in out["rows"]:
        grown, fresh = row["search"]["grown"], row["search"]["fresh build"]
        stats = row["stats"]
        fit = "exact" if stats["exact"] else f"fitted on {stats['fitted_on_documents']:,}"
        rows.append([f"{row['documents']:,}", f"{fit}, {stats['delta_segments']} deltas", grown["recall@10"],
                     fresh["recall@10"], grown["p50_ms"], fresh["p50_ms"], row["p50_ratio"],
                     row.get("throughput_ratio", float("nan"))])
    return markdown_table(["documents", "grown index", "recall@10 grown", "recall@10 fresh", "p50 ms grown",
                           "p50 ms fresh", "p50 grown / fresh", "writes/s during re-fit / without"], rows)


def report_exact(out: dict[str, Any]) -> str:
    tables = []
    for kind, study in out.items():
        rows = [[f"{row['documents']:,}", row["search"]["fitted"]["recall@10"], row["search"]["exact"]["recall@10"],
                 row["search"]["fitted"]["p50_ms"], row["search"]["exact"]["p50_ms"], row["exact_over_fitted"]]
                for row in study["rows"]]
        tables.append(f"{kind} ({study['first_stage']} when fitted, {study['d_bow']}-d tokens):\n\n" + markdown_table(
            ["documents", f"recall@10 {study['first_stage']}", "recall@10 exact", f"p50 ms {study['first_stage']}",
             "p50 ms exact", "exact / fitted"], rows))
    return "\n\n".join(tables)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", choices=("growth", "exact"))
    p.add_argument("--source", type=Path, help="a ColBERT-class index whose vectors give the token documents' "
                   "geometry and lengths (default with --quick: the sample index, widened to 128-d)")
    p.add_argument("--text-source", type=Path, help="exact: an index of unprojected MiniLM vectors (the text "
                   "model's documents)")
    p.add_argument("--sizes", default="1000,10000,100000", help="comma-separated document counts")
    p.add_argument("--batch", type=int, default=64, help="documents per published write")
    p.add_argument("--queries", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--refit-rounds", type=int, default=3, help="growth: pairs of throughput windows at each size")
    p.add_argument("--window", type=int, default=40, help="growth: batches in a window (one during a re-fit ends "
                   "sooner if the re-fit does)")
    p.add_argument("--throughput-at", help="growth: comma-separated sizes after which the throughput windows run "
                   "(default: the largest; their writes would carry the index past the next size)")
    p.add_argument("--kinds", default="tokens,text", help="exact: which kinds of documents (comma-separated)")
    p.add_argument("--work", type=Path, help="where indexes go (default: a temporary directory, removed after)")
    p.add_argument("--quick", action="store_true", help="tiny sizes around the sample index (the CI smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.source = args.source or SAMPLE_INDEX
        args.text_source = args.text_source or args.source
        args.sizes, args.queries, args.rounds, args.refit_rounds, args.window = "200,600", 6, 1, 1, 2
    if args.source is None:
        p.error("--source is required (a ColBERT-class index; see the module doc)")
    args.sizes = sorted(int(s) for s in args.sizes.split(","))
    args.throughput_at = ({int(s) for s in args.throughput_at.split(",")} if args.throughput_at
                          else set(args.sizes) if args.quick else {args.sizes[-1]})
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-growth-"))
    work.mkdir(parents=True, exist_ok=True)
    info = machine()
    try:
        result = run_growth(args, work) if args.study == "growth" else run_exact(args, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    payload = {"machine": info, "study": args.study, "sizes": args.sizes, "source": str(args.source),
               "text_source": str(args.text_source), **({"growth": result} if args.study == "growth" else
                                                        {"exact": result})}
    print(machine_line(info))
    print(report_growth(result) if args.study == "growth" else report_exact(result))
    write_results(f"growth_{args.study}" + ("_quick" if args.quick else ""), payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
