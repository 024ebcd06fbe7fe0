"""POST /v1/search and /v1/search/batch: request model -> the engine (micro-batched) -> response model."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import TypeAdapter

from espn.engine import RULES, Document, Engine, QueryAnswer
from espn.errors import InvalidParameterError

from ..deps import get_engine
from ..errors import ApiError
from ..middleware import LOG_EXTRA_KEY
from ..schemas import (
    BatchSearchRequest,
    MAX_QUERY_CHARS,
    BatchSearchResponse,
    ErrorResponse,
    ExplanationModel,
    LexicalMatchModel,
    QueryError,
    SearchHit,
    SearchOptions,
    SearchRequest,
    SearchResponse,
    SearchStatsModel,
)

router = APIRouter(prefix="/search", tags=["search"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "malformed JSON or invalid UTF-8"},
    413: {"model": ErrorResponse, "description": "request body too large"},
    415: {"model": ErrorResponse, "description": "the body is not application/json"},
    422: {"model": ErrorResponse, "description": "a field or search parameter out of bounds, an invalid filter, "
                                                 "mode lexical or hybrid on an index without a full-text index, or "
                                                 "a request over the work budget "
                                                 "(over_budget: queries x max(k, rerank_count, prefetch_k) above "
                                                 "ESPN_MAX_REQUEST_WORK, or an estimated response above "
                                                 "ESPN_MAX_RESPONSE_BYTES)"},
    503: {"model": ErrorResponse, "description": "not ready, shutting down, or queue full (Retry-After)"},
}


#: What writes the answers as JSON (pydantic-core writes the bytes): FastAPI's response_model
#: path would dump a model, validate it again and encode it once more. exclude_unset: title and
#: text appear only when return_text asked for them, explanations only with explain.
_RESPONSE = TypeAdapter(SearchResponse)
_ERRORS_LIST = TypeAdapter(list[QueryError])


# response_model documents the answer (OpenAPI); the routes serialise it themselves (`_RESPONSE`).
@router.post("", response_model=SearchResponse, response_model_exclude_unset=True, summary="Search one query",
             responses=_ERRORS)
async def search(body: SearchRequest, request: Request, engine: Engine = Depends(get_engine)) -> Response:
    return await search_one(engine, request, body)


async def search_one(engine: Engine, request: Request, body: SearchRequest) -> Response:
    """The route's work, also run by `server.search_fast_path` for the requests it takes."""
    (response,), _, _ = await _search(engine, request, [body.query], body, explain=bool(body.explain))
    return Response(response, media_type="application/json")


@router.post("/batch", response_model=BatchSearchResponse, response_model_exclude_unset=True,
             summary="Search several queries", responses=_ERRORS)
async def search_batch(
    body: BatchSearchRequest, request: Request, engine: Engine = Depends(get_engine)
) -> Response:
    """One query's failure is that query's: a blank or too long text, or one the search
    refuses, is an `invalid_query` entry of `errors`; a failure that is not a refusal (a bug, a
    failed read) is an `internal_error` entry, its traceback in the server's log; every other
    query is answered."""
    limit = request.app.state.espn.settings.max_batch_queries
    if len(body.queries) > limit:
        raise ApiError(422, f"queries: at most {limit} queries per batch, got {len(body.queries)}",
                       code="invalid_request")
    errors = [QueryError(index=i, error="invalid_query", message=f"queries[{i}]: {problem}")
              for i, problem in enumerate(map(_text_problem, body.queries)) if problem is not None]
    unsearchable = {e.index for e in errors}
    rows = [i for i in range(len(body.queries)) if i not in unsearchable]
    responses: list[bytes] = []
    if not rows:  # no text to search: the request's own parameters are still checked
        await engine.check(body.engine_options())
    else:
        # The engine searches each query alone when it refuses the batch: a refused query is that
        # query's entry of `errors`, the others are answered.
        responses, refused, broken = await _search(engine, request, [body.queries[i] for i in rows], body,
                                                   rows=rows)
        errors += [QueryError(index=i, error="invalid_query", message=f"queries[{i}]: {exc}")
                   for i, exc in refused.items()]
        errors += [QueryError(index=i, error="internal_error", message=f"queries[{i}]: the search failed inside the "
                              "server (not the query's fault); its traceback is in the server's log, retry or report it")
                   for i in broken]
    # BatchSearchResponse as its model writes it, from the responses' JSON.
    return Response(b'{"responses":[' + b",".join(responses) + b'],"errors":'
                    + _ERRORS_LIST.dump_json(sorted(errors, key=lambda e: e.index), exclude_unset=True) + b"}",
                    media_type="application/json")


