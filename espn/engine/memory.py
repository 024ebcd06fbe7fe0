"""The memory budget of a registry: what an open index holds, estimated, and room made for one.

The estimate of an index is its RAM plan as the library makes it (`espn.store.ram_plan`, from
its config's `ram_mib`): the files its searches map into memory (`espn.files.index_directory.resident_bytes`:
not the records, read from storage per query unless the mmap reader maps them, nor the
passages or the model, loaded once per process for every index that uses it), plus its record
cache (one copy, shared by the processes of a server) or the memory reader's table. The
budget is per process.

Before a closed index opens, `make_room` closes idle indexes (no request inside), least
recently used first, until the open ones plus the new one fit; the default index counts but
is never closed. If they still do not fit, the request is refused with UnavailableError.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable, Optional

from ..errors import InvalidParameterError, UnavailableError
from ..files.index_directory import resident_bytes
from ..store.ram_plan import RamPlan, plan_ram
from .config import IndexConfig

if TYPE_CHECKING:
    from .served import ServedIndex

__all__ = ["make_room", "estimate_bytes", "plan_index_ram", "MIB"]

MIB = 1 << 20


def plan_index_ram(path: Path, config: IndexConfig) -> RamPlan:
    """The split of the index's RAM (`config.ram_mib`) for its reader; InvalidParameterError when
    the RAM given is below what the index keeps resident."""
    return plan_ram(path, _bytes(config.ram_mib), config.reader)


def estimate_bytes(path: Path, config: IndexConfig) -> int:
    """What the index at `path` holds in memory when open: its RAM plan (what its searches keep
    resident, its record cache or the memory reader's table), and for mmap the mapped table."""
    if config.reader == "mmap":
        return resident_bytes(path, mapped_embeddings=True)
    try:
        plan = plan_index_ram(path, config)
    except InvalidParameterError:  # too little RAM: opening the index says so; a listing of indexes must not fail
        plan = plan_ram(path, None, config.reader)
        return plan.resident_bytes + plan.table_in_ram_bytes
    cache = plan.record_cache_bytes if config.record_cache_mb is None else int(config.record_cache_mb * MIB)
    return plan.resident_bytes + plan.table_in_ram_bytes + cache


def _bytes(mib: Optional[float]) -> Optional[int]:
    return None if mib is None else int(mib * MIB)


async def make_room(held: Iterable["ServedIndex"], opening: "ServedIndex", budget_mib: float,
                    close: Callable[["ServedIndex", str], Awaitable[None]]) -> None:
    """Close idle indexes of `held`, least recently used first, until `opening` fits the budget."""
    budget = budget_mib * MIB
    if budget <= 0:
        return
    need = opening.estimate_memory()
    while True:
        open_ = [other for other in held if other is not opening and other.life.serving]
        used = sum(other.estimate_memory() for other in open_)
        if used + need <= budget:
            return
        idle = sorted((other for other in open_ if not other.default and other.life.inside == 0),
                      key=lambda other: other.last_used)
        if not idle:
            raise UnavailableError(
                f"index {opening.name!r} needs an estimated {need / MIB:.1f} MiB and the open indexes hold "
                f"{used / MIB:.1f} MiB with requests inside: over the memory budget of {budget_mib:g} MiB "
                "(--index-memory-budget); retry later", retry_after_s=5)
        await close(idle[0], "memory budget")
