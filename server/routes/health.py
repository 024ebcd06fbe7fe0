"""Operations endpoints: liveness, readiness and Prometheus metrics (no API key)."""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse

from ..auth import Principal
from ..deps import AppState, get_principal, get_state
from ..metrics import CONTENT_TYPE_LATEST
from ..schemas import HealthResponse, ReadinessResponse
from .indexes import index_info

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
async def readyz(state: AppState = Depends(get_state),
                 principal: Optional[Principal] = Depends(get_principal)) -> Response:
    """Ready or not; with the key (on a server that needs one) also what is served, of the indexes
    the key reaches: without it, no index name, reader or replication detail is given away."""
    engines = state.engines
    ready = engines.readiness()
    if principal is None:
        bare = ReadinessResponse(status=ready.state.value, detail=None if ready.ready else "not ready")
        return JSONResponse(bare.model_dump(mode="json", exclude_none=True), status_code=200 if ready.ready else 503,
                            headers=None if ready.ready else {"Retry-After": "1"})
    every = engines.describe()
    held = [info for info in every if principal.reaches(info.name)]
    described = held if len(every) > 1 or engines.default_name is None else None
    body = ReadinessResponse(
        status=ready.state.value, detail=None if ready.ready else "not ready", reader=ready.reader,
        generation=ready.generation,
        mode=None if ready.read_only is None else "read-only" if ready.read_only else "read-write",
        replication=ready.replication, partition=ready.partition, trust_remote_code=ready.trust_remote_code,
        indexes=[index_info(info) for info in described] if described is not None else None,
    ).model_dump(mode="json", exclude_none=True)
    if ready.ready:
        return JSONResponse(body)
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})


@metrics_router.get(
    "/metrics",
    summary="Prometheus metrics (all workers)",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
async def metrics(state: AppState = Depends(get_state)) -> Response:
    replication = state.engines.replication()
    if replication is not None:
        state.metrics.set_replication(replication)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
