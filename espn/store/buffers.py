"""The read buffers, pooled and guarded against reuse while a read may still target them:
page-aligned host mappings (`BufferPool`) and the kvikio reader's device tensors
(`DeviceBufferPool`, reused once the CUDA event of their parse has completed)."""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import threading
from typing import Protocol

import numpy as np
import torch

from .engines.ownership import CANARY, ReturnGuard

__all__ = ["BufferPool", "DeviceBufferPool", "DEFAULT_DEVICE_POOL_BYTES", "process_pool", "allocate"]

#: Device bytes the buffer pool keeps for reuse (beyond it, released buffers are freed).
DEFAULT_DEVICE_POOL_BYTES = 256 << 20


#: Buffers this large or larger ask for transparent huge pages.
HUGE_PAGE_BYTES = 2 << 20


def allocate(nbytes: int) -> mmap.mmap:
    """A fresh page-aligned buffer: a private anonymous mapping, with huge pages asked for where it
    spans one. Its first touch is the cost (the kernel faults it in under a direct read): for 4 MiB,
    2.8 ms in 4 KiB faults of a shared mapping (`mmap.mmap(-1, n)`, shared memory that a forked
    child would also see), 1.5 ms private, 0.1 ms with huge pages (THP in "madvise" mode)."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without THP: 4 KiB pages
            buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def _mmap_span(buf: mmap.mmap) -> tuple[int, int]:
    return int(np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]), len(buf)


def _mmap_fill(buf: mmap.mmap) -> None:
    np.frombuffer(buf, dtype=np.uint8).fill(CANARY)


def _mmap_intact(buf: mmap.mmap) -> bool:
    return bool((np.frombuffer(buf, dtype=np.uint8) == CANARY).all())


class BufferPool:
    """Page-aligned anonymous buffers, reused across reads.

    A fresh mapping costs a page fault per 4 KiB on first touch (and an munmap when dropped);
    reusing buffers keeps that off the read path. Buffers are kept in power-of-two size classes
    (a read takes the smallest free one of its class or up to REUSE_LARGER times it) while the
    buffers handed out and the free ones together stay within `retain_bytes`; a buffer given
    back, or a new one, makes room by dropping the free buffers given back longest ago, so the
    sizes in use now stay pooled (a few large buffers of a one-off read, such as a cache being
    filled, do not keep every later read on fresh mappings) and the pool's RAM peaks at
    `retain_bytes` or what is handed out at once, not their sum.

    Every buffer that comes back passes the ownership check (`engines.ownership.ReturnGuard`):
    one that a read in flight still targets is quarantined, never reused, until the read
    drains (an OwnershipError under the strict policy, unless the caller said so).
    """

    MIN_BYTES = 1 << 16

    #: The pool's RAM, handed out and free together (the posix readers of a process share one
    #: pool: `process_pool`). Counting only the free buffers (64 MiB of them) let a batch's waves
    #: (`espn.search.centroid_stage.READ_BYTES_IN_FLIGHT`) add their 32 MiB on top: the posix
    #: reader's peak was 354 MiB on SciFact (300 queries and 8 batches of 32). With buffers that a
    #: read may reuse when larger (REUSE_LARGER) and that are cheap to make afresh (`allocate`:
    #: huge pages), 24 MiB costs no latency: side by side on SciFact, the posix process's memory
    #: cgroup peaked 27-30 MiB lower than at 64 MiB with shared 4 KiB-page buffers, single-query
    #: p50 0.87-0.97x and batch-32 0.87-0.98x, with a record cache or without
    #: (docs/benchmarks/io.md). At 16 MiB batches took 1.1x as long.
    RETAIN_BYTES = 24 << 20
    #: A read may take a free buffer up to this many times the size it needs: the pool holds fewer
    #: sizes, and a read whose size varies (a record cache's misses) finds one more often.
    REUSE_LARGER = 4

    def __init__(self, retain_bytes: int = RETAIN_BYTES) -> None:
        self.retain_bytes = retain_bytes
        self._free: dict[int, list[mmap.mmap]] = {}
        self._given_back: collections.OrderedDict[int, mmap.mmap] = collections.OrderedDict()  # free, oldest first
        self._retained = 0
        self._in_use = 0
        self._in_use_bytes = 0
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
        dropped: list[mmap.mmap] = []
        with self._lock:
            fit = min((s for s, bufs in self._free.items() if bufs and size <= s <= size * self.REUSE_LARGER),
                      default=0)
            self._in_use += 1
            self._in_use_bytes += fit or size
            if fit:
                self._retained -= fit
                buf = self._free[fit].pop()
                del self._given_back[id(buf)]
            else:
                buf = None
                dropped = self._make_room(0)
        for old in dropped:
            self._guard.forget(old)
        if buf is None:
            return allocate(size)
        try:
            self._guard.handing_out(buf)
        except BaseException:
            with self._lock:
                self._in_use -= 1
                self._in_use_bytes -= fit
            raise
        return buf

    def release(self, buf: mmap.mmap, in_flight: bool = False) -> None:
        """Give `buf` back. in_flight: the caller knows reads may still target it (a failure
        it could not drain): it is quarantined until they have drained, without an error."""
        with self._lock:
            self._in_use -= 1
            self._in_use_bytes -= len(buf)
        if self._guard.give_back(buf, known_in_flight=in_flight):
            self._keep(buf)

    def _make_room(self, size: int) -> list[mmap.mmap]:
        """Drop free buffers, longest given back first, until `size` more bytes fit beside what is
        handed out and kept (or none is left); under the lock. The dropped, for the guard."""
        dropped = []
        while self._given_back and self._retained + self._in_use_bytes + size > self.retain_bytes:
            _, old = self._given_back.popitem(last=False)
            bufs = self._free[len(old)]
            bufs.pop(next(i for i, b in enumerate(bufs) if b is old))
            self._retained -= len(old)
            dropped.append(old)
        return dropped

    def _keep(self, buf: mmap.mmap) -> None:
        size = len(buf)
        dropped = [buf]
        with self._lock:
            if size == self.size_class(size) and size <= self.retain_bytes:
                dropped = self._make_room(size)
                if self._retained + self._in_use_bytes + size <= self.retain_bytes:
                    self._free.setdefault(size, []).append(buf)
                    self._given_back[id(buf)] = buf
                    self._retained += size
                else:  # what is handed out fills the pool: this one goes too
                    dropped.append(buf)
        for old in dropped:
            self._guard.forget(old)

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
            self._given_back.clear()
            self._retained = 0


_process_pool: BufferPool | None = None
_process_pool_lock = threading.Lock()


def process_pool() -> BufferPool:
    """The host read buffers of this process, shared by every posix reader: a server of many
    indexes (or a live index between two generations) keeps `BufferPool.RETAIN_BYTES` of them in
    all, not that much per index."""
    global _process_pool
    with _process_pool_lock:
        if _process_pool is None:
            _process_pool = BufferPool()
        return _process_pool


def _new_pool_after_fork() -> None:
    """A forked child starts its own pool (its copy of the parent's lock may be held)."""
    global _process_pool, _process_pool_lock
    _process_pool, _process_pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_pool_after_fork)


