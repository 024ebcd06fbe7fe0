"""POST /v1/search and /v1/search/batch: queries go through the micro-batcher."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Sequence

from fastapi import APIRouter, Depends, Request

from espn.filters import canonical_filter
from espn.params import has_text

from ..batching import BatchedResult
from ..budget import check_budget
from ..deps import AppState, get_state
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

if TYPE_CHECKING:
    from espn import Searcher
    from espn.results import Document, QueryResult

    from ..batching import MicroBatcher

router = APIRouter(prefix="/v1/search", tags=["search"])

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


# exclude_unset: title and text appear only when return_text asked for them.
@router.post("", response_model=SearchResponse, response_model_exclude_unset=True, summary="Search one query",
             responses=_ERRORS)
async def search(body: SearchRequest, request: Request, state: AppState = Depends(get_state)) -> SearchResponse:
    (response,) = await _search(state, request, [body.query], body, explain=bool(body.explain))
    return response


@router.post("/batch", response_model=BatchSearchResponse, response_model_exclude_unset=True,
             summary="Search several queries", responses=_ERRORS)
async def search_batch(
    body: BatchSearchRequest, request: Request, state: AppState = Depends(get_state)
) -> BatchSearchResponse:
    """One query's failure is that query's: a blank or too long text, or one the search
    refuses, is an entry of `errors`; every other query is answered."""
    limit = state.settings.max_batch_queries
    if len(body.queries) > limit:
        raise ApiError(422, f"queries: at most {limit} queries per batch, got {len(body.queries)}",
                       code="invalid_request")
    errors = [QueryError(index=i, error="invalid_query", message=f"queries[{i}]: {problem}")
              for i, problem in enumerate(map(_text_problem, body.queries)) if problem is not None]
    failed = {e.index for e in errors}
    rows = [i for i in range(len(body.queries)) if i not in failed]
    answered: list[tuple[int, SearchResponse]] = []
    if not rows:  # no text to search: the request's own parameters are still checked
        with state.lease() as searcher:
            await _checked_kwargs(state, searcher, 0, body, explain=False)
    else:
        try:
            answered = list(zip(rows, await _search(state, request, [body.queries[i] for i in rows], body,
                                                    isolate=True)))
        except _QueriesRefused:  # some query's fault: searched alone, each answers for itself
            answered, refused = await _search_alone(state, request, body, rows)
            errors += refused
    for i, response in answered:
        response.index = i
    return BatchSearchResponse(responses=[r for _, r in answered], errors=sorted(errors, key=lambda e: e.index))


def _text_problem(query: str) -> Optional[str]:
    """Why a batch's query text cannot be searched (None: it can), as /v1/search's schema says it."""
    if len(query) > MAX_QUERY_CHARS:
        return f"{len(query)} characters; at most {MAX_QUERY_CHARS}"
    if not has_text(query):
        return "no text (only whitespace or control characters)"
    return None


async def _search_alone(state: AppState, request: Request, body: BatchSearchRequest,
                        rows: list[int]) -> tuple[list[tuple[int, SearchResponse]], list[QueryError]]:
    answered, errors = [], []
    for i in rows:
        try:
            (response,) = await _search(state, request, [body.queries[i]], body, isolate=True)
        except _QueriesRefused as refused:
            errors.append(QueryError(index=i, error="invalid_query", message=f"queries[{i}]: {refused.cause}"))
            continue
        answered.append((i, response))
    return answered, errors


class _QueriesRefused(Exception):
    """The search refused a batch of queries (InvalidParameterError) after the request's own checks passed."""

    def __init__(self, cause: ValueError) -> None:
        super().__init__(str(cause))
        self.cause = cause


async def _search(
    state: AppState, request: Request, queries: Sequence[str], options: SearchOptions, explain: bool = False,
    isolate: bool = False,
) -> list[SearchResponse]:
    """isolate: a refusal by the search itself (after the request's checks) is raised as
    _QueriesRefused, so a batch can tell it from a refusal of the request."""
    batcher = state.require_batcher()
    # The request holds the generation it started on (refreshed first: a write answered before
    # this request began is visible); a newer one swapped in meanwhile leaves it open until then.
    with state.lease() as searcher:
        return await _search_with(state, request, searcher, batcher, queries, options, explain, isolate)


