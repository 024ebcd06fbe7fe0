"""Read engines under the posix reader, best first: `io_uring`, then Linux AIO, then threads.

`open_engine(None)` takes the first one this host allows and says in one log line why it
passed over the others (containers' default seccomp profiles refuse io_uring; the
`kernel.io_uring_disabled` sysctl may be set). Naming an engine forces it, and fails with
the reason where it cannot run.
"""

from __future__ import annotations

import logging

from ...errors import BackendUnavailableError, InvalidParameterError
from .aio import AioEngine
from .base import EngineRead, ReadEngine
from .errors import EngineUnavailable, OwnershipError, ReadError, StoreClosedError
from .faults import FaultInjector, inject_faults
from .limits import IoLimits
from .ownership import OwnershipPolicy, set_ownership_policy
from .threads import ThreadsEngine
from .uring import UringEngine

__all__ = ["ENGINES", "ENGINE_ORDER", "EngineRead", "EngineUnavailable", "FaultInjector", "IoLimits", "OwnershipError",
           "OwnershipPolicy", "ReadEngine", "ReadError", "StoreClosedError", "inject_faults", "open_engine",
           "set_ownership_policy"]

logger = logging.getLogger(__name__)

#: Engines by name, best first.
ENGINES: dict[str, type[ReadEngine]] = {cls.name: cls for cls in (UringEngine, AioEngine, ThreadsEngine)}
ENGINE_ORDER = tuple(ENGINES)


def open_engine(name: str | None = None, depth: int | None = None, limits: IoLimits | None = None) -> ReadEngine:
    """The engine called `name`, or (None / "auto") the best one this host allows."""
    options: dict = {} if depth is None else {"depth": depth}
    if limits is not None:
        options["limits"] = limits
    if name not in (None, "auto"):
        if name not in ENGINES:
            raise InvalidParameterError(f"unknown io engine {name!r}; choose one of auto, {', '.join(ENGINES)}")
        cls = ENGINES[name]
        reason = cls.unavailable_reason()
        if reason is None:
            try:
                return cls(**options)
            except EngineUnavailable as exc:
                reason = str(exc)
        raise BackendUnavailableError(f"io engine {name!r} cannot run here: {reason}")
    passed_over: list[str] = []
    for cls in ENGINES.values():
        reason = cls.unavailable_reason()
        if reason is None:
            try:
                engine = cls(**options)
            except EngineUnavailable as exc:
                reason = str(exc)
            else:
                if passed_over:
                    logger.info("io engine %s (passed over: %s)", engine.name, "; ".join(passed_over))
                return engine
        passed_over.append(f"{cls.name}: {reason}")
    raise BackendUnavailableError("no io engine can run here: " + "; ".join(passed_over))
