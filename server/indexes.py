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
per worker. With an index root (server.index_admin creates and deletes indexes there), a name
a worker does not hold is looked up in the root, and an index whose directory is gone is a 404
that closes it: what one worker creates or deletes, the others see. Before an index opens,
server.index_budget makes room for it within `--index-memory-budget`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from starlette.types import ASGIApp, Receive, Scope, Send

from espn.errors import EspnError
from espn.service import LiveSearcher, encoder_label, is_index_directory, live_documents, read_only_reason
from espn.service import remove_snapshot_leftovers as remove_leftovers

from .deps import INDEX_STATE_KEY, AppState
from .errors import ApiError, error_response
from .index_budget import estimate_bytes, make_room
from .metrics import ServerMetrics
from .schemas import IndexInfo
from .search_service import SearchService, open_searcher
from .settings import ServerSettings
from .index_names import INDEX_NAME, indexes_under
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
    state.documents = searcher.searchable_documents
    state.metrics.set_index(state.name, True, state.documents)
    state.memory_bytes = await asyncio.to_thread(estimate_bytes, settings)
    state.metrics.set_index_memory(state.name, state.memory_bytes)


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
        state.documents = state.live.current.searchable_documents
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


def _built_documents(path: Path) -> int:
    try:
        return live_documents(path)
    except (EspnError, OSError, ValueError, KeyError, TypeError):
        return 0


