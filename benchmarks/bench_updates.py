"""Live-index updates: add throughput, delete latency, search latency as deltas pile up.

    python -m benchmarks.bench_updates --index INDEX --corpus CORPUS --queries QUERIES
    python -m benchmarks.bench_updates --index INDEX --corpus CORPUS --queries QUERIES --quick

INDEX is never modified: the script works on a copy (in --work, default a temporary
directory). On that copy, in order:

1. add: `espn_indexing.bulk.add_corpus` of `--add-docs` corpus documents under new ids (one
   generation), against the build's encode stage alone (`encode_corpus`, the same
   documents, same process, same loader settings): docs/s of each and their ratio.
2. delete: `--deletes` single-id deletes, one generation each: median and p99 ms.
3. search latency (single queries, k = 10, the index's default parameters) in the states
   0 deltas -> 10 deltas -> 50 deltas -> 50 deltas + 10% of the base deleted -> compacted
   (the delta counts are `--deltas`; --quick uses 1 and 2);
   deltas are small upserts (`--delta-docs` each). Median and p99 ms per query over
   `--queries-n` queries x `--repeats` passes, all states measured in this one run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import machine, machine_line, markdown_table, percentiles, read_jsonl, write_results



def _write_corpus(docs: list[dict[str, Any]], path: Path, prefix: str) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"_id": f"{prefix}{d['_id']}", "title": d.get("title", ""), "text": d["text"]}) + "\n")
    return path


def _search_latency(index: Path, queries: list[str], repeats: int) -> dict[str, Any]:
    from espn import Searcher

    with Searcher.open(index, verify="none") as searcher:
        searcher.warmup()
        times = []
        for _ in range(repeats):
            for query in queries:
                started = time.perf_counter()
                searcher.search([query], k=10)
                times.append((time.perf_counter() - started) * 1000)
        generation = searcher.view.generation if searcher.view is not None else None
        return {"ms": percentiles(times), "segments": len(generation.segments) if generation else 0,
                "deleted": generation.deleted_count if generation else 0,
                "documents": generation.live_documents if generation else searcher.num_documents}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from espn_indexing.bulk import add_corpus
    from espn_indexing.encode import encode_corpus
    from espn.live.checks import NewDocument
    from espn.live.live_index import LiveIndex

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-updates-"))
    index = work / "index"
    shutil.rmtree(index, ignore_errors=True)
    shutil.copytree(args.index, index)
    few, many = args.deltas
    corpus = read_jsonl(args.corpus, args.add_docs + args.delta_docs * many)
    queries = [q["text"] for q in read_jsonl(args.queries, args.queries_n)]
    out: dict[str, Any] = {"machine": machine(), "index": str(args.index), "add_docs": args.add_docs}

    writer = LiveIndex.open(index)
    encoder = writer.encoder()
    adds = _write_corpus(corpus[: args.add_docs], work / "adds.jsonl", "add-")
    # The build's encode stage alone on the same documents (chunk files into a scratch dir).
    scratch = work / "encode-only"
    shutil.rmtree(scratch, ignore_errors=True)
    started = time.perf_counter()
    encode_corpus(adds, scratch, encoder, loader_workers=args.loader_workers, progress=False)
    encode_s = time.perf_counter() - started
    shutil.rmtree(scratch)
    states: list[tuple[str, dict[str, Any]]] = [("0 deltas", _search_latency(index, queries, args.repeats))]
    started = time.perf_counter()
    add_corpus(writer, adds, loader_workers=args.loader_workers)
    add_s = time.perf_counter() - started
    out["add"] = {"docs_per_s": args.add_docs / add_s, "encode_only_docs_per_s": args.add_docs / encode_s,
                  "ratio": encode_s / add_s, "seconds": add_s}

    ids = np.random.default_rng(0).permutation([f"{d['_id']}" for d in read_jsonl(args.corpus)])
    delete_ms = []
    for doc_id in ids[: args.deletes]:
        started = time.perf_counter()
        writer.delete([str(doc_id)])
        delete_ms.append((time.perf_counter() - started) * 1000)
    out["delete_ms"] = percentiles(delete_ms)

    pool = corpus[args.add_docs :]
    upsert_ms = []

    def add_deltas(until: int) -> None:
        while len(writer.current().segments) < until:
            at = len(writer.current().segments) * args.delta_docs % max(1, len(pool) - args.delta_docs)
            docs = [NewDocument(f"delta-{len(upsert_ms)}-{d['_id']}", d["text"], d.get("title", ""))
                    for d in pool[at : at + args.delta_docs]]
            started = time.perf_counter()
            writer.upsert(docs)
            upsert_ms.append((time.perf_counter() - started) * 1000)

    add_deltas(few)
    states.append((f"{few} deltas", _search_latency(index, queries, args.repeats)))
    add_deltas(many)
    states.append((f"{many} deltas", _search_latency(index, queries, args.repeats)))
    view_base = writer.current().base_documents
    doomed = [str(i) for i in ids[args.deletes : args.deletes + int(0.1 * view_base)]]
    writer.delete(doomed)
    states.append((f"{many} deltas + 10% deleted", _search_latency(index, queries, args.repeats)))
    started = time.perf_counter()
    writer.compact()
    out["compact_s"] = time.perf_counter() - started
    states.append(("compacted", _search_latency(index, queries, args.repeats)))
    writer.close()
    out["upsert_ms"] = percentiles(upsert_ms)
    out["search"] = {name: state for name, state in states}
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, required=True, help="index to copy (never modified)")
    p.add_argument("--corpus", type=Path, required=True, help="corpus the added documents come from (jsonl[.gz])")
    p.add_argument("--queries", type=Path, required=True, help="queries.jsonl (BEIR)")
    p.add_argument("--work", type=Path, help="where the copy goes (default: a temporary directory, removed after)")
    p.add_argument("--add-docs", type=int, default=500)
    p.add_argument("--deletes", type=int, default=20)
    p.add_argument("--delta-docs", type=int, default=5)
    p.add_argument("--queries-n", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loader-workers", type=int, default=1)
    p.add_argument("--deltas", default="10,50", help="the two delta counts whose search latency is measured")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one pass (for the CI smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.add_docs, args.deletes, args.delta_docs, args.queries_n, args.repeats = 8, 2, 1, 3, 1
        args.loader_workers, args.deltas = 0, "1,2"
    args.deltas = tuple(int(n) for n in args.deltas.split(","))
    out = run(args)
    base = out["search"]["0 deltas"]["ms"]["p50"]
    print(machine_line(out["machine"]))
    print(markdown_table(["measure", "value"], [
        ["add (espn add: add_corpus), docs/s", f"{out['add']['docs_per_s']:.1f}"],
        ["build encode stage alone, docs/s", f"{out['add']['encode_only_docs_per_s']:.1f}"],
        ["add / encode-only throughput", f"{out['add']['ratio']:.2f}"],
        ["delete of one id, median ms (p99)", f"{out['delete_ms']['p50']:.1f} ({out['delete_ms']['p99']:.1f})"],
        [f"upsert of {args.delta_docs} docs, median ms (p99)",
         f"{out['upsert_ms']['p50']:.1f} ({out['upsert_ms']['p99']:.1f})"],
        ["compact, s", f"{out['compact_s']:.2f}"],
    ]))
    print()
    print(markdown_table(["state", "segments", "deleted", "p50 ms", "p99 ms", "p50 / 0 deltas"], [
        [name, s["segments"], s["deleted"], f"{s['ms']['p50']:.2f}", f"{s['ms']['p99']:.2f}",
         f"{s['ms']['p50'] / base:.2f}"] for name, s in out["search"].items()
    ]))
    write_results("bench_updates" + ("_quick" if args.quick else ""), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
