"""An optional hot-record cache in front of a reader, within an explicit RAM budget.

Query streams are skewed: a few documents are candidates for many queries. `CachedReader`
keeps the records of the frequently asked-for documents in RAM and reads only the others
from the wrapped reader, so the SSD serves the long tail and RAM the head.

Storage is numpy only: one preallocated arena of `budget_bytes // slot_bytes` fixed-size
slots, a doc -> slot map ([N] int32, -1: not cached) and a slot -> doc map. The slot size is
a high percentile of the record lengths (`SLOT_PERCENTILE`), so most records fit one slot;
longer ones are never cached (they are read, as before). No Python object per record.

Admission is by frequency (TinyLFU): a count-min sketch (`FrequencySketch`) counts every
document asked for, halving its counters every `10 x width` additions so old popularity
fades. A record that was read from storage enters a free slot if there is one; otherwise
it replaces a sampled resident only when it has been asked for more often than that
resident. One scan over many cold documents therefore leaves the hot set in place.

Reads are exact: hits are copied out of the arena under the cache's lock (an admission
cannot overwrite a slot being copied), misses go to the wrapped reader in one submission,
and the two are laid into one buffer that the base class parses like any other.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..errors import InvalidParameterError
from .pending import Fetch, PendingRead
from .reader import Reader
from .engines.errors import StoreClosedError

__all__ = ["FrequencySketch", "CachedReader", "SLOT_PERCENTILE", "with_record_cache"]

#: Slot size = this percentile of the record lengths (rounded up to 64 bytes).
SLOT_PERCENTILE = 95.0
#: Readers the cache may front: those that read each request from storage into a buffer of
#: their own (memory already holds everything; mmap's page cache is a cache of its own).
CACHEABLE = ("posix",)
#: Residents sampled per admission candidate when the arena is full.
VICTIM_SAMPLES = 4
_MiB = 1 << 20


class FrequencySketch:
    """Count-min sketch of how often each key (doc number) was asked for, with aging.

    depth rows of `width` uint16 counters (width a power of two); estimate = the minimum
    over the rows. Every `10 x width` additions all counters are halved (TinyLFU's reset),
    which bounds them well below 2^16 and lets the estimate follow a changing stream.
    """

    def __init__(self, width: int, depth: int = 4, seed: int = 0) -> None:
        if width < 16:
            raise InvalidParameterError(f"width must be >= 16, got {width}")
        self.width = 1 << (int(width) - 1).bit_length()
        self._shift = np.uint64(64 - self.width.bit_length() + 1)
        rng = np.random.default_rng(seed)
        # Odd multipliers: multiply-shift hashing of 64-bit keys.
        self._mul = rng.integers(1, 2**63, size=depth, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._table = np.zeros((depth, self.width), dtype=np.uint16)
        self._rows = np.arange(depth)[:, None]
        self._added = 0
        self.sample_size = 10 * self.width

    @property
    def nbytes(self) -> int:
        return int(self._table.nbytes)

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        """[depth, n] counter index of each key in each row."""
        k = np.asarray(keys, dtype=np.int64).astype(np.uint64)
        with np.errstate(over="ignore"):
            return ((k[None, :] * self._mul[:, None]) >> self._shift).astype(np.int64)

    def add(self, keys: np.ndarray) -> None:
        """Count one more request of each of `keys` ([n] int; repeats count each time)."""
        if len(keys) == 0:
            return
        slots = self._slots(keys)
        for row in range(len(slots)):  # one vectorised add per row (depth rows, not per key)
            np.add.at(self._table[row], slots[row], 1)
        self._added += len(keys)
        if self._added >= self.sample_size:
            self._table >>= 1
            self._added //= 2

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """[n] int64 estimated request counts (never below the true count since the last reset)."""
        if len(keys) == 0:
            return np.zeros(0, dtype=np.int64)
        return self._table[self._rows, self._slots(keys)].min(axis=0).astype(np.int64)


class _CachedFetch(Fetch):
    """Hits already copied out of the arena, plus the misses' read in flight."""

    def __init__(self, cache: "CachedReader", docs: np.ndarray, n_bow: np.ndarray, lengths: np.ndarray,
                 hit: np.ndarray, hit_rows: np.ndarray, misses: PendingRead | None) -> None:
        self._cache = cache
        self._docs, self._n_bow, self._lengths = docs, n_bow, lengths
        self._hit, self._hit_rows = hit, hit_rows
        self._misses = misses

    def complete(self) -> tuple[np.ndarray, np.ndarray, int, int]:
        cache, hit = self._cache, self._hit
        slot_bytes = cache.slot_bytes
        starts = np.zeros(len(self._docs), dtype=np.int64)
        starts[hit] = np.arange(int(hit.sum()), dtype=np.int64) * slot_bytes
        head = len(self._hit_rows) * slot_bytes
        if self._misses is None:
            return self._hit_rows.reshape(-1), starts, 0, 0
        pending, self._misses = self._misses, None
        with pending.records() as batch:
            miss = np.flatnonzero(~hit)
            ends = batch.starts + _lengths_of(batch.docs, self._docs[miss], self._lengths[miss])
            # Lay each read buffer's used span after the hits: one copy per buffer, none per record.
            spans = [int(ends[batch.buffer_of == b].max(initial=0)) for b in range(len(batch.buffers))]
            bases = head + np.concatenate([[0], np.cumsum(spans)[:-1]]).astype(np.int64)
            out = np.empty(head + sum(spans) + slot_bytes, dtype=np.uint8)  # + a slot: admission windows
            out[:head] = self._hit_rows.reshape(-1)
            for b, (buffer, span) in enumerate(zip(batch.buffers, spans)):
                out[int(bases[b]): int(bases[b]) + span] = np.asarray(buffer)[:span]
            rows = batch.rows_of(self._docs[miss])
            starts[miss] = bases[batch.buffer_of[rows]] + batch.starts[rows]
            read_bytes, ios = batch.bytes_read, batch.ios
        cache.admit(self._docs[miss], self._lengths[miss], out, starts[miss])
        return out, starts, read_bytes, ios

    def release(self) -> None:
        pending, self._misses = self._misses, None
        if pending is not None:  # abandoned before completion: the reads must drain first
            pending.discard()


def _lengths_of(rows: np.ndarray, docs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[len(rows)] the length of each of the doc numbers `rows`, all among `docs` ([n], with `lengths`)."""
    order = np.argsort(docs, kind="stable")
    return lengths[order[np.searchsorted(docs[order], rows)]]


class CachedReader(Reader):
    """A reader whose frequently asked-for records are served from an arena in RAM.

    inner: the reader of the storage (posix, kvikio, mmap); budget_bytes: the arena's size
    (the doc -> slot map and the sketch come on top: 4 bytes per document and 8 per slot).
    Host buffers only: the cache is for the CPU path.
    """

    name = "posix"  # what it fronts (CACHEABLE): stats and metrics name the reader that reads
    io_bound = True
    follows_appends = True

    def __init__(self, inner: Reader, budget_bytes: int) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise InvalidParameterError(f"record_cache_mb must be a positive number, got {budget_bytes / _MiB!r}")
        if inner.name not in CACHEABLE or inner.device.type != "cpu":
            raise InvalidParameterError(
                f"the record cache fronts reads from storage into host memory ({', '.join(CACHEABLE)} reader on "
                f"the CPU), not the {inner.name} reader on {inner.device}")
        super().__init__(inner.path, inner.records, inner.layout, inner.device)
        self.inner = inner
        self.slot_bytes = _slot_bytes(inner.records)
        n_slots = int(budget_bytes) // self.slot_bytes
        if n_slots < 1:
            raise InvalidParameterError(f"record_cache_mb={budget_bytes / _MiB:g} holds no record of "
                                        f"{self.slot_bytes} bytes; give at least {self.slot_bytes / _MiB:.3f}")
        self.budget_bytes = int(budget_bytes)
        self._arena = np.empty((n_slots, self.slot_bytes), dtype=np.uint8)
        self._slot_of = np.full(len(inner.records), -1, dtype=np.int32)
        self._doc_of = np.full(n_slots, -1, dtype=np.int64)
        self._used = 0  # slots filled so far (they fill in order, then are replaced)
        self._sketch = FrequencySketch(max(1024, 8 * n_slots))
        self._rng = np.random.default_rng(0)
        self._lock = threading.Lock()
        self._requests = self._hits = self._admitted = self._evicted = 0

    @property
    def engine(self) -> str:
        return self.inner.engine

    @property
    def nbytes(self) -> int:
        """RAM the cache holds: arena, maps and sketch."""
        return int(self._arena.nbytes + self._slot_of.nbytes + self._doc_of.nbytes + self._sketch.nbytes)

    def stats(self) -> dict[str, Any]:
        """Requests, hits, hit rate, admissions and evictions since open; slots and bytes held."""
        with self._lock:
            requests, hits = self._requests, self._hits
            return {"requests": requests, "hits": hits, "hit_rate": hits / requests if requests else 0.0,
                    "admitted": self._admitted, "evicted": self._evicted, "slots": len(self._doc_of),
                    "slots_used": self._used, "slot_bytes": self.slot_bytes, "budget_bytes": self.budget_bytes,
                    "bytes": self.nbytes}

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "record_cache": self.stats()}

    def extend_records(self, records: np.ndarray) -> bool:
        if records is self.records:
            return True
        if not self.inner.extend_records(records):
            return False
        with self._lock:  # rows of older doc numbers are unchanged: their cached records stay valid
            grown = np.full(len(records), -1, dtype=np.int32)
            grown[: len(self._slot_of)] = self._slot_of
            self._slot_of = grown
            self.records, self.file_size = records, self.inner.file_size
        return True

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self.inner.close()

    def start_fetch(self, doc_numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray, Fetch | None]:
        if self.closed:
            raise StoreClosedError(f"the {self.name} reader of {self.path} is closed")
        docs = self._validate(doc_numbers)
        if len(docs) == 0:
            return docs, np.zeros(0, dtype=np.int64), None
        rows = self.records[docs]
        n_bow = np.asarray(rows["n_bow"], dtype=np.int64)
        lengths = np.asarray(rows["length"], dtype=np.int64)
        with self._lock:
            self._sketch.add(docs)
            slots = self._slot_of[docs]
            hit = slots >= 0
            hit_rows = self._arena[slots[hit]]  # a copy, taken before any admission can reuse the slot
            self._requests += len(docs)
            self._hits += int(hit.sum())
        misses = None if hit.all() else self.inner.submit(docs[~hit])
        return docs, n_bow, _CachedFetch(self, docs, n_bow, lengths, hit, hit_rows, misses)

    def admit(self, docs: np.ndarray, lengths: np.ndarray, buffer: np.ndarray, starts: np.ndarray) -> None:
        """Offer records just read (at `starts` in `buffer`, which has a slot of room past its end)."""
        fits = lengths <= self.slot_bytes
        docs, starts = docs[fits], starts[fits]
        if len(docs) == 0:
            return
        docs, first = np.unique(docs, return_index=True)
        starts = starts[first]
        windows = np.lib.stride_tricks.sliding_window_view(buffer, self.slot_bytes)
        with self._lock:
            fresh = self._slot_of[docs] < 0  # another search may have admitted it meanwhile
            docs, starts = docs[fresh], starts[fresh]
            free = min(len(docs), len(self._doc_of) - self._used)
            self._place(docs[:free], starts[:free], np.arange(self._used, self._used + free, dtype=np.int64), windows)
            self._used += free
            if free < len(docs):  # the arena is full: the rest compete with residents
                enter, victims = self._victims(docs[free:])
                self._slot_of[self._doc_of[victims]] = -1
                self._evicted += len(victims)
                self._place(docs[free:][enter], starts[free:][enter], victims, windows)

    def _place(self, docs: np.ndarray, starts: np.ndarray, slots: np.ndarray, windows: np.ndarray) -> None:
        """Copy records (windows of the read buffer at `starts`) into `slots`; under the lock."""
        if len(slots):
            self._arena[slots] = windows[starts]
            self._slot_of[docs] = slots
            self._doc_of[slots] = docs
            self._admitted += len(slots)

    def _victims(self, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For a full arena: (which candidates enter, the slots they take). Each candidate is
        paired with one of the least frequent sampled residents and enters only if it was asked
        for more often (the TinyLFU rule)."""
        freq = self._sketch.estimate(candidates)
        sample = np.unique(self._rng.integers(0, len(self._doc_of), size=VICTIM_SAMPLES * len(candidates)))
        resident = self._sketch.estimate(self._doc_of[sample])
        by_candidate = np.argsort(-freq, kind="stable")
        by_resident = np.argsort(resident, kind="stable")
        m = min(len(candidates), len(sample))
        wins = freq[by_candidate[:m]] > resident[by_resident[:m]]
        return by_candidate[:m][wins], sample[by_resident[:m]][wins]


def _slot_bytes(records: Any) -> int:
    """SLOT_PERCENTILE of the record lengths (of a sample of up to 2^16 rows), rounded up to
    64 bytes (at least 64). records: RECORD_DTYPE rows, or a table indexed like them."""
    if len(records) == 0:
        return 64
    sample = np.random.default_rng(0).integers(0, len(records), size=min(len(records), 1 << 16))
    lengths = np.asarray(records[np.sort(sample)]["length"], dtype=np.int64)
    size = int(np.percentile(lengths, SLOT_PERCENTILE, method="higher"))
    return max(64, -(-size // 64) * 64)


def with_record_cache(reader: Reader, record_cache_mb: float | None) -> Reader:
    """`reader` behind a CachedReader of `record_cache_mb` MiB; 0 or None: the reader itself."""
    if record_cache_mb is None or record_cache_mb == 0:
        return reader
    if isinstance(record_cache_mb, bool) or not isinstance(record_cache_mb, (int, float)) or record_cache_mb < 0:
        raise InvalidParameterError(f"record_cache_mb must be a number >= 0, got {record_cache_mb!r}")
    return CachedReader(reader, int(record_cache_mb * _MiB))
