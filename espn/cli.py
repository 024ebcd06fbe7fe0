"""`espn` command line: search, calibrate, verify here; index, index-merge, serve, route plug in.

The only place that reads argv; every command calls the library. Every error ends as one
line on stderr, `espn CMD: error: ...`, with exit status 1, or 2 when the command line
itself is wrong (as argparse does); never a traceback (`-v` adds one). Third-party
libraries' log lines (FAISS's loader, transformers, ...) are shown only with `-v`.

The library must not import the build job or the server (they import it), so their
subcommands register themselves through the `espn.commands` entry-point group: each
entry point is a `register(subparsers)` that adds its parsers and sets `handler`.
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence, cast

import numpy as np

from .errors import EspnError, InvalidParameterError
from .params import SearchParams
from .results import Hit

__all__ = ["main", "add_reader_options", "reader_options", "configure_logging", "CliParser", "UsageError",
           "COMMANDS_GROUP"]

COMMANDS_GROUP = "espn.commands"
# Entry points register in this order, so `espn --help` lists the build before the server.
_PLUGIN_ORDER = ("indexing", "server")
IO_ENGINES = ("auto", "io_uring", "aio", "threads")

log = logging.getLogger("espn")
#: Loggers of this project (the library, the build job, the server): INFO by default.
OWN_LOGGERS = ("espn", "espn_indexing", "espn_server")


class UsageError(Exception):
    """The command line itself is wrong (a missing or conflicting flag): exit status 2, as argparse gives."""


class CliParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `espn search: error: ... (see `espn search --help`)`, exit 2.

    argparse prints the whole usage block before its error; the help is one flag away.
    Subparsers inherit the class (`add_subparsers` uses the parent's type).
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def configure_logging(verbosity: int) -> None:
    """This project's INFO lines on stderr; third-party loggers and Python warnings only with -v.

    verbosity 0: ours at INFO, everyone else's at ERROR (FAISS's loader announces its
    fallbacks at INFO, with a ModuleNotFoundError in the text: noise to a user).
    1 (-v): ours at DEBUG, theirs at INFO; 2 (-vv): everything at DEBUG.
    Calling it again replaces the handler it installed (tests call `main` more than once).
    """
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "espn_cli", False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr)
    handler.espn_cli = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel((logging.ERROR, logging.INFO, logging.DEBUG)[min(verbosity, 2)])
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if verbosity else logging.INFO)
    logging.captureWarnings(True)  # warnings.warn from libraries: through the "py.warnings" logger, as above
    # transformers logs through its own handler, not the root's: its own switch (a user's setting wins).
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", ("error", "info", "debug")[min(verbosity, 2)])


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (some libraries' messages span several)."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def add_reader_options(p: argparse.ArgumentParser) -> None:
    """--io-engine, --io-depth, --max-extent-bytes, --no-direct: options of the posix reader."""
    g = p.add_argument_group("reader I/O (posix reader only)")
    g.add_argument("--io-engine", choices=IO_ENGINES, default=os.environ.get("ESPN_IO_ENGINE") or None,
                   help="read engine (ESPN_IO_ENGINE; default auto: io_uring, then aio, then threads)")
    g.add_argument("--io-depth", type=int, metavar="N", help="extents in flight at once (default 64)")
    g.add_argument("--max-extent-bytes", type=int, metavar="N", help="cap on one coalesced read (default 1 MiB)")
    g.add_argument("--no-direct", action="store_true", help="buffered reads instead of O_DIRECT")
    p.add_argument("--record-cache-mb", type=float, metavar="MB", default=None,
                   help="RAM for a cache of frequently read records in front of the reader (default 0: off)")


def reader_options(args: argparse.Namespace) -> dict[str, Any]:
    """The reader options the user set (only those: other readers take none)."""
    options: dict[str, Any] = {}
    if getattr(args, "io_engine", None) is not None:
        options["io_engine"] = None if args.io_engine == "auto" else args.io_engine
    if getattr(args, "io_depth", None) is not None:
        options["io_depth"] = args.io_depth
    if getattr(args, "max_extent_bytes", None) is not None:
        options["max_extent_bytes"] = args.max_extent_bytes
    if getattr(args, "no_direct", False):
        options["direct"] = False
    if options and getattr(args, "reader", None) not in (None, "posix"):
        raise InvalidParameterError(f"--io-engine, --io-depth, --max-extent-bytes and --no-direct apply to the "
                                    f"posix reader only, not --reader {args.reader}")
    if getattr(args, "record_cache_mb", None):  # espn.store.record_cache; checked where the reader opens
        options["record_cache_mb"] = args.record_cache_mb
    return options


def _add_search_params(p: argparse.ArgumentParser, readers: list[str]) -> None:
    p.add_argument("--nprobe", type=int, help="IVF clusters visited (default: the index's)")
    p.add_argument("--prefetch-step", type=float, help="fraction of nprobe per prefetch wave, in (0, 1]")
    p.add_argument("--prefetch-k", type=int, help="candidates each prefetch wave reads (0 = off)")
    p.add_argument("--rerank-count", type=int, help="candidates re-ranked with MaxSim")
    p.add_argument("--prefetch-waves", type=int, help="most prefetch waves (1 = the paper's single prefetch)")
    p.add_argument("--no-prefetch", action="store_true", help="sequential reference path (same results)")
    p.add_argument("--reader", choices=readers, help="embedding reader (default: kvikio with CUDA, else posix)")
    add_reader_options(p)


def _add_mode_params(p: argparse.ArgumentParser) -> None:
    from espn.hybrid import FUSIONS, MODES
    from espn.text.query import SYNTAXES

    g = p.add_argument_group("search mode (lexical and hybrid need the index's full-text index)")
    g.add_argument("--mode", choices=MODES, help="dense (default), lexical (BM25) or hybrid (both, fused)")
    g.add_argument("--query-syntax", choices=SYNTAXES, help="lexical and hybrid: plain (default: every character is "
                   'text, never an operator) or simple ("phrases", +required, -excluded; what it cannot read is '
                   "read as text)")
    g.add_argument("--fusion", choices=FUSIONS, help="hybrid: rrf or mix (default: the index's)")
    g.add_argument("--lexical-k", type=int, help="hybrid: candidates from the lexical side (default 100)")
    g.add_argument("--rrf-k", type=int, help="hybrid: the RRF constant (default 60)")
    g.add_argument("--mix-weight", type=float, help="hybrid: the dense side's weight in the mix (default: calibrated)")
    g.add_argument("--no-union", action="store_true",
                   help="hybrid: do not MaxSim-score what only the lexical side found")


def _mode_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {"mode": args.mode, "fusion": args.fusion, "lexical_k": args.lexical_k, "rrf_k": args.rrf_k,
            "mix_weight": args.mix_weight, "union": False if args.no_union else None,
            "syntax": getattr(args, "query_syntax", None)}


def _search_overrides(args: argparse.Namespace) -> dict:
    return {
        "nprobe": args.nprobe, "prefetch_step": args.prefetch_step, "prefetch_k": args.prefetch_k,
        "rerank_count": args.rerank_count, "prefetch_waves": args.prefetch_waves, "prefetch": False if args.no_prefetch else None,
    }


def _check_output_file(command: str, path: Path) -> None:
    """Refuse an output file that cannot be written before any work is done."""
    parent = path.absolute().parent
    if not parent.is_dir():
        raise InvalidParameterError(f"--out {path}: directory {parent} does not exist")
    if path.is_dir():
        raise InvalidParameterError(f"--out {path} is a directory; give a file name")
    if not os.access(parent, os.W_OK):
        raise InvalidParameterError(f"--out {path}: directory {parent} is not writable")


def _register_plugins(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Subcommands from the `espn.commands` entry points (the build job, the server)."""
    found = sorted(importlib.metadata.entry_points(group=COMMANDS_GROUP),
                   key=lambda ep: (_PLUGIN_ORDER.index(ep.name) if ep.name in _PLUGIN_ORDER else 99, ep.name))
    for entry_point in found:
        try:
            register = entry_point.load()
        except ImportError as exc:  # a broken install: say which part and why, keep the rest usable
            p = sub.add_parser(entry_point.name, help=f"(unavailable: {exc})")
            p.set_defaults(handler=_unavailable(entry_point.name, exc))
            continue
        register(sub)


