"""GET /v1/indexes: the indexes this server holds (`espn serve --index NAME=PATH ...`); POST creates one
and DELETE /v1/indexes/{name} removes one, behind the API key like every /v1 route.

Each index's own routes are under /v1/indexes/{name}/: the routes of /v1/search, /v1/documents
and /v1/snapshots, mounted again with the index's name as a path parameter (server.app)."""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, Depends, Path, Response

from espn.engine import IndexInfo as EngineIndexInfo

from ..auth import Principal
from ..deps import AppState, get_principal, get_state
from ..errors import ApiError
from ..schemas import CreateIndexRequest, ErrorResponse, IndexInfo, IndexListResponse

router = APIRouter(prefix="/v1/indexes", tags=["indexes"])

_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorResponse, "description": "no index with this name"}}
_CREATE_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "malformed JSON or invalid UTF-8"},
    413: {"model": ErrorResponse, "description": "request body too large"},
    415: {"model": ErrorResponse, "description": "the body is not application/json"},
    409: {"model": ErrorResponse, "description": "`index_exists`: the name is taken (or being created); `admin_off`: "
                                                 "the server has no index root or no --model; `read_only`: "
                                                 "--read-only"},
    422: {"model": ErrorResponse, "description": "`unknown_model`: no configured model of that name (the message "
                                                 "lists them); `invalid_request`: a bad name or body"},
    503: {"model": ErrorResponse, "description": "`create_failed`: the creation failed (the message says why); "
                                                 "`unavailable`: too many creations at once (`Retry-After`)"},
}
_DELETE_ERRORS: dict[int | str, dict[str, Any]] = {
    **_NOT_FOUND,
    409: {"model": ErrorResponse, "description": "`index_protected`: the default index, or one served from outside "
                                                 "the index root; `admin_off`: the server has no index root; "
                                                 "`read_only`: --read-only"},
    503: {"model": ErrorResponse, "description": "`unavailable`: requests still inside after the graceful timeout "
                                                 "(`Retry-After`), nothing was deleted; `delete_failed`: the "
                                                 "directory could not be removed"},
}


def index_info(info: EngineIndexInfo) -> IndexInfo:
    """The engine's view of an index as the HTTP model (also in /readyz)."""
    return IndexInfo(name=info.name, default=info.default, open=info.open, documents=info.documents,
                     generation=info.generation, encoder=info.encoder,
                     mode=None if info.read_only is None else "read-only" if info.read_only else "read-write",
                     memory_mib=round(info.memory_bytes / 2**20, 3),
                     fit=dict(info.fit) if info.fit is not None else None)


@router.get("", response_model=IndexListResponse, summary="List the indexes: name, documents, encoder, open or closed")
async def list_indexes(state: AppState = Depends(get_state),
                       principal: Optional[Principal] = Depends(get_principal)) -> IndexListResponse:
    """The indexes the request's key reaches (every index without keys)."""
    return IndexListResponse(indexes=[index_info(info) for info in state.engines.describe()
                                      if principal is not None and principal.reaches(info.name)])


@router.get("/{name}", response_model=IndexInfo, summary="One index: documents, encoder, open or closed",
            responses=_NOT_FOUND)
async def get_index(name: str = Path(description="the index's name (`--index NAME=PATH`)"),
                    state: AppState = Depends(get_state)) -> IndexInfo:
    return index_info(state.engines.info(name))


@router.post("", response_model=IndexInfo, status_code=201, responses=_CREATE_ERRORS,
             summary="Create an empty index with one of the server's configured models (`--model NAME=SPEC`)",
             description="Writes an empty index in the index root (`--index-root`), in a fraction of a second "
                         "(the first creation with a model loads it once): it takes writes under "
                         "/v1/indexes/{name}/documents at once, is searched exactly while small, and is fitted on "
                         "its own documents as it grows (nothing is trained on other text).")
async def post_index(body: CreateIndexRequest, state: AppState = Depends(get_state),
                     principal: Optional[Principal] = Depends(get_principal)) -> IndexInfo:
    if principal is None or not principal.reaches(body.name):  # the middleware checked the admin role
        raise ApiError(403, f"the API key may not create an index named {body.name!r}: it reaches "
                       f"{', '.join(principal.indexes) if principal else 'no index'}", code="forbidden")
    return index_info(await state.engines.create(body.name, body.model))


@router.post("/{name}/refit", response_model=IndexInfo, status_code=202, responses={
    **_NOT_FOUND, 409: {"model": ErrorResponse, "description": "`read_only`: the index is served read-only"}},
    summary="Fit the index on its own documents again, in the background (searches and writes go on)",
    description="Starts a base rewrite that fits the index's IVF, token centroids and residual codes on its live "
                "documents (an index also re-fits itself as it grows). It answers 202 once the re-fit is "
                "started; `fit.refit_running` of GET /v1/indexes/{name} shows its progress until it ends, "
                "when a new generation is served.")
async def refit_index(name: str = Path(description="the index's name"),
                      state: AppState = Depends(get_state)) -> IndexInfo:
    async with state.engines.use(name) as engine:
        await engine.refit()
    return index_info(state.engines.info(name))


@router.delete("/{name}", status_code=204, response_class=Response, responses=_DELETE_ERRORS,
               summary="Delete an index: its requests finish, it closes, its directory is removed")
async def remove_index(name: str = Path(description="the index's name"),
                       state: AppState = Depends(get_state)) -> Response:
    await state.engines.delete(name)
    return Response(status_code=204)
