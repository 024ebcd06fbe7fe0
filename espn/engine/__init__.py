"""The library's one door for the programs that serve it: the HTTP server, the router, the CLI.

An entry point opens a registry of named indexes (`open_engines`) and asks each index, as an
`Engine`, for searches, documents, writes and snapshots, passing and receiving the plain
dataclasses declared here; `RULES` states what the library accepts from outside; a router
places ids and fuses partitions through `PARTITIONS` and follows a shard map on object storage
through `ShardMapView`. Nothing an entry point needs lies behind it (tests/test_code_layout.py
holds the server to this module and `espn.errors`), and nothing here is a re-export of the
library's internals: the engine's implementation (espn.engine.registry and below) loads torch
and FAISS only when the first registry opens, so importing the door stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..live.checks import NewDocument, WriteResult
from ..results import Document
from .config import DEFAULT_INDEX_NAME, IndexConfig, ServeConfig
from .messages import (IndexInfo, IndexLimits, Lifecycle, QueryAnswer, Readiness, SearchAnswer, SearchOptions,
                       SnapshotInfo)
from .partitions import PARTITIONS, ShardMapView
from .protocol import Engine, Engines, NullObserver, Observer
from .rules import RULES

if TYPE_CHECKING:
    from .preflight import Startup

__all__ = [
    # opening a registry, and what it is asked
    "open_engines", "Engines", "Engine", "Observer", "ServeConfig", "IndexConfig", "DEFAULT_INDEX_NAME",
    # what goes in and out
    "SearchOptions", "SearchAnswer", "QueryAnswer", "Document", "NewDocument", "WriteResult", "SnapshotInfo",
    "IndexInfo", "IndexLimits", "Lifecycle", "Readiness",
    # what the library accepts from outside, a router's partitioning and shard maps, the once-per-server steps
    "RULES", "PARTITIONS", "ShardMapView", "startup",
]


def open_engines(config: ServeConfig, observer: Optional[Observer] = None) -> Engines:
    """A registry of the config's indexes (nothing opens until `start`, or a request)."""
    # The registry loads torch and FAISS: imported with the first registry, not with the door.
    from .registry import Registry

    return Registry(config, observer if observer is not None else NullObserver())


def startup() -> "type[Startup]":
    """The steps a serving process takes once before its workers start (espn.engine.preflight)."""
    # FAISS and the live index's modules: loaded by the serving command only, not with the door.
    from .preflight import Startup

    return Startup
