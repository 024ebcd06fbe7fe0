"""/v1/documents: a passage by its external id; writes to a live index (PUT, DELETE, batch).

A write runs the library's `LiveIndex` (the same code as `espn add/delete`) in a thread:
it takes the index's writer lock (waiting up to `write_wait_s`), publishes one
generation durably, and this worker swaps to it before answering. Other workers look
at live/CURRENT (one stat) at the start of every request, so any search that starts
after the response sees the write.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Annotated, Any, Sequence

from fastapi import APIRouter, Depends, Path, Response
from pydantic import AfterValidator

from ..deps import AppState, get_state
from ..errors import ApiError
from ..schemas import (MAX_DOC_ID_CHARS, MAX_WRITE_ID_CHARS, WRITE_ID_PATTERN, BatchWriteRequest, DocumentResponse,
                       DocumentWrite, ErrorResponse, WriteResponse, check_write_id)

if TYPE_CHECKING:
    from espn_indexing.live import NewDocument, WriteResult

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/documents", tags=["documents"])

_ERROR = {"model": ErrorResponse}
_READ_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {**_ERROR, "description": "no document with this id"},
    422: {**_ERROR, "description": "an id out of bounds"},
    503: {**_ERROR, "description": "the index is not open yet, or the server is shutting down"},
}
_WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {**_ERROR, "description": "malformed JSON or invalid UTF-8"},
    404: {**_ERROR, "description": "an id to delete is not in the index (nothing is written)"},
    409: {**_ERROR, "description": "the write conflicts with itself (an id twice, an id both upserted and deleted) "
                                   "or with the index (a metadata field of another type); nothing is written"},
    413: {**_ERROR, "description": "request body too large"},
    415: {**_ERROR, "description": "the body is not application/json"},
    422: {**_ERROR, "description": "a field out of bounds, or the schema not met (nothing is written)"},
    503: {**_ERROR, "description": "another write or a compaction holds the index past ESPN_WRITE_WAIT_S (Retry-After), "
                                   "or the index is not open"},
}


# Before the {doc_id} routes: /v1/documents/batch is its own path, and by OpenAPI's rule a
# concrete path wins over a templated one, so its other methods are 405 (not "the document
# with id 'batch'"). The id `batch` therefore cannot be read or written over HTTP.
@router.api_route("/batch", methods=["GET", "PUT", "DELETE"], include_in_schema=False)
async def batch_other_methods() -> None:
    raise ApiError(405, "method not allowed: /v1/documents/batch takes POST", headers={"Allow": "POST"})


@router.get(
    "/{doc_id:path}",
    response_model=DocumentResponse,
    summary="Fetch one document's title and text",
    responses=_READ_ERRORS,
)
async def get_document(
    doc_id: str = Path(min_length=1, max_length=MAX_DOC_ID_CHARS, description="external document id"),
    state: AppState = Depends(get_state),
) -> DocumentResponse:
    searcher = state.require_searcher()
    # Reads passage text from disk: keep it off the event loop.
    document = await asyncio.to_thread(searcher.document, doc_id)
    return DocumentResponse(id=document.doc_id, title=document.title, text=document.text)


_encoder_lock = threading.Lock()


def _write_encoder(state: AppState) -> Any:
    """The encoder writes use: its own instance (a fast tokenizer refuses concurrent use), loaded once."""
    with _encoder_lock:
        encoder = state.write_encoder
        if encoder is None:
            from espn.encoders import load_encoder

            base = state.require_searcher_unrefreshed().index
            encoder = load_encoder(base.file("encoder"), base.manifest["encoder"], device="cpu")
            state.write_encoder = encoder
        return encoder


def _write(state: AppState, upserts: Sequence["NewDocument"], deletes: Sequence[str]) -> "WriteResult":
    """One generation through the library's writer (in a worker thread)."""
    from espn_indexing.live import LiveIndex

    with LiveIndex.open(state.settings.index, wait_s=state.settings.write_wait_s,
                        encoder=_write_encoder(state) if upserts else None) as writer:
        return writer.apply(upserts, deletes)


async def _apply(state: AppState, upserts: Sequence["NewDocument"], deletes: Sequence[str]) -> "WriteResult":
    state.require_searcher()
    result = await asyncio.to_thread(_write, state, upserts, deletes)
    state.refresh()  # this worker serves the new generation before it answers
    _maybe_compact(state)
    return result


def _maybe_compact(state: AppState) -> None:
    """Past the policy's threshold, compact in a background thread of this worker. Searches go
    on throughout (they swap to the compacted generation when it is published); writes wait
    for the writer lock meanwhile (up to write_wait_s, then 503)."""
    from espn_indexing.live import CompactionPolicy, LiveIndex

    settings = state.settings
    policy = CompactionPolicy(settings.compact_max_segments, settings.compact_deleted_fraction)
    searcher = state.require_searcher_unrefreshed()
    if state.compacting or searcher.view is None or not policy.due(searcher.view.generation):
        return
    state.compacting = True

    def run() -> None:
        try:
            with LiveIndex.open(settings.index, wait_s=0.0) as writer:
                if policy.due(writer.current()):
                    writer.compact()
        except Exception:  # another writer has the lock, or the disk is full: try after a later write
            logger.warning("background compaction did not run", exc_info=True)
        finally:
            state.compacting = False

    threading.Thread(target=run, name="espn-compact", daemon=True).start()


def _response(result: "WriteResult") -> WriteResponse:
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
    response: Response,
    doc_id: Annotated[str, Path(min_length=1, max_length=MAX_WRITE_ID_CHARS, json_schema_extra={"pattern": WRITE_ID_PATTERN},
                                description=f"external document id: at most {MAX_WRITE_ID_CHARS} characters, no "
                                            "surrounding whitespace, no control characters"),
                      AfterValidator(check_write_id)],
    state: AppState = Depends(get_state),
) -> WriteResponse:
    from espn_indexing.live import NewDocument

    result = await _apply(state, [NewDocument(doc_id, body.text, body.title, body.metadata)], [])
    if result.replaced:
        response.status_code = 200
    return _response(result)


@router.delete(
    "/{doc_id:path}",
    response_model=WriteResponse,
    summary="Delete a document by id (404 for an unknown id)",
    responses={status: error for status, error in _WRITE_ERRORS.items() if status not in (400, 409, 413, 415)},
)
async def delete_document(
    doc_id: str = Path(min_length=1, max_length=MAX_DOC_ID_CHARS, description="external document id"),
    state: AppState = Depends(get_state),
) -> WriteResponse:
    return _response(await _apply(state, [], [doc_id]))


@router.post(
    "/batch",
    response_model=WriteResponse,
    summary="Upserts and deletes applied as one generation (all or nothing)",
    responses=_WRITE_ERRORS,
)
async def write_batch(body: BatchWriteRequest, state: AppState = Depends(get_state)) -> WriteResponse:
    from espn_indexing.live import NewDocument

    limit = state.settings.max_batch_writes
    if max(len(body.upsert), len(body.delete)) > limit:
        raise ApiError(422, f"at most {limit} upserts and {limit} deletes per batch (ESPN_MAX_BATCH_WRITES)",
                       code="invalid_request")
    upserts = [NewDocument(d.id, d.text, d.title, d.metadata) for d in body.upsert]
    return _response(await _apply(state, upserts, body.delete))
