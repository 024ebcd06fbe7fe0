"""Liveness, readiness (at least one partition ready) and the router's Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ...schemas import HealthResponse
from ..answers import MAX_SMALL_ANSWER_BYTES, PartitionAnswer
from ..deps import RouterState, get_router_state

__all__ = ["router"]

router = APIRouter()


# exclude={"reader"}: a router has no reader of its own (HealthResponse is shared with the server).
@router.get("/healthz", response_model=HealthResponse, response_model_exclude={"reader"},
            summary="Liveness: the router answers")
async def healthz() -> HealthResponse:
    return HealthResponse(status="ok")


@router.get("/readyz", response_model=HealthResponse, summary="Readiness: at least one partition is ready",
            responses={503: {"model": HealthResponse}})
async def readyz(state: RouterState = Depends(get_router_state)) -> Response:
    fan = state.require_fanout()
    # Only the status is read: a ready partition answers 200, whatever its body says; a
    # partition is ready when one of its replicas is.
    targets = fan.targets()
    replicas = [(t.partition, url) for t in targets for url in t.replicas]
    outcomes = await asyncio.gather(*(fan.call(url, "GET", "/readyz", {}, None, MAX_SMALL_ANSWER_BYTES)
                                      for _, url in replicas))
    ready = {p for (p, _), o in zip(replicas, outcomes) if isinstance(o, PartitionAnswer) and o.status == 200}
    detail = f"{len(ready)} of {len(targets)} shard(s) ready"
    if ready:
        return JSONResponse(HealthResponse(status="ready", detail=detail).model_dump(exclude={"reader"}))
    return JSONResponse(HealthResponse(status="unavailable", detail=detail).model_dump(exclude={"reader"}),
                        status_code=503, headers={"Retry-After": "1"})


@router.get("/metrics", summary="Prometheus metrics of the router", response_class=Response)
async def prometheus(state: RouterState = Depends(get_router_state)) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
