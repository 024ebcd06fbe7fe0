"""/v1/snapshots: `espn snapshot` over HTTP, behind the API key like every /v1 route.

Snapshots go under `--snapshot-dir` only (a caller names a snapshot, never a path), each a
consistent copy of the generation served when it started, taken while searches and writes
go on (espn.live.snapshot). Off unless the directory is configured.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Optional

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from espn.service import default_name, snapshot, snapshots_in

from ..deps import AppState, get_state
from ..errors import ApiError
from ..schemas import ErrorResponse

router = APIRouter(prefix="/v1/snapshots", tags=["snapshots"])

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


def _directory(state: AppState) -> Path:
    directory = state.settings.snapshot_dir
    if directory is None:
        raise ApiError(404, "snapshots over HTTP are off: start the server with --snapshot-dir DIR "
                            "(or run `espn snapshot INDEX DEST` beside it)", code="snapshots_off")
    return directory


@router.post("", response_model=SnapshotInfo, status_code=201,
             summary="Take a consistent snapshot of the served index (while it is searched and written)",
             responses={400: {"model": ErrorResponse, "description": "malformed JSON or invalid UTF-8"},
                        404: {"model": ErrorResponse, "description": "--snapshot-dir is not set"},
                        409: {"model": ErrorResponse, "description": "a snapshot with this name exists or is "
                                                                         "being taken"},
                        413: {"model": ErrorResponse, "description": "request body too large"},
                        415: {"model": ErrorResponse, "description": "the body is not application/json"},
                        507: {"model": ErrorResponse, "description": "the disk is full (nothing was kept)"}})
async def take_snapshot(body: Optional[SnapshotRequest] = None, state: AppState = Depends(get_state)) -> SnapshotInfo:
    directory = _directory(state)
    name = (body.name if body is not None else None) or default_name()  # to the ms, with a random suffix: never 409
    # The library claims the name before it copies anything (a second request for it gets a
    # ConflictError, 409) and renames the copy into place only once it verifies; a full disk
    # is a StorageFullError (507) with nothing left behind.
    result = await asyncio.to_thread(snapshot, state.settings.index, directory / name)
    return SnapshotInfo(name=name, generation=result.generation, files=result.files,
                        linked_bytes=result.linked_bytes, copied_bytes=result.copied_bytes)


@router.get("", response_model=SnapshotList, response_model_exclude_none=True, summary="The snapshots under --snapshot-dir",
            responses={404: {"model": ErrorResponse, "description": "--snapshot-dir is not set"}})
async def list_snapshots(state: AppState = Depends(get_state)) -> Any:
    found = snapshots_in(_directory(state))
    return SnapshotList(snapshots=[SnapshotInfo(name=name, generation=generation) for name, generation in found])
