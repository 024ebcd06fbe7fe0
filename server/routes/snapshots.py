"""/v1/snapshots: `espn snapshot` over HTTP, behind the API key like every /v1 route.

Snapshots go under `--snapshot-dir` only (a caller names a snapshot, never a path), each a
consistent copy of the generation served when it started, taken while searches and writes
go on (espn.live.snapshot). Off unless the directory is configured.
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from espn.engine import Engine

from ..deps import get_engine
from ..schemas import ErrorResponse

router = APIRouter(prefix="/snapshots", tags=["snapshots"])

SNAPSHOT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"


class SnapshotRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Optional[str] = Field(None, pattern=SNAPSHOT_NAME,
                                description="directory name under --snapshot-dir; default snapshot-<UTC time to the "
                                            "millisecond>-<random suffix>, unique")


class SnapshotInfo(BaseModel):
    name: str
    generation: int = Field(description="the generation the snapshot holds")
    files: Optional[int] = None
    linked_bytes: Optional[int] = Field(default=None, description="bytes shared with the index by hard links")
    copied_bytes: Optional[int] = None


class SnapshotList(BaseModel):
    snapshots: list[SnapshotInfo]


@router.post("", response_model=SnapshotInfo, status_code=201,
             summary="Take a consistent snapshot of the served index (while it is searched and written)",
             responses={400: {"model": ErrorResponse, "description": "malformed JSON or invalid UTF-8"},
                        404: {"model": ErrorResponse, "description": "--snapshot-dir is not set"},
                        409: {"model": ErrorResponse, "description": "a snapshot with this name exists or is "
                                                                         "being taken"},
                        413: {"model": ErrorResponse, "description": "request body too large"},
                        415: {"model": ErrorResponse, "description": "the body is not application/json"},
                        507: {"model": ErrorResponse, "description": "the disk is full (nothing was kept)"}})
async def take_snapshot(body: Optional[SnapshotRequest] = None, engine: Engine = Depends(get_engine)) -> SnapshotInfo:
    # Without a name: the time to the millisecond with a random suffix, never a 409. The library
    # claims the name before it copies anything (a second request for it gets a 409) and renames
    # the copy into place only once it verifies; a full disk is a 507 with nothing left behind.
    taken = await engine.snapshot(body.name if body is not None else None)
    return SnapshotInfo(name=taken.name, generation=taken.generation, files=taken.files,
                        linked_bytes=taken.linked_bytes, copied_bytes=taken.copied_bytes)


@router.get("", response_model=SnapshotList, response_model_exclude_none=True, summary="The snapshots under --snapshot-dir",
            responses={404: {"model": ErrorResponse, "description": "--snapshot-dir is not set"}})
async def list_snapshots(engine: Engine = Depends(get_engine)) -> Any:
    return SnapshotList(snapshots=[SnapshotInfo(name=one.name, generation=one.generation) for one in engine.snapshots()])
