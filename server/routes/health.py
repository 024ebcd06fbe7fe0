"""Operations endpoints: liveness, readiness and Prometheus metrics (no API key)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse

from espn.service import PartitionLayout

from ..deps import AppState, get_state
from ..metrics import CONTENT_TYPE_LATEST
from ..schemas import HealthResponse, ReadinessResponse

router = APIRouter(tags=["operations"])
# Separate, so that `--metrics-port` can leave it off the API port.
metrics_router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=HealthResponse, response_model_exclude_none=True,
            summary="Liveness: the process answers")
async def healthz() -> HealthResponse:
    return HealthResponse(status="ok")


@router.get(
    "/readyz",
    response_model=ReadinessResponse,
    response_model_exclude_none=True,
    summary="Readiness: the index is open and warmed; its generation and whether it takes writes",
    responses={503: {"model": ReadinessResponse, "description": "starting, warming or draining"}},
)
async def readyz(state: AppState = Depends(get_state)) -> Response:
    if state.live is not None and state.ready:
        state.live.refresh()  # one stat: report the generation a search would be served from now
    searcher = state.live.current if state.live is not None else None
    body = ReadinessResponse(
        status="ready" if state.ready else state.status, detail=None if state.ready else "not ready",
        reader=searcher.reader.describe() if searcher is not None else None,
        generation=searcher.generation if searcher is not None else None,
        mode=None if searcher is None else "read-only" if state.read_only else "read-write",
        replication=state.replication(),
        partition=PartitionLayout.from_manifest(searcher.manifest).to_json() if searcher is not None else None,
        trust_remote_code=None if searcher is None else searcher.manifest["encoder"].get("trust_remote_code") is True,
        indexes=state.indexes.describe() if state.indexes is not None and len(state.indexes.states) > 1 else None,
    ).model_dump(mode="json", exclude_none=True)
    if state.ready:
        return JSONResponse(body)
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})


@metrics_router.get(
    "/metrics",
    summary="Prometheus metrics (all workers)",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
async def metrics(state: AppState = Depends(get_state)) -> Response:
    replication = state.replication()
    if replication is not None:
        state.metrics.set_replication(replication)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
