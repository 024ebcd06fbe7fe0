"""The record cache's storage: every record in a slot of its size class, in one memory segment.

Slot sizes are cut at quantiles of the table's record lengths (`class_sizes`, multiples of
`ALIGN`), the last exactly the longest record, so every record of the table has a class and
slots fit records closely. The arena is split between the classes in proportion to the bytes
of the table in each: at a budget of a fraction f of the table, each class holds f of its
records (at least one slot each where the budget allows), and at f >= 1 every record fits.

One segment holds, as numpy views (no Python object per record): a header (the layout, a
`dirty` flag and shared counters), per slot the document it holds, that record's offset in the
file (checked on every hit, so a slot never answers for another record), the tick of its last
use and the free stack of its class, the frequency sketch, the doc -> slot map (`MAP_GROWTH`
times the table's documents, for those a live index appends) and the class arenas.

Hits are read where they lie, as the memory reader reads its array: a read registers itself
(`begin_read`: its process and a tick) in the table of reads in flight before its lookup,
which stamps the slots it found with that tick, and unregisters when its records have been
scored. A slot is overwritten (evicted, or reused after `forget`) only when its stamp is older
than every read in flight, so no read ever sees its record change; rows of processes that
died are dropped. Every method runs under the segment's lock (`RecordCache` takes it). A
change sets `dirty` first and clears it last; a process that finds it set (its writer died
mid-change) unmaps every record before using the cache again.
"""

from __future__ import annotations

import dataclasses
import mmap
from typing import Any

import numpy as np

from ..errors import InvalidParameterError
from ..files.locks import process_alive
from .cache_policy import POLICIES, VICTIM_SAMPLES, FrequencySketch, contenders, pick_victims

__all__ = ["SlabPlan", "SlabStore", "plan_slabs", "class_sizes", "ALIGN", "MAX_CLASSES", "COUNTERS"]

ALIGN = 64
MAX_CLASSES = 32
#: Map entries kept beyond the table's documents at creation, as a multiple of them plus a
#: constant: documents a live index appends (a rewrite of its base, at half the base by default,
#: makes a new cache). Pages of the map are touched only where documents are cached, so unused
#: headroom costs address space, not RAM.
MAP_GROWTH, MAP_HEADROOM = 2, 1 << 16
SKETCH_DEPTH = 4
_MAGIC = 0x6573706E52430001
_VERSION = 1
_HEADER_WORDS = 512
_H_MAGIC, _H_VERSION, _H_DIRTY, _H_CLASSES, _H_MAP, _H_WIDTH, _H_ADDED, _H_TICK, _H_POLICY, _H_SIZE, _H_DOCS, \
    _H_SHORT = range(12)
#: Reads in flight at once, over every process of a segment (a read past them finds no hit).
READS_IN_FLIGHT = 1024
_H_COUNTERS, _H_SLOT_BYTES, _H_SLOTS, _H_FREE = 16, 64, 128, 192
COUNTERS = ("requests", "hits", "admitted", "evicted", "rejected", "forgotten", "resets", "too_large")
#: Bytes of tables per slot: document, offset, last use (int64 each) and free stack (int32).
SLOT_OVERHEAD = 28


