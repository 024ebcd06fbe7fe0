"""GET /v1/documents/{id}: from the partition that owns the id (with --writers), else from
whichever partition holds it."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from ...schemas import DocumentResponse, ErrorResponse
from ..answers import MAX_ANSWER_BYTES, BadAnswer, check_document, error_body
from ..deps import RouterState, forwarded_headers, get_router_state, router_error
from ..fanout import shard_message
from ..models import ShardFailure

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/documents/{doc_id:path}", summary="A document, from the partition that owns its id",
            response_model=DocumentResponse,
            responses={404: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
async def document(doc_id: str, request: Request, state: RouterState = Depends(get_router_state)) -> Any:
    fan = state.require_fanout()
    path = "/v1/documents/" + quote(doc_id, safe="")
    # With writers the layout is the hash rule: only the owner can hold the id. Without
    # (an index built before the rule), every partition is asked.
    shards = [fan.shards[state.require_writers().owner(doc_id)]] if state.settings.writers else fan.shards
    outcomes = await asyncio.gather(*(fan.call(s, "GET", path, forwarded_headers(request), None, MAX_ANSWER_BYTES)
                                      for s in shards))
    failures: list[ShardFailure] = []
    for shard, outcome in zip(shards, outcomes):
        if isinstance(outcome, ShardFailure):
            failures.append(outcome)
        elif outcome.status == 200:
            try:
                return JSONResponse(check_document(outcome, doc_id).model_dump(mode="json"))
            except BadAnswer as exc:
                failures.append(fan.record_failure(shard, "bad_response", str(exc)))
        elif outcome.status in (401, 403):
            return JSONResponse(error_body(outcome, "shard_error"), status_code=outcome.status)
        elif outcome.status != 404 or error_body(outcome, "shard_error")["error"] != "document_not_found":
            # A 404 that is not the server's document_not_found is a wrong path (a URL prefix, a proxy).
            failures.append(fan.record_failure(shard, f"http_{outcome.status}", shard_message(outcome)))
    if failures:  # it may live in a partition that did not answer
        return router_error(503, "unavailable", f"document {doc_id!r} not found in the partitions that answered",
                            failed_shards=[f.model_dump() for f in failures])
    return router_error(404, "document_not_found", f"no document with id {doc_id!r}")
