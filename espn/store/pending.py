"""Reads in flight: a backend's `Fetch`, and `PendingRead`, which groups several submissions
and parses them together (into a ReadBatch) or hands their records over (a RecordBatch)."""

from __future__ import annotations

import abc
import dataclasses
import errno
from concurrent.futures import Executor, Future
from typing import Callable, Protocol

import numpy as np
import torch

from ..errors import IndexCorruptError
from .engines.faults import current_faults
from .format import StoreLayout
from .gather import gather_records
from .records import Buffer, ReadBatch, RecordBatch

__all__ = ["Fetch", "DeferredFetch", "FetchPart", "PendingRead", "ReadSource", "complete_parts", "hand_over_parts"]


class ReadSource(Protocol):
    """What a PendingRead needs of its reader (`espn.store.reader.Reader` provides it)."""

    layout: StoreLayout
    device: torch.device

    def start_fetches(self, doc_numbers: np.ndarray) -> list[FetchPart]: ...


class Fetch(abc.ABC):
    """One backend read in flight (what `Reader._submit` returns)."""

    #: The records are in memory already (a cache's hits): `complete` does not wait on storage.
    in_memory = False

    @abc.abstractmethod
    def complete(self) -> tuple[Buffer, np.ndarray, int, int]:
        """Wait for the read; (buffer, starts, bytes_read, ios) as `Reader._fetch` returns them."""

    def release(self) -> None:
        """The buffer has been parsed, or is abandoned: give it back (pooled backends) once no
        read targets it any more (drain it first, or quarantine it). Idempotent."""

    def cancel(self) -> None:
        """Withdraw what has not been handed to the storage yet (a search being abandoned);
        `complete` or `release` still reaps the rest."""


class DeferredFetch(Fetch):
    """The default for backends without asynchronous reads: `fetch` (the reader's `_fetch`)
    runs at `complete`."""

    def __init__(self, fetch: Callable[[np.ndarray, np.ndarray], tuple[Buffer, np.ndarray, int, int]],
                 offsets: np.ndarray, lengths: np.ndarray) -> None:
        self._call = (fetch, offsets, lengths)

    def complete(self) -> tuple[Buffer, np.ndarray, int, int]:
        fetch, offsets, lengths = self._call
        done = fetch(offsets, lengths)
        buffer, starts = done[0], done[1]
        size = buffer.numel() if isinstance(buffer, torch.Tensor) else buffer.size
        # The native scorer reads records by address without bounds: a record past its buffer's
        # end would be scored from whatever memory follows, so it is refused here.
        if len(starts) and int(np.max(starts + lengths)) > size:
            raise IndexCorruptError(f"a record ends past the {size}-byte buffer it was fetched into "
                                    f"(at byte {int(np.max(starts + lengths))})")
        return done


@dataclasses.dataclass
class FetchPart:
    """Documents of one request and the fetch bringing them (what `Reader.start_fetches` returns:
    one part, or several where the documents come from different places, such as a cache's
    hits and the misses read from storage).

    positions: [len(docs)] rows of the request these documents fill; None: all of them, in order.
    """

    docs: np.ndarray
    n_bow: np.ndarray
    fetch: Fetch | None
    positions: np.ndarray | None = None