class IndexRegistry:
    """Every index the app holds by name, the default first; opens and closes the lazy ones."""

    def __init__(self, default: AppState, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.encoders = SharedEncoders()
        self.settings, self.metrics = settings, metrics
        #: Where indexes are created and deleted over HTTP (None: they are not), and with what encoders.
        self.root, self.models = settings.creation_root(), settings.model_map()
        named = settings.index_map()
        self.default_name = next(iter(named))
        default.name = self.default_name
        default.settings = settings.model_copy(update={"ram_mib": settings.ram_mib_for(self.default_name, settings.ram_mib)})
        self.states: dict[str, AppState] = {self.default_name: default}
        self.encoder_names = {self.default_name: encoder_label(named[self.default_name])}
        self._locks: dict[str, asyncio.Lock] = {self.default_name: asyncio.Lock()}
        for name, path in named.items():
            if name != self.default_name:
                self.add(name, path)
        self._idle_task: Optional[asyncio.Task[None]] = None
        self._drops: set[asyncio.Future[None]] = set()

    def add(self, name: str, path: Path) -> AppState:
        """Hold the index at `path` (closed: it opens at its first request) as `name`."""
        update: dict[str, Any] = {"index": path, "ram_mib": self.settings.ram_mib_for(name, self.settings.ram_mib)}
        if self.settings.snapshot_dir is not None:
            update["snapshot_dir"] = self.settings.snapshot_dir / name
        state = AppState(settings=self.settings.model_copy(update=update), metrics=self.metrics, name=name,
                         lazy=True, documents=_built_documents(path))
        self.states[name] = state
        self.encoder_names[name] = encoder_label(path)
        self._locks.setdefault(name, asyncio.Lock())
        return state

    def forget(self, name: str) -> None:
        """Stop holding a (closed) index: deleted, here or by another worker."""
        self.states.pop(name, None)
        self.encoder_names.pop(name, None)
        self.metrics.forget_index(name)

    async def _drop(self, state: AppState) -> None:
        """Close (once no request is inside) and forget an index another worker deleted."""
        while state.in_flight:
            await asyncio.sleep(0.05)
        await self.close_one(state, "deleted")
        if self.states.get(state.name) is state:
            self.forget(state.name)

    def lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def refresh(self) -> None:
        """Hold what another worker created in the index root since (a directory with a manifest)."""
        if self.root is None:
            return
        for name, path in indexes_under(self.root).items():
            if name not in self.states and INDEX_NAME.match(name):
                self.add(name, path)

    @staticmethod
    def gone(state: AppState) -> bool:
        """Whether an index's directory was removed (deleted by a worker, this one or another)."""
        return state.deleting or (state.lazy and not is_index_directory(state.settings.index))

    def __iter__(self) -> Iterator[AppState]:
        return iter(self.states.values())

    def get(self, name: str) -> AppState:
        state = self.states.get(name)
        if state is None and self.root is not None and INDEX_NAME.match(name) \
                and is_index_directory(self.root / name):
            state = self.add(name, (self.root / name).resolve())  # created by another worker
        if state is not None and self.gone(state) and not state.deleting:  # deleted by another worker
            drop = asyncio.ensure_future(self._drop(state))
            self._drops.add(drop)  # held until done: the loop keeps only a weak reference to a task
            drop.add_done_callback(self._drops.discard)
        if state is None or self.gone(state):
            raise ApiError(404, f"no index named {name!r} on this server; GET /v1/indexes lists them",
                           code="not_found")
        return state

    async def enter(self, name: str) -> AppState:
        """The named index for one request, opened first if it is closed (or closing); pair with `leave`."""
        state = self.get(name)
        state.in_flight += 1
        try:
            if state.lazy and (state.live is None or state.closing):
                async with self.lock(name):
                    if self.gone(state):  # deleted while this request waited
                        raise ApiError(404, f"no index named {name!r} on this server (deleted)", code="not_found")
                    if state.live is None:
                        await make_room(self, state)
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
        self.refresh()
        out = []
        for state in list(self):
            if self.gone(state):
                if state.live is None and not state.deleting:
                    self.forget(state.name)
                continue
            live = state.live
            searcher = live.current if live is not None else None
            out.append(IndexInfo(
                name=state.name, default=not state.lazy, open=searcher is not None and not state.closing,
                documents=searcher.searchable_documents if searcher is not None else state.documents or 0,
                generation=searcher.generation if searcher is not None else None,
                encoder=self.encoder_names[state.name],
                mode=None if searcher is None else "read-only" if state.read_only else "read-write",
                memory_mib=round(self.memory_bytes(state) / 2**20, 3)))
        return out

    def memory_bytes(self, state: AppState) -> int:
        """The estimate of what the index holds when open (server.index_budget)."""
        if state.memory_bytes is None:
            state.memory_bytes = estimate_bytes(state.settings)
        return state.memory_bytes

    def start(self, idle_close_s: float) -> None:
        """Close idle indexes in the background (idle_close_s > 0); call from the running loop."""
        if idle_close_s > 0 and (len(self.states) > 1 or self.root is not None):
            self._idle_task = asyncio.create_task(self._close_idle_loop(idle_close_s), name="espn-index-idle")

    async def _close_idle_loop(self, idle_close_s: float) -> None:
        interval = min(max(idle_close_s / 4.0, 0.05), 5.0)
        while True:
            await asyncio.sleep(interval)
            await self.close_idle(idle_close_s)

    async def close_idle(self, idle_close_s: float) -> None:
        """Close every lazy index open, unused now and for idle_close_s seconds."""
        now = time.monotonic()
        for state in list(self):
            if not state.lazy or state.live is None or state.closing or state.in_flight:
                continue
            if self.gone(state) or now - state.last_used >= idle_close_s:
                await self.close_one(state, "deleted" if self.gone(state) else "idle", round(now - state.last_used, 1))

    async def close_one(self, state: AppState, reason: str, idle_s: float = 0.0) -> None:
        """Close an open lazy index with no request inside (idle, over the memory budget, deleted)."""
        state.closing = True  # on the loop, before any await: a request arriving now waits and reopens
        try:
            async with self.lock(state.name):
                if state.live is not None:
                    logger.info("closing index", extra={"index": state.name, "reason": reason, "idle_s": idle_s})
                    state.ready, state.status = False, "closed"
                    await close_index(state, self.encoders)
        except Exception:
            logger.exception("closing the index %s failed", state.name)
        finally:
            state.closing = False

    async def close(self) -> None:
        """Stop closing idle indexes and close every lazy one (the app's lifespan closes the default)."""
        if self._idle_task is not None:
            self._idle_task.cancel()
            await asyncio.gather(self._idle_task, return_exceptions=True)
        for state in list(self):
            if state.lazy and state.live is not None:
                async with self.lock(state.name):
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
