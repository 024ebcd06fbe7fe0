"""The memory budget of a registry: what an open index holds, estimated, and room made for one.

The estimate of an index is the size of the files its searches map into memory, as the
library counts them (`espn.files.resident_bytes`: not the records, read from storage per
query unless the mmap reader maps them, nor the passages or the model, loaded once per
process for every index that uses it): the pages a process touches once searches have run,
an upper bound of what it keeps resident. The budget is per process.

Before a closed index opens, `make_room` closes idle indexes (no request inside), least
recently used first, until the open ones plus the new one fit; the default index counts but
is never closed. If they still do not fit, the request is refused with UnavailableError.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Iterable

from ..errors import UnavailableError
from .served import ServedIndex

__all__ = ["make_room", "MIB"]

MIB = 1 << 20


async def make_room(held: Iterable[ServedIndex], opening: ServedIndex, budget_mib: float,
                    close: Callable[[ServedIndex, str], Awaitable[None]]) -> None:
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
