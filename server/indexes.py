"""Several named indexes in one server: `/v1/indexes/{name}/...` and the lifecycle of each index.

`espn serve --index NAME=PATH ...` serves each index under `/v1/indexes/{name}/` with every
route the default index has under `/v1/` (search, batch, documents and writes, snapshots).
`IndexRoutes`, an ASGI layer in front of FastAPI, takes a request for
`/v1/indexes/{name}/search...` and hands it on as `/v1/search...` with the named index's
`AppState` in its scope (`deps.INDEX_STATE_KEY`), so the routes, the search fast path and
the error handlers are the default index's own; `deps.get_state` picks the state up. Each
index has its own state: search service, live writer (writes to one never reach another),
snapshot directory (`--snapshot-dir/NAME` for all but the default).

The default index opens at start-up (its readiness is the server's, as before); every other
index opens at its first request and, with `--index-idle-close S`, closes after S seconds
without one. Indexes whose encoder is the same (server.shared_encoders) hold one loaded model
per worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from starlette.types import ASGIApp, Receive, Scope, Send

from espn.errors import EspnError
from espn.generation.live_searcher import LiveSearcher
from espn.live.snapshot import remove_leftovers
from espn.live.status import read_only_reason

from .deps import INDEX_STATE_KEY, AppState
from .errors import ApiError, error_response
from .metrics import ServerMetrics
from .schemas import IndexInfo
from .search_service import SearchService, open_searcher
from .settings import ServerSettings
from .shared_encoders import SharedEncoders

__all__ = ["IndexRegistry", "IndexRoutes", "open_index", "close_index", "INDEX_PREFIX", "INDEX_ROUTES"]

logger = logging.getLogger(__name__)

INDEX_PREFIX = "/v1/indexes/"
#: The first path segment after /v1/ of the routes an index has under /v1/indexes/{name}/.
INDEX_ROUTES = frozenset({"search", "documents", "snapshots"})


def _read_only(settings: ServerSettings) -> bool:
    """Without `espn serve` (which decides it once): read-only when the index cannot be written."""
    reason = read_only_reason(settings.index)
    if reason is not None:
        logger.warning("serving %s read-only: %s; writes get 409", settings.index, reason)
    return reason is not None


async def open_index(state: AppState, encoders: SharedEncoders) -> None:
    """Open the state's index (its encoder shared through `encoders`) and start its search service."""
    settings = state.settings

    def loader(directory: Path, entry: Any) -> Any:
        key, encoder = encoders.acquire(directory, entry, settings.device, settings.trust_remote_code)
        state.encoder_key = key
        return encoder

    try:
        searcher = await asyncio.to_thread(open_searcher, settings, loader)
    except BaseException:
        _release_encoder(state, encoders)
        raise
    if state.lazy:  # `espn serve` decided the default's once; --read-only holds for every index
        state.read_only = True if settings.read_only else _read_only(settings)
    else:
        state.read_only = settings.read_only if settings.read_only is not None else _read_only(settings)
    if state.lazy and settings.snapshot_dir is not None:  # --snapshot-dir/NAME: what killed snapshots left
        await asyncio.to_thread(_snapshot_dir_ready, settings.snapshot_dir)
    state.live = LiveSearcher(searcher)
    state.search = SearchService(state.live, settings, state.metrics)
    state.search.start()
    state.documents = searcher.num_documents
    state.metrics.set_index(state.name, True, searcher.num_documents)


async def close_index(state: AppState, encoders: SharedEncoders) -> None:
    """Search what is queued, publish what was accepted, close the index and give back its encoder."""
    if state.search is not None:
        await state.search.close()
    if state.writes is not None:  # what was accepted is published before the index closes
        await asyncio.to_thread(state.writes.close)
        state.writes = None
    if state.publisher is not None:  # ... and uploaded, when the store answers
        await asyncio.to_thread(state.publisher.stop)
    if state.live is not None:
        state.documents = state.live.current.num_documents
        state.live.close()
    state.live, state.search = None, None
    _release_encoder(state, encoders)
    state.metrics.set_index(state.name, False, state.documents or 0)


