"""The shard map: which partition owns each hash slot, where each partition's store is, and the
slot moves of a reshard in progress.

It lives on object storage beside the partitions, `s3://BUCKET/PREFIX/shard-map.json`, each
partition under `s3://BUCKET/PREFIX/<store>` (espn.live.replication.cluster reads and writes
it, always by a conditional write on the ETag last read, so two resharders never both win).
This module is the map as data: parsed and checked as anything from outside is, and the
rules that change it. A document's slot is `espn.partitioning.slot_of(id)` (fnv1a64 mod
1,024); its partition is `owners[slot]`.

A move takes slots from a source partition to a target one in three states, each entered by
one conditional write of the map (espn.live.replication.reshard runs them):

    copying    the target takes in the slots' documents (bundles of stored records); the
               source still owns and writes them
    freezing   the source stops taking writes to the slots and says at which generation
    switched   `owners` gives the slots to the target (the one write that switches them);
               the source drops its copies

A finished move leaves the map. A partition that owns no slot and is marked retired is no
longer searched.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

import numpy as np

from .errors import IndexCorruptError, InvalidParameterError
from .partitioning import SLOT_COUNT, SLOT_HASH_NAME, slots_of
from .untrusted import load_json

__all__ = ["MAP_FORMAT", "MAX_MAP_BYTES", "MAX_PARTITIONS", "MOVE_STATES", "Partition", "Move", "ShardMap",
           "plan_moves"]

MAP_FORMAT = 1
#: The most bytes of a shard map read before it is parsed (a map is some 10 kB).
MAX_MAP_BYTES = 1 << 20
MAX_PARTITIONS = 256
MOVE_STATES = ("copying", "freezing", "switched")
_STORE = re.compile(r"[A-Za-z0-9._-]{1,100}(/[A-Za-z0-9._-]{1,100}){0,3}\Z")
_MOVE_ID = re.compile(r"move-[0-9]{6}\Z")


@dataclasses.dataclass(frozen=True)
class Partition:
    """A partition: its id and its store's prefix, relative to the map's (e.g. "part-2")."""

    id: int
    store: str
    retired: bool = False


@dataclasses.dataclass(frozen=True)
class Move:
    """Slots (sorted) moving from partition `source` to `target`, in one of MOVE_STATES."""

    id: str
    slots: tuple[int, ...]
    source: int
    target: int
    state: str = "copying"


@dataclasses.dataclass(frozen=True)
class ShardMap:
    """Version `version` of the map: owners [SLOT_COUNT] partition ids, the partitions, the moves."""

    version: int
    owners: tuple[int, ...]
    partitions: tuple[Partition, ...]
    moves: tuple[Move, ...] = ()

    @classmethod
    def initial(cls, count: int, store: str = "part-{}") -> "ShardMap":
        """S partitions built by `espn index --partitions S` (S dividing SLOT_COUNT): slot s to s mod S,
        which is where the build placed every id."""
        if not 1 <= count <= MAX_PARTITIONS or SLOT_COUNT % count:
            raise InvalidParameterError(f"partitions must divide {SLOT_COUNT} (1, 2, 4, ... {MAX_PARTITIONS}) for a "
                                        f"build to start a shard map, got {count}; reshard afterwards for any count")
        owners = tuple(slot % count for slot in range(SLOT_COUNT))
        return cls(1, owners, tuple(Partition(p, store.format(p)) for p in range(count)))

    # -- reading it ----------------------------------------------------------------------
    @property
    def owner_array(self) -> np.ndarray:
        return np.asarray(self.owners, dtype=np.int64)

    def owners_of(self, ids: np.ndarray) -> np.ndarray:
        """The owning partition of each id ([n] bytes array), [n] int64."""
        return self.owner_array[slots_of(ids)]

    def owner(self, doc_id: str) -> int:
        return int(self.owners_of(np.array([doc_id.encode("utf-8")], dtype=bytes))[0])

    def slots(self, partition: int) -> np.ndarray:
        """[SLOT_COUNT] bool: the slots `partition` owns."""
        return self.owner_array == partition

    def partition(self, partition: int) -> Partition:
        for entry in self.partitions:
            if entry.id == partition:
                return entry
        raise InvalidParameterError(f"the shard map (version {self.version}) has no partition {partition}")

    def searched(self) -> list[int]:
        """The partitions a search goes to: those that own a slot (a move's target holds its
        documents before they are its own, and its answers would only be filtered out)."""
        return sorted(set(self.owners))

    def moves_of(self, partition: int) -> list[Move]:
        return [m for m in self.moves if partition in (m.source, m.target)]

    def move(self, move_id: str) -> Move:
        for move in self.moves:
            if move.id == move_id:
                return move
        raise InvalidParameterError(f"the shard map (version {self.version}) has no move {move_id!r}")

    # -- changing it (each returns the next version) ----------------------------------------
    def _next(self, **changes: Any) -> "ShardMap":
        return dataclasses.replace(self, version=self.version + 1, **changes)

    def with_partition(self, store: str) -> tuple["ShardMap", int]:
        """A new partition (owning nothing yet) whose store is `store`; (the map, its id)."""
        new = max(p.id for p in self.partitions) + 1
        if any(p.store == store for p in self.partitions):
            raise InvalidParameterError(f"the shard map has a partition stored at {store!r} already")
        return self._next(partitions=(*self.partitions, Partition(new, store))), new

    def with_move(self, slots: Sequence[int], source: int, target: int) -> tuple["ShardMap", Move]:
        slots = tuple(sorted(int(s) for s in slots))
        if not slots or any(self.owners[s] != source for s in slots):
            raise InvalidParameterError(f"a move takes slots that partition {source} owns")
        if {s for m in self.moves for s in m.slots} & set(slots):
            raise InvalidParameterError("a slot already moving cannot move again before its move ends")
        self.partition(target)
        number = max((int(m.id[5:]) for m in self.moves), default=self.version)
        move = Move(f"move-{number + 1:06d}", slots, source, target)
        return self._next(moves=(*self.moves, move)), move

    def with_state(self, move_id: str, state: str) -> "ShardMap":
        """The move in `state`; "switched" also gives its slots to the target."""
        move = self.move(move_id)
        if state not in MOVE_STATES or MOVE_STATES.index(state) < MOVE_STATES.index(move.state):
            raise InvalidParameterError(f"{move_id}: {move.state} cannot go to {state!r}")
        owners = list(self.owners)
        if state == "switched":
            for slot in move.slots:
                owners[slot] = move.target
        moves = tuple(dataclasses.replace(m, state=state) if m.id == move_id else m for m in self.moves)
        return self._next(owners=tuple(owners), moves=moves)

    def without_move(self, move_id: str) -> "ShardMap":
        if self.move(move_id).state != "switched":
            raise InvalidParameterError(f"{move_id} has not switched: it cannot end")
        return self._next(moves=tuple(m for m in self.moves if m.id != move_id))

    def retired(self, partition: int) -> "ShardMap":
        if self.slots(partition).any() or self.moves_of(partition):
            raise InvalidParameterError(f"partition {partition} still owns slots or takes part in a move")
        return self._next(partitions=tuple(dataclasses.replace(p, retired=True) if p.id == partition else p
                                           for p in self.partitions))

    # -- as stored ---------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        return json.dumps({"format": MAP_FORMAT, "version": self.version, "slots": SLOT_COUNT, "hash": SLOT_HASH_NAME,
                           "owners": list(self.owners),
                           "partitions": [dataclasses.asdict(p) for p in self.partitions],
                           "moves": [{**dataclasses.asdict(m), "slots": list(m.slots)} for m in self.moves]},
                          sort_keys=True).encode()

    @classmethod
    def parse(cls, body: bytes, what: str) -> "ShardMap":
        """The map, every field checked (it is data from the store): IndexCorruptError naming `what`."""
        obj = load_json(body, what, max_bytes=MAX_MAP_BYTES, error=IndexCorruptError, finite=True)
        try:
            if obj["format"] != MAP_FORMAT or obj["slots"] != SLOT_COUNT or obj["hash"] != SLOT_HASH_NAME:
                raise ValueError(f"format {obj['format']!r}, {obj['slots']!r} slots by {str(obj['hash'])[:80]!r}; "
                                 f"this espn reads format {MAP_FORMAT}, {SLOT_COUNT} slots by {SLOT_HASH_NAME!r}")
            partitions = tuple(Partition(_int(p["id"]), str(p["store"]), bool(p.get("retired", False)))
                               for p in obj["partitions"])
            moves = tuple(Move(str(m["id"]), tuple(_int(s) for s in m["slots"]), _int(m["source"]),
                               _int(m["target"]), str(m["state"])) for m in obj["moves"])
            shard_map = cls(_int(obj["version"]), tuple(_int(o) for o in obj["owners"]), partitions, moves)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise IndexCorruptError(f"{what}: not a shard map ({type(exc).__name__}: {exc})") from None
        problem = shard_map.problem()
        if problem:
            raise IndexCorruptError(f"{what}: not a shard map: {problem}")
        return shard_map

    def problem(self) -> str:
        """Why this is not a consistent map ('' when it is)."""
        ids = [p.id for p in self.partitions]
        if not 1 <= len(ids) <= MAX_PARTITIONS or len(set(ids)) != len(ids) or min(ids) < 0:
            return f"{len(ids)} partitions, ids {ids[:10]}"
        if len({p.store for p in self.partitions}) != len(ids) or not all(
                _STORE.match(p.store) and ".." not in p.store.split("/") for p in self.partitions):
            return "partition stores must be distinct relative prefixes (letters, digits, ._- and /)"
        if len(self.owners) != SLOT_COUNT or not set(self.owners) <= set(ids):
            return f"owners must name a partition for each of the {SLOT_COUNT} slots"
        if any(p.retired for p in self.partitions if p.id in set(self.owners)):
            return "a retired partition owns slots"
        taken: set[int] = set()
        for m in self.moves:
            if not _MOVE_ID.match(m.id) or m.state not in MOVE_STATES or {m.source, m.target} - set(ids) \
                    or m.source == m.target or not m.slots or taken & set(m.slots) \
                    or not all(0 <= s < SLOT_COUNT for s in m.slots):
                return f"move {m.id[:40]!r} is not a move of free slots between two partitions"
            owner = m.target if m.state == "switched" else m.source
            if any(self.owners[s] != owner for s in m.slots):
                return f"move {m.id} ({m.state}): its slots are not owned by partition {owner}"
            taken |= set(m.slots)
        return ""


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{str(value)[:40]!r} is not an integer")
    return value


def plan_moves(shard_map: ShardMap, count: int) -> list[tuple[list[int], int, int]]:
    """How to reach `count` partitions evenly from the map's partitions, moving as few slots as
    possible: moves (slots, source, target), one per (source, target), where a target above the
    map's highest partition id is a new partition (an empty one that is not retired is used
    first). Growing, each partition gives its excess (its highest slots) to the others;
    shrinking, the highest-numbered partitions give all of theirs to the others."""
    if not 1 <= count <= MAX_PARTITIONS:
        raise InvalidParameterError(f"partitions must be in [1, {MAX_PARTITIONS}], got {count}")
    if shard_map.moves:
        raise InvalidParameterError(f"moves {[m.id for m in shard_map.moves]} are in progress: finish them first")
    active = sorted(set(shard_map.owners))
    # Partitions that own nothing yet but are not retired (a split that stopped after creating
    # them) are filled before any new one is made.
    candidates = sorted(set(active) | {p.id for p in shard_map.partitions if not p.retired})
    first_new = max(p.id for p in shard_map.partitions) + 1
    kept = candidates[:count]
    ids = kept + list(range(first_new, first_new + count - len(kept)))
    quota = {p: SLOT_COUNT // count + (1 if i < SLOT_COUNT % count else 0) for i, p in enumerate(ids)}
    owners = shard_map.owner_array
    spare: list[tuple[int, int]] = []  # (slot, its source) given away, highest slots first
    for p in active:
        mine = np.flatnonzero(owners == p)
        excess = len(mine) - quota.get(p, 0)
        spare += [(int(s), p) for s in mine[::-1][:max(0, excess)]]
    moves: dict[tuple[int, int], list[int]] = {}
    for p in ids:
        want = quota[p] - int((owners == p).sum())
        while want > 0 and spare:
            slot, source = spare.pop(0)
            moves.setdefault((source, p), []).append(slot)
            want -= 1
    return [(sorted(slots), source, target) for (source, target), slots in sorted(moves.items())]
