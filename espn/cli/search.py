"""`espn search`: batch queries to a TREC run file; with --qrels, the effectiveness measures.

Everything that can be checked without the index is checked before it loads; a query the
library refuses costs only itself (reported on stderr by id) unless --strict.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .. import Searcher
from ..corpus import read_qrels, read_queries
from ..encoders.precomputed import load_query_embeddings
from ..errors import InvalidParameterError
from ..evaluation import evaluate, strictly_decreasing, write_run
from ..filters import canonical_filter
from ..params import HybridParams
from ..search.isolation import search_each, sort_outcomes
from ..params import SearchParams
from ..results import Hit
from .common import UsageError, check_output_file, one_line, reader_options

__all__ = ["cmd_search"]


def _mode_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {"mode": args.mode, "fusion": args.fusion, "lexical_k": args.lexical_k, "rrf_k": args.rrf_k,
            "mix_weight": args.mix_weight, "union": False if args.no_union else None,
            "syntax": getattr(args, "query_syntax", None)}


def _search_overrides(args: argparse.Namespace) -> dict:
    return {
        "nprobe": args.nprobe, "prefetch_step": args.prefetch_step, "prefetch_k": args.prefetch_k,
        "rerank_count": args.rerank_count, "prefetch_waves": args.prefetch_waves, "prefetch": False if args.no_prefetch else None,
    }


@dataclasses.dataclass
class _Run:
    """What a batch search collects: the ranking per query, timings and the refused queries."""

    ranked: dict[str, list[tuple[str, float]]] = dataclasses.field(default_factory=dict)
    latencies: list[float] = dataclasses.field(default_factory=list)
    hit_rates: list[float] = dataclasses.field(default_factory=list)
    explained: list[tuple[str, int, Hit]] = dataclasses.field(default_factory=list)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    truncated: list[str] = dataclasses.field(default_factory=list)  # queries longer than the model reads

    def add(self, answered: list[tuple[str, list[Hit]]]) -> None:
        for qid, hits in answered:
            self.ranked[qid] = [(h.doc_id, h.score) for h in hits]
            self.explained += [(qid, rank, h) for rank, h in enumerate(hits, start=1)
                               if h.explanation is not None or h.lexical_matches is not None]


def cmd_search(args: argparse.Namespace) -> int:
    overrides, modes = _check_search_args(args)
    explain_out = args.out.with_name(args.out.name + ".explain.jsonl") if args.explain else None
    options = reader_options(args)
    if not (args.index / "manifest.json").is_file():
        raise FileNotFoundError(f"{args.index} is not an ESPN index directory (no manifest.json)")
    queries, embeddings = _load_queries(args)
    qrels = read_qrels(args.qrels) if args.qrels else None
    if qrels is not None:  # evaluate what was judged: BEIR's queries.jsonl holds every split's queries
        queries, embeddings = _judged(args, queries, embeddings, qrels)
    searcher = Searcher.open(args.index, reader=args.reader, with_encoder=embeddings is None, reader_options=options,
                             trust_remote_code=args.trust_remote_code)
    searcher.params(args.k, **overrides)  # the bounds that depend on the index (nprobe <= nlist)
    searcher.check_request(searcher.hybrid_params(**modes))  # the run's modes, not a query's
    filtered = searcher.filtered_docs(args.filter)  # checked against the index's fields
    if filtered is not None:
        print(f"filter matches {filtered.matches} of {searcher.num_documents} documents")
    run = _Run()
    started = time.perf_counter()
    for start in range(0, len(queries), args.batch_size):
        batch = queries[start : start + args.batch_size]
        if args.exhaustive:
            run.add(_search_exhaustive(args, searcher, batch, embeddings, start,
                                       None if filtered is None else filtered.mask))
        else:
            run.add(_search_pipeline(args, searcher, batch, embeddings, start, overrides, modes, run))
    elapsed = time.perf_counter() - started
    return _report(args, run, queries, qrels, explain_out, elapsed, searcher.reader_name)


def _check_search_args(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Everything that can be checked without the index, before it loads: (overrides, modes)."""
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
    check_output_file(args.out)
    if args.explain and (args.exhaustive or args.query_embeddings is not None):
        raise InvalidParameterError("--explain needs query text and the pipeline: not with --exhaustive "
                                    "or --query-embeddings")
    return overrides, modes


def _load_queries(args: argparse.Namespace) -> tuple[list[tuple[str, str]], Any]:
    if (args.queries is None) == (args.query_embeddings is None):
        raise UsageError("give exactly one of --queries and --query-embeddings")
    if args.queries is not None:
        return read_queries(args.queries, keep_empty=True), None  # an empty one: an error of its own below
    ids, embeddings = load_query_embeddings(args.query_embeddings)
    return [(qid, "") for qid in ids], embeddings


def _judged(args: argparse.Namespace, queries: list[tuple[str, str]], embeddings: Any,
            qrels: Any) -> tuple[list[tuple[str, str]], Any]:
    """Only the queries `qrels` judges (with their rows of `embeddings`)."""
    judged = [i for i, (qid, _) in enumerate(queries) if qid in qrels]
    if not judged:
        raise InvalidParameterError(f"--qrels {args.qrels}: none of the {len(queries)} queries has judgements in it")
    if len(judged) < len(queries):
        print(f"searching the {len(judged)} of {len(queries)} queries that {args.qrels} judges")
        queries = [queries[i] for i in judged]
        embeddings = None if embeddings is None else embeddings[np.asarray(judged)]
    return queries, embeddings


