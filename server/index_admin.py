"""Creating and deleting indexes over HTTP (`POST /v1/indexes`, `DELETE /v1/indexes/{name}`).

Both work in the index root (`--index-root`, or the one `--index DIR` of indexes): a created
index is built there by espn.live.create (its quantizers trained on the bundled sample corpus,
then emptied) and moved into place by one rename; a deleted one is renamed to a hidden
tombstone there, then removed. Other workers see either through the directory itself: a
name they do not hold is looked up in the root, and an index whose directory is gone is a 404
(server.indexes). The default index, and an index served from outside the root, cannot be
deleted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from espn.errors import EspnError, IndexExistsError
from espn.service import create_empty_index, remove_index

from .errors import ApiError, ServiceUnavailableError
from .index_names import INDEX_NAME, NAME_RULE
from .index_schemas import CreateIndexRequest, IndexInfo
from .indexes import IndexRegistry, close_index

__all__ = ["create_index", "delete_index"]

logger = logging.getLogger(__name__)

#: Names being created in this worker now (a second request for one is a 409 at once).
_creating: set[str] = set()


def _root_or_409(registry: IndexRegistry, what: str) -> Path:
    if registry.settings.read_only:
        raise ApiError(409, f"this server is read-only (--read-only): it {what} no indexes", code="read_only")
    if registry.root is None:
        raise ApiError(409, f"this server {what} no indexes: it has no index root (start it with --index-root DIR, "
                            "or --index DIR of indexes)", code="admin_off")
    return registry.root


def _info(registry: IndexRegistry, name: str) -> IndexInfo:
    return next(item for item in registry.describe() if item.name == name)


async def create_index(registry: IndexRegistry, request: CreateIndexRequest) -> IndexInfo:
    """Build the empty index `request.name` with the configured model `request.model`; its IndexInfo."""
    root = _root_or_409(registry, "creates")
    name = request.name
    if not INDEX_NAME.match(name):
        raise ApiError(422, f"index name {name!r}: {NAME_RULE}", code="invalid_request")
    if not registry.models:
        raise ApiError(409, "this server has no models to create indexes with: start it with --model NAME=SPEC "
                            "(e.g. --model small=minilm)", code="admin_off")
    spec = registry.models.get(request.model)
    if spec is None:
        raise ApiError(422, f"no model named {request.model!r}; this server creates indexes with: "
                            f"{', '.join(sorted(registry.models))} (--model NAME=SPEC)", code="unknown_model")
    registry.refresh()
    if name in registry.states or name in _creating or (root / name).exists():
        raise ApiError(409, f"an index named {name!r} exists (or is being created); DELETE it first or choose "
                            "another name", code="index_exists")
    _creating.add(name)
    started = time.perf_counter()
    try:
        path = await asyncio.to_thread(create_empty_index, root, name, spec)
    except IndexExistsError as exc:  # created by another worker meanwhile
        raise ApiError(409, f"an index named {name!r} exists: {exc}", code="index_exists") from exc
    except (EspnError, OSError) as exc:
        logger.error("creating index %s failed: %s", name, exc)
        raise ApiError(503, f"creating index {name!r} with model {request.model!r} failed: {exc}",
                       code="create_failed") from exc
    finally:
        _creating.discard(name)
    registry.add(name, path)
    logger.info("index created", extra={"index": name, "model": request.model,
                                        "seconds": round(time.perf_counter() - started, 1)})
    return _info(registry, name)


async def delete_index(registry: IndexRegistry, name: str, wait_s: float) -> None:
    """Refuse new requests to `name`, let those inside finish (up to wait_s), close it, remove its directory."""
    root = _root_or_409(registry, "deletes")
    state = registry.get(name)
    if not state.lazy:
        raise ApiError(409, f"index {name!r} is this server's default index (served by /v1/search, ...); it cannot be "
                            "deleted over HTTP", code="index_protected")
    if state.settings.index.parent != root or (root / name).is_symlink():
        raise ApiError(409, f"index {name!r} is served from {state.settings.index}, outside the index root {root}; "
                            "only indexes in the root can be deleted over HTTP", code="index_protected")
    state.deleting = True  # from now on its requests get 404
    deadline = time.monotonic() + wait_s
    while state.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if state.in_flight:
        state.deleting = False
        raise ServiceUnavailableError(f"index {name!r} still has {state.in_flight} request(s) inside after "
                                      f"{wait_s:g} s; nothing was deleted", retry_after_s=5)
    try:
        async with registry.lock(name):
            if state.live is not None:
                state.ready, state.status = False, "closed"
                await close_index(state, registry.encoders)
            await asyncio.to_thread(remove_index, root, name)
    except (EspnError, OSError) as exc:
        if not (root / name).exists():  # another worker deleted it meanwhile
            registry.forget(name)
            raise ApiError(404, f"no index named {name!r} on this server (deleted)", code="not_found") from exc
        state.deleting = False
        raise ApiError(503, f"deleting index {name!r} failed: {exc}", code="delete_failed") from exc
    registry.forget(name)
    logger.info("index deleted", extra={"index": name})
