"""The time a generation, a base or a build's progress records: UTC, to the second, ISO 8601."""

from __future__ import annotations

import time

__all__ = ["utc_now"]


def utc_now() -> str:
    """The time a generation or a base records: UTC, to the second, ISO 8601."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
