"""The record cache: the records most asked for kept in RAM in front of the posix reader, one
copy shared by the workers of a server.

Query streams are skewed: a few documents are candidates for many queries. `CachedReader`
serves the records it holds from RAM and reads only the others from storage, then offers
those to the cache. Storage is `espn.store.cache_slabs` (every record has a size class: no
length is too long to cache) in a segment of `espn.store.cache_segment` (private, or shared
through /dev/shm by every process given the same `share` key); which records stay is
`espn.store.cache_policy` (TinyLFU admission by default, chosen by measurement).

A request splits into two parts (`Reader.start_fetches`): the hits, read where they lie in
the segment, as the memory reader reads its array (no copy; the read is registered in the
segment's table of reads in flight until its records are scored, and no slot a read may be
reading is overwritten meanwhile), and the misses, read by the wrapped reader in one
submission and offered to the cache when they complete. A read that fails offers nothing. Each slot remembers the file offset of its record and a hit must match it, and a
live index's deleted or replaced documents are dropped (`forget`): the cache never answers
for a record other than the one the current records table names.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidParameterError
from .cache_policy import DEFAULT_POLICY, POLICIES
from .cache_segment import CacheSegment, check_share_key, open_segment, segment_lock
from .cache_slabs import SlabStore, plan_slabs
from .engines.errors import StoreClosedError
from .pending import Fetch, FetchPart
from .reader import Reader

__all__ = ["CachedReader", "RecordCache", "with_record_cache", "segment_documents", "CACHEABLE", "WARM_CHUNK_BYTES"]

logger = logging.getLogger(__name__)

#: Readers the cache may front: those that read each request from storage into a buffer of
#: their own (memory already holds everything; mmap's page cache is a cache of its own).
CACHEABLE = ("posix",)
#: Bytes read per submission while a new cache is filled from the file (`CachedReader.warm`).
WARM_CHUNK_BYTES = 32 << 20
#: A cached reader counts as waiting on storage (prefetch waves may pay) while more than this
#: share of the records asked for are misses, as a running mean with MISS_SHARE_WEIGHT per request.
IO_BOUND_MISSES = 0.02
MISS_SHARE_WEIGHT = 0.1
#: A read's records are offered to the cache on one read in OFFER_ONE_READ_IN while the cache takes
#: in fewer than ADMIT_YIELD of the records offered to it (a running mean per process, YIELD_WEIGHT
#: per offer) and their size classes have no free slot; otherwise on every read. An offer costs
#: 0.4-0.5 ms whatever it brings in (the policy and the copy: numpy calls on small arrays), and a
#: full cache at its steady state takes in 2-4% of what it is offered (SciFact, 5-50% of the
#: table). The sketch still counts every request at lookup, so a record asked for often comes in a
#: few reads later. A cache still learning a stream (the 100,000-document token index at 25% and
#: 50%: 14% and 21% came in) is offered every read, or it would learn four times slower.
#: Measured in docs/benchmarks/io.md.
OFFER_ONE_READ_IN = 4
ADMIT_YIELD = 0.1
YIELD_WEIGHT = 0.1
_MiB = 1 << 20


class RecordCache:
    """A slab store in a memory segment, each operation under the segment's lock."""

    def __init__(self, segment: CacheSegment) -> None:
        self.segment = segment
        self.store = SlabStore(segment.buffer)
        #: The whole segment as bytes: what hits are read from (`lookup`'s starts index it).
        self.arena = np.frombuffer(segment.buffer, dtype=np.uint8)
        self._pid = os.getpid()

    @classmethod
    def open(cls, path: Path, records: Any, budget_bytes: int, share: str | None = None,
             policy: str = DEFAULT_POLICY) -> "RecordCache":
        """The cache of the file at `path` (whose records table is `records`) within `budget_bytes`,
        shared with every process that gives the same `share` key, or private without one."""
        lengths = np.asarray(_all_rows(records)["length"], dtype=np.int64)
        plan = plan_slabs(lengths, budget_bytes, len(records), policy)
        size = plan.regions()["size"][0]
        info = path.stat()
        identity = hashlib.sha1(f"{path.resolve()}|{info.st_dev}|{info.st_ino}|{budget_bytes}|{policy}".encode())
        segment = open_segment(size, share, identity.hexdigest()[:20], lambda buffer: SlabStore.initialise(buffer, plan),
                               SlabStore.is_initialised)
        try:
            return cls(segment)
        except BaseException:
            segment.close()
            raise

    @property
    def created(self) -> bool:
        """Whether this process made the segment (and so may fill it from the file)."""
        return self.segment.created

    def lookup(self, docs: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """(hit mask, starts, read): which of `docs` (records at `offsets`) are held and where each hit's record starts in
        `arena` ([hits] int64). The hits stay as they are until `end_read(read)`; -1: no hit."""
        with self.segment.lock():
            self.store.recover()
            read, tick = self.store.begin_read(self._pid)
            if read < 0:  # every row of the table of reads in flight is taken: read from storage
                return np.zeros(len(docs), dtype=bool), np.zeros(0, dtype=np.int64), -1
            slots = self.store.lookup(docs, offsets, tick)
            hit = slots >= 0
            if not hit.any():
                self.store.end_read(read)
                return hit, np.zeros(0, dtype=np.int64), -1
        return hit, self.store.slot_starts(slots[hit]), read

    def end_read(self, read: int) -> None:
        """The records of `read` (a `lookup`) are no longer read: their slots may change."""
        if read >= 0:
            with self.segment.lock():
                self.store.end_read(read)

    def admit(self, docs: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, buffer: np.ndarray,
              starts: np.ndarray) -> int:
        """Offer records just read (doc i's record at `starts[i]` of `buffer`); duplicates allowed.
        Returns how many came in."""
        if not len(docs):
            return 0
        docs, first = np.unique(docs, return_index=True)
        with self.segment.lock():
            self.store.recover()
            return self.store.admit(docs, offsets[first], lengths[first], buffer, starts[first])

    def forget(self, docs: np.ndarray) -> int:
        with self.segment.lock():
            self.store.recover()
            return self.store.forget(docs)

    def free_slots(self) -> np.ndarray:
        """[k] free slots per size class."""
        with self.segment.lock():
            return self.store.free_count.copy()

    def cached_documents(self) -> np.ndarray:
        """Sorted doc numbers of every record the cache holds."""
        with self.segment.lock():
            self.store.recover()
            return self.store.cached_documents()

    def stats(self) -> dict[str, Any]:
        """The store's counters (every process's, for a shared segment), its size and where it lives."""
        with self.segment.lock():
            out = self.store.stats()
            out["reads_in_flight"] = int((self.store.reads[:, 0] != 0).sum())
        out.update(segment_bytes=self.segment.size, shared=self.segment.shared,
                   segment=None if self.segment.path is None else str(self.segment.path))
        return out

    def close(self) -> None:
        self.segment.close()


def _all_rows(records: Any) -> np.ndarray:
    """Every row of a records table (an array, a memmap or a live index's RecordTable)."""
    return records if isinstance(records, np.ndarray) else records[np.arange(len(records))]


class _ArenaFetch(Fetch):
    """A cache's hits, read where they lie in its segment (until `release` ends the read)."""

    in_memory = True

    def __init__(self, cache: RecordCache, read: int, starts: np.ndarray) -> None:
        self._cache, self._read = cache, read
        self._done = (cache.arena, starts, 0, 0)

    def complete(self) -> tuple[np.ndarray, np.ndarray, int, int]:
        return self._done

    def release(self) -> None:
        read, self._read = self._read, -1
        self._cache.end_read(read)


class _AdmittingFetch(Fetch):
    """The wrapped reader's fetch of the misses; what it brings is offered to the cache."""

    def __init__(self, inner: Fetch, reader: "CachedReader", docs: np.ndarray, offsets: np.ndarray,
                 lengths: np.ndarray) -> None:
        self._inner, self._reader = inner, reader
        self._docs, self._offsets, self._lengths = docs, offsets, lengths

    def complete(self) -> tuple[Any, np.ndarray, int, int]:
        done = self._inner.complete()  # a failed read raises here: nothing is offered
        buffer, starts = done[0], np.asarray(done[1], dtype=np.int64)
        self._reader.offer(self._docs, self._offsets, self._lengths, np.asarray(buffer), starts)
        return done

    def release(self) -> None:
        self._inner.release()

    def cancel(self) -> None:
        self._inner.cancel()


class CachedReader(Reader):
    """The posix reader with the records most asked for served from RAM.

    inner: the reader of the storage (posix, on the CPU); budget_bytes: all the RAM the cache
    may hold (arena and tables); share: processes giving the same key (the workers of one
    server) share one copy; policy: a name of `espn.store.cache_policy.POLICIES`.
    """

    name = "posix"  # what it fronts (CACHEABLE): stats and metrics name the reader that reads
    follows_appends = True

    def __init__(self, inner: Reader, budget_bytes: int, share: str | None = None,
                 policy: str = DEFAULT_POLICY) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise InvalidParameterError(f"record_cache_mb must be a positive number, got {budget_bytes / _MiB!r}")
        if inner.name not in CACHEABLE or inner.device.type != "cpu":
            raise InvalidParameterError(
                f"the record cache fronts reads from storage into host memory ({', '.join(CACHEABLE)} reader on "
                f"the CPU), not the {inner.name} reader on {inner.device}")
        super().__init__(inner.path, inner.records, inner.layout, inner.device)
        self.inner = inner
        self.budget_bytes = int(budget_bytes)
        self.cache = RecordCache.open(inner.path, inner.records, self.budget_bytes, share, policy)
        self._requests = self._hits = self._reads = 0
        self._miss_share = 1.0  # running mean over requests (the first sets it): what `io_bound` reads
        self._admit_yield = 1.0  # running mean of the share of offered records that came in

    @property
    def io_bound(self) -> bool:  # type: ignore[override]  # a class constant in the readers that know it
        """Whether a search should expect to wait on storage: while more than IO_BOUND_MISSES of
        the records asked for lately were misses. A cache that holds what is asked for is read
        like the memory reader, without prefetch waves (which would only add work)."""
        return self._miss_share > IO_BOUND_MISSES

    @property
    def engine(self) -> str:
        return self.inner.engine

    @property
    def nbytes(self) -> int:
        """RAM the cache holds at most: its arena and tables (`SlabPlan.nbytes`)."""
        return self.cache.store.plan.nbytes

    def stats(self) -> dict[str, Any]:
        """This process's requests, hits and hit rate; the cache's own counters and size."""
        requests, hits = self._requests, self._hits
        return {"requests": requests, "hits": hits, "hit_rate": hits / requests if requests else 0.0,
                "budget_bytes": self.budget_bytes, **{f"cache_{k}" if k in ("requests", "hits") else k: v
                                                     for k, v in self.cache.stats().items()}}

    def describe(self) -> dict[str, Any]:
        out = self.inner.describe()
        if self.ram_plan is not None:
            out["ram"] = self.ram_plan
        return {**out, "record_cache": self.stats()}

    def cached_documents(self) -> np.ndarray:
        """Sorted doc numbers whose records the cache holds now."""
        return self.cache.cached_documents()

    def extend_records(self, records: np.ndarray) -> bool:
        if records is self.records:
            return True
        if not self.inner.extend_records(records):
            return False
        self.records, self.file_size = records, self.inner.file_size  # older rows, and their slots, are unchanged
        return True

    def forget(self, doc_numbers: np.ndarray) -> None:
        if len(doc_numbers):
            self.cache.forget(np.asarray(doc_numbers, dtype=np.int64))

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self.inner.close()
        self.cache.close()

    def start_fetches(self, doc_numbers: np.ndarray) -> list[FetchPart]:
        if self.closed:
            raise StoreClosedError(f"the {self.name} reader of {self.path} is closed")
        docs = self._validate(doc_numbers)
        if len(docs) == 0:
            return [FetchPart(docs, np.zeros(0, dtype=np.int64), None)]
        rows = self.records[docs]
        offsets = np.asarray(rows["offset"], dtype=np.int64)
        lengths = np.asarray(rows["length"], dtype=np.int64)
        n_bow = np.asarray(rows["n_bow"], dtype=np.int64)
        hit, starts, read = self.cache.lookup(docs, offsets)
        n_hits = int(hit.sum())
        self._requests += len(docs)
        self._hits += n_hits
        missed = (len(docs) - n_hits) / len(docs)
        self._miss_share = missed if self._requests == len(docs) else \
            self._miss_share + MISS_SHARE_WEIGHT * (missed - self._miss_share)
        if read < 0:
            return [self._misses(docs, offsets, lengths, None)]
        parts = [FetchPart(docs[hit], n_bow[hit], _ArenaFetch(self.cache, read, starts), np.flatnonzero(hit))]
        if n_hits < len(docs):
            parts.append(self._misses(docs, offsets, lengths, ~hit))
        return parts

    def start_fetch(self, doc_numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray, Fetch | None]:
        """Read every record of `doc_numbers` from storage, without looking in the cache (what it
        reads is offered to it); `start_fetches` is the cached path."""
        part = self._misses(*self._rows(doc_numbers), None)
        return part.docs, part.n_bow, part.fetch

    def _rows(self, doc_numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        docs = self._validate(doc_numbers)
        rows = self.records[docs]
        return docs, np.asarray(rows["offset"], dtype=np.int64), np.asarray(rows["length"], dtype=np.int64)

    def _misses(self, docs: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, miss: np.ndarray | None) -> FetchPart:
        """The part read from storage: the documents of `miss` (None: all), offered to the cache."""
        wanted = docs if miss is None else docs[miss]
        if miss is not None:
            offsets, lengths = offsets[miss], lengths[miss]
        got_docs, n_bow, fetch = self.inner.start_fetch(wanted)
        if fetch is not None and self._offer_this_read(lengths):
            fetch = _AdmittingFetch(fetch, self, wanted, offsets, lengths)
        return FetchPart(got_docs, n_bow, fetch, None if miss is None else np.flatnonzero(miss))

    def _offer_this_read(self, lengths: np.ndarray) -> bool:
        """Whether the records of a read (of these lengths) are offered to the cache: always while
        it takes in ADMIT_YIELD of what it is offered or a class of theirs has a free slot, else
        on one read in OFFER_ONE_READ_IN."""
        self._reads += 1
        if self._admit_yield >= ADMIT_YIELD:
            return True
        free = self.cache.store.free_count  # read without the lock: a stale count only shifts one read
        cls = self.cache.store.class_of(lengths)
        if bool(free[cls[cls < len(free)]].any()):
            return True
        return self._reads % OFFER_ONE_READ_IN == 0

    def offer(self, docs: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, buffer: np.ndarray,
              starts: np.ndarray) -> None:
        """Offer the records of a read from storage to the cache (`RecordCache.admit`), and count
        the share that came in."""
        if not len(docs):
            return
        admitted = self.cache.admit(docs, offsets, lengths, buffer, starts)
        self._admit_yield += YIELD_WEIGHT * (admitted / len(docs) - self._admit_yield)

    def warm(self, limit_bytes: int | None = None) -> int:
        """Fill the free slots from the file, in file order, each class with the first records of
        its size, reading at most `limit_bytes` (None: until the cache or the table is full).
        A budget that covers the table thus starts with every record. Returns the records admitted."""
        rows = _all_rows(self.records)
        offsets = np.asarray(rows["offset"], dtype=np.int64)
        lengths = np.asarray(rows["length"], dtype=np.int64)
        chosen = _first_of_each_class(self.cache, offsets, lengths)
        if limit_bytes is not None:
            chosen = chosen[np.cumsum(lengths[chosen]) <= limit_bytes]
        chunk_of = np.cumsum(lengths[chosen]) // WARM_CHUNK_BYTES
        for docs in np.split(chosen, np.flatnonzero(np.diff(chunk_of)) + 1):
            if self.closed or not len(docs):
                break
            with self.inner.submit(docs).records() as batch:
                for b, buffer in enumerate(batch.buffers):
                    mine = np.flatnonzero(batch.buffer_of == b)
                    got = batch.docs[mine]
                    self.cache.admit(got, offsets[got], lengths[got], np.asarray(buffer), batch.starts[mine])
        logger.info("record cache of %s warmed with %d records", self.path, len(chosen))
        return len(chosen)


def _first_of_each_class(cache: RecordCache, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Doc numbers, in file order, of the first records of each size class, as many as it has free slots."""
    free = cache.free_slots()
    cls = cache.store.class_of(lengths)
    order = np.argsort(offsets, kind="stable")
    order = order[(cls[order] < len(free)) & (lengths[order] > 0)]
    by_class = np.argsort(cls[order], kind="stable")
    group_start = np.searchsorted(cls[order][by_class], cls[order][by_class], side="left")
    rank = np.empty(len(order), dtype=np.int64)
    rank[by_class] = np.arange(len(order)) - group_start
    return order[rank < free[cls[order]]]


def with_record_cache(reader: Reader, record_cache_mb: float | None, share: str | None = None,
                      policy: str = DEFAULT_POLICY, warm: bool = False) -> Reader:
    """`reader` behind a CachedReader of `record_cache_mb` MiB (0 or None: the reader itself),
    shared under `share`, filled from the file first with `warm` (by the process that made it)."""
    if record_cache_mb is None or record_cache_mb == 0:
        return reader
    if isinstance(record_cache_mb, bool) or not isinstance(record_cache_mb, (int, float)) or record_cache_mb < 0:
        raise InvalidParameterError(f"record_cache_mb must be a number >= 0, got {record_cache_mb!r}")
    if share is not None:
        check_share_key(share)
    if policy not in POLICIES:
        raise InvalidParameterError(f"record_cache_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    cached = CachedReader(reader, int(record_cache_mb * _MiB), share, policy)
    if warm and cached.cache.created:
        try:
            cached.warm()
        except BaseException:
            cached.close()
            raise
    return cached


def segment_documents(path: Path) -> np.ndarray:
    """Sorted doc numbers whose records the shared segment at `path` holds, read under its lock
    without attaching to it: how a test (or an operator) sees what the workers of a server cache."""
    with segment_lock(path), open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        store = SlabStore(buffer)
        documents = store.cached_documents()
        del store  # its views of the mapping go before the mapping does
    return documents
