"""The host read buffers: page-aligned anonymous mappings, pooled and guarded against reuse
while a read may still target them."""

from __future__ import annotations

import mmap
import threading

import numpy as np

from .engines.base import CANARY, ReturnGuard

__all__ = ["BufferPool"]


def _mmap_span(buf: mmap.mmap) -> tuple[int, int]:
    return int(np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]), len(buf)


def _mmap_fill(buf: mmap.mmap) -> None:
    np.frombuffer(buf, dtype=np.uint8).fill(CANARY)


def _mmap_intact(buf: mmap.mmap) -> bool:
    return bool((np.frombuffer(buf, dtype=np.uint8) == CANARY).all())


class BufferPool:
    """Page-aligned anonymous buffers, reused across reads.

    A fresh mapping costs a page fault per 4 KiB on first touch; reusing buffers keeps that
    off the read path. Buffers are kept in power-of-two size classes up to `retain_bytes`
    in total; beyond that a released buffer is dropped.

    Every buffer that comes back passes the ownership check (`engines.base.ReturnGuard`):
    one that a read in flight still targets is quarantined, never reused, until the read
    drains (an OwnershipError under the strict policy, unless the caller said so).
    """

    MIN_BYTES = 1 << 16

    def __init__(self, retain_bytes: int = 64 << 20) -> None:
        self.retain_bytes = retain_bytes
        self._free: dict[int, list[mmap.mmap]] = {}
        self._retained = 0
        self._in_use = 0
        self._lock = threading.Lock()
        self._guard = ReturnGuard("host read buffer", _mmap_span, _mmap_fill, _mmap_intact)

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(BufferPool.MIN_BYTES, 1 << (max(1, nbytes) - 1).bit_length())

    def acquire(self, nbytes: int) -> mmap.mmap:
        if self._guard.quarantined:
            for buf in self._guard.reclaim():
                self._keep(buf)
        size = self.size_class(nbytes)
        with self._lock:
            self._in_use += 1
            free = self._free.get(size)
            if free:
                self._retained -= size
                buf = free.pop()
            else:
                buf = None
        if buf is None:
            return mmap.mmap(-1, size)
        try:
            self._guard.handing_out(buf)
        except BaseException:
            with self._lock:
                self._in_use -= 1
            raise
        return buf

    def release(self, buf: mmap.mmap, in_flight: bool = False) -> None:
        """Give `buf` back. in_flight: the caller knows reads may still target it (a failure
        it could not drain): it is quarantined until they have drained, without an error."""
        with self._lock:
            self._in_use -= 1
        if self._guard.give_back(buf, known_in_flight=in_flight):
            self._keep(buf)

    def _keep(self, buf: mmap.mmap) -> None:
        size = len(buf)
        with self._lock:
            if size == self.size_class(size) and self._retained + size <= self.retain_bytes:
                self._free.setdefault(size, []).append(buf)
                self._retained += size
                return
        self._guard.forget(buf)

    def check(self) -> None:
        """Check that no free buffer changed since it came back (canary policy; tests)."""
        with self._lock:
            free = [b for bufs in self._free.values() for b in bufs]
        self._guard.check(free)

    def stats(self) -> dict[str, int]:
        """free buffers, bytes they hold, buffers handed out and not back, quarantined ones."""
        with self._lock:
            free = sum(len(b) for b in self._free.values())
            retained, in_use = self._retained, self._in_use
        return {"free": free, "retained_bytes": retained, "in_use": in_use, "quarantined": self._guard.quarantined}

    def clear(self) -> None:
        with self._lock:
            for bufs in self._free.values():
                for buf in bufs:
                    self._guard.forget(buf)
            self._free.clear()
            self._retained = 0
