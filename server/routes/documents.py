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
from typing import TYPE_CHECKING, Any, Sequence

from fastapi import APIRouter, Depends, Path, Response

from ..deps import AppState, get_state
from ..schemas import MAX_DOC_ID_CHARS, BatchWriteRequest, DocumentResponse, DocumentWrite, ErrorResponse, WriteResponse

if TYPE_CHECKING:
    from espn_indexing.live import NewDocument, WriteResult

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/documents", tags=["documents"])


@router.get(
    "/{doc_id:path}",
    response_model=DocumentResponse,
    summary="Fetch one document's title and text",
    responses={404: {"model": ErrorResponse}, 422: {"model": ErrorResponse}, 503: {"model": ErrorResponse}},
)
async def get_document(
    doc_id: str = Path(min_length=1, max_length=MAX_DOC_ID_CHARS, description="external document id"),
    state: AppState = Depends(get_state),
) -> DocumentResponse:
    searcher = state.require_searcher()
    # Reads passage text from disk: keep it off the event loop.
    document = await asyncio.to_thread(searcher.document, doc_id)
    return DocumentResponse(id=document.doc_id, title=document.title, text=document.text)


_WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}, 413: {"model": ErrorResponse},
    422: {"model": ErrorResponse}, 503: {"model": ErrorResponse},
}
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
    responses={200: {"model": WriteResponse}, **_WRITE_ERRORS},
)
async def put_document(
    body: DocumentWrite,
    response: Response,
    doc_id: str = Path(min_length=1, max_length=MAX_DOC_ID_CHARS, description="external document id"),
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
    responses=_WRITE_ERRORS,
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

    upserts = [NewDocument(d.id, d.text, d.title, d.metadata) for d in body.upsert]
    return _response(await _apply(state, upserts, body.delete))