def _snapshot_dir_ready(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    removed = remove_leftovers(directory)
    if removed:
        logger.info("removed leftovers of killed snapshots", extra={"removed": removed})


def _release_encoder(state: AppState, encoders: SharedEncoders) -> None:
    if state.encoder_key is not None:
        encoders.release(state.encoder_key)
        state.encoder_key = None


def _encoder_name(path: Path) -> str:
    try:
        entry = json.loads((path / "manifest.json").read_text())["encoder"]
        return f"{entry.get('kind', '?')}:{entry.get('name', '?')}"
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"


def _built_documents(path: Path) -> int:
    try:
        return int(json.loads((path / "manifest.json").read_text())["counts"]["documents"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


class IndexRegistry:
    """Every index the app holds by name, the default first; opens and closes the lazy ones."""

    def __init__(self, default: AppState, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.encoders = SharedEncoders()
        named = settings.index_map()
        self.default_name = next(iter(named))
        default.name = self.default_name
        self.states: dict[str, AppState] = {}
        self.encoder_names = {name: _encoder_name(path) for name, path in named.items()}
        for name, path in named.items():
            if name == self.default_name:
                self.states[name] = default
                continue
            update: dict[str, Any] = {"index": path}
            if settings.snapshot_dir is not None:
                update["snapshot_dir"] = settings.snapshot_dir / name
            self.states[name] = AppState(settings=settings.model_copy(update=update), metrics=metrics, name=name,
                                         lazy=True, documents=_built_documents(path))
        self._locks = {name: asyncio.Lock() for name in self.states}
        self._idle_task: Optional[asyncio.Task[None]] = None

    def __iter__(self) -> Iterator[AppState]:
        return iter(self.states.values())

    def get(self, name: str) -> AppState:
        state = self.states.get(name)
        if state is None:
            raise ApiError(404, f"no index named {name!r} on this server; GET /v1/indexes lists them",
                           code="not_found")
        return state

    async def enter(self, name: str) -> AppState:
        """The named index for one request, opened first if it is closed (or closing); pair with `leave`."""
        state = self.get(name)
        state.in_flight += 1
        try:
            if state.lazy and (state.live is None or state.closing):
                async with self._locks[name]:
                    if state.live is None:
                        logger.info("opening index", extra={"index": name, "path": str(state.settings.index)})
                        await open_index(state, self.encoders)
                        state.status, state.ready = "ready", True
        except BaseException:
            self.leave(state)
            raise
        return state

    def leave(self, state: AppState) -> None:
        state.in_flight -= 1
        state.last_used = time.monotonic()

    def describe(self) -> list[IndexInfo]:
        out = []
        for state in self:
            live = state.live
            searcher = live.current if live is not None else None
            out.append(IndexInfo(
                name=state.name, default=not state.lazy, open=searcher is not None and not state.closing,
                documents=searcher.num_documents if searcher is not None else state.documents or 0,
                generation=searcher.generation if searcher is not None else None,
                encoder=self.encoder_names[state.name],
                mode=None if searcher is None else "read-only" if state.read_only else "read-write"))
        return out

    def start(self, idle_close_s: float) -> None:
        """Close idle indexes in the background (idle_close_s > 0); call from the running loop."""
        if idle_close_s > 0 and len(self.states) > 1:
            self._idle_task = asyncio.create_task(self._close_idle_loop(idle_close_s), name="espn-index-idle")

    async def _close_idle_loop(self, idle_close_s: float) -> None:
        interval = min(max(idle_close_s / 4.0, 0.05), 5.0)
        while True:
            await asyncio.sleep(interval)
            await self.close_idle(idle_close_s)

    async def close_idle(self, idle_close_s: float) -> None:
        """Close every lazy index open, unused now and for idle_close_s seconds."""
        now = time.monotonic()
        for state in self:
            if (not state.lazy or state.live is None or state.closing or state.in_flight
                    or now - state.last_used < idle_close_s):
                continue
            state.closing = True  # on the loop, before any await: a request arriving now waits and reopens
            try:
                async with self._locks[state.name]:
                    logger.info("closing idle index", extra={"index": state.name, "idle_s": round(now - state.last_used, 1)})
                    state.ready, state.status = False, "closed"
                    await close_index(state, self.encoders)
            except Exception:
                logger.exception("closing the idle index %s failed", state.name)
            finally:
                state.closing = False

    async def close(self) -> None:
        """Stop closing idle indexes and close every lazy one (the app's lifespan closes the default)."""
        if self._idle_task is not None:
            self._idle_task.cancel()
            await asyncio.gather(self._idle_task, return_exceptions=True)
        for state in self:
            if state.lazy and state.live is not None:
                async with self._locks[state.name]:
                    state.ready, state.status = False, "draining"
                    await close_index(state, self.encoders)


class IndexRoutes:
    """`/v1/indexes/{name}/<route>` -> `/v1/<route>` with the named index's state (see the module doc).

    A name the server does not hold is a 404 (`not_found`); a path under an index that is no
    index route is a 404 too. Sits inside the API-key check, so the key guards every index."""

    def __init__(self, app: ASGIApp, registry: IndexRegistry) -> None:
        self.app = app
        self.registry = registry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(INDEX_PREFIX):
            await self.app(scope, receive, send)
            return
        name, sep, tail = path[len(INDEX_PREFIX):].partition("/")
        if not sep or not tail:  # /v1/indexes/{name}: a route of its own
            await self.app(scope, receive, send)
            return
        raw_prefix = f"{INDEX_PREFIX}{name}/".encode()
        raw_path: bytes = scope.get("raw_path") or path.encode()
        try:
            if tail.split("/", 1)[0] not in INDEX_ROUTES or not raw_path.startswith(raw_prefix):
                self.registry.get(name)  # an unknown index is named as such first
                raise ApiError(404, f"no route {path!r}: an index has {', '.join(sorted(INDEX_ROUTES))} under "
                                    f"{INDEX_PREFIX}{{name}}/", code="not_found")
            state = await self.registry.enter(name)
        except ApiError as exc:
            await error_response(exc.status_code, exc.code, exc.message, headers=exc.headers)(scope, receive, send)
            return
        except (EspnError, OSError) as exc:  # the index would not open (damaged, removed since start-up)
            logger.error("index %s could not be opened: %s", name, exc)
            await error_response(503, "unavailable", f"index {name!r} could not be opened: {exc}",
                                 headers={"Retry-After": "5"})(scope, receive, send)
            return
        try:
            state.metrics.index_requests.labels(name).inc()
            inner = dict(scope)
            inner["path"] = "/v1/" + tail
            inner["raw_path"] = b"/v1/" + raw_path[len(raw_prefix):]
            inner[INDEX_STATE_KEY] = state
            await self.app(inner, receive, send)
        finally:
            self.registry.leave(state)
