"""/v1/documents: a passage by its external id; writes to a live index (PUT, DELETE, batch).

A write is checked (ids, text, metadata limits: a 422 before anything is queued) and handed
to the index's engine, whose group committer takes it: writes that arrive
while a generation is being published are encoded together and published as the next
generation, under the index's writer lock, which the workers take in turn. This worker
swaps to the new generation before it answers; other workers look at live/CURRENT (one
stat) at the start of every request, so any request that starts after the answer sees
the write. On a read-only index every write is a 409 that says so.

Ids in the URL path are taken from the raw path and decoded as strict UTF-8 (Starlette's
decoding would turn invalid bytes into U+FFFD, so two different ids could collide): a
NUL, a control character, invalid UTF-8 or a lone surrogate is a 422 naming it.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Optional

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import AfterValidator

from espn.engine import RULES, Engine, NewDocument, WriteResult

from ..deps import get_engine
from ..errors import METHOD_NOT_ALLOWED_ROUTE, ApiError
from ..schemas import (ID_LIMIT, ID_SCHEMA, BatchWriteRequest, DocumentResponse,
                       DocumentWrite, ErrorResponse, WriteResponse, check_write_id, path_doc_id)

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/documents", tags=["documents"])

_ERROR = {"model": ErrorResponse}
_READ_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {**_ERROR, "description": "no document with this id"},
    422: {**_ERROR, "description": "an id out of bounds, with a control character or not UTF-8"},
    503: {**_ERROR, "description": "the index is not open yet, or the server is shutting down"},
}
_WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {**_ERROR, "description": "malformed JSON or invalid UTF-8"},
    404: {**_ERROR, "description": "an id to delete is not in the index (nothing is written)"},
    409: {**_ERROR, "description": "the write conflicts with itself (an id twice, an id both upserted and deleted) "
                                   "or with the index (a metadata field of another type), or the server serves the "
                                   "index read-only (code `read_only`); nothing is written"},
    413: {**_ERROR, "description": "request body too large, or a page image that could never fit the server's page "
                                   "memory (code `too_large`); nothing is written"},
    421: {**_ERROR, "description": "an id another partition owns (code `wrong_partition`): write through `espn route`"},
    415: {**_ERROR, "description": "the body is not application/json"},
    422: {**_ERROR, "description": "a field out of bounds, or the schema not met (nothing is written)"},
    503: {**_ERROR, "description": "another write or a compaction holds the index past ESPN_WRITE_WAIT_S, the write "
                                   "queue is full, the page memory is held by other writes, or the index is not "
                                   "open (Retry-After)"},
    507: {**_ERROR, "description": "the disk is full: nothing of this write is kept (Retry-After)"},
}
# Every id an index holds obeys the write rules (the build and the writer refuse others), so
# reads and deletes state the same pattern: a schema-valid id is never refused.
StoredId = Annotated[str, Path(min_length=1, json_schema_extra=ID_SCHEMA,
                               description=f"external document id ({ID_LIMIT}; no surrounding whitespace, "
                                           "no control characters)"),
                     AfterValidator(check_write_id)]


# Before the {doc_id} routes: /v1/documents/batch is its own path, and by OpenAPI's rule a
# concrete path wins over a templated one, so its other methods are 405 (not "the document
# with id 'batch'"). The id `batch` therefore cannot be read or written over HTTP.
@router.api_route("/batch", methods=["GET", "PUT", "DELETE"], include_in_schema=False,
                  name=METHOD_NOT_ALLOWED_ROUTE)
async def batch_other_methods(request: Request) -> None:
    raise ApiError(405, f"method {request.method} is not allowed on /v1/documents/batch; it takes POST",
                   headers={"Allow": "POST"})


@router.get(
    "/{doc_id:path}",
    response_model=DocumentResponse,
    summary="Fetch one document's title, text and metadata, or a page's image",
    responses={200: {"content": {"image/jpeg": {"schema": {"type": "string", "format": "binary"}}},
                     "description": "the document; with image=true the page's stored image (JPEG)"},
               **_READ_ERRORS, 404: {**_ERROR, "description": "no document with this id (with image=true: or no "
                                                              "page image stored for it: an index of text)"}},
)
async def get_document(
    request: Request,
    doc_id: StoredId,
    image: bool = Query(False, description="an index of pages: answer with the page's stored image (JPEG, at most "
                                           "1,600 px a side) instead of its JSON"),
    max_side: Optional[int] = Query(None, ge=RULES.min_thumbnail_side, le=RULES.max_thumbnail_side,
                                    description="with image=true: a thumbnail at most this many px a side"),
    engine: Engine = Depends(get_engine),
) -> Any:
    if image:
        data, media_type = await engine.page_image(path_doc_id(request), max_side)
        return Response(content=data, media_type=media_type, headers={"Cache-Control": "no-cache"})
    document = await engine.document(path_doc_id(request))
    return DocumentResponse(id=document.doc_id, title=document.title, text=document.text, metadata=document.metadata)


def _response(result: WriteResult) -> WriteResponse:
    return WriteResponse(generation=result.generation, created=result.created, replaced=result.replaced,
                         deleted=result.deleted)


@router.put(
    "/{doc_id:path}",
    response_model=WriteResponse,
    status_code=201,
    summary="Add a document, or replace the one with this id (200)",
    responses={200: {"model": WriteResponse, "description": "replaced"},
               **{status: error for status, error in _WRITE_ERRORS.items() if status != 404}},
)
async def put_document(
    body: DocumentWrite,
    request: Request,
    response: Response,
    doc_id: Annotated[str, Path(min_length=1, json_schema_extra=ID_SCHEMA,
                                description=f"external document id: {ID_LIMIT}, no surrounding whitespace, no "
                                            "control characters"),
                      AfterValidator(check_write_id)],
    engine: Engine = Depends(get_engine),
) -> WriteResponse:
    document = NewDocument(path_doc_id(request), body.text, body.title, body.metadata, body.image_bytes())
    result = await engine.write([document], [])
    if result.replaced:
        response.status_code = 200
    return _response(result)


@router.delete(
    "/{doc_id:path}",
    response_model=WriteResponse,
    summary="Delete a document by id (404 for an unknown id)",
    responses={status: error for status, error in _WRITE_ERRORS.items() if status not in (400, 413, 415)},
)
async def delete_document(
    request: Request,
    doc_id: StoredId,
    engine: Engine = Depends(get_engine),
) -> WriteResponse:
    return _response(await engine.write([], [path_doc_id(request)]))


@router.post(
    "/batch",
    response_model=WriteResponse,
    summary="Upserts and deletes applied as one generation (all or nothing)",
    responses=_WRITE_ERRORS,
)
async def write_batch(body: BatchWriteRequest, request: Request, engine: Engine = Depends(get_engine)) -> WriteResponse:
    limit = request.app.state.espn.settings.max_batch_writes
    if max(len(body.upsert), len(body.delete)) > limit:
        raise ApiError(422, f"at most {limit} upserts and {limit} deletes per batch (ESPN_MAX_BATCH_WRITES)",
                       code="invalid_request")
    upserts = [NewDocument(d.id, d.text, d.title, d.metadata, d.image_bytes()) for d in body.upsert]
    return _response(await engine.write(upserts, body.delete))
