"""How long a read engine keeps trying (retries, back-off, the stuck-read timeout)."""

from __future__ import annotations

import dataclasses
import time

from ...errors import InvalidParameterError

__all__ = ["IoLimits"]


@dataclasses.dataclass(frozen=True)
class IoLimits:
    """How long an engine keeps trying before a read fails.

    max_retries:   transient failures one read (or one syscall that makes no progress) may
                   see before it fails with a ReadError naming the errno
    backoff_s:     first pause after a transient failure; doubles per retry ...
    max_backoff_s: ... up to this (32 retries take about 0.5 s in all)
    timeout_s:     a wait that sees no completion for this long cancels what is in flight
                   and fails with ETIMEDOUT; `close` waits this long for other threads'
                   reads to drain before it leaves their buffers quarantined
    """

    max_retries: int = 32
    backoff_s: float = 50e-6
    max_backoff_s: float = 0.02
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise InvalidParameterError(f"max_retries must be an integer >= 0, got {self.max_retries!r}")
        for name in ("backoff_s", "max_backoff_s", "timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidParameterError(f"{name} must be a number > 0, got {value!r}")

    def pause(self, attempt: int) -> None:
        """Sleep before retry number `attempt` (1, 2, ...) of a transient failure."""
        time.sleep(min(self.max_backoff_s, self.backoff_s * (1 << min(attempt - 1, 30))))