@dataclasses.dataclass(frozen=True)
class SlabPlan:
    """The layout of a cache: slot size and count per class, map entries, sketch width, policy."""

    slot_bytes: np.ndarray  # [k] int64, increasing
    slots: np.ndarray  # [k] int64
    map_capacity: int
    sketch_width: int
    policy: str
    n_documents: int  # of the table it was planned for
    short: bool = True  # some class has fewer slots than the table has records of its size

    def regions(self) -> dict[str, tuple[int, int]]:
        """name -> (byte offset, bytes) of each table in the segment, and "size" -> (total, 0)."""
        total_slots = int(self.slots.sum())
        out: dict[str, tuple[int, int]] = {}
        at = _HEADER_WORDS * 8
        for name, nbytes in (("slot_doc", 8 * total_slots), ("slot_offset", 8 * total_slots),
                             ("slot_stamp", 8 * total_slots), ("free", 4 * total_slots),
                             ("reads", 16 * READS_IN_FLIGHT),
                             ("sketch", 2 * SKETCH_DEPTH * self.sketch_width), ("map", 4 * self.map_capacity)):
            out[name] = (at, nbytes)
            at = _align(at + nbytes, mmap.PAGESIZE)
        for c, (size, count) in enumerate(zip(self.slot_bytes.tolist(), self.slots.tolist())):
            out[f"arena{c}"] = (at, size * count)
            at = _align(at + size * count, ALIGN)
        out["size"] = (_align(at, mmap.PAGESIZE), 0)
        return out

    @property
    def arena_bytes(self) -> int:
        return int((self.slot_bytes * self.slots).sum())

    @property
    def nbytes(self) -> int:
        """The RAM the cache holds at most: the segment but the map entries past the table's documents."""
        return self.regions()["size"][0] - 4 * (self.map_capacity - self.n_documents)


