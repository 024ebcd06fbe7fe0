"""The portable engine: a thread pool of `os.preadv` calls.

It runs everywhere (no io_uring, no AIO), at the cost of one Python call and one GIL
round trip per extent, so it is the last resort. Each task reads an interleaved group
of extents into slices of the one buffer, so a read of m extents costs `depth` futures,
not m.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from .base import EngineRead, ReadEngine, check_extents

__all__ = ["ThreadsEngine"]


def read_fully(fd: int, view: memoryview, file_offset: int) -> int:
    """preadv until `view` is full or the file ends; the bytes read. Retries EINTR."""
    got = 0
    want = len(view)
    while got < want:
        try:
            n = os.preadv(fd, [view[got:]], file_offset + got)
        except InterruptedError:
            continue
        if n == 0:
            break
        got += n
    return got


class _ThreadsRead(EngineRead):
    def __init__(self, futures: list[Future], counts: np.ndarray) -> None:
        self._futures = futures
        self._counts = counts

    def wait(self) -> np.ndarray:
        wait(self._futures)
        for future in self._futures:
            future.result()  # re-raises the first OSError, now that every task is done
        return self._counts


class ThreadsEngine(ReadEngine):
    """`depth` threads, each reading a group of extents with `os.preadv`."""

    name = "threads"

    def __init__(self, depth: int = 16, **options: Any) -> None:
        super().__init__(depth, **options)
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="espn-io")

    def submit(self, fd: int, file_offsets: np.ndarray, lengths: np.ndarray, buffer: np.ndarray,
               buffer_offsets: np.ndarray) -> EngineRead:
        file_offsets, lengths, buffer_offsets = check_extents(file_offsets, lengths, buffer, buffer_offsets)
        m = len(lengths)
        counts = np.zeros(m, dtype=np.int64)
        whole = buffer.data.cast("B")  # the ndarray as a flat byte view (no copy)
        offsets, sizes, at = file_offsets.tolist(), lengths.tolist(), buffer_offsets.tolist()

        def read_group(indices: range) -> None:
            for i in indices:
                counts[i] = read_fully(fd, whole[at[i]: at[i] + sizes[i]], offsets[i])

        groups = min(m, self.depth)
        if groups <= 1:
            future: Future = Future()
            try:
                read_group(range(m))
                future.set_result(None)
            except OSError as exc:
                future.set_exception(exc)
            return _ThreadsRead([future], counts)
        return _ThreadsRead([self._pool.submit(read_group, range(g, m, groups)) for g in range(groups)], counts)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

