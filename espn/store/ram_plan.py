"""One RAM number per index: what its searches must keep resident, and the rest for the record cache.

An operator states how much RAM an index may use (`ram_bytes`); `plan_ram` gives the first
stage what it must keep resident (the files its searches map: IVF or token centroids, the
records table, ids, metadata, full-text index; `espn.files.index_directory.resident_bytes`) and the rest to the
posix reader's record cache, up to what caching the whole table takes. Without a number the
cache gets `DEFAULT_CACHE_TABLE_FRACTION` of the table, at most `DEFAULT_CACHE_RAM_FRACTION` of
the machine's RAM: on by default, and never a large share of a machine nobody sized it for.
The memory reader holds the whole table instead, and mmap leaves the rest to the page cache.

Sizes only: no file is opened but for its size, and nothing here imports numpy.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from ..errors import InvalidParameterError
from ..files.index_directory import resident_bytes

__all__ = ["RamPlan", "plan_ram", "DEFAULT_CACHE_TABLE_FRACTION", "DEFAULT_CACHE_RAM_FRACTION", "MIN_CACHE_BYTES",
           "CACHE_TABLE_HEADROOM"]

#: Without a RAM number: the record cache's share of the table (measured: a quarter of
#: SciFact's table holds what a skewed stream asks for most; docs/benchmarks/memory-and-readers.md) ...
DEFAULT_CACHE_TABLE_FRACTION = 0.25
#: ... and at most this share of the machine's physical RAM.
DEFAULT_CACHE_RAM_FRACTION = 0.125
#: A cache smaller than this is not worth its tables: none.
MIN_CACHE_BYTES = 1 << 20
#: The cache that holds the whole table: the table's bytes and this share more (slots are a
#: little larger than records; the slot tables, the map and the sketch).
CACHE_TABLE_HEADROOM = 0.02
_MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class RamPlan:
    """How an index's RAM is split (bytes).

    ram_bytes: what was stated (None: espn's default); reader: the reader it was planned for;
    resident_bytes: what the searches keep resident (first stage and tables); record_cache_bytes:
    the posix reader's record cache (0: none); table_bytes: embeddings.bin; table_in_ram_bytes:
    the table held in RAM by the memory reader (0 for the others).
    """

    ram_bytes: int | None
    reader: str
    resident_bytes: int
    record_cache_bytes: int
    table_bytes: int
    table_in_ram_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """What the index holds in RAM at most, as planned."""
        return self.resident_bytes + self.record_cache_bytes + self.table_in_ram_bytes

    @property
    def record_cache_mb(self) -> float:
        return self.record_cache_bytes / _MiB

    def to_json(self) -> dict[str, Any]:
        return {"ram_bytes": self.ram_bytes, "reader": self.reader, "resident_bytes": self.resident_bytes,
                "record_cache_bytes": self.record_cache_bytes, "table_bytes": self.table_bytes,
                "table_in_ram_bytes": self.table_in_ram_bytes, "total_bytes": self.total_bytes,
                "record_cache_fraction_of_table": round(self.record_cache_bytes / self.table_bytes, 4)
                if self.table_bytes else 0.0}


def plan_ram(index: Path | str, ram_bytes: int | None = None, reader: str | None = None,
             physical_bytes: int | None = None) -> RamPlan:
    """The split of `ram_bytes` for the index at `index` read with `reader` (None: posix).

    Raises InvalidParameterError (naming `ram_mib`) when the RAM stated is below what the index
    must keep resident (for the memory reader: that and the table)."""
    if ram_bytes is not None and (isinstance(ram_bytes, bool) or not isinstance(ram_bytes, int) or ram_bytes < 0):
        raise InvalidParameterError(f"ram_mib must be a number >= 0, got {ram_bytes / _MiB if isinstance(ram_bytes, int) else ram_bytes!r}")
    reader = reader or "posix"
    index = Path(index)
    resident = resident_bytes(index)
    table = _table_bytes(index)
    if ram_bytes is not None and ram_bytes < resident:
        raise InvalidParameterError(
            f"ram_mib={round(ram_bytes / _MiB, 3):g} is below the {resident / _MiB:.1f} MiB that {index} keeps resident "
            f"(its first stage, records table and ids); give at least that")
    if reader == "memory":
        if ram_bytes is not None and ram_bytes < resident + table:
            raise InvalidParameterError(
                f"ram_mib={round(ram_bytes / _MiB, 3):g} cannot hold the memory reader's copy of the table ({table / _MiB:.1f} "
                f"MiB) besides the {resident / _MiB:.1f} MiB kept resident; give at least "
                f"{(resident + table) / _MiB:.1f}, or read with posix and its record cache")
        return RamPlan(ram_bytes, reader, resident, 0, table, table)
    if reader != "posix":  # mmap: the rest is the page cache's; kvikio reads into the GPU
        return RamPlan(ram_bytes, reader, resident, 0, table)
    whole = int(table * (1 + CACHE_TABLE_HEADROOM)) + MIN_CACHE_BYTES
    if ram_bytes is None:
        physical = physical_bytes if physical_bytes is not None else _physical_bytes()
        cache = int(min(DEFAULT_CACHE_TABLE_FRACTION * table, DEFAULT_CACHE_RAM_FRACTION * physical))
    else:
        cache = ram_bytes - resident
    cache = min(cache, whole)
    return RamPlan(ram_bytes, reader, resident, cache if cache >= MIN_CACHE_BYTES else 0, table)


def _table_bytes(index: Path) -> int:
    """The size of the index's embeddings.bin: its base's, or the largest of a live index's bases
    (a rewritten base sits in live/base-NNNNNN until the older one is removed)."""
    sizes = [0]
    for path in [index / "embeddings.bin", *(index / "live").glob("base-*/embeddings.bin")]:
        try:
            sizes.append(os.stat(path).st_size)
        except FileNotFoundError:
            continue
    return max(sizes)


def _physical_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0
