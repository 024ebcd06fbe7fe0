"""`--index-memory-budget MIB`: what an open index holds in memory, estimated, and making room for one.

The estimate of an index is its RAM plan as the library makes it (`espn.store.ram_plan`, from
`--ram-mib`/`--index-ram`): the size of the files its searches map into memory
(`espn.files.resident_bytes`: not the records, read from storage per query unless `--reader
mmap` maps them, nor the passages or the model, loaded once per worker for every index that
uses it, server.shared_encoders), plus its record cache (one copy, shared by the workers) or
the memory reader's table. The budget is per worker.

Before a closed index opens (server.indexes), `make_room` closes idle indexes (no request
inside), least recently used first, until the open ones plus the new one fit; the default
index counts but is never closed. If they still do not fit, the request gets a 503 with
`Retry-After` naming the budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from espn.service import plan_ram, resident_bytes

from .deps import AppState
from .errors import ServiceUnavailableError
from .settings import ServerSettings

if TYPE_CHECKING:
    from .indexes import IndexRegistry

__all__ = ["estimate_bytes", "make_room", "MIB"]

MIB = 1 << 20


def estimate_bytes(settings: ServerSettings) -> int:
    """The estimated memory of the index at settings.index when open: its RAM plan (what its searches
    keep resident, its record cache or the memory reader's table: espn.store.ram_plan), and for mmap
    the mapped table (espn.files.resident_bytes)."""
    if settings.reader == "mmap":
        return resident_bytes(settings.index, mapped_embeddings=True)
    plan = plan_ram(settings.index, None if settings.ram_mib is None else int(settings.ram_mib * MIB), settings.reader)
    cache = plan.record_cache_bytes if settings.record_cache_mb is None else int(settings.record_cache_mb * MIB)
    return plan.resident_bytes + plan.table_in_ram_bytes + cache


async def make_room(registry: "IndexRegistry", state: AppState) -> None:
    """Close idle indexes, least recently used first, until `state` fits the budget; else a 503."""
    budget = registry.settings.index_memory_budget_mib * MIB
    if budget <= 0:
        return
    need = registry.memory_bytes(state)
    while True:
        held = [other for other in registry if other is not state and other.live is not None]
        used = sum(registry.memory_bytes(other) for other in held)
        if used + need <= budget:
            return
        idle = sorted((other for other in held if other.lazy and not other.in_flight and not other.closing),
                      key=lambda other: other.last_used)
        if not idle:
            raise ServiceUnavailableError(
                f"index {state.name!r} needs an estimated {need / MIB:.1f} MiB and the open indexes hold "
                f"{used / MIB:.1f} MiB with requests inside: over the memory budget of "
                f"{registry.settings.index_memory_budget_mib:g} MiB (--index-memory-budget); retry later",
                retry_after_s=5)
        await registry.close_one(idle[0], "memory budget")