def _unavailable(name: str, exc: ImportError) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        raise EspnError(f"the {name} commands cannot load: {exc}")

    return handler


def build_parser() -> argparse.ArgumentParser:
    from espn.evaluation import DEFAULT_MEASURES
    from espn.store import READERS

    parser = CliParser(prog="espn", description="Multi-vector retrieval with the embedding table on SSD.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more output: -v adds debug lines, other libraries' log lines and a traceback with an "
                             "error; -vv debug lines of every library")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("search", help="batch queries to a TREC run file; with --qrels, print effectiveness")
    p.add_argument("index", type=Path)
    p.add_argument("--queries", type=Path, help="BEIR queries.jsonl or id<TAB>text")
    p.add_argument("--query-embeddings", type=Path, help="queries encoded elsewhere (see espn.encoders.precomputed)")
    p.add_argument("--out", type=Path, required=True, help="TREC run file to write")
    p.add_argument("--k", type=int, default=1000)
    p.add_argument("--qrels", type=Path, help="qrels (BEIR TSV or TREC) to evaluate against; only the queries it "
                   "judges are searched (BEIR's queries.jsonl holds those of every split)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--exhaustive", action="store_true", help="brute-force reference: exact CLS over all docs, "
                   "MaxSim over --rerank-count (default 1000)")
    p.add_argument("--tag", default="espn")
    p.add_argument("--strict", action="store_true", help="stop at the first query that cannot be searched (default: "
                   "report it on stderr naming its id, search the others, write their run, exit 1)")
    p.add_argument("--explain", action="store_true", help="also write OUT.explain.jsonl: per re-ranked hit, each "
                   "query token's MaxSim contribution and the passage span it matched")
    p.add_argument("--filter", metavar="JSON", help='metadata filter every hit satisfies, e.g. '
                   '\'{"topic": "oceans", "year": {"gte": 2000}}\' (see espn.filters)')
    _add_search_params(p, sorted(READERS))
    _add_mode_params(p)
    p.set_defaults(handler=cmd_search)

    p = sub.add_parser("calibrate", help="fit the score weight w on training queries; stored in the manifest")
    p.add_argument("index", type=Path)
    p.add_argument("--queries", type=Path, required=True)
    p.add_argument("--qrels", type=Path, required=True)
    p.add_argument("--measure", default="nDCG@10", choices=[str(m) for m in DEFAULT_MEASURES])
    p.add_argument("--dry-run", action="store_true", help="print the best w without writing it")
    p.add_argument("--hybrid", action="store_true", help="fit the hybrid mix weight (the dense side's share in "
                   "fusions 'mix' and 'zscore') instead of w, and make the best of mix, zscore and rrf the default "
                   "fusion; needs a full-text index")
    p.add_argument("--reader", choices=sorted(READERS), help="embedding reader (default: kvikio with CUDA, else posix)")
    add_reader_options(p)
    p.set_defaults(handler=cmd_calibrate)

    p = sub.add_parser("verify", help="check every file of an index against its manifest checksums")
    p.add_argument("index", type=Path)
    p.set_defaults(handler=cmd_verify)

    # The plugins' register(sub) take the plain argparse type; the parsers they add are CliParsers.
    _register_plugins(cast("argparse._SubParsersAction[argparse.ArgumentParser]", sub))
    return parser


