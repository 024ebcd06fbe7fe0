"""PUT, DELETE and batch writes, each placed on the writer of the partition that owns its
id (see `..writers`); without --writers, a 405 that says how to turn them on."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from espn.errors import InvalidParameterError

from ...errors import METHOD_NOT_ALLOWED_ROUTE, allowed_methods
from ...schemas import BatchWriteRequest, ErrorResponse, path_doc_id
from ..deps import RouterState, get_router_state, router_error
from ..models import PartitionOutcome, RoutedWriteResponse
from ..writers import RETRY_AFTER_S, WriterPool, body_of, relay

__all__ = ["router", "no_writes_router"]

router = APIRouter()
# Without --writers: every write method on a document path is a 405 that says why.
no_writes_router = APIRouter()

_FORWARDED = ("authorization", "x-request-id", "content-type")


def _headers_of(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in _FORWARDED if name in request.headers}


async def _single(request: Request, state: RouterState, method: str) -> JSONResponse:
    started = time.perf_counter()
    try:
        doc_id = path_doc_id(request)
    except InvalidParameterError as exc:
        return JSONResponse({"error": "invalid_parameter", "message": str(exc)}, status_code=422)
    writers = state.require_writers()
    partition = writers.owner(doc_id)
    path = "/v1/documents/" + urllib.parse.quote(doc_id, safe="")
    answer = await writers.send(partition, method, path, _headers_of(request), await request.body())
    response = relay(answer, partition)
    state.observe("write", started, response.status_code)
    return response


@router.api_route("/v1/documents/batch", methods=["GET", "PUT", "DELETE"], include_in_schema=False,
                  name=METHOD_NOT_ALLOWED_ROUTE)
async def batch_other_methods(request: Request) -> JSONResponse:
    return JSONResponse({"error": "method_not_allowed", "message": f"method {request.method} is not allowed on "
                         "/v1/documents/batch; it takes POST"}, status_code=405, headers={"Allow": "POST"})


def _parts(writers: WriterPool, body: BatchWriteRequest) -> dict[int, dict[str, list[Any]]]:
    """The batch split by the partition that owns each id."""
    parts: dict[int, dict[str, list[Any]]] = {}
    for document in body.upsert:
        parts.setdefault(writers.owner(document.id), {"upsert": [], "delete": []})["upsert"].append(
            document.model_dump(exclude_none=True))
    for doc_id in body.delete:
        parts.setdefault(writers.owner(doc_id), {"upsert": [], "delete": []})["delete"].append(doc_id)
    return parts


def _outcome(partition: int, part: dict[str, list[Any]], answer: Any) -> tuple[PartitionOutcome, dict[str, Any]]:
    status, reply = body_of(answer)
    applied = status == 200 and isinstance(reply, dict) and "generation" in reply
    outcome = PartitionOutcome(
        partition=partition, status=status, applied=applied, generation=reply.get("generation") if applied else None,
        upserts=[d["id"] for d in part["upsert"]], deletes=part["delete"],
        error=None if applied else str(reply.get("error", "writer_error")),
        message=None if applied else str(reply.get("message", "")))
    return outcome, reply


@router.post("/v1/documents/batch", response_model=RoutedWriteResponse,
             summary="Upserts and deletes, each part applied on the partition that owns its ids",
             responses={422: {"model": ErrorResponse}, 503: {"model": RoutedWriteResponse}})
async def write_batch(request: Request, state: RouterState = Depends(get_router_state)) -> JSONResponse:
    started = time.perf_counter()
    try:
        body = BatchWriteRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        return JSONResponse({"error": "invalid_request", "message": "the request does not match the schema",
                             "errors": errors}, status_code=422)
    writers = state.require_writers()
    parts = _parts(writers, body)
    order = sorted(parts)
    headers = {**_headers_of(request), "content-type": "application/json"}
    answers = await asyncio.gather(*(
        writers.send(p, "POST", "/v1/documents/batch", headers, json.dumps(parts[p], ensure_ascii=False).encode())
        for p in order))
    outcomes, created, replaced, deleted = [], [], [], []
    for p, answer in zip(order, answers):
        outcome, reply = _outcome(p, parts[p], answer)
        if outcome.applied:
            created += reply["created"]
            replaced += reply["replaced"]
            deleted += reply["deleted"]
        outcomes.append(outcome)
    failed = [o for o in outcomes if not o.applied]
    result = RoutedWriteResponse(created=created, replaced=replaced, deleted=deleted,
                                 applied=[o.partition for o in outcomes if o.applied],
                                 failed=[o.partition for o in failed], partitions=outcomes)
    # All applied: 200. Otherwise the first failed part's status, so a client that reads
    # only the status still sees the write did not all happen; the body says which did.
    status = 200 if not failed else failed[0].status
    headers_out = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    state.observe("batch_write", started, status)
    return JSONResponse(result.model_dump(mode="json"), status_code=status, headers=headers_out)


@router.put("/v1/documents/{doc_id:path}", summary="Add or replace a document on the partition that owns its id",
            responses={503: {"model": ErrorResponse}, 504: {"model": ErrorResponse}})
async def put_document(doc_id: str, request: Request, state: RouterState = Depends(get_router_state)) -> JSONResponse:
    return await _single(request, state, "PUT")


@router.delete("/v1/documents/{doc_id:path}", summary="Delete a document on the partition that owns its id",
               responses={503: {"model": ErrorResponse}, 504: {"model": ErrorResponse}})
async def delete_document(doc_id: str, request: Request,
                          state: RouterState = Depends(get_router_state)) -> JSONResponse:
    return await _single(request, state, "DELETE")


@no_writes_router.api_route("/v1/documents/{doc_id:path}", methods=["PUT", "DELETE", "POST"], include_in_schema=False,
                            name=METHOD_NOT_ALLOWED_ROUTE)
async def no_writes(request: Request) -> JSONResponse:
    allowed = allowed_methods(request)
    response = router_error(405, "method_not_allowed", f"this router takes no writes: start it with --writers "
                            f"(one writer URL per partition); {request.url.path} takes {allowed}")
    response.headers["Allow"] = allowed
    return response