def _search_exhaustive(args: argparse.Namespace, searcher: Any, batch: list[tuple[str, str]], embeddings: Any,
                       start: int, allowed: np.ndarray | None) -> list[tuple[str, list[Hit]]]:
    if embeddings is not None:
        q = embeddings[start : start + len(batch)]
    else:
        assert searcher.encoder is not None  # opened with_encoder above
        q = searcher.encoder.encode_queries([text for _, text in batch])
    rerank = 1000 if args.rerank_count is None else args.rerank_count  # 0 is honoured: CLS only
    hit_lists = searcher.search_exhaustive(q, k=args.k, rerank_count=rerank, allowed=allowed)
    return list(zip([qid for qid, _ in batch], hit_lists))


def _search_pipeline(args: argparse.Namespace, searcher: Any, batch: list[tuple[str, str]], embeddings: Any,
                     start: int, overrides: dict[str, Any], modes: dict[str, Any],
                     run: _Run) -> list[tuple[str, list[Hit]]]:
    def search_rows(rows: list[int]) -> list[Any]:
        if embeddings is not None:
            return searcher.search_embeddings(embeddings[[start + r for r in rows]], args.k,
                                              filter=args.filter, **overrides)
        return searcher.search([batch[r][1] for r in rows], args.k, filter=args.filter,
                               explain=args.explain, **modes, **overrides)

    results, errors = _search_each(search_rows, [qid for qid, _ in batch], strict=args.strict)
    for row, message in errors.items():
        run.failed[batch[row][0]] = message
        print(f"espn search: error: query {batch[row][0]}: {message}", file=sys.stderr)
    if results:
        run.latencies.append(next(iter(results.values())).stats.stage_ms["total"])
        run.hit_rates += [r.stats.hit_rate for r in results.values()]
        run.truncated += [batch[row][0] for row, result in results.items() if result.stats.query_truncated]
    return [(batch[row][0], result.hits) for row, result in results.items()]


def _report(args: argparse.Namespace, run: _Run, queries: list[tuple[str, str]], qrels: Any,
            explain_out: Path | None, elapsed: float, reader_name: str) -> int:
    """Write the run (and the explanations), print what it cost and measured; the exit status."""
    write_run(args.out, run.ranked, tag=args.tag)
    if explain_out is not None:
        _write_explanations(explain_out, run.explained)
        print(f"wrote explanations of {len(run.explained)} hits to {explain_out}")
    searched = len(queries) - len(run.failed)  # the refused ones cost nothing: they are no part of the rate
    rate = f"{searched / elapsed:.1f} queries/s, " if searched else ""
    print(f"wrote {sum(map(len, run.ranked.values()))} lines for {len(run.ranked)} queries to {args.out} "
          f"({rate}reader={reader_name})")
    if run.truncated:
        named = f"{', '.join(run.truncated[:10])}{', ...' if len(run.truncated) > 10 else ''}"
        print(f"{len(run.truncated)} of {len(queries)} queries were longer than the model's query length and were "
              f"cut as its library cuts them ({named})")
    if run.latencies:
        p50, p95, p99 = np.percentile(run.latencies, [50, 95, 99])
        print(f"batch latency (batch size {args.batch_size}): p50 {p50:.1f} ms, p95 {p95:.1f} ms, p99 {p99:.1f} ms; "
              f"mean prefetch hit rate {np.mean(run.hit_rates):.3f}")
    if qrels is not None:
        ranking = {qid: dict(strictly_decreasing(hits)) for qid, hits in run.ranked.items()}
        for measure, value in evaluate(ranking, qrels).items():
            print(f"{measure}\t{value:.4f}")
    if run.failed:
        failed = run.failed
        named = f"{', '.join(list(failed)[:10])}{', ...' if len(failed) > 10 else ''}"
        if not searched:
            which = "the only query was" if len(failed) == 1 else f"all {len(failed)} queries were"
            print(f"espn search: error: no query was searched: {which} refused ({named}; why above)", file=sys.stderr)
        else:
            print(f"espn search: error: {len(failed)} of {len(queries)} queries failed ({named}); the run file holds "
                  f"the other {len(run.ranked)}", file=sys.stderr)
        return 1
    return 0


def _search_each(run: Callable[[list[int]], list[Any]], ids: list[str],
                 strict: bool) -> tuple[dict[int, Any], dict[int, str]]:
    """Search a batch with `run(rows)`; a query the library refuses (a parameter error: too
    long, no text, ...) costs only itself (espn.search.isolation.search_each): the refused
    ones come back as {row: message}. strict: the first refusal ends the run (raised, naming
    the query's id). Any other error is not a query's: it ends the run as it is."""
    def refuse(row: int, refused: InvalidParameterError) -> None:
        raise InvalidParameterError(f"query {ids[row]}: {one_line(refused)}") from refused

    outcomes = sort_outcomes(search_each(run, len(ids), on_refusal=refuse if strict else None))
    return outcomes.answered, {row: one_line(refused) for row, refused in outcomes.refused.items()}


def _write_explanations(path: Path, explained: list[tuple[str, int, Hit]]) -> None:
    """One JSON line per explained hit, in run order; written to a temporary name, then renamed."""
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