async def _search_with(
    state: AppState, request: Request, searcher: "Searcher", batcher: "MicroBatcher[QueryResult]",
    queries: Sequence[str], options: SearchOptions, explain: bool, isolate: bool,
) -> list[SearchResponse]:
    setattr(request.state, LOG_EXTRA_KEY, {"queries": len(queries), "k": options.k})
    kwargs = await _checked_kwargs(state, searcher, len(queries), options, explain)
    try:
        batched: list[BatchedResult[QueryResult]] = await batcher.submit_many(queries, kwargs)
    except ValueError as exc:  # InvalidParameterError of the search itself: a query's, not the request's
        if not isolate:
            raise
        raise _QueriesRefused(exc) from exc
    documents: Optional[dict[str, Document]] = None
    if options.return_text:
        wanted = sorted({hit.doc_id for item in batched for hit in item.result.hits})
        documents = await asyncio.to_thread(_documents, state, wanted)
    responses = []
    for query, item in zip(queries, batched):
        stats = item.result.stats
        state.metrics.observe_query(
            queue_ms=item.queue_ms, hit_rate=stats.hit_rate, prefetched=stats.prefetched,
            missed=stats.missed, bytes_read=stats.bytes_read, ios=stats.ios,
        )
        responses.append(_to_response(query, item, documents, searcher.reader.engine))
    batch_sizes = sorted({item.batch_size for item in batched})
    setattr(request.state, LOG_EXTRA_KEY, {"queries": len(queries), "k": options.k, "batch_sizes": batch_sizes})
    return responses


async def _checked_kwargs(state: AppState, searcher: "Searcher", n_queries: int, options: SearchOptions,
                          explain: bool) -> dict[str, Any]:
    """The request's own checks (bounds, mode, explain, budget, filter), before it queues: a refused
    request costs nothing and is a 422 of the whole request, whatever its queries hold. Returns
    the batcher's keyword arguments."""
    kwargs = options.search_kwargs()
    modes = options.mode_kwargs()
    params = searcher.params(**{key: value for key, value in kwargs.items() if key not in modes})
    hybrid = searcher.hybrid_params(**modes)
    if hybrid.mode != "dense":
        from espn.search.lexical import require_text  # as the searcher has: loaded already

        require_text(searcher.text, hybrid.mode)  # a 422 before the request queues
    if explain and hybrid.mode != "lexical":
        from espn.search.explain import can_explain  # the searcher has loaded torch already

        can_explain(searcher.encoder)
    settings = state.settings
    check_budget(params, n_queries, searcher.num_documents, state.text_bytes, options.return_text,
                 max_work=settings.max_request_work, max_response_bytes=settings.max_response_bytes)
    if options.filter is not None:
        # Validated (a bad filter is a 422 naming the problem) and compiled into the searcher's
        # cache off the event loop; the batch key carries its canonical text, so requests with
        # the same filter share a batch and different filters never do.
        await asyncio.to_thread(searcher.filtered_docs, options.filter)
        kwargs["filter"] = canonical_filter(options.filter)
    if explain:
        kwargs["explain"] = True
    return kwargs


def _documents(state: AppState, doc_ids: Sequence[str]) -> dict[str, "Document"]:
    """The hits' passages from the newest generation (the batch may have run on a newer one
    than the request started on); a hit deleted since is left without text."""
    from espn.errors import DocumentNotFoundError

    out = {}
    with state.require_live().lease() as searcher:
        for doc_id in doc_ids:
            try:
                out[doc_id] = searcher.document(doc_id)
            except DocumentNotFoundError:
                continue
    return out


def _to_response(query: str, item: BatchedResult["QueryResult"], documents: Optional[dict[str, "Document"]],
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
    return SearchResponse(query=query, results=hits, stats=model)