class PendingRead:
    """Reads in flight, parsed together: `submit` adds documents (their reads start at once),
    `result()` waits for every one and parses them into one ReadBatch.

    A search submits each prefetch wave and then its misses into one group and scores the
    result in one call: one gather into preallocated tensors, however many waves there were,
    and (with `select`) only of the documents that are finally scored. Call `result()` or
    `discard()` on the thread that submitted: ring-based engines keep a ring per thread.
    """

    def __init__(self, reader: ReadSource, started: "list[_Part] | None" = None, requests: int = 0) -> None:
        """started, requests: parts another read started, and how many submits it had (its split)."""
        self._reader = reader
        self._parts: list[_Part] = started or []
        self._result: ReadBatch | None = None
        self._requests = requests

    def submit(self, doc_numbers: np.ndarray, executor: Executor | None = None) -> "PendingRead":
        """Start reading more documents; returns self.

        With an executor, the planning, the submission and the wait for completion run on one
        of its threads (which owns its I/O ring): the caller pays one future per call, so a
        search thread scanning clusters is not slowed by reads it starts.
        """
        if self._result is not None:
            raise ValueError("this read has already been parsed; submit into a new one")
        request = self._requests
        self._requests += 1
        if executor is None:
            self._parts.extend(_Part.started(part, request) for part in self._reader.start_fetches(doc_numbers))
        else:
            reader = self._reader

            def start_and_wait() -> list[_Part]:
                parts = [_Part.started(part, request) for part in reader.start_fetches(doc_numbers)]
                try:
                    for part in parts:
                        part.wait()
                except BaseException:
                    for part in parts:
                        part.release()
                    raise
                return parts

            try:
                future = executor.submit(start_and_wait)
            except RuntimeError:  # the executor is shut down (its owner is closing): read here instead
                self._parts.extend(_Part.started(part, request) for part in self._reader.start_fetches(doc_numbers))
                return self
            self._parts.append(_Part(np.zeros(0, np.int64), np.zeros(0, np.int64), None, request=request,
                                     future=future))
        return self

    def wait(self) -> None:
        """Wait for the I/O of everything submitted so far, without parsing it."""
        for part in self._parts:
            part.wait()

    def result(self, select: np.ndarray | None = None) -> ReadBatch:
        """Wait for every read and parse it, once.

        select: sorted unique doc numbers to parse (each must have been submitted), one row each,
        in no particular order (`ReadBatch.docs` and `rows_of` say which row holds which).
        None: every submitted document, in submission order (duplicates keep their rows).
        """
        if self._result is None:
            parts, self._parts = self._parts, []
            self._result = complete_parts(parts, select, self._reader.layout, self._reader.device)
        return self._result

    def records(self, select: np.ndarray | None = None) -> RecordBatch:
        """Wait for every read and hand over the records where they lie, unparsed, once.

        select: as for `result`. The caller owns the buffers until `RecordBatch.release()`.
        """
        if self._result is not None:
            raise ValueError("this read has already been parsed")
        parts, self._parts = self._parts, []
        return hand_over_parts(parts, select)

    def split_in_memory(self) -> list[tuple[np.ndarray, "PendingRead"]]:
        """This read as separate reads, each with its doc numbers: the parts already in memory (a
        cache's hits) first, then those still in flight, so that a search scores the first while
        the others are read. One read (self) when nothing or everything is in memory, or a part
        was started on an executor (its split is known only once it has been waited for)."""
        parts = self._parts
        ready = [part.future is None and part.fetch is not None and part.fetch.in_memory for part in parts]
        if not any(ready) or all(ready) or any(part.future is not None for part in parts):
            return [(np.concatenate([part.docs for part in parts] + [np.zeros(0, np.int64)]), self)]
        if self._result is not None:
            raise ValueError("this read has already been parsed")
        self._parts = []
        groups = ([p for p, r in zip(parts, ready) if r], [p for p, r in zip(parts, ready) if not r])
        return [(np.concatenate([part.docs for part in group]), PendingRead(self._reader, group, self._requests))
                for group in groups]

    def discard(self) -> None:
        """Cancel what has not gone to the storage yet and wait for the rest without parsing
        it (a search that failed part-way, or was abandoned). Cancellations are not errors."""
        parts, self._parts = self._parts, []
        try:
            for part in parts:
                part.cancel()
            error = _wait_all(parts)  # every read must finish before the buffers go back
        finally:
            for part in parts:
                part.release()
        if error is not None and getattr(error, "errno", None) != errno.ECANCELED:
            raise error


