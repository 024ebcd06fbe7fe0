"""Which partition owns a document: a stable hash of its id, modulo the partition count, or
through a fixed number of hash slots and a shard map (espn.shard_map).

`espn index --partitions S` places every document by this rule and records it in each
partition's manifest (`partition: {index, count, by}`); the router sends a write to the
partition the same rule names, and a writer refuses an id that is not its own (421). The
rule depends on the id's bytes and S alone, never on corpus order or on which documents
exist, so it cannot change under a running index. Changing S means a rebuild.

The hash is FNV-1a 64 over the id's UTF-8 bytes: simple enough to restate in any language
a client is written in, and computed here for a whole array of ids in one pass per byte
column (no Python work per id at build time).

Slots: `slot(id) = fnv1a64(id) mod SLOT_COUNT` (1,024). A shard map says which partition owns
each slot, so ownership moves slot by slot (a reshard) while the hash never changes. A build
of S partitions, S a power of two up to 1,024, placed every id exactly where the map that
gives slot s to partition s mod S does: fnv mod S equals (fnv mod 1,024) mod S when S divides
1,024, so such a build starts a map without moving a document.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .errors import WrongPartitionError

__all__ = ["HASH_NAME", "SLOT_COUNT", "SLOT_HASH_NAME", "PartitionLayout", "WrongPartitionError", "id_hashes",
           "owners", "owner", "slots_of", "slot_of"]

HASH_NAME = "fnv1a64(utf8(id)) mod count"
#: Hash slots of a shard map: fixed, so that a slot's owner can change while the hash does not.
SLOT_COUNT = 1024
SLOT_HASH_NAME = f"fnv1a64(utf8(id)) mod {SLOT_COUNT}"
_OFFSET = np.uint64(0xCBF29CE484222325)
_PRIME = np.uint64(0x100000001B3)


def id_hashes(ids: np.ndarray) -> np.ndarray:
    """FNV-1a 64 of each id: `ids` [n] a bytes ('S') array of UTF-8 ids. Returns [n] uint64."""
    ids = np.asarray(ids)
    if ids.dtype.kind != "S":
        raise TypeError(f"id_hashes takes a bytes ('S') array, got {ids.dtype}")
    n, width = len(ids), ids.dtype.itemsize
    hashes = np.full(n, _OFFSET, dtype=np.uint64)
    if n == 0:
        return hashes
    columns = np.frombuffer(np.ascontiguousarray(ids).tobytes(), dtype=np.uint8).reshape(n, width)
    lengths = np.char.str_len(ids)  # 'S' pads with NUL; ids never hold one (espn.ids)
    for j in range(width):
        live = lengths > j
        mixed = (hashes ^ columns[:, j].astype(np.uint64)) * _PRIME  # wraps mod 2**64, as FNV wants
        hashes = np.where(live, mixed, hashes)
    return hashes


def owners(ids: np.ndarray, count: int) -> np.ndarray:
    """The partition (0 .. count-1) of each id in a bytes array, [n] int64."""
    if count < 1:
        raise ValueError(f"partition count must be >= 1, got {count}")
    return (id_hashes(ids) % np.uint64(count)).astype(np.int64)


def owner(doc_id: str, count: int) -> int:
    """The partition of one id (the router's call for a single write)."""
    return int(owners(np.array([doc_id.encode("utf-8")], dtype=bytes), count)[0])


def slots_of(ids: np.ndarray) -> np.ndarray:
    """The hash slot (0 .. SLOT_COUNT-1) of each id in a bytes array, [n] int64."""
    return owners(ids, SLOT_COUNT)


def slot_of(doc_id: str) -> int:
    """The hash slot of one id."""
    return owner(doc_id, SLOT_COUNT)


@dataclasses.dataclass(frozen=True)
class PartitionLayout:
    """Partition `index` of `count`, documents placed by `by` (HASH_NAME for this version's builds)."""

    index: int = 0
    count: int = 1
    by: str | None = HASH_NAME

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> "PartitionLayout":
        section = manifest.get("partition") or {}
        count = int(section.get("count", 1))
        # Builds before the hash rule placed document i in partition i mod S: no rule a write can follow.
        return cls(int(section.get("index", 0)), count, section.get("by", HASH_NAME if count == 1 else None))

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "count": self.count, "by": self.by}

    @property
    def hashed(self) -> bool:
        return self.by == HASH_NAME

    def check_owned(self, doc_ids: Sequence[str] | Iterable[str]) -> None:
        """WrongPartitionError naming the first id this partition does not own."""
        if self.count == 1 or not self.hashed:
            return
        ids = list(doc_ids)
        if not ids:
            return
        homes = owners(np.array([i.encode("utf-8") for i in ids], dtype=bytes), self.count)
        wrong = np.flatnonzero(homes != self.index)
        if len(wrong):
            doc_id = ids[int(wrong[0])]
            raise WrongPartitionError(
                f"id {doc_id!r} belongs to partition {int(homes[wrong[0]])} of {self.count}, not to this one "
                f"({self.index}); send writes through `espn route`, which places them by {HASH_NAME}")
