"""Operations endpoints: liveness, readiness and Prometheus metrics (no API key)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse

from ..deps import AppState, get_state
from ..metrics import CONTENT_TYPE_LATEST
from ..schemas import HealthResponse

router = APIRouter(tags=["operations"])
# Separate, so that `--metrics-port` can leave it off the API port.
metrics_router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=HealthResponse, response_model_exclude_none=True,
            summary="Liveness: the process answers")
async def healthz() -> HealthResponse:
    return HealthResponse(status="ok")


@router.get(
    "/readyz",
    response_model=HealthResponse,
    summary="Readiness: the index is open and warmed",
    responses={503: {"model": HealthResponse, "description": "starting, warming or draining"}},
)
async def readyz(state: AppState = Depends(get_state)) -> Response:
    reader = state.searcher.reader.describe() if state.searcher is not None else None
    if state.ready:
        return JSONResponse(HealthResponse(status="ready", reader=reader).model_dump(mode="json", exclude_none=True))
    return JSONResponse(
        HealthResponse(status=state.status, detail="not ready", reader=reader).model_dump(mode="json",
                                                                                         exclude_none=True),
        status_code=503,
        headers={"Retry-After": "1"},
    )


@metrics_router.get(
    "/metrics",
    summary="Prometheus metrics (all workers)",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
async def metrics(state: AppState = Depends(get_state)) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
