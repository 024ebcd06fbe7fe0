"""Where the router sends each request: the partitions, each partition's replicas and its writer.

Two sources, one interface (`Routing`):
- `StaticRouting`: the flags. `--shards` lists one entry per partition, in partition order,
  each a URL or several replicas joined by `|`; `--writers` one writer per partition. Ids are
  placed by the build's hash rule (fnv1a64 mod S), which each writer's /readyz is checked against.
- `MapRouting`: a shard map on object storage (`--shard-map s3://BUCKET/PREFIX`, read through
  espn.engine's ShardMapView): the partitions that own slots, each one's replicas (the servers that
  registered, followers first) and its writer (the holder of its lease). It is read at start
  and again every MAP_POLL_S (the map itself only when its ETag moved) in a background task,
  and at once when a writer says it is not the one or that an id is not its own. During a
  reshard a document can be in two partitions for a moment (copied to the target before the
  switch, dropped by the source after it): only the partition the map says owns its slot
  counts, so each id is answered once (`owned`).

A partition's searches go to its replicas in turn (round robin), and a replica that fails is
tried last for REPLICA_COOLDOWN_S, so one dead replica costs each search at most one failed
attempt, right after it dies, and none after (`Target.order`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import Optional, Protocol, Sequence

import numpy as np

from espn.engine import PARTITIONS, ShardMapView

from ..router_settings import RouterSettings

__all__ = ["MAP_POLL_S", "REPLICA_COOLDOWN_S", "Target", "Routing", "StaticRouting", "MapRouting", "routing_for"]

logger = logging.getLogger(__name__)

#: How often the router reads the shard map, the leases and the members again.
MAP_POLL_S = 2.0
#: How long a replica that failed is tried after the others.
REPLICA_COOLDOWN_S = 10.0
#: At most this often a writer's refusal makes the router read the cluster again at once.
_REFRESH_AT_MOST_S = 0.5


class Target:
    """One partition as searches see it: its replicas, tried in turn."""

    def __init__(self, partition: int, replicas: Sequence[str]) -> None:
        self.partition, self.replicas = partition, tuple(replicas)
        self._turn = itertools.count()
        self._failed: dict[str, float] = {}

    @property
    def name(self) -> str:
        """How an answer names the partition: its one URL, or its replicas joined by |."""
        return "|".join(self.replicas) or f"partition {self.partition}"

    def order(self) -> list[str]:
        """The replicas to try, in order: the next in turn first, the recently failed last."""
        if not self.replicas:
            return []
        start = next(self._turn) % len(self.replicas)
        turn = self.replicas[start:] + self.replicas[:start]
        now = time.monotonic()
        return sorted(turn, key=lambda url: now - self._failed.get(url, -1e18) < REPLICA_COOLDOWN_S)

    def failed(self, url: str) -> None:
        self._failed[url] = time.monotonic()


class Routing(Protocol):
    """What the routes ask of the cluster's layout."""

    @property
    def targets(self) -> list[Target]: ...

    @property
    def takes_writes(self) -> bool: ...

    @property
    def checks_layout(self) -> bool:
        """Whether a writer's /readyz partition must be checked before it gets a write (static only)."""

    def partition_count(self) -> int: ...

    def owner(self, doc_id: str) -> int: ...

    def writer(self, partition: int) -> Optional[str]: ...

    def owned(self, partition: int, ids: Sequence[str]) -> Optional[np.ndarray]:
        """[n] bool: which of these ids `partition` owns; None when every answer counts (static)."""

    async def refresh(self) -> None:
        """Read the layout again now (a writer said it is not the one, or not the owner)."""


class StaticRouting:
    """The flags' layout: --shards (replicas joined by |) and --writers, ids by the hash rule."""

    def __init__(self, shards: Sequence[str], writers: Sequence[str]) -> None:
        self._targets = [Target(p, entry.split("|")) for p, entry in enumerate(shards)]
        self._writers = list(writers)

    @property
    def targets(self) -> list[Target]:
        return self._targets

    @property
    def takes_writes(self) -> bool:
        return bool(self._writers)

    @property
    def checks_layout(self) -> bool:
        return True

    def partition_count(self) -> int:
        return len(self._targets)

    def owner(self, doc_id: str) -> int:
        return PARTITIONS.owner(doc_id, len(self._targets))

    def writer(self, partition: int) -> Optional[str]:
        return self._writers[partition]

    def owned(self, partition: int, ids: Sequence[str]) -> Optional[np.ndarray]:
        return None

    async def refresh(self) -> None:
        return None


class MapRouting:
    """The layout a shard map holds, kept current by `run` (a task of the router's lifespan)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.view: Optional[ShardMapView] = None
        self._targets: dict[int, Target] = {}
        self._lock = asyncio.Lock()
        self._read_at = 0.0

    async def start(self) -> None:
        """The first read: the router does not start without its map."""
        await self._read()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(MAP_POLL_S)
            try:
                await self._read()
            except Exception as exc:  # noqa: BLE001 - the store is away: route by what was read last
                logger.warning("reading the shard map at %s: %s (routing by version %s meanwhile)", self.url, exc,
                               self.view.version if self.view else "none")

    async def refresh(self) -> None:
        if time.monotonic() - self._read_at >= _REFRESH_AT_MOST_S:
            with contextlib.suppress(Exception):  # the caller's answer stands; the next poll tries again
                await self._read()

    async def _read(self) -> None:
        async with self._lock:
            view = await asyncio.to_thread(ShardMapView.read, self.url, self.view)
            if self.view is None or view.version != self.view.version:
                logger.info("shard map %s: version %d, partitions %s", self.url, view.version, view.partitions())
            targets = {}
            for partition in view.partitions():
                replicas = view.replicas(partition)
                known = self._targets.get(partition)
                # Kept while its replicas are the same: their turn and their failures carry over.
                targets[partition] = known if known is not None and known.replicas == tuple(replicas) else \
                    Target(partition, replicas)
            self.view, self._targets, self._read_at = view, targets, time.monotonic()

    def _view(self) -> ShardMapView:
        assert self.view is not None  # start() read it before the router took requests
        return self.view

    @property
    def targets(self) -> list[Target]:
        return [self._targets[p] for p in sorted(self._targets)]

    @property
    def takes_writes(self) -> bool:
        return True

    @property
    def checks_layout(self) -> bool:
        return False

    def partition_count(self) -> int:
        return len(self._targets)

    def owner(self, doc_id: str) -> int:
        return self._view().owner(doc_id)

    def writer(self, partition: int) -> Optional[str]:
        return self._view().writer(partition)

    def owned(self, partition: int, ids: Sequence[str]) -> Optional[np.ndarray]:
        return self._view().owned(partition, ids)


def routing_for(settings: RouterSettings) -> StaticRouting | MapRouting:
    return MapRouting(settings.shard_map) if settings.shard_map is not None else \
        StaticRouting(settings.shards, settings.writers)

