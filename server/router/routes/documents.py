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
from ..fanout import Fanout, shard_message
from ..models import ShardFailure
from ..routing import Target

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/documents/{doc_id:path}", summary="A document, from the partition that owns its id",
            response_model=DocumentResponse,
            responses={404: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
async def document(doc_id: str, request: Request, state: RouterState = Depends(get_router_state)) -> Any:
    fan = state.require_fanout()
    path = "/v1/documents/" + quote(doc_id, safe="")
    # With writers (or a shard map) only the owner can hold the id. Without (an index built
    # before the hash rule), every partition is asked. Each partition from its replicas in turn.
    targets = fan.targets()
    if state.routing.takes_writes:
        home = state.routing.owner(doc_id)
        targets = [t for t in targets if t.partition == home]
    outcomes = await asyncio.gather(*(_ask(fan, t, path, doc_id, forwarded_headers(request)) for t in targets))
    failures: list[ShardFailure] = []
    for outcome in outcomes:
        if isinstance(outcome, ShardFailure):
            failures.append(outcome)
        elif isinstance(outcome, JSONResponse):
            return outcome
    if failures:  # it may live in a partition that did not answer
        return router_error(503, "unavailable", f"document {doc_id!r} not found in the partitions that answered",
                            failed_shards=[f.model_dump() for f in failures])
    return router_error(404, "document_not_found", f"no document with id {doc_id!r}")


async def _ask(fan: Fanout, target: Target, path: str, doc_id: str,
               headers: dict[str, str]) -> JSONResponse | ShardFailure | None:
    """The document from one partition (its replicas in turn): the answer to give, None when the
    partition says it has no such document, or the failure of its last replica."""
    failure: ShardFailure | None = None
    for replica in target.order():
        outcome = await fan.call(replica, "GET", path, headers, None, MAX_ANSWER_BYTES)
        if isinstance(outcome, ShardFailure):
            target.failed(replica)
            failure = outcome
        elif outcome.status == 200:
            try:
                return JSONResponse(check_document(outcome, doc_id).model_dump(mode="json"))
            except BadAnswer as exc:
                target.failed(replica)
                failure = fan.record_failure(replica, "bad_response", str(exc))
        elif outcome.status in (401, 403):
            return JSONResponse(error_body(outcome, "shard_error"), status_code=outcome.status)
        elif outcome.status == 404 and error_body(outcome, "shard_error")["error"] == "document_not_found":
            return None
        else:  # a 404 that is not the server's document_not_found is a wrong path (a URL prefix, a proxy)
            target.failed(replica)
            failure = fan.record_failure(replica, f"http_{outcome.status}", shard_message(outcome))
    return failure or fan.no_replica(target)