# -- device buffers --------------------------------------------------------------------------


class _Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def _record_event(device: torch.device) -> _Event:
    """A CUDA event on the current stream of `device` (the stream the parse was queued on)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _allocate_device(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _tensor_span(buf: torch.Tensor) -> tuple[int, int]:
    return int(buf.data_ptr()), int(buf.numel() * buf.element_size())


def _tensor_fill(buf: torch.Tensor) -> None:
    buf.fill_(CANARY)


def _tensor_intact(buf: torch.Tensor) -> bool:
    return bool((buf == CANARY).all())


class DeviceBufferPool:
    """Device byte buffers owned by one reader, reused across reads, guarded by events.

    Buffers come in power-of-two size classes (>= 64 KiB). `release(buf)` records an event
    on the caller's current stream, after the kernels that parse the buffer; `acquire`
    hands a buffer out again only once its event has completed, so kvikio never writes
    into memory a queued kernel may still read. When no free buffer of the class is
    ready, a new one is allocated, unless the pool already holds `retain_bytes`: then it
    waits for the oldest event of the class (the only host wait the pool ever does).
    A buffer released beyond the cap is freed once its event has completed; one that a
    read still targets is quarantined (`engines.ownership.ReturnGuard`).
    """

    def __init__(self, device: torch.device, retain_bytes: int = DEFAULT_DEVICE_POOL_BYTES) -> None:
        self.device = device
        self.retain_bytes = retain_bytes
        self._free: dict[int, list[tuple[torch.Tensor, _Event | None]]] = {}
        self._retiring: list[tuple[torch.Tensor, _Event | None]] = []  # beyond the cap, freed once their event is done
        self._held = 0  # bytes allocated by the pool, in use, free, retiring or quarantined
        self._lock = threading.Lock()
        self._guard = ReturnGuard("device read buffer", _tensor_span, _tensor_fill, _tensor_intact)

    def acquire(self, nbytes: int) -> torch.Tensor:
        if self._guard.quarantined:
            for buf in self._guard.reclaim():
                self._keep(buf)
        size = BufferPool.size_class(nbytes)
        wait: tuple[torch.Tensor, _Event | None] | None = None
        with self._lock:
            self._prune_retiring()
            free = self._free.get(size, [])
            for i, (buf, event) in enumerate(free):
                if event is None or event.query():
                    del free[i]
                    self._guard.handing_out(buf)
                    return buf
            if free and self._held + size > self.retain_bytes:
                wait = free.pop(0)  # the oldest: its parse was queued first
            else:
                self._held += size
        if wait is not None:
            buf, event = wait
            if event is not None:
                event.synchronize()
            self._guard.handing_out(buf)
            return buf
        return _allocate_device(size, self.device)

    def release(self, buf: torch.Tensor, in_flight: bool = False) -> None:
        """Give `buf` back after the kernels that parse it were queued on the current stream.
        in_flight: the caller knows a read may still target it (quarantined, no error)."""
        if self._guard.give_back(buf, known_in_flight=in_flight):
            self._keep(buf)

    def _keep(self, buf: torch.Tensor) -> None:
        event = _record_event(self.device)  # after the parse (and the canary, if any)
        size = buf.numel()
        with self._lock:
            if self._held <= self.retain_bytes:
                self._free.setdefault(size, []).append((buf, event))
            else:
                self._retiring.append((buf, event))

    def _prune_retiring(self) -> None:
        """Under the lock: free the buffers beyond the cap whose parse has run."""
        keep: list[tuple[torch.Tensor, _Event | None]] = []
        for buf, event in self._retiring:
            if event is None or event.query():
                self._held -= buf.numel()
                self._guard.forget(buf)
            else:
                keep.append((buf, event))
        self._retiring = keep

    def check(self) -> None:
        """Check that no free buffer changed since it came back (canary policy; tests)."""
        with self._lock:
            free = [b for bufs in self._free.values() for b, _ in bufs]
        self._guard.check(free)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"free": sum(len(b) for b in self._free.values()), "retiring": len(self._retiring),
                    "held_bytes": self._held, "quarantined": self._guard.quarantined}

    def clear(self) -> None:
        """Drop every free buffer, once the kernels that parse it have run."""
        with self._lock:
            pending = [pair for bufs in self._free.values() for pair in bufs] + self._retiring
            self._free.clear()
            self._retiring = []
            self._held = 0
        for buf, event in pending:
            if event is not None and not event.query():
                event.synchronize()
            self._guard.forget(buf)
