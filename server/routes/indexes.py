"""GET /v1/indexes: the indexes this server holds (`espn serve --index NAME=PATH ...`).

Each index's own routes are under /v1/indexes/{name}/ (server.indexes hands them to the
routes of /v1/search, /v1/documents and /v1/snapshots with that index's state)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Path

from ..deps import AppState, get_state
from ..schemas import ErrorResponse, IndexInfo, IndexListResponse

router = APIRouter(prefix="/v1/indexes", tags=["indexes"])

_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorResponse, "description": "no index with this name"}}


def _registry(state: AppState) -> Any:
    assert state.indexes is not None  # build_app makes it
    return state.indexes


@router.get("", response_model=IndexListResponse, summary="List the indexes: name, documents, encoder, open or closed")
async def list_indexes(state: AppState = Depends(get_state)) -> IndexListResponse:
    return IndexListResponse(indexes=_registry(state).describe())


@router.get("/{name}", response_model=IndexInfo, summary="One index: documents, encoder, open or closed",
            responses=_NOT_FOUND)
async def get_index(name: str = Path(description="the index's name (`--index NAME=PATH`)"),
                    state: AppState = Depends(get_state)) -> IndexInfo:
    registry = _registry(state)
    registry.get(name)  # 404 for a name it does not hold
    (info,) = [item for item in registry.describe() if item.name == name]
    return info