def _load_queries(args: argparse.Namespace):
    if (args.queries is None) == (args.query_embeddings is None):
        raise UsageError("give exactly one of --queries and --query-embeddings")
    if args.queries is not None:
        from espn.corpus import read_queries

        return read_queries(args.queries, keep_empty=True), None  # an empty one: an error of its own below
    from espn.encoders.precomputed import load_query_embeddings

    ids, embeddings = load_query_embeddings(args.query_embeddings)
    return [(qid, "") for qid in ids], embeddings


def cmd_search(args: argparse.Namespace) -> int:
    from espn import Searcher
    from espn.corpus import read_qrels
    from espn.evaluation import evaluate, strictly_decreasing, write_run

    # Everything that can be checked without the index is checked before it loads.
    from espn.filters import canonical_filter

    from espn.hybrid import HybridParams

    overrides = _search_overrides(args)
    SearchParams().replace(k=args.k, **overrides).validate(nlist=1 << 30, num_documents=0)  # nlist: below
    modes = _mode_overrides(args)
    HybridParams().replace(**modes)
    if modes["mode"] in ("lexical", "hybrid") and (args.exhaustive or args.query_embeddings is not None):
        raise InvalidParameterError(f"--mode {modes['mode']} needs --queries (text) and the pipeline: not with "
                                    "--exhaustive or --query-embeddings")
    if args.filter is not None:
        canonical_filter(args.filter)  # malformed JSON: one line before the index loads
    if args.batch_size < 1:
        raise InvalidParameterError(f"--batch-size must be >= 1, got {args.batch_size}")
    _check_output_file("search", args.out)
    if args.explain and (args.exhaustive or args.query_embeddings is not None):
        raise InvalidParameterError("--explain needs query text and the pipeline: not with --exhaustive "
                                    "or --query-embeddings")
    explain_out = args.out.with_name(args.out.name + ".explain.jsonl") if args.explain else None
    options = reader_options(args)
    if not (args.index / "manifest.json").is_file():
        raise FileNotFoundError(f"{args.index} is not an ESPN index directory (no manifest.json)")
    queries, embeddings = _load_queries(args)
    qrels = read_qrels(args.qrels) if args.qrels else None
    if qrels is not None:  # evaluate what was judged: BEIR's queries.jsonl holds every split's queries
        judged = [i for i, (qid, _) in enumerate(queries) if qid in qrels]
        if not judged:
            raise InvalidParameterError(f"--qrels {args.qrels}: none of the {len(queries)} queries has judgements in it")
        if len(judged) < len(queries):
            print(f"searching the {len(judged)} of {len(queries)} queries that {args.qrels} judges")
            queries = [queries[i] for i in judged]
            embeddings = None if embeddings is None else embeddings[np.asarray(judged)]
    searcher = Searcher.open(args.index, reader=args.reader, with_encoder=embeddings is None, reader_options=options)
    searcher.params(args.k, **overrides)  # the bounds that depend on the index (nprobe <= nlist)
    if searcher.hybrid_params(**modes).mode != "dense":
        from espn.lexical import require_text

        require_text(searcher.text, modes["mode"] or searcher.hybrid_defaults.mode)  # the run's, not a query's
    filtered = searcher.filtered_docs(args.filter)  # checked against the index's fields
    if filtered is not None:
        print(f"filter matches {filtered.matches} of {searcher.num_documents} documents")
    ranked, latencies, hit_rates = {}, [], []
    explained: list[tuple[str, int, Hit]] = []
    failed: dict[str, str] = {}
    started = time.perf_counter()
    for start in range(0, len(queries), args.batch_size):
        batch = queries[start : start + args.batch_size]
        if args.exhaustive:
            if embeddings is not None:
                q = embeddings[start : start + len(batch)]
            else:
                assert searcher.encoder is not None  # opened with_encoder above
                q = searcher.encoder.encode_queries([text for _, text in batch])
            rerank = 1000 if args.rerank_count is None else args.rerank_count  # 0 is honoured: CLS only
            hit_lists = searcher.search_exhaustive(q, k=args.k, rerank_count=rerank,
                                                   allowed=None if filtered is None else filtered.mask)
            answered = list(zip([qid for qid, _ in batch], hit_lists))
        else:
            def search_rows(rows: list[int]) -> list[Any]:
                if embeddings is not None:
                    return searcher.search_embeddings(embeddings[[start + r for r in rows]], args.k,
                                                      filter=args.filter, **overrides)
                return searcher.search([batch[r][1] for r in rows], args.k, filter=args.filter,
                                       explain=args.explain, **modes, **overrides)

            results, errors = _search_each(search_rows, [qid for qid, _ in batch], strict=args.strict)
            for row, message in errors.items():
                failed[batch[row][0]] = message
                print(f"espn search: error: query {batch[row][0]}: {message}", file=sys.stderr)
            answered = [(batch[row][0], result.hits) for row, result in results.items()]
            if results:
                latencies.append(next(iter(results.values())).stats.stage_ms["total"])
                hit_rates += [r.stats.hit_rate for r in results.values()]
        for qid, hits in answered:
            ranked[qid] = [(h.doc_id, h.score) for h in hits]
            explained += [(qid, rank, h) for rank, h in enumerate(hits, start=1)
                          if h.explanation is not None or h.lexical_matches is not None]
    elapsed = time.perf_counter() - started
    write_run(args.out, ranked, tag=args.tag)
    if explain_out is not None:
        _write_explanations(explain_out, explained)
        print(f"wrote explanations of {len(explained)} hits to {explain_out}")
    print(f"wrote {sum(map(len, ranked.values()))} lines for {len(ranked)} queries to {args.out} "
          f"({len(queries) / elapsed:.1f} queries/s, reader={searcher.reader_name})")
    if latencies:
        p50, p95, p99 = np.percentile(latencies, [50, 95, 99])
        print(f"batch latency (batch size {args.batch_size}): p50 {p50:.1f} ms, p95 {p95:.1f} ms, p99 {p99:.1f} ms; "
              f"mean prefetch hit rate {np.mean(hit_rates):.3f}")
    if qrels is not None:
        run = {qid: dict(strictly_decreasing(hits)) for qid, hits in ranked.items()}
        for measure, value in evaluate(run, qrels).items():
            print(f"{measure}\t{value:.4f}")
    if failed:
        print(f"espn search: error: {len(failed)} of {len(queries)} queries failed ({', '.join(list(failed)[:10])}"
              f"{', ...' if len(failed) > 10 else ''}); the run file holds the other {len(ranked)}", file=sys.stderr)
        return 1
    return 0


