"""`espn` command line: index, index-merge, search, calibrate, verify, serve, route.

The only place that reads argv; every command calls the library. Errors end as one
line on stderr and a non-zero exit, never a traceback (set ESPN_DEBUG=1 for one).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["main"]

log = logging.getLogger("espn")


def _shard(value: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 0/2, got {value!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"shard I/N needs 0 <= I < N, got {value!r}")
    return i, n


def _add_search_params(p: argparse.ArgumentParser, readers: list[str]) -> None:
    p.add_argument("--nprobe", type=int, help="IVF clusters visited (default: the index's)")
    p.add_argument("--prefetch-step", type=float, help="fraction of nprobe per prefetch wave, in (0, 1]")
    p.add_argument("--prefetch-k", type=int, help="candidates each prefetch wave reads (0 = off)")
    p.add_argument("--rerank-count", type=int, help="candidates re-ranked with MaxSim")
    p.add_argument("--prefetch-waves", type=int, help="most prefetch waves (1 = the paper's single prefetch)")
    p.add_argument("--no-prefetch", action="store_true", help="sequential reference path (same results)")
    p.add_argument("--reader", choices=readers, help="embedding reader (default: kvikio with CUDA, else posix)")


def _search_overrides(args: argparse.Namespace) -> dict:
    return {
        "nprobe": args.nprobe, "prefetch_step": args.prefetch_step, "prefetch_k": args.prefetch_k,
        "rerank_count": args.rerank_count, "prefetch_waves": args.prefetch_waves, "prefetch": False if args.no_prefetch else None,
    }


def build_parser() -> argparse.ArgumentParser:
    from espn.evaluation import DEFAULT_MEASURES
    from espn.store import READERS

    parser = argparse.ArgumentParser(prog="espn", description="Multi-vector retrieval with the embedding table on SSD.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("index", help="build an index from a corpus (BEIR corpus.jsonl[.gz] or id<TAB>text TSV)")
    p.add_argument("corpus", type=Path, nargs="?", help="corpus file (omit with --embeddings)")
    p.add_argument("--out", type=Path, required=True, help="index directory to create")
    p.add_argument("--encoder", default="minilm", help="minilm (default), hf:PATH or colberter:PATH")
    p.add_argument("--embeddings", type=Path, help="build from precomputed embedding shards in this directory")
    p.add_argument("--bow-dim", type=int, default=64, help="BOW dimensions after PCA (384 = no projection)")
    p.add_argument("--nlist", type=int, help="IVF lists (default: from the corpus size)")
    p.add_argument("--ann", choices=("flat", "pq"), default="flat", help="IVF-Flat (default) or IVF-PQ")
    p.add_argument("--pq-m", type=int, default=32, help="PQ bytes per vector with --ann pq")
    p.add_argument("--block-size", type=int, default=4096, help="record block size in bytes")
    p.add_argument("--chunk-size", type=int, default=1024, help="documents per chunk (the unit of resume)")
    p.add_argument("--batch-size", type=int, default=32, help="documents per model batch")
    p.add_argument("--shard", type=_shard, default=(0, 1), metavar="I/N", help="encode only shard I of N")
    p.add_argument("--partitions", type=int, default=1, help="write S index partitions OUT/part-0.. sharing one encoder")
    p.add_argument("--score-weight", type=float, help="w in w·cls + (1-w)·bow (default: the model's, else 0.3; "
                   "`espn calibrate` fits it)")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed corpus lines instead of failing")
    p.add_argument("--force", action="store_true", help="replace an existing index at --out")
    p.add_argument("--device", help="torch device for encoding (default: cuda if available)")
    p.add_argument("--loader-workers", type=int, default=1, help="tokenising processes (0 = in-process)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("index-merge", help="assemble the shards of `espn index --shard I/N` into the index")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--partitions", type=int, default=1)
    p.add_argument("--force", action="store_true")

    p = sub.add_parser("search", help="batch queries to a TREC run file; with --qrels, print effectiveness")
    p.add_argument("index", type=Path)
    p.add_argument("--queries", type=Path, help="BEIR queries.jsonl or id<TAB>text")
    p.add_argument("--query-embeddings", type=Path, help="queries encoded elsewhere (see espn.encoders.precomputed)")
    p.add_argument("--out", type=Path, required=True, help="TREC run file to write")
    p.add_argument("--k", type=int, default=1000)
    p.add_argument("--qrels", type=Path, help="qrels (BEIR TSV or TREC) to evaluate against")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--exhaustive", action="store_true", help="brute-force reference: exact CLS over all docs, "
                   "MaxSim over --rerank-count (default 1000)")
    p.add_argument("--tag", default="espn")
    _add_search_params(p, sorted(READERS))

    p = sub.add_parser("calibrate", help="fit the score weight w on training queries; stored in the manifest")
    p.add_argument("index", type=Path)
    p.add_argument("--queries", type=Path, required=True)
    p.add_argument("--qrels", type=Path, required=True)
    p.add_argument("--measure", default="nDCG@10", choices=[str(m) for m in DEFAULT_MEASURES])
    p.add_argument("--dry-run", action="store_true", help="print the best w without writing it")

    p = sub.add_parser("verify", help="check every file of an index against its manifest checksums")
    p.add_argument("index", type=Path)

    p = sub.add_parser("serve", help="serve an index over HTTP (FastAPI under uvicorn)")
    from server.cli import add_serve_arguments
    from server.router import add_route_arguments

    add_serve_arguments(p)
    p = sub.add_parser("route", help="fan queries out to index partition servers and merge their top-k")
    add_route_arguments(p)
    return parser


def cmd_index(args: argparse.Namespace) -> int:
    from indexing.build import BuildConfig, build_from_embeddings, build_index

    manifest: dict | None
    if args.embeddings is not None:
        manifest = build_from_embeddings(args.embeddings, args.out, block_size=args.block_size, nlist=args.nlist,
                                         ann=args.ann, pq_m=args.pq_m, chunk_size=args.chunk_size,
                                         corpus=args.corpus, force=args.force, score_weight=args.score_weight)
    else:
        if args.corpus is None:
            raise SystemExit("espn index: error: give a CORPUS file or --embeddings DIR")
        config = BuildConfig(
            corpus=args.corpus, out=args.out, encoder=args.encoder, bow_dim=args.bow_dim, nlist=args.nlist,
            ann=args.ann, pq_m=args.pq_m, block_size=args.block_size, chunk_size=args.chunk_size,
            batch_size=args.batch_size, skip_bad=args.skip_bad, force=args.force, shard=args.shard[0],
            num_shards=args.shard[1], partitions=args.partitions, device=args.device,
            loader_workers=args.loader_workers, progress=not args.no_progress, score_weight=args.score_weight,
        )
        manifest = build_index(config)
    if manifest is None:
        print(f"shard encoded; when all shards are done run: espn index-merge --out {args.out}")
    else:
        counts = manifest["counts"]
        print(f"indexed {counts['documents']} documents ({counts['bow_vectors']} BOW vectors) into {args.out}")
    return 0


def cmd_index_merge(args: argparse.Namespace) -> int:
    from indexing.build import merge_index

    manifest = merge_index(args.out, partitions=args.partitions, force=args.force)
    print(f"merged {manifest['counts']['documents']} documents into {args.out}")
    return 0


def _load_queries(args: argparse.Namespace):
    if (args.queries is None) == (args.query_embeddings is None):
        raise SystemExit(f"espn {args.command}: error: give exactly one of --queries and --query-embeddings")
    if args.queries is not None:
        from espn.corpus import read_queries

        return read_queries(args.queries), None
    from espn.encoders.precomputed import load_query_embeddings

    ids, embeddings = load_query_embeddings(args.query_embeddings)
    return [(qid, "") for qid in ids], embeddings


def cmd_search(args: argparse.Namespace) -> int:
    from espn import Searcher
    from espn.corpus import read_qrels
    from espn.evaluation import evaluate, write_run

    queries, embeddings = _load_queries(args)
    qrels = read_qrels(args.qrels) if args.qrels else None
    searcher = Searcher.open(args.index, reader=args.reader, with_encoder=embeddings is None)
    overrides = _search_overrides(args)
    searcher.params(args.k, **overrides)  # fail before any work on a bad parameter
    if args.batch_size < 1:
        raise SystemExit("espn search: error: --batch-size must be >= 1")
    ranked, latencies, hit_rates = {}, [], []
    started = time.perf_counter()
    for start in range(0, len(queries), args.batch_size):
        batch = queries[start : start + args.batch_size]
        ids = [qid for qid, _ in batch]
        if args.exhaustive:
            if embeddings is not None:
                q = embeddings[start : start + len(batch)]
            else:
                assert searcher.encoder is not None  # opened with_encoder above
                q = searcher.encoder.encode_queries([text for _, text in batch])
            hit_lists = searcher.search_exhaustive(q, k=args.k, rerank_count=args.rerank_count or 1000)
        else:
            if embeddings is not None:
                results = searcher.search_embeddings(embeddings[start : start + len(batch)], args.k, **overrides)
            else:
                results = searcher.search([text for _, text in batch], args.k, **overrides)
            hit_lists = [r.hits for r in results]
            latencies.append(results[0].stats.stage_ms["total"])
            hit_rates += [r.stats.hit_rate for r in results]
        for qid, hits in zip(ids, hit_lists):
            ranked[qid] = [(h.doc_id, h.score) for h in hits]
    elapsed = time.perf_counter() - started
    write_run(args.out, ranked, tag=args.tag)
    print(f"wrote {sum(map(len, ranked.values()))} lines for {len(ranked)} queries to {args.out} "
          f"({len(queries) / elapsed:.1f} queries/s, reader={searcher.reader_name})")
    if latencies:
        p50, p95, p99 = np.percentile(latencies, [50, 95, 99])
        print(f"batch latency (batch size {args.batch_size}): p50 {p50:.1f} ms, p95 {p95:.1f} ms, p99 {p99:.1f} ms; "
              f"mean prefetch hit rate {np.mean(hit_rates):.3f}")
    if qrels is not None:
        run = {qid: {doc: score for doc, score in hits} for qid, hits in ranked.items()}
        for measure, value in evaluate(run, qrels).items():
            print(f"{measure}\t{value:.4f}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from espn import Searcher
    from espn.corpus import read_qrels, read_queries
    from espn.evaluation import evaluate
    from espn.index import update_manifest

    searcher = Searcher.open(args.index)
    queries, qrels = read_queries(args.queries), read_qrels(args.qrels)
    queries = [(qid, text) for qid, text in queries if qid in qrels]
    if not queries:
        raise SystemExit("espn calibrate: error: no query has judgements in --qrels")
    params = searcher.defaults
    heads: dict[str, list] = {}
    for start in range(0, len(queries), 32):
        batch = queries[start : start + 32]
        results = searcher.search([t for _, t in batch], k=params.rerank_count)
        for (qid, _), result in zip(batch, results):
            heads[qid] = [(h.doc_id, h.cls_score, h.bow_score) for h in result.hits if h.bow_score is not None]
    best_w, best = None, -1.0
    for w in np.round(np.arange(0.0, 1.0001, 0.05), 2):
        run = {qid: {d: float(w * c + (1 - w) * b) for d, c, b in hits} for qid, hits in heads.items()}
        value = evaluate(run, qrels)[args.measure]
        log.debug("w=%.2f %s=%.4f", w, args.measure, value)
        if value > best + 1e-9:
            best_w, best = float(w), value
    print(f"best w = {best_w:.2f} ({args.measure} {best:.4f} on {len(heads)} queries; was {searcher.weight:.2f})")
    if not args.dry_run:
        update_manifest(args.index, score={**searcher.manifest["score"], "w": best_w, "calibrated": True,
                                           "calibrated_on": str(Path(args.qrels).absolute())})
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from espn.index import IndexDirectory

    index = IndexDirectory.open(args.index, verify="full")
    print(f"{args.index}: {len(index.manifest['files'])} files verified, {index.num_documents} documents")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # Before torch or FAISS load OpenMP: spinning idle threads starve the other pool on
    # small machines (a 9x slower search measured on 2 cores). Users can still override.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from espn.errors import EspnError

    commands = {"index": cmd_index, "index-merge": cmd_index_merge, "search": cmd_search,
                "calibrate": cmd_calibrate, "verify": cmd_verify}
    if args.command == "serve":
        from server.cli import run_serve as handler
    elif args.command == "route":
        from server.router import run_route as handler
    else:
        handler = commands[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt:
        print(f"espn {args.command}: interrupted", file=sys.stderr)
        return 130
    except (EspnError, ValueError, FileNotFoundError) as exc:
        if os.environ.get("ESPN_DEBUG"):
            raise
        print(f"espn {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if os.environ.get("ESPN_DEBUG"):
            raise
        if exc.errno == errno.ENOSPC:
            print(f"espn {args.command}: error: no space left on device"
                  f"{' writing ' + str(exc.filename) if exc.filename else ''}; the partial build is kept, "
                  "free space and re-run the same command to resume", file=sys.stderr)
        else:
            print(f"espn {args.command}: error: {exc.strerror or exc}{': ' + str(exc.filename) if exc.filename else ''}",
                  file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
