"""One JSON object per log line, for the server's own logs and uvicorn's."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable

__all__ = ["JsonFormatter", "RepeatFilter", "logging_config", "ACCESS_LOGGER"]

ACCESS_LOGGER = "espn.server.access"

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "msg", ...extra fields}` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_") and key not in ("color_message",):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class RepeatFilter(logging.Filter):
    """At most `burst` records of one message (logger, level and format string) per `period_s`,
    for warnings and above: an error repeated thousands of times a second (asyncio's
    "socket.accept() out of system resource") cannot fill a disk. The first record let through
    after a quiet period carries `suppressed`: how many like it were dropped before."""

    def __init__(self, burst: int = 5, period_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst, self.period_s, self.clock = burst, period_s, clock
        self._seen: dict[tuple[str, int, str], list[float]] = {}  # -> [window start, let through, dropped]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        with self._lock:
            window = self._seen.get(key)
            if window is None or now - window[0] >= self.period_s:
                if window is not None and window[2]:
                    record.suppressed = int(window[2])
                if len(self._seen) >= 1024:  # bounded, whatever the messages
                    self._seen.clear()
                self._seen[key] = [now, 1, 0]
                return True
            if window[1] < self.burst:
                window[1] += 1
                return True
            window[2] += 1
            return False


def logging_config(level: str) -> dict[str, Any]:
    """A logging.config.dictConfig for uvicorn's `log_config`: applied in every worker."""
    level = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "filters": {"repeats": {"()": RepeatFilter}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr",
                                "filters": ["repeats"]}},
        "loggers": {
            "": {"handlers": ["stderr"], "level": level},
            "uvicorn": {"handlers": [], "level": level, "propagate": True},
            "uvicorn.error": {"handlers": [], "level": level, "propagate": True},
            # Our access middleware logs each request once, with more fields.
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
    }
