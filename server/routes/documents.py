"""GET /v1/documents/{doc_id}: a passage by its external id."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Path

from ..deps import AppState, get_state
from ..schemas import MAX_DOC_ID_CHARS, DocumentResponse, ErrorResponse

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