@dataclasses.dataclass
class _Part:
    """One fetch of a PendingRead: its documents, their BOW counts, the fetch in flight and,
    once waited for, what the fetch brought. A part started on an executor stands for every
    part its request split into (`extra` holds the others once it has been waited for)."""

    docs: np.ndarray
    n_bow: np.ndarray
    fetch: Fetch | None
    done: tuple[Buffer, np.ndarray, int, int] | None = None
    request: int = 0  # which submit of the PendingRead
    positions: np.ndarray | None = None  # rows of that submit (FetchPart.positions)
    future: Future | None = None  # started and waited for on an executor thread
    extra: list["_Part"] = dataclasses.field(default_factory=list)

    @staticmethod
    def started(part: FetchPart, request: int) -> "_Part":
        return _Part(part.docs, part.n_bow, part.fetch, request=request, positions=part.positions)

    def wait(self) -> tuple[Buffer, np.ndarray, int, int] | None:
        if self.future is not None:
            future, self.future = self.future, None
            if future.cancelled():  # cancelled before it started: nothing was read
                return None
            ran: list[_Part] = future.result()  # re-raises the worker's error
            first, self.extra = ran[0], ran[1:]
            self.docs, self.n_bow, self.fetch, self.done = first.docs, first.n_bow, first.fetch, first.done
            self.positions = first.positions
        if self.done is None and self.fetch is not None:
            self.done = self.fetch.complete()
        return self.done

    def flat(self) -> list["_Part"]:
        """This part and the others of its request started beside it (once waited for)."""
        return [self, *self.extra]

    def cancel(self) -> None:
        if self.future is not None:
            self.future.cancel()  # not started yet: it never will be
        elif self.fetch is not None and self.done is None:
            self.fetch.cancel()

    def release(self) -> None:
        if self.future is not None:  # abandoned: the worker's read must end before its buffer goes back
            future, self.future = self.future, None
            if not future.cancel() and future.exception() is None:
                for part in future.result():
                    part.release()
        if self.fetch is not None:
            self.fetch.release()
            self.fetch = None
        extra, self.extra = self.extra, []
        for part in extra:
            part.release()


def _fault_point(name: str) -> None:
    """Where a test's fault injector may interrupt the read path between syscalls."""
    faults = current_faults()
    if faults is not None:
        faults.point(name)


def _wait_all(parts: list[_Part]) -> BaseException | None:
    """Wait for every part, even after one fails; the first error, or None."""
    error: BaseException | None = None
    for part in parts:
        try:
            part.wait()
        except BaseException as exc:
            error = error or exc
    return error


def _pick(parts: list[_Part], select: np.ndarray) -> list[np.ndarray]:
    """Per part, which of its documents become rows: each of the sorted `select` once."""
    select = np.asarray(select, dtype=np.int64)
    taken = np.zeros(len(select), dtype=bool)
    picks = []
    for docs in (p.docs for p in parts):
        if len(select) == 0 or len(docs) == 0:
            picks.append(np.zeros(0, dtype=np.int64))
            continue
        at = np.minimum(np.searchsorted(select, docs), len(select) - 1)
        idx = np.flatnonzero((select[at] == docs) & ~taken[at])
        idx = idx[np.unique(at[idx], return_index=True)[1]]  # one row per document
        taken[at[idx]] = True
        picks.append(idx)
    if not taken.all():
        raise ValueError("select names documents that were never submitted")
    return picks


