"""The indexes of a process by name (`Registry`, the Engines protocol): each through its lifecycle.

The default index (the first of the config's) opens at `start` and warms in the background;
every other index opens at its first request (`use`) and, with `idle_close_s`, closes after
that long without one. Before an index opens, room is made for it within the memory budget
(espn.engine.memory). Indexes whose encoder is the same hold one loaded model per process
(espn.encoders.shared). With an index root, a name this process does not hold is looked up
there, and an index whose directory is gone is a 404 that closes it: what one process
creates or deletes (espn.engine.admin), the others see.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Optional

from ..encoders.shared import SharedEncoders
from ..errors import EspnError, IndexNotFoundError, ShuttingDownError, UnavailableError
from ..files.index_directory import is_index_directory
from ..index import encoder_label
from ..live.create import EncoderFiles, live_documents
from ..live.status import fit_status
from ..pages.memory import configure_process_page_memory
from .admin import create_index, delete_index
from .config import ServeConfig
from .lifecycle import SERVING
from .memory import make_room
from .messages import IndexInfo, IndexLimits, Lifecycle, Readiness
from .protocol import Engine, Observer
from .rules import RULES
from .served import ServedIndex

__all__ = ["Registry"]

logger = logging.getLogger(__name__)


def _fit_status(path: Path) -> Optional[Mapping[str, Any]]:
    try:
        return fit_status(path)
    except (EspnError, OSError, ValueError, KeyError, TypeError):  # a listing never fails on one index
        return None


def _built_documents(path: Path) -> int:
    try:
        return live_documents(path)
    except (EspnError, OSError, ValueError, KeyError, TypeError):
        return 0


class Registry:
    """Every index the process holds by name, the default first (see the module doc)."""

    def __init__(self, config: ServeConfig, observer: Observer) -> None:
        self.config, self.observer = config, observer
        self.encoders = SharedEncoders()
        self.held: dict[str, ServedIndex] = {}
        self.encoder_names: dict[str, str] = {}
        for name, path in config.indexes.items():
            self.hold(name, path, default=name == config.default_name)
        self.creating: set[str] = set()  # names being created in this process now
        self.templates: dict[str, EncoderFiles] = {}  # configured model -> its saved files in the root
        self._model_locks: dict[str, asyncio.Lock] = {}
        self._inside = 0  # requests inside any index of this registry
        self._started = self._closing = False
        self._warm: Optional[asyncio.Task[None]] = None
        self._idle: Optional[asyncio.Task[None]] = None
        self._drops: set[asyncio.Future[None]] = set()

    @property
    def default_name(self) -> Optional[str]:
        return self.config.default_name

    @property
    def root(self) -> Optional[Path]:
        return self.config.root

    def hold(self, name: str, path: Path, default: bool = False) -> ServedIndex:
        """Hold the index at `path` as `name` (closed: it opens at its first request, or at start)."""
        config = self.config.index_config(name)
        if config.snapshot_dir is not None and not default:
            config = config.replace(snapshot_dir=config.snapshot_dir / name)
        served = ServedIndex(name, path, config, self.observer, default=default, quiet=self._quiet,
                             documents=_built_documents(path))
        self.held[name] = served
        self.encoder_names[name] = encoder_label(path)
        return served

    def model_lock(self, model: str) -> asyncio.Lock:
        """One load of a configured model at a time (espn.engine.admin)."""
        return self._model_locks.setdefault(model, asyncio.Lock())

    def forget(self, name: str) -> None:
        """Stop holding a (closed) index: deleted, here or by another process."""
        self.held.pop(name, None)
        self.encoder_names.pop(name, None)
        self.observer.forget_index(name)

    def _quiet(self) -> bool:
        """Nothing else is in progress in this process: a lone search may run on the event loop."""
        return self._inside <= 1

    # -- start and stop ------------------------------------------------------------------

    async def start(self) -> None:
        # This process's page memory, for every index it serves (a process holds one registry).
        configure_process_page_memory(self.config.index.page_memory_bytes)
        self.observer.set_ready(False)
        default = self._default()
        if default is not None:
            await self._open(default, warm=True)
        else:
            self.observer.set_ready(True)
        self._started = True
        idle_s = self.config.idle_close_s
        if idle_s > 0 and (len(self.held) > 1 or self.root is not None):
            self._idle = asyncio.create_task(self._close_idle_loop(idle_s), name="espn-index-idle")

    async def close(self) -> None:
        """Stop closing idle indexes; close every index, the default last."""
        self._closing = True
        self.observer.set_ready(False)
        for task in (self._idle, self._warm):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for served in sorted(self.held.values(), key=lambda s: s.default):
            await self.close_one(served, "shutting down")

    # -- requests -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def use(self, name: Optional[str] = None) -> AsyncIterator[Engine]:
        """The named index (None: the default) for one request, opened first if it is closed."""
        served = self._lookup(name)
        served.life.enter()
        self._inside += 1
        try:
            await self._until_serving(served)
            if name is not None:
                self.observer.count_index_request(served.name)
            yield served
        finally:
            self._inside -= 1
            served.last_used = time.monotonic()
            served.life.leave()

    def _lookup(self, name: Optional[str]) -> ServedIndex:
        if name is None:
            if self.default_name is None:
                raise IndexNotFoundError("this server has no default index: name one, /v1/indexes/{name}/... "
                                         "(GET /v1/indexes lists them)")
            name = self.default_name
        served = self.held.get(name)
        if served is None and self.root is not None and RULES.index_name_problem(name) is None \
                and is_index_directory(self.root / name):
            served = self.hold(name, (self.root / name).resolve())  # created by another process
        if served is not None and self._gone(served) and served.life.state is not Lifecycle.DELETING:
            drop = asyncio.ensure_future(self._drop(served))  # deleted by another process
            self._drops.add(drop)  # held until done: the loop keeps only a weak reference to a task
            drop.add_done_callback(self._drops.discard)
        if served is None or self._gone(served):
            raise IndexNotFoundError(f"no index named {name!r} on this server; GET /v1/indexes lists them")
        return served

    def _gone(self, served: ServedIndex) -> bool:
        """Whether an index's directory was removed (deleted by this process or another)."""
        return served.life.state in (Lifecycle.DELETING, Lifecycle.GONE) or \
            (not served.default and not is_index_directory(served.path))

    async def _until_serving(self, served: ServedIndex) -> None:
        while True:
            state = served.life.state
            if state in SERVING:
                return
            if state in (Lifecycle.DELETING, Lifecycle.GONE):
                raise IndexNotFoundError(f"no index named {served.name!r} on this server (deleted)")
            if self._closing:
                raise ShuttingDownError("the server is shutting down")
            if state is Lifecycle.CLOSED:
                if served.default and not self._started:
                    raise UnavailableError(f"index {served.name!r} is not open yet (starting)", retry_after_s=5)
                await self._open(served)
                continue
            await served.life.wait_until(lambda life: life.state is not state)  # opening or closing

    async def _open(self, served: ServedIndex, warm: bool = False) -> None:
        async with served.lock:
            if served.life.state is not Lifecycle.CLOSED:
                return  # another request opened it meanwhile
            await make_room(list(self.held.values()), served, self.config.memory_budget_mib, self.close_one)
            logger.info("opening index", extra={"index": served.name, "path": str(served.path)})
            served.life.move(Lifecycle.OPENING)
            try:
                await served.open(self.encoders)
            except BaseException:
                served.life.move(Lifecycle.CLOSED)
                raise
            if warm:
                served.life.move(Lifecycle.WARMING)
                self._warm = asyncio.create_task(self._warm_up(served), name="espn-warmup")
            else:
                served.life.move(Lifecycle.READY)

    async def _warm_up(self, served: ServedIndex) -> None:
        try:
            if served.config.warmup:
                await asyncio.to_thread(served.warm)
        except Exception:
            logger.exception("warm-up failed; the index is not ready")
            return
        served.life.move(Lifecycle.READY)
        self.observer.set_ready(True)
        logger.info("ready", extra={"index": str(served.path), "documents": served.documents,
                                    "generation": served.generation, "read_only": served.read_only})

    async def close_one(self, served: ServedIndex, reason: str) -> None:
        """Close an open index (idle, over the memory budget, deleted elsewhere, shutting down):
        requests arriving meanwhile wait and open it again; queued ones are answered."""
        if served.life.state not in SERVING:
            return
        served.life.move(Lifecycle.CLOSING)
        async with served.lock:
            logger.info("closing index", extra={"index": served.name, "reason": reason})
            try:
                await served.close(self.encoders)
            except Exception:
                logger.exception("closing the index %s failed", served.name)
            finally:
                served.life.move(Lifecycle.CLOSED)

    async def _drop(self, served: ServedIndex) -> None:
        """Close (once no request is inside) and forget an index another process deleted."""
        await served.life.wait_until(lambda life: life.inside == 0)
        await self.close_one(served, "deleted")
        if self.held.get(served.name) is served:
            self.forget(served.name)

    async def _close_idle_loop(self, idle_s: float) -> None:
        interval = min(max(idle_s / 4.0, 0.05), 5.0)
        while True:
            await asyncio.sleep(interval)
            await self.close_idle(idle_s)

    async def close_idle(self, idle_s: float) -> None:
        """Close every index but the default that is open and unused now, and for idle_s seconds."""
        now = time.monotonic()
        for served in list(self.held.values()):
            if served.default or served.life.state is not Lifecycle.READY or served.life.inside:
                continue
            if self._gone(served) or now - served.last_used >= idle_s:
                await self.close_one(served, "deleted" if self._gone(served) else "idle")

    # -- what the registry tells ------------------------------------------------------------

    def refresh(self) -> None:
        """Hold what another process created in the index root since."""
        if self.root is None:
            return
        for name, path in ServeConfig.indexes_under(self.root).items():
            if name not in self.held:
                self.hold(name, path)

    def describe(self) -> list[IndexInfo]:
        self.refresh()
        out = []
        for served in list(self.held.values()):
            if self._gone(served):
                if served.life.state is Lifecycle.CLOSED:
                    self.forget(served.name)
                continue
            out.append(self._info(served))
        return out

    def info(self, name: str) -> IndexInfo:
        return self._info(self._lookup(name))

    def _info(self, served: ServedIndex) -> IndexInfo:
        live = served.live
        return IndexInfo(name=served.name, default=served.default, state=served.life.state,
                         documents=live.current.searchable_documents if live is not None else served.documents,
                         encoder=self.encoder_names[served.name], generation=served.generation,
                         read_only=served.read_only if live is not None else None,
                         memory_bytes=served.estimate_memory(), fit=_fit_status(served.path))

    def readiness(self) -> Readiness:
        if self.default_name is None:
            state = Lifecycle.READY if self._started and not self._closing else Lifecycle.CLOSED
            return Readiness(ready=state is Lifecycle.READY, state=state)
        return self.held[self.default_name].readiness()

    def replication(self) -> Optional[Mapping[str, Any]]:
        default = self._default()
        return default.replication() if default is not None else None

    def limits(self) -> Optional[IndexLimits]:
        default = self._default()
        return default.limits() if default is not None else None

    def _default(self) -> Optional[ServedIndex]:
        return self.held.get(self.default_name) if self.default_name is not None else None

    # -- creation and deletion (espn.engine.admin) -------------------------------------------

    async def create(self, name: str, model: str) -> IndexInfo:
        return self._info(await create_index(self, name, model))

    async def delete(self, name: str) -> None:
        await delete_index(self, name)
