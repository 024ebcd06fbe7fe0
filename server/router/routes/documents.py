"""GET /v1/documents/{id}: from the partition that owns the id (with --writers), else from
whichever partition holds it."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from ...schemas import ErrorResponse
from ..deps import RouterState, forwarded_headers, get_router_state, router_error
from ..fanout import json_or_text, shard_message
from ..models import ShardFailure

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/documents/{doc_id:path}", summary="A document, from the partition that owns its id",
            responses={404: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
async def document(doc_id: str, request: Request, state: RouterState = Depends(get_router_state)) -> Any:
    fan = state.require_fanout()
    path = "/v1/documents/" + quote(doc_id, safe="")
    # With writers the layout is the hash rule: only the owner can hold the id. Without
    # (an index built before the rule), every partition is asked.
    shards = [fan.shards[state.require_writers().owner(doc_id)]] if state.settings.writers else fan.shards
    outcomes = await asyncio.gather(*(fan.call(s, "GET", path, forwarded_headers(request), None) for s in shards))
    failures: list[ShardFailure] = []
    for shard, outcome in zip(shards, outcomes):
        if isinstance(outcome, ShardFailure):
            failures.append(outcome)
        elif outcome.status_code == 200:
            return JSONResponse(json_or_text(outcome))
        elif outcome.status_code in (401, 403):
            return JSONResponse(json_or_text(outcome), status_code=outcome.status_code)
        elif outcome.status_code != 404:
            failures.append(fan.record_failure(shard, f"http_{outcome.status_code}", shard_message(outcome)))
    if failures:  # it may live in a partition that did not answer
        return router_error(503, "unavailable", f"document {doc_id!r} not found in the partitions that answered",
                            failed_shards=[f.model_dump() for f in failures])
    return router_error(404, "not_found", f"no document with id {doc_id!r}")