def _search_each(run: Callable[[list[int]], list[Any]], ids: list[str],
                 strict: bool) -> tuple[dict[int, Any], dict[int, str]]:
    """Search a batch with `run(rows)`; a query the library refuses (a parameter error: too
    long, no text, ...) costs only itself: when the batch fails, each query is searched alone
    and the refused ones come back as {row: message}. strict: the first refusal ends the run
    (raised, naming the query's id)."""
    try:
        return dict(enumerate(run(list(range(len(ids)))))), {}
    except ValueError as exc:  # InvalidParameterError and the engines' refusals of a query
        if len(ids) == 1:
            if strict:
                raise InvalidParameterError(f"query {ids[0]}: {_one_line(exc)}") from exc
            return {}, {0: _one_line(exc)}
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    for row in range(len(ids)):
        try:
            (results[row],) = run([row])
        except ValueError as exc:
            if strict:
                raise InvalidParameterError(f"query {ids[row]}: {_one_line(exc)}") from exc
            errors[row] = _one_line(exc)
    return results, errors


def _write_explanations(path: Path, explained: list[tuple[str, int, "Hit"]]) -> None:
    """One JSON line per explained hit, in run order; written to a temporary name, then renamed."""
    import dataclasses
    import json

    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        for qid, rank, hit in explained:
            line = {"query_id": qid, "doc_id": hit.doc_id, "rank": rank, "score": hit.score,
                    "cls_score": hit.cls_score, "bow_score": hit.bow_score,
                    "explanation": None if hit.explanation is None else dataclasses.asdict(hit.explanation)}
            if hit.lexical_matches is not None:
                line.update(dense_score=hit.dense_score, lexical_score=hit.lexical_score,
                            lexical_matches=[dataclasses.asdict(m) for m in hit.lexical_matches])
            f.write(json.dumps(line) + "\n")
    os.replace(partial, path)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from espn import Searcher
    from espn.corpus import read_qrels, read_queries
    from espn.evaluation import evaluate
    from espn.index import update_manifest

    options = reader_options(args)
    queries, qrels = read_queries(args.queries), read_qrels(args.qrels)
    searcher = Searcher.open(args.index, reader=args.reader, reader_options=options)
    queries = [(qid, text) for qid, text in queries if qid in qrels]
    if not queries:
        raise InvalidParameterError(f"--qrels {args.qrels}: no query of --queries has judgements in it")
    if args.hybrid:
        return _calibrate_hybrid(searcher, queries, qrels, args)
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
        # The manifest of the base the searcher serves: after a live index's compaction that is
        # live/base-N, whose manifest the next compaction carries forward.
        update_manifest(searcher.index.path, score={**searcher.manifest["score"], "w": best_w, "calibrated": True,
                                           "calibrated_on": str(Path(args.qrels).absolute())})
    return 0