def _align(n: int, to: int) -> int:
    return -(-int(n) // to) * to


def class_sizes(lengths: np.ndarray) -> np.ndarray:
    """[k] slot sizes covering every length in `lengths` ([n] > 0), k <= MAX_CLASSES: the lengths
    rounded up to ALIGN, cut at equal-count quantiles (each class the longest record of its
    quantile, the last exactly the longest record), so slots fit the records closely where the
    lengths are dense (SciFact's token records waste 0.9% of their bytes)."""
    rounded = np.sort(-(-np.asarray(lengths, dtype=np.int64) // ALIGN) * ALIGN)
    cuts = np.ceil(np.arange(1, MAX_CLASSES + 1) / MAX_CLASSES * len(rounded)).astype(np.int64) - 1
    return np.unique(rounded[cuts])


def plan_slabs(lengths: np.ndarray, budget_bytes: int, n_documents: int, policy: str) -> SlabPlan:
    """The layout of a cache of `budget_bytes` in all (tables included) for records of `lengths`
    (the table's, [n] int). Raises InvalidParameterError when the budget holds no record."""
    if policy not in POLICIES:
        raise InvalidParameterError(f"record_cache_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0] if len(lengths) else lengths
    sizes = class_sizes(lengths) if len(lengths) else np.array([ALIGN], dtype=np.int64)
    counts = np.bincount(np.searchsorted(sizes, lengths, side="left"), minlength=len(sizes)).astype(np.int64)
    if not counts.any():
        counts[:] = 1
    map_capacity = MAP_GROWTH * int(n_documents) + MAP_HEADROOM
    # Fixed costs: header, the map's entries of the documents there are, page alignment of the tables.
    fixed = _HEADER_WORDS * 8 + 4 * int(n_documents) + 8 * mmap.PAGESIZE
    per_record = sizes * counts  # bytes of slots per class if every record were cached
    for least in (1, 0):  # a slot for every class if the budget allows, so no length goes uncached
        room = budget_bytes - fixed
        for _ in range(8):  # the sketch's width is a power of two: shrink until the whole plan fits
            fraction = room / float(per_record.sum() + (SLOT_OVERHEAD + 8 * SKETCH_DEPTH) * counts.sum())
            # never more slots than records of the class (a budget above the table's needs would
            # otherwise plan slots no record fills, and a plan larger than the budget)
            slots = np.minimum(counts, np.maximum(least, np.floor(np.maximum(0.0, fraction) * counts))).astype(np.int64)
            plan = SlabPlan(sizes, slots, map_capacity, FrequencySketch.width_for(int(slots.sum())), policy,
                            int(n_documents), bool((slots < counts).any()))
            if plan.nbytes <= budget_bytes or slots.sum() < 1 or room <= 0:
                break
            room -= plan.nbytes - budget_bytes
        if plan.nbytes <= budget_bytes:
            break
    if slots.sum() < 1 or plan.nbytes > budget_bytes:
        raise InvalidParameterError(
            f"a record cache of {budget_bytes / 2**20:.3f} MiB holds no record (the shortest slot is "
            f"{int(sizes[0])} bytes besides {fixed / 2**20:.3f} MiB of tables); give more RAM or none")
    return plan


class SlabStore:
    """The tables of one segment as numpy views (see the module docstring). Not thread-safe:
    the caller holds the segment's lock."""

    def __init__(self, buffer: mmap.mmap) -> None:
        header = np.frombuffer(buffer, dtype=np.int64, count=_HEADER_WORDS)
        if int(header[_H_MAGIC]) != _MAGIC or int(header[_H_VERSION]) != _VERSION:
            raise ValueError("not an initialised record cache segment")
        k = int(header[_H_CLASSES])
        self.plan = SlabPlan(header[_H_SLOT_BYTES: _H_SLOT_BYTES + k].copy(), header[_H_SLOTS: _H_SLOTS + k].copy(),
                             int(header[_H_MAP]), int(header[_H_WIDTH]), POLICIES[int(header[_H_POLICY])],
                             int(header[_H_DOCS]), bool(header[_H_SHORT]))
        regions = self.plan.regions()
        if regions["size"][0] > len(buffer):
            raise ValueError("record cache segment shorter than its layout")
        self.header = header
        self.counters = header[_H_COUNTERS: _H_COUNTERS + len(COUNTERS)]
        self.free_count = header[_H_FREE: _H_FREE + k]

        def view(name: str, dtype: Any) -> np.ndarray:
            at, nbytes = regions[name]
            return np.frombuffer(buffer, dtype=dtype, count=nbytes // np.dtype(dtype).itemsize, offset=at)

        self.slot_doc, self.slot_offset = view("slot_doc", np.int64), view("slot_offset", np.int64)
        self.slot_stamp, self.free = view("slot_stamp", np.int64), view("free", np.int32)
        self.reads = view("reads", np.int64).reshape(READS_IN_FLIGHT, 2)  # (pid, tick) of each read; pid 0: free
        arena_at = np.array([regions[f"arena{c}"][0] for c in range(k)], dtype=np.int64)
        #: [slots] byte position of each slot in the segment (this process's own table: 8 bytes a slot)
        self.slot_at = np.repeat(arena_at, self.plan.slots) + (
            np.arange(int(self.plan.slots.sum())) - np.repeat(np.cumsum(self.plan.slots) - self.plan.slots,
                                                             self.plan.slots)) * np.repeat(self.plan.slot_bytes,
                                                                                           self.plan.slots)
        self.map = view("map", np.int32)
        self.sketch = FrequencySketch(view("sketch", np.uint16).reshape(SKETCH_DEPTH, self.plan.sketch_width),
                                      header[_H_ADDED: _H_ADDED + 1])
        self.base = np.concatenate([[0], np.cumsum(self.plan.slots)]).astype(np.int64)
        self.arenas = [view(f"arena{c}", np.uint8).reshape(int(n), int(s))
                       for c, (s, n) in enumerate(zip(self.plan.slot_bytes, self.plan.slots))]
        self._rng = np.random.default_rng(0)  # victims are sampled, not secret: the same choices each run

    @staticmethod
    def initialise(buffer: mmap.mmap, plan: SlabPlan) -> None:
        """Write an empty cache of `plan` into `buffer` (the magic number last)."""
        header = np.frombuffer(buffer, dtype=np.int64, count=_HEADER_WORDS)
        k = len(plan.slot_bytes)
        if k > MAX_CLASSES:
            raise ValueError(f"{k} size classes, at most {MAX_CLASSES}")
        header[:] = 0
        header[_H_VERSION], header[_H_CLASSES], header[_H_MAP] = _VERSION, k, plan.map_capacity
        header[_H_WIDTH], header[_H_POLICY] = plan.sketch_width, POLICIES.index(plan.policy)
        header[_H_SIZE], header[_H_DOCS], header[_H_SHORT] = plan.regions()["size"][0], plan.n_documents, plan.short
        header[_H_SLOT_BYTES: _H_SLOT_BYTES + k], header[_H_SLOTS: _H_SLOTS + k] = plan.slot_bytes, plan.slots
        header[_H_MAGIC] = _MAGIC
        SlabStore(buffer).clear()

    @staticmethod
    def is_initialised(buffer: mmap.mmap) -> bool:
        header = np.frombuffer(buffer, dtype=np.int64, count=_HEADER_WORDS)
        return int(header[_H_MAGIC]) == _MAGIC and int(header[_H_VERSION]) == _VERSION

    def clear(self) -> None:
        """Unmap every record (the map needs no reset: an entry counts only where its slot agrees);
        the free stacks get every slot no read in flight may be reading."""
        self.slot_doc[:] = -1
        self.slot_offset[:] = -1
        idle = self.slot_stamp < self.oldest_read()
        for c, (lo, hi) in enumerate(zip(self.base[:-1].tolist(), self.base[1:].tolist())):
            free = np.flatnonzero(idle[lo:hi])[::-1].astype(np.int32) + lo  # popped from the end: low slots first
            self.free[lo: lo + len(free)] = free
            self.free_count[c] = len(free)
        self.header[_H_DIRTY] = 0

    def recover(self) -> None:
        """Empty the cache if a process died changing it (its `dirty` flag is still set)."""
        if int(self.header[_H_DIRTY]):
            self.clear()
            self.counters[COUNTERS.index("resets")] += 1

    def begin_read(self, pid: int) -> tuple[int, int]:
        """(row, tick) of a new read in flight of process `pid` (row -1: the table is full)."""
        self.header[_H_TICK] += 1
        tick = int(self.header[_H_TICK])
        free = np.flatnonzero(self.reads[:, 0] == 0)
        if not len(free):
            self.drop_dead_reads()
            free = np.flatnonzero(self.reads[:, 0] == 0)
            if not len(free):
                return -1, tick
        row = int(free[0])
        self.reads[row] = (pid, tick)
        return row, tick

    def end_read(self, row: int) -> None:
        if row >= 0:
            self.reads[row, 0] = 0

    def oldest_read(self) -> int:
        """The tick of the oldest read in flight (past every stamp when there is none)."""
        busy = self.reads[:, 0] != 0
        if not busy.any():
            return int(self.header[_H_TICK]) + 1
        self.drop_dead_reads()
        busy = self.reads[:, 0] != 0
        return int(self.reads[busy, 1].min()) if busy.any() else int(self.header[_H_TICK]) + 1

    def drop_dead_reads(self) -> None:
        """Free the rows of processes that no longer exist (killed mid-read)."""
        for pid in np.unique(self.reads[self.reads[:, 0] != 0, 0]).tolist():
            if not process_alive(pid):
                self.reads[self.reads[:, 0] == pid, 0] = 0

    def count(self, name: str, n: int) -> None:
        self.counters[COUNTERS.index(name)] += n

    def class_of(self, lengths: np.ndarray) -> np.ndarray:
        """[n] size class of each record length (k: longer than every slot)."""
        return np.searchsorted(self.plan.slot_bytes, lengths, side="left")

    def lookup(self, docs: np.ndarray, offsets: np.ndarray, tick: int) -> np.ndarray:
        """[n] the slot holding each record (doc `docs[i]` at file offset `offsets[i]`), -1 where none
        does; counts the requests and stamps the slots found with `tick` (that of the read,
        `begin_read`: none is overwritten until it ends). A slot answers only for the document and
        offset it was filled with, so it never serves another record (the offset fixes the length)."""
        if self.plan.short or not self.free_count.all():  # counts matter only where a class can fill
            self.sketch.add(docs)
        known = docs < self.plan.map_capacity
        entry = np.where(known, self.map[np.where(known, docs, 0)].astype(np.int64) - 1, -1)
        held = entry >= 0
        slot = np.where(held, entry, 0)
        held &= (self.slot_doc[slot] == docs) & (self.slot_offset[slot] == offsets)
        slots = np.where(held, entry, -1)
        self.slot_stamp[slots[held]] = tick
        self.count("requests", len(docs))
        self.count("hits", int(np.count_nonzero(held)))
        return slots

    def slot_starts(self, slots: np.ndarray) -> np.ndarray:
        """[n] byte position in the segment of each slot's record."""
        return self.slot_at[slots]

    def admit(self, docs: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, buffer: np.ndarray,
              starts: np.ndarray) -> int:
        """Offer records just read (record i at `starts[i]` of `buffer`, `lengths[i]` bytes): each
        takes a free slot of its class, or competes by the policy for a resident of its class that
        no read in flight may be reading. Unique `docs` only. Vectorised over every class at once.
        Returns how many came in."""
        cls = self.class_of(lengths)
        self.count("too_large", int((cls >= len(self.arenas)).sum()))
        keep = np.flatnonzero((cls < len(self.arenas)) & (docs < self.plan.map_capacity))
        current = self.map[docs[keep]].astype(np.int64) - 1
        resident = np.zeros(len(keep), dtype=bool)
        resident[current >= 0] = self.slot_doc[current[current >= 0]] == docs[keep][current >= 0]
        # A resident record at another offset is an older version (a read that began before a write
        # offered it after the write's `forget`): it gives way, or the new one could never come in.
        stale = np.flatnonzero(resident)
        stale = stale[self.slot_offset[current[stale]] != offsets[keep[stale]]]
        if len(stale):
            self.forget(docs[keep[stale]])
            resident[stale] = False
        keep = keep[~resident]  # another search admitted them meanwhile
        keep = keep[np.argsort(cls[keep], kind="stable")]
        if not len(keep):
            return 0
        docs, offsets, lengths, starts, cls = docs[keep], offsets[keep], lengths[keep], starts[keep], cls[keep]
        self.header[_H_DIRTY] = 1
        rank = np.arange(len(cls)) - np.searchsorted(cls, cls, side="left")  # place within its class
        free = self.free_count[cls]
        takes_free = rank < free
        slots = np.full(len(cls), -1, dtype=np.int64)
        slots[takes_free] = self.free[(self.base[cls] + free - 1 - rank)[takes_free]]
        self.free_count[:] -= np.minimum(self.free_count, np.bincount(cls, minlength=len(self.arenas)))
        rest = np.flatnonzero(~takes_free)
        if len(rest):  # their classes are full: they compete with residents
            slots[rest] = self._compete(docs[rest], cls[rest])
        placed = np.flatnonzero(slots >= 0)
        for lo, hi in _runs(cls[placed]):  # the bytes first, one copy per class ...
            rows = placed[lo:hi]
            self._copy(int(cls[rows[0]]), slots[rows], lengths[rows], buffer, starts[rows])
        slots, docs = slots[placed], docs[placed]  # ... then what makes them found
        self.slot_offset[slots] = offsets[placed]
        self.slot_doc[slots] = docs
        self.slot_stamp[slots] = self.header[_H_TICK]
        self.map[docs] = (slots + 1).astype(np.int32)
        self.count("admitted", len(slots))
        self.header[_H_DIRTY] = 0
        return len(slots)

    def _compete(self, docs: np.ndarray, cls: np.ndarray) -> np.ndarray:
        """[n] the slot each candidate (of a full class) takes, -1 where it stays out: the candidates
        `contenders` lets through are each paired with the weakest of VICTIM_SAMPLES residents sampled
        from its class (`pick_victims`)."""
        out = np.full(len(docs), -1, dtype=np.int64)
        freq = self.sketch.estimate(docs)
        chosen = contenders(self.plan.policy, freq)
        self.count("rejected", len(docs) - len(chosen))
        if not len(chosen):
            return out
        cls = cls[chosen]
        n = self.plan.slots[cls]
        sample = self.base[cls][:, None] + (self._rng.random((len(cls), VICTIM_SAMPLES)) * n[:, None]).astype(np.int64)
        usable = self.slot_stamp[sample] < self.oldest_read()  # no read in flight may be reading it
        held = self.slot_doc[sample]  # -1: a forgotten slot that a read was still reading then: first to go
        held_freq = np.where(held >= 0, self.sketch.estimate(np.maximum(held, 0).ravel()).reshape(held.shape), -1)
        stamp = np.where(held >= 0, self.slot_stamp[sample], -1)
        taken = pick_victims(self.plan.policy, freq[chosen], sample, held_freq, stamp, usable)
        won = taken >= 0
        self.count("rejected", int((~won).sum()))
        self.count("evicted", int(won.sum()))
        self.slot_doc[taken[won]] = -1  # unmapped before a byte of them changes
        out[chosen] = taken
        return out

    def _copy(self, c: int, slots: np.ndarray, lengths: np.ndarray, buffer: np.ndarray, starts: np.ndarray) -> None:
        """Copy records into `slots` of class c. A copy per record would be Python work per record, so
        the records are copied as windows of the slot size in one call; the few that end within a slot
        of the buffer's end are copied one by one."""
        size = int(self.plan.slot_bytes[c])
        arena, local = self.arenas[c], slots - self.base[c]
        whole = starts + size <= len(buffer)
        if whole.any():  # every window of `size` bytes of the buffer, as a strided view (no copy)
            windows = np.lib.stride_tricks.as_strided(buffer, shape=(len(buffer) - size + 1, size),
                                                      strides=(buffer.strides[0], buffer.strides[0]), writeable=False)
            arena[local[whole]] = windows[starts[whole]]
        for slot, start, length in zip(local[~whole].tolist(), starts[~whole].tolist(), lengths[~whole].tolist()):
            arena[slot, :length] = buffer[start: start + length]

    def forget(self, docs: np.ndarray) -> int:
        """Drop the records of `docs` (deleted or replaced documents); returns how many were cached."""
        docs = np.unique(np.asarray(docs, dtype=np.int64))
        docs = docs[(docs >= 0) & (docs < self.plan.map_capacity)]
        entry = self.map[docs].astype(np.int64) - 1
        held = np.flatnonzero(entry >= 0)
        held = held[self.slot_doc[entry[held]] == docs[held]]
        slots = entry[held]
        if not len(slots):
            return 0
        self.header[_H_DIRTY] = 1
        self.slot_doc[slots] = -1
        self.map[docs[held]] = 0
        idle = slots[self.slot_stamp[slots] < self.oldest_read()]  # the rest: taken by eviction once idle
        cls = np.searchsorted(self.base, idle, side="right") - 1
        for c in np.unique(cls).tolist():
            freed = idle[cls == c].astype(np.int32)
            lo, free = int(self.base[c]), int(self.free_count[c])
            self.free[lo + free: lo + free + len(freed)] = freed
            self.free_count[c] = free + len(freed)
        self.header[_H_DIRTY] = 0
        self.count("forgotten", len(slots))
        return len(slots)

    def cached_documents(self) -> np.ndarray:
        """Sorted doc numbers of every record held."""
        return np.sort(self.slot_doc[self.slot_doc >= 0])

    def stats(self) -> dict[str, Any]:
        """Counters (shared by every process of the segment), slots, entries, bytes of records held."""
        used = self.plan.slots - self.free_count
        out: dict[str, Any] = {name: int(v) for name, v in zip(COUNTERS, self.counters.tolist())}
        out.update(entries=int(used.sum()), slots=int(self.plan.slots.sum()), classes=len(self.arenas),
                   record_bytes=int((used * self.plan.slot_bytes).sum()), arena_bytes=self.plan.arena_bytes,
                   bytes=self.plan.nbytes, policy=self.plan.policy)
        return out




def _runs(sorted_values: np.ndarray) -> list[tuple[int, int]]:
    """[(start, stop)] of the runs of equal values in `sorted_values`."""
    if not len(sorted_values):
        return []
    edges = np.flatnonzero(np.diff(sorted_values)) + 1
    bounds = np.concatenate([[0], edges, [len(sorted_values)]]).tolist()
    return list(zip(bounds[:-1], bounds[1:]))
