"""POST /v1/search and /v1/search/batch over every partition, merged into one answer."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request

from ...schemas import BatchSearchRequest, ErrorResponse, QueryError, SearchRequest
from ..answers import check_batch, check_search
from ..deps import RouterState, forwarded_headers, get_router_state
from ..merge import fan_out_body, merge_responses
from ..owners import owned_batches, owned_hits
from ..models import RoutedBatchResponse, RoutedSearchAnswer, RoutedSearchResponse, ShardFailure, ShardsBatch

__all__ = ["router"]

router = APIRouter()

_ERRORS: dict[int | str, dict[str, Any]] = {422: {"model": ErrorResponse}, 503: {"model": ErrorResponse}}


@router.post("/v1/search", response_model=RoutedSearchResponse, summary="Search one query over every partition",
             responses=_ERRORS)
async def search(body: SearchRequest, request: Request, state: RouterState = Depends(get_router_state)) -> Any:
    started = time.perf_counter()
    fanout = state.require_fanout()
    asked = fan_out_body(body)
    answered, failures = await fanout.search("/v1/search", asked, forwarded_headers(request), check_search)
    if not answered:
        return state.unavailable("search", failures)
    answers = await owned_hits(fanout, state.routing, answered, asked, forwarded_headers(request))
    merged = merge_responses(body.query, answers, body.k, len(fanout.shards), failures,
                             (time.perf_counter() - started) * 1000)
    state.observe("search", started, partial=merged.partial)
    return merged


@router.post("/v1/search/batch", response_model=RoutedBatchResponse,
             summary="Search several queries over every partition", responses=_ERRORS)
async def search_batch(body: BatchSearchRequest, request: Request,
                       state: RouterState = Depends(get_router_state)) -> Any:
    started = time.perf_counter()
    fanout = state.require_fanout()
    answered, failures = await fanout.search("/v1/search/batch", fan_out_body(body), forwarded_headers(request),
                                             check_batch)
    if not answered:  # a shard that answered other queries than asked failed in check_batch
        return state.unavailable("batch", failures)
    answers = owned_batches(state.routing, answered)
    route_ms = (time.perf_counter() - started) * 1000
    responses, errors = _merge_batch(body, answers, failures, len(fanout.shards), route_ms)
    state.observe("batch", started, partial=bool(failures))
    return RoutedBatchResponse(responses=responses, errors=errors, partial=bool(failures), failed_shards=failures)


def _merge_batch(body: BatchSearchRequest, answers: list[ShardsBatch], failures: list[ShardFailure], shards: int,
                 route_ms: float) -> tuple[list[RoutedSearchAnswer], list[QueryError]]:
    """Per query, the partitions' answers merged; a query no partition answered is an error
    entry, in the first partition's words (every partition checks a query's text alike)."""
    by_index = [answer.by_index() for answer in answers]
    refused = {e.index: e for answer in reversed(answers) for e in answer.errors}
    responses, errors = [], []
    for i, query in enumerate(body.queries):
        answered = [shard[i] for shard in by_index if i in shard]
        if not answered:
            errors.append(refused.get(i) or QueryError(index=i, error="invalid_query",
                                                       message=f"queries[{i}]: no partition answered it"))
            continue
        merged = merge_responses(query, answered, body.k, shards, failures, route_ms)
        responses.append(RoutedSearchAnswer(index=i, **dict(merged)))
    return responses, errors
