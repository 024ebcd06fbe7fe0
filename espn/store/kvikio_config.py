"""The process-wide kvikio settings the kvikio reader asks for, and their defaults (the
module doc of `espn.store.kvikio` says why each value)."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

from ..errors import InvalidParameterError
from .extents import DEFAULT_MAX_EXTENT_BYTES

__all__ = ["KvikioConfig", "DEFAULT_NTHREADS", "DEFAULT_GDS_THRESHOLD", "DEFAULT_TASK_SIZE",
           "DEFAULT_BOUNCE_BUFFER_SIZE"]

#: kvikio thread-pool size: extents in flight at once (kvikio's own default is 1).
DEFAULT_NTHREADS = 16
#: Reads of at least this many bytes go to the thread pool (cuFile / GDS); smaller ones take
#: kvikio's synchronous POSIX shortcut in the caller's thread. One 4 KiB block is at it.
DEFAULT_GDS_THRESHOLD = 4096
#: kvikio splits one read into tasks of this size; = the extent cap, so one task per extent.
DEFAULT_TASK_SIZE = DEFAULT_MAX_EXTENT_BYTES
#: Pinned host bounce buffer per thread in compatibility mode; one task fits in one.
DEFAULT_BOUNCE_BUFFER_SIZE = DEFAULT_MAX_EXTENT_BYTES

_COMPAT_MODES = ("on", "off", "auto")


@dataclasses.dataclass(frozen=True)
class KvikioConfig:
    """The process-wide kvikio settings a reader asks for (None: leave kvikio's value)."""

    nthreads: int = DEFAULT_NTHREADS
    gds_threshold: int = DEFAULT_GDS_THRESHOLD
    task_size: int = DEFAULT_TASK_SIZE
    bounce_buffer_size: int | None = DEFAULT_BOUNCE_BUFFER_SIZE
    compat_mode: str | None = None

    def __post_init__(self) -> None:
        def check(name: str, value: Any, low: int, high: int | None = None, optional: bool = False) -> None:
            if value is None and optional:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                bound = f"in [{low}, {high}]" if high else f">= {low}"
                raise InvalidParameterError(f"{name} must be an integer {bound}, got {value!r}")

        check("nthreads", self.nthreads, 1, 1024)
        check("gds_threshold", self.gds_threshold, 0)
        check("task_size", self.task_size, 4096)
        check("bounce_buffer_size", self.bounce_buffer_size, 4096, optional=True)
        if self.compat_mode is not None and self.compat_mode not in _COMPAT_MODES:
            raise InvalidParameterError(
                f"compat_mode must be one of {', '.join(_COMPAT_MODES)} or None, got {self.compat_mode!r}"
            )

    def settings(self, kvikio: ModuleType) -> dict[str, Any]:
        """The `kvikio.defaults.set` dictionary (keys as kvikio 26.x names them)."""
        out: dict[str, Any] = {
            "num_threads": self.nthreads,
            "gds_threshold": self.gds_threshold,
            "task_size": self.task_size,
        }
        if self.bounce_buffer_size is not None:
            out["bounce_buffer_size"] = self.bounce_buffer_size
        if self.compat_mode is not None:
            out["compat_mode"] = getattr(kvikio.CompatMode, self.compat_mode.upper())
        return out