def _calibrate_hybrid(searcher: Any, queries: list[tuple[str, str]], qrels: Any, args: argparse.Namespace) -> int:
    """Fit the mix weight: one hybrid search per query returns its whole fusion pool with both
    sides' scores, then every weight on a 0.05 grid is fused from those (`espn.hybrid.fuse`)."""
    from espn.evaluation import evaluate, strictly_decreasing
    from espn.hybrid import fuse
    from espn.index import update_manifest
    from espn.params import MAX_K

    hybrid = searcher.hybrid_params(mode="hybrid", fusion="mix")
    depth = min(MAX_K, searcher.defaults.rerank_count + hybrid.lexical_k)
    pools: dict[str, tuple[list[str], np.ndarray, np.ndarray]] = {}
    for start in range(0, len(queries), 32):
        batch = queries[start : start + 32]
        for (qid, _), result in zip(batch, searcher.search([t for _, t in batch], k=depth, mode="hybrid", fusion="mix")):
            nan = float("nan")
            pools[qid] = ([h.doc_id for h in result.hits],
                          np.array([nan if h.dense_score is None else h.dense_score for h in result.hits], np.float32),
                          np.array([nan if h.lexical_score is None else h.lexical_score for h in result.hits], np.float32))
    def measure(params: Any) -> float:
        run = {}
        for qid, (docs, dense, lexical) in pools.items():
            fused = fuse(np.array(docs, dtype=object), dense, lexical, params)
            run[qid] = dict(strictly_decreasing([(str(d), float(v)) for d, v in zip(fused.doc, fused.score)]))
        return evaluate(run, qrels)[args.measure]

    best_fusion, best_weight, best = "mix", hybrid.mix_weight, -1.0
    for fusion in ("mix", "zscore"):  # both weighted fusions, each over the grid
        for weight in np.round(np.arange(0.0, 1.0001, 0.05), 2):
            value = measure(hybrid.replace(fusion=fusion, mix_weight=float(weight)))
            log.debug("%s mix_weight=%.2f %s=%.4f", fusion, weight, args.measure, value)
            if value > best + 1e-9:
                best_fusion, best_weight, best = fusion, float(weight), value
    rrf = measure(hybrid.replace(fusion="rrf"))
    fusion = best_fusion if best >= rrf else "rrf"
    print(f"best mix_weight = {best_weight:.2f} with {best_fusion} ({args.measure} {best:.4f} on {len(pools)} "
          f"queries; was {hybrid.mix_weight:.2f}); rrf {rrf:.4f}; default fusion: {fusion}")
    if not args.dry_run:
        update_manifest(searcher.index.path, hybrid={**hybrid.to_json(), "fusion": fusion, "mix_weight": best_weight,
                                                     "calibrated_on": str(Path(args.qrels).absolute())})
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from espn.segments import open_view

    view = open_view(args.index, verify="full")  # the base and every delta segment of the current generation
    view.close()
    generation = view.generation
    files = len(view.base.manifest["files"]) + sum(len(s.files) for s in generation.segments) + len(generation.tombstones)
    print(f"{args.index}: {files} files verified, {generation.live_documents} documents"
          + (f" (generation {generation.number})" if generation.number else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # Before torch or FAISS load OpenMP: spinning idle threads starve the other pool on
    # small machines (a 9x slower search measured on 2 cores). Users can still override.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    handler: Callable[[argparse.Namespace], int] = args.handler
    prefix = f"espn {args.command}: error:"
    try:
        return handler(args)
    except KeyboardInterrupt:
        print(f"espn {args.command}: interrupted", file=sys.stderr)
        return 130
    except UsageError as exc:
        print(f"{prefix} {_one_line(exc)} (see `espn {args.command} --help`)", file=sys.stderr)
        return 2
    except (EspnError, ValueError, FileNotFoundError) as exc:
        log.debug("traceback", exc_info=True)
        print(f"{prefix} {_one_line(exc)}", file=sys.stderr)
        return 1
    except OSError as exc:
        log.debug("traceback", exc_info=True)
        if exc.errno == errno.ENOSPC:
            print(f"{prefix} no space left on device"
                  f"{' writing ' + str(exc.filename) if exc.filename else ''}; the partial build is kept, "
                  "free space and re-run the same command to resume", file=sys.stderr)
        else:
            print(f"{prefix} {exc.strerror or _one_line(exc)}{': ' + str(exc.filename) if exc.filename else ''}",
                  file=sys.stderr)
        return 1
    except Exception as exc:  # a bug: still one line, the traceback one -v away
        log.debug("traceback", exc_info=True)
        print(f"{prefix} internal error, {type(exc).__name__}: {_one_line(exc)} (run with -v for the traceback; "
              "please report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
