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
from ...schemas import BatchWriteRequest, ErrorResponse, WriteResponse, path_doc_id
from ..deps import RouterState, get_router_state, router_error
from ..models import PartitionOutcome, RoutedWriteResponse
from ..writers import RETRY_AFTER_S, WriteOutcome, WriterPool, relay

__all__ = ["router", "no_writes_router"]

router = APIRouter()
# Without --writers: every write method on a document path is a 405 that says why.
no_writes_router = APIRouter()

_FORWARDED = ("authorization", "x-request-id", "content-type")
# What the router itself answers for a write it could not confirm (the writer's own refusals,
# 4xx, are passed on as the server declares them).
_WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    502: {"model": ErrorResponse, "description": "the writer answered what is not a write result of the ids sent"},
    503: {"model": ErrorResponse, "description": "the writer is down or holds another partition"},
    504: {"model": ErrorResponse, "description": "the writer did not answer in time: may or may not be applied"}}


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
    upserts, deletes = ([doc_id], []) if method == "PUT" else ([], [doc_id])
    body = await request.body()
    outcome = await writers.write(partition, method, path, _headers_of(request), body, upserts, deletes)
    if outcome.status == 421 and not state.routing.checks_layout:
        # The writer holds a newer shard map than this router (a reshard just switched the
        # id's slot): read it again, and send the write once to the partition it names now.
        await state.routing.refresh()
        if writers.owner(doc_id) != partition:
            outcome = await writers.write(writers.owner(doc_id), method, path, _headers_of(request), body, upserts,
                                          deletes)
    response = relay(outcome)
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


def _outcome(part: dict[str, list[Any]], outcome: WriteOutcome) -> PartitionOutcome:
    result = outcome.result
    return PartitionOutcome(
        partition=outcome.partition, status=outcome.status, applied=result is not None,
        generation=None if result is None else result.generation,
        upserts=[d["id"] for d in part["upsert"]], deletes=part["delete"],
        error=None if result is not None else str(outcome.body.get("error", "writer_error")),
        message=None if result is not None else str(outcome.body.get("message", "")))


@router.post("/v1/documents/batch", response_model=RoutedWriteResponse,
             summary="Upserts and deletes, each part applied on the partition that owns its ids",
             responses={422: {"model": ErrorResponse}, 502: {"model": RoutedWriteResponse},
                        503: {"model": RoutedWriteResponse}, 504: {"model": RoutedWriteResponse}})
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
        writers.write(p, "POST", "/v1/documents/batch", headers, json.dumps(parts[p], ensure_ascii=False).encode(),
                      [d["id"] for d in parts[p]["upsert"]], parts[p]["delete"])
        for p in order))
    outcomes, created, replaced, deleted = [], [], [], []
    for p, answer in zip(order, answers):
        if answer.result is not None:  # checked: the ids this part was sent, applied
            created += answer.result.created
            replaced += answer.result.replaced
            deleted += answer.result.deleted
        outcomes.append(_outcome(parts[p], answer))
    failed = [o for o in outcomes if not o.applied]
    result = RoutedWriteResponse(created=created, replaced=replaced, deleted=deleted,
                                 applied=[o.partition for o in outcomes if o.applied],
                                 failed=[o.partition for o in failed], partitions=outcomes)
    # All applied: 200. Otherwise the first failed part's status (never a 2xx: a part is failed
    # only with a writer's refusal or the router's 502/503/504), so a client that reads only
    # the status still sees the write did not all happen; the body says which did.
    status = 200 if not failed else failed[0].status
    headers_out = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    state.observe("batch_write", started, status)
    return JSONResponse(result.model_dump(mode="json"), status_code=status, headers=headers_out)


@router.put("/v1/documents/{doc_id:path}", summary="Add or replace a document on the partition that owns its id",
            response_model=WriteResponse, status_code=201,
            responses={200: {"model": WriteResponse, "description": "replaced"}, **_WRITE_ERRORS})
async def put_document(doc_id: str, request: Request, state: RouterState = Depends(get_router_state)) -> JSONResponse:
    return await _single(request, state, "PUT")


@router.delete("/v1/documents/{doc_id:path}", summary="Delete a document on the partition that owns its id",
               response_model=WriteResponse, responses=_WRITE_ERRORS)
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