def _text_problem(query: str) -> Optional[str]:
    """Why a batch's query text cannot be searched (None: it can), as /v1/search's schema says it."""
    if len(query) > MAX_QUERY_CHARS:
        return f"{len(query)} characters; at most {MAX_QUERY_CHARS}"
    if not RULES.has_text(query):
        return "no text (only whitespace or control characters)"
    return None


async def _search(engine: Engine, request: Request, queries: Sequence[str], options: SearchOptions,
                  explain: bool = False, rows: Optional[Sequence[int]] = None
                  ) -> tuple[list[bytes], dict[int, InvalidParameterError], list[int]]:
    """The queries searched by the engine, as each response's JSON; the request's log line names
    its batch sizes. rows (a batch: each query's position in the request): a query the search
    refuses is isolated, returned by its row beside the responses of the others, whose `index` is
    their row; so is a query whose search failed otherwise (its row in the list returned last).

    Each response is written as JSON as soon as its model is made, and the model dropped: a
    response model costs about 700 bytes a hit, its JSON about 110, and a batch of 104 queries
    at k = 1000 holds tens of thousands of hits (tests/test_search_memory.py)."""
    setattr(request.state, LOG_EXTRA_KEY, {"queries": len(queries), "k": options.k})
    answer = await engine.search(queries, options.engine_options(explain), isolate=rows is not None)
    responses = []
    for at, item in zip(answer.positions, answer.answers):
        response = _to_response(queries[at], item, answer.documents, answer.engine)
        if rows is not None:
            response.index = rows[at]
        responses.append(_RESPONSE.dump_json(response, exclude_unset=True))
    refused: dict[int, InvalidParameterError] = {}
    failed: list[int] = []
    if rows is not None:
        refused = {rows[at]: exc for at, exc in answer.refused.items()}
        failed = [rows[at] for at in answer.failed]
    batch_sizes = sorted({item.batch_size for item in answer.answers})
    setattr(request.state, LOG_EXTRA_KEY, {"queries": len(queries), "k": options.k, "batch_sizes": batch_sizes})
    return responses, refused, failed


def _to_response(query: str, item: QueryAnswer, documents: Optional[dict[str, Document]],
                 reader_engine: str) -> SearchResponse:
    stats = item.result.stats
    hits = []
    for hit in item.result.hits:
        document = documents.get(hit.doc_id) if documents is not None else None
        if document is not None:
            hits.append(SearchHit(id=hit.doc_id, score=hit.score, cls_score=hit.cls_score, bow_score=hit.bow_score,
                                  title=document.title, text=document.text))
        else:
            hits.append(SearchHit(id=hit.doc_id, score=hit.score, cls_score=hit.cls_score, bow_score=hit.bow_score))
        if hit.explanation is not None:  # set only when asked: exclude_unset keeps other answers as they were
            hits[-1].explanation = ExplanationModel.model_validate(dataclasses.asdict(hit.explanation))
        if stats.mode != "dense":  # both sides' scores, for a client (or the router) that fuses itself
            hits[-1].dense_score, hits[-1].lexical_score = hit.dense_score, hit.lexical_score
        if hit.lexical_matches is not None:
            hits[-1].lexical_matches = [LexicalMatchModel.model_validate(dataclasses.asdict(m))
                                        for m in hit.lexical_matches]
    model = SearchStatsModel(
        stage_ms=stats.stage_ms,
        queue_ms=round(item.queue_ms, 3),
        batch_size=item.batch_size,
        hit_rate=stats.hit_rate,
        bytes_read=stats.bytes_read,
        ios=stats.ios,
        prefetched=stats.prefetched,
        missed=stats.missed,
        read_amplification=stats.read_amplification,
        engine=stats.engine or reader_engine,  # a searcher that does not fill it: the reader's engine
    )
    if stats.matched is not None:  # set only when filtered: exclude_unset keeps other answers as they were
        model.matched, model.filter_path = stats.matched, stats.filter_path
    if stats.mode != "dense":
        model.mode, model.hybrid, model.syntax = stats.mode, stats.hybrid, stats.syntax
        if stats.ignored:
            model.ignored = list(stats.ignored)
    if stats.query_truncated:  # set only when cut: exclude_unset keeps other answers as they were
        model.query_truncated, model.query_read_chars = True, stats.query_read_chars
    return SearchResponse(query=query, results=hits, stats=model)