def complete_parts(parts: list[_Part], select: np.ndarray | None, lay: StoreLayout,
                   device: torch.device) -> ReadBatch:
    """Wait for every part and gather the wanted rows into one preallocated batch on `device`
    (with no `select`, in the order the documents were submitted)."""
    try:
        error = _wait_all(parts)  # every read finished (or failed) before any buffer is parsed
        if error is not None:
            raise error
        _fault_point("gather")
        flat = [piece for part in parts for piece in part.flat()]
        picks = [np.arange(len(p.docs)) for p in flat] if select is None else _pick(flat, select)
        counts = [p.n_bow[pick] for p, pick in zip(flat, picks)]
        n = sum(len(c) for c in counts)
        total = int(sum(int(c.sum()) for c in counts))
        cls = torch.empty((n, lay.d_cls), dtype=torch.float16, device=device)
        vectors = torch.empty((total, lay.d_bow), dtype=torch.float16, device=device)
        row_docs = np.zeros(n, dtype=np.int64)
        offsets = np.zeros(n + 1, dtype=np.int64)
        bytes_read = ios = 0
        row = vec = 0
        for part, pick, count in zip(flat, picks, counts):
            if part.done is None:
                continue
            buffer, starts, got_bytes, got_ios = part.done
            bytes_read, ios = bytes_read + int(got_bytes), ios + int(got_ios)
            if len(pick):
                m, t = len(pick), int(count.sum())
                gather_records(buffer, np.asarray(starts)[pick], count, lay,
                               cls_out=cls[row: row + m], vectors_out=vectors[vec: vec + t])
                row_docs[row: row + m] = part.docs[pick]
                np.cumsum(count, out=offsets[row + 1: row + m + 1])
                offsets[row + 1: row + m + 1] += vec
                row, vec = row + m, vec + t
        batch = ReadBatch(cls=cls, vectors=vectors, offsets=offsets, bytes_read=bytes_read, ios=ios, docs=row_docs)
        order = _submission_order(flat) if select is None else None
    finally:
        for part in parts:
            part.release()
    return batch if order is None else _reorder(batch, order)


def _submission_order(flat: list[_Part]) -> np.ndarray | None:
    """The gathered rows (parts in turn) in submission order: None when they already are, else the
    permutation (a request split into parts, e.g. a cache's hits and misses)."""
    if all(part.positions is None for part in flat):
        return None
    sizes = np.zeros(max(part.request for part in flat) + 1, dtype=np.int64)
    for part in flat:
        sizes[part.request] += len(part.docs)
    base = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    keys = np.concatenate([base[part.request] + (np.arange(len(part.docs)) if part.positions is None
                                                 else part.positions) for part in flat])
    return np.argsort(keys, kind="stable")


def _reorder(batch: ReadBatch, order: np.ndarray) -> ReadBatch:
    """`batch` with its rows taken in `order` (one index_select per tensor)."""
    counts = np.diff(batch.offsets)[order]
    offsets = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    vector_rows = np.repeat(batch.offsets[:-1][order] - offsets[:-1], counts) + np.arange(int(offsets[-1]))
    device = batch.cls.device
    return ReadBatch(cls=batch.cls.index_select(0, torch.from_numpy(order).to(device)),
                     vectors=batch.vectors.index_select(0, torch.from_numpy(vector_rows).to(device)),
                     offsets=offsets, bytes_read=batch.bytes_read, ios=batch.ios,
                     docs=None if batch.docs is None else batch.docs[order])


def hand_over_parts(parts: list[_Part], select: np.ndarray | None) -> RecordBatch:
    """Wait for every part; the wanted rows' records in place (the parts are released by the batch)."""
    try:
        error = _wait_all(parts)
        if error is not None:
            raise error
        _fault_point("gather")
        flat = [piece for part in parts for piece in part.flat()]
        picks = [np.arange(len(p.docs)) for p in flat] if select is None else _pick(flat, select)
        used = [i for i, (part, pick) in enumerate(zip(flat, picks)) if part.done is not None and len(pick)]
        buffers = [flat[i].done[0] for i in used]  # type: ignore[index]
        docs = [flat[i].docs[picks[i]] for i in used]
        batch = RecordBatch(
            docs=np.concatenate(docs) if docs else np.zeros(0, np.int64),
            n_bow=np.concatenate([flat[i].n_bow[picks[i]] for i in used]) if used else np.zeros(0, np.int64),
            buffers=buffers,
            buffer_of=np.repeat(np.arange(len(used), dtype=np.int64), [len(d) for d in docs]),
            starts=np.concatenate([np.asarray(flat[i].done[1], dtype=np.int64)[picks[i]] for i in used])  # type: ignore[index]
            if used else np.zeros(0, np.int64),
            bytes_read=sum(int(p.done[2]) for p in flat if p.done is not None),
            ios=sum(int(p.done[3]) for p in flat if p.done is not None),
            _parts=parts)
    except BaseException:
        for part in parts:
            part.release()
        raise
    return batch
