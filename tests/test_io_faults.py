"""The read engines under injected faults: the kernel never writes into memory handed back.

Real files in tmp_path read with O_DIRECT (the filesystem is probed; where it refuses
O_DIRECT the tests that need it skip, the others run buffered and say so in `direct`),
real rings and AIO contexts. Faults come through the engines' public test hook,
`espn.store.engines.inject_faults`: a FaultInjector sees every syscall (io_uring_enter,
io_submit, io_getevents, preadv), every batch of read results and the gather, and fails,
shortens or interrupts them as a loaded kernel (or a Ctrl-C) would. No private name is
patched.

Every test runs under the strict ownership policy (tests/conftest.py): a buffer given
back to its pool while a read still targets it raises OwnershipError, and given-back
buffers are filled with a canary that is checked when they are handed out again and
once more at the end (`assert_clean`): no byte of a buffer changes after it was given
back. Every read returns exactly the bytes that were written, or a clear error.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import wait_until
from test_store import LAYOUTS, Store, assert_batch_equal, direct_io_supported, random_counts, write_store

from espn.store import PosixReader
from espn.store.buffers import BufferPool
from espn.store.engines import (ENGINES, FaultInjector, IoLimits, OwnershipError, ReadError, StoreClosedError,
                                inject_faults, open_engine)
from espn.store.engines import uring as uring_module
from espn.store.engines.ownership import CANARY, LEDGER

LAYOUT = LAYOUTS[1]  # 4096-byte blocks, records of up to ~3 blocks
AVAILABLE = [name for name, cls in ENGINES.items() if cls.unavailable_reason() is None]
NATIVE = [name for name in ("io_uring", "aio") if name in AVAILABLE]
#: (engine, syscall) pairs the hook can fail: every syscall each engine makes per read.
CALLS = [(e, c) for e, c in [("io_uring", "io_uring_enter"), ("aio", "io_submit"), ("aio", "io_getevents"),
                             ("threads", "preadv")] if e in AVAILABLE]
TRANSIENT = [errno.EAGAIN, errno.EBUSY, errno.ENOMEM, errno.EINTR]
QUICK = IoLimits(max_retries=4, backoff_s=1e-4, max_backoff_s=1e-3)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    rng = np.random.default_rng(22)
    # Unpadded: the last extent comes back short at the end of the file, as in production.
    return write_store(tmp_path_factory.mktemp("faults"), LAYOUT, random_counts(rng, 400, LAYOUT), pad=False)


@pytest.fixture(scope="module")
def direct(store: Store) -> bool:
    return direct_io_supported(store.path, LAYOUT.block_size)


def requests(store: Store, seed: int = 0) -> list[np.ndarray]:
    """Reads of every size: one document, a few, a wave, every document (a backlog at depth 8)."""
    rng = np.random.default_rng(seed)
    n = len(store.records)
    return [np.array([n - 1]), rng.integers(0, n, 5), rng.integers(0, n, 64), np.arange(n), rng.integers(0, n, 200)]


def open_posix(store: Store, engine: str, depth: int = 8, limits: IoLimits | None = None) -> PosixReader:
    return PosixReader(store.path, store.records, store.layout, io_engine=engine, io_depth=depth, io_limits=limits)


def assert_clean(reader: PosixReader) -> None:
    """Every buffer is back and unquarantined, no claim is left, and no byte of a free buffer
    changed since it was given back (a late write by the kernel would show here)."""
    # Not synchronisation: a correct engine has no write left to wait for, so there is no event to
    # wait on. The pause gives a buggy one's stray write, still in the device queue, time to land.
    time.sleep(0.02)
    reader.buffer_pool.check()
    stats = reader.buffer_pool.stats()
    assert stats["in_use"] == 0 and stats["quarantined"] == 0, stats
    assert LEDGER.outstanding() == 0


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


class RandomFaults(FaultInjector):
    """Fails a fraction of the calls named in `calls` with one of `errnos` (seeded, thread-safe)."""

    def __init__(self, calls: set[str], errnos: list[int], rate: float, seed: int = 0) -> None:
        self.calls, self.errnos, self.rate = calls, errnos, rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.injected = 0

    def syscall(self, name: str) -> int:
        if name not in self.calls:
            return 0
        with self.lock:
            if self.rng.random() >= self.rate:
                return 0
            self.injected += 1
            return self.rng.choice(self.errnos)


class InterruptAt(FaultInjector):
    """Raises KeyboardInterrupt at the n-th call of `call` (once), as a Ctrl-C landing there."""

    def __init__(self, call: str, nth: int) -> None:
        self.call, self.nth, self.seen, self.fired = call, nth, 0, 0
        self.lock = threading.Lock()

    def syscall(self, name: str) -> int:
        if name == self.call:
            with self.lock:
                self.seen += 1
                fire = self.seen == self.nth
                self.fired += fire
            if fire:
                raise KeyboardInterrupt
        return 0


class Slow(FaultInjector):
    """Every syscall takes `seconds` longer: a wave stays in flight long enough to close under it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def syscall(self, name: str) -> int:
        time.sleep(self.seconds)  # the slowness injected, not synchronisation
        return 0


# -- transient errors ------------------------------------------------------------------------


@pytest.mark.parametrize("err", TRANSIENT, ids=lambda e: errno.errorcode[e])
@pytest.mark.parametrize("engine,call", CALLS, ids=[f"{e}-{c}" for e, c in CALLS])
def test_transient_errors_at_each_syscall_are_retried(store: Store, direct: bool, engine: str, call: str,
                                                      err: int) -> None:
    faults = RandomFaults({call}, [err], rate=0.3, seed=err)
    with open_posix(store, engine) as reader, inject_faults(faults):
        assert reader.direct == direct
        for docs in requests(store, err):
            assert_batch_equal(reader.read(docs), store.expected(docs))
        # Two in flight on one thread (a prefetch wave and the misses), waited in reverse.
        docs_a, docs_b = requests(store, err + 1)[2], requests(store, err + 1)[4]
        first, second = reader.submit(docs_a), reader.submit(docs_b)
        assert_batch_equal(second.result(), store.expected(docs_b))
        assert_batch_equal(first.result(), store.expected(docs_a))
        assert faults.injected > 0
        assert_clean(reader)


@pytest.mark.parametrize("engine,call", [c for c in CALLS if c[1] != "io_getevents"],
                         ids=[f"{e}-{c}" for e, c in CALLS if c != "io_getevents"])
def test_a_call_that_keeps_failing_ends_in_one_error_naming_file_offset_and_errno(
        store: Store, engine: str, call: str) -> None:
    docs = requests(store)[2]
    with open_posix(store, engine, limits=QUICK) as reader:
        with inject_faults(RandomFaults({call}, [errno.EAGAIN], rate=1.0)), pytest.raises(ReadError) as info:
            reader.read(docs)
        error = info.value
        assert error.errno == errno.EAGAIN and error.filename == str(store.path)
        assert error.offset % LAYOUT.block_size == 0 and 0 <= error.offset < store.path.stat().st_size
        assert f"{store.path} at offset {error.offset}" in str(error) and "EAGAIN" in str(error)
        assert_clean(reader)
        assert_batch_equal(reader.read(docs), store.expected(docs))  # the engine goes on


class FailResults(FaultInjector):
    """Every read completes with -err, as the kernel reports a failed read."""

    def __init__(self, err: int) -> None:
        self.err = err

    def results(self, engine: str, lengths: np.ndarray, results: np.ndarray) -> np.ndarray:
        return np.full_like(results, -self.err)


@pytest.mark.parametrize("engine", AVAILABLE)
def test_a_read_whose_result_stays_transient_fails_after_its_retry_budget(store: Store, engine: str) -> None:
    docs = requests(store)[2]
    with open_posix(store, engine, limits=QUICK) as reader:
        with inject_faults(FailResults(errno.EAGAIN)), pytest.raises(ReadError, match="after 4 retries") as info:
            reader.read(docs)
        assert info.value.errno == errno.EAGAIN and info.value.filename == str(store.path)
        # A hard error is not retried, and does not make the reader give up O_DIRECT.
        direct = reader.direct
        with inject_faults(FailResults(errno.EINVAL)), pytest.raises(ReadError, match="EINVAL"):
            reader.read(docs)
        assert reader.direct == direct
        assert_clean(reader)
        assert_batch_equal(reader.read(docs), store.expected(docs))


@pytest.mark.skipif("io_uring" not in AVAILABLE, reason="io_uring is refused here")
def test_a_read_that_never_completes_is_cancelled_at_the_time_limit() -> None:
    # A read from an empty pipe: the kernel parks it until data comes, i.e. forever.
    r, w = os.pipe()
    engine = ENGINES["io_uring"](depth=4, limits=IoLimits(timeout_s=0.3))
    buffer = np.frombuffer(mmap.mmap(-1, 4096), dtype=np.uint8)
    buffer[:] = CANARY
    zero = np.zeros(1, dtype=np.int64)
    try:
        pending = engine.submit(r, zero, zero + 4096, buffer, zero)
        with pytest.raises(ReadError) as info:
            pending.wait()
        assert info.value.errno == errno.ETIMEDOUT and "pipe:" in str(info.value) and "0.3 s" in str(info.value)
        assert pending.drained  # cancelled (IORING_OP_ASYNC_CANCEL) and reaped: the buffer is free
        os.write(w, b"late")
        out = np.frombuffer(mmap.mmap(-1, 4096), dtype=np.uint8)
        assert engine.submit(r, zero, zero + 4, out, zero).wait().tolist() == [4]  # the ring goes on
        # The pipe gives its bytes once, to the first read waiting: the new read got them, so the
        # cancelled one was no longer waiting and can never write (no pause needed to see it).
        assert out[:4].tobytes() == b"late"
        assert (buffer == CANARY).all()  # the cancelled read never wrote
    finally:
        engine.close()
        os.close(r)
        os.close(w)


# -- exceptions between the steps ------------------------------------------------------------


class RaiseIn(FaultInjector):
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def point(self, name: str) -> None:
        if name == "gather":
            raise self.exc


@pytest.mark.parametrize("engine", AVAILABLE)
def test_an_exception_inside_the_gather_gives_every_buffer_back(store: Store, engine: str) -> None:
    reqs = requests(store, 3)
    with open_posix(store, engine) as reader:
        pending = reader.submit(reqs[2]).submit(reqs[3])  # two waves into one group
        with inject_faults(RaiseIn(RuntimeError("injected in the gather"))), \
                pytest.raises(RuntimeError, match="injected in the gather"):
            pending.result()
        with inject_faults(RaiseIn(KeyboardInterrupt())), pytest.raises(KeyboardInterrupt):
            reader.read(reqs[4])
        assert_clean(reader)
        assert_batch_equal(reader.read(reqs[4]), store.expected(reqs[4]))


@pytest.mark.parametrize("nth", [1, 3])
@pytest.mark.parametrize("engine,call", CALLS, ids=[f"{e}-{c}" for e, c in CALLS])
def test_keyboard_interrupt_at_a_syscall_drains_before_it_propagates(store: Store, engine: str, call: str,
                                                                     nth: int) -> None:
    faults = InterruptAt(call, nth)
    interrupted = 0
    with open_posix(store, engine, depth=4) as reader:
        with inject_faults(faults):
            for docs in requests(store, nth):
                try:
                    batch = reader.read(docs)
                except KeyboardInterrupt:
                    interrupted += 1
                    continue
                assert_batch_equal(batch, store.expected(docs))
        assert faults.fired == 1 and interrupted == 1
        assert_clean(reader)
        docs = requests(store)[3]
        assert_batch_equal(reader.read(docs), store.expected(docs))


@pytest.mark.parametrize("engine", AVAILABLE)
def test_discarding_a_read_cancels_what_the_kernel_has_not_taken(store: Store, engine: str) -> None:
    class Count(FaultInjector):
        def __init__(self) -> None:
            self.completed = 0
            self.lock = threading.Lock()

        def results(self, engine: str, lengths: np.ndarray, results: np.ndarray) -> np.ndarray:
            with self.lock:
                self.completed += len(results)
            return results

    docs = np.arange(len(store.records))
    count = Count()
    with open_posix(store, engine, depth=2) as reader, inject_faults(count):
        pending = reader.submit(docs)
        pending.discard()  # a search abandoned right after it started its reads
        if engine != "threads":  # the threads engine may have read its groups already
            assert count.completed < len(store.records) // 4
        assert_clean(reader)
        assert_batch_equal(reader.read(docs[:50]), store.expected(docs[:50]))


# -- closing under reads in flight -----------------------------------------------------------


@pytest.mark.parametrize("engine", AVAILABLE)
def test_closing_the_reader_from_another_thread_waits_for_the_reads_in_flight(store: Store, engine: str) -> None:
    baseline = open_descriptors()
    reader = open_posix(store, engine, depth=2)
    docs = np.arange(len(store.records))
    submitted = threading.Event()
    outcome: dict[str, object] = {}

    def search() -> None:
        try:
            with inject_faults(Slow(0.001)):
                pending = reader.submit(docs)  # many extents, two in flight at a time
                submitted.set()
                # close() refuses new reads first, then waits for these: it has begun.
                wait_until(lambda: reader.closed, "the reader to start closing", timeout_s=10, interval_s=0.005)
                outcome["batch"] = pending.result()
            try:
                reader.submit(docs[:3])
            except StoreClosedError as exc:
                outcome["after"] = exc
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    worker = threading.Thread(target=search)
    worker.start()
    assert submitted.wait(10)
    reader.close()  # from this thread, while the worker's wave is in flight
    worker.join(30)
    assert "error" not in outcome, outcome.get("error")
    assert_batch_equal(outcome["batch"], store.expected(docs))
    assert isinstance(outcome["after"], StoreClosedError) and "closed" in str(outcome["after"])
    assert_clean(reader)
    assert open_descriptors() == baseline  # the worker's ring and the file are closed


@pytest.mark.parametrize("engine", NATIVE)
def test_a_ring_whose_thread_has_not_waited_yet_is_closed_by_that_thread(store: Store, engine: str,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    baseline = open_descriptors()
    reader = open_posix(store, engine, depth=2, limits=IoLimits(timeout_s=0.3))
    docs = np.arange(len(store.records))
    submitted, closed = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def search() -> None:
        pending = reader.submit(docs)
        submitted.set()
        closed.wait(10)  # waits only after close has given up waiting for it
        outcome["batch"] = pending.result()

    worker = threading.Thread(target=search)
    worker.start()
    assert submitted.wait(10)
    with caplog.at_level(logging.WARNING, logger="espn.store.engines"):
        reader.close()  # returns after timeout_s: the worker's reads are still in flight
    closed.set()
    worker.join(30)
    assert any("still has" in r.getMessage() and "in flight" in r.getMessage() for r in caplog.records)
    assert_batch_equal(outcome["batch"], store.expected(docs))  # the worker's reads completed intact
    assert_clean(reader)
    assert open_descriptors() == baseline  # its thread released the ring once drained


def test_a_closed_engine_refuses_reads_with_a_clear_error(store: Store) -> None:
    for name in AVAILABLE:
        engine = open_engine(name, 4)
        engine.close()
        buffer = np.frombuffer(mmap.mmap(-1, 4096), dtype=np.uint8)
        one = np.zeros(1, dtype=np.int64)
        fd = os.open(store.path, os.O_RDONLY)
        try:
            with pytest.raises(StoreClosedError, match=f"{name} engine is closed"):
                engine.submit(fd, one, one + 4096, buffer, one)
        finally:
            os.close(fd)
    reader = open_posix(store, AVAILABLE[0])
    reader.close()
    with pytest.raises(StoreClosedError, match="reader .* is closed"):
        reader.read(np.arange(3))


# -- short reads under O_DIRECT --------------------------------------------------------------


class ShortReads(FaultInjector):
    """Multi-block reads come back 1000 bytes short (an unaligned count), as a kernel may
    return them; the engine must re-read from the aligned block holding the rest."""

    def __init__(self) -> None:
        self.shortened = 0
        self.lock = threading.Lock()

    def results(self, engine: str, lengths: np.ndarray, results: np.ndarray) -> np.ndarray:
        cut = (results == lengths) & (lengths >= 2 * LAYOUT.block_size)
        with self.lock:
            self.shortened += int(cut.sum())
        results = results.copy()
        results[cut] -= 1000
        return results


@pytest.mark.parametrize("engine", AVAILABLE)
def test_short_reads_under_o_direct_re_read_the_aligned_block(store: Store, direct: bool, engine: str) -> None:
    if not direct:
        pytest.skip(f"the filesystem of {store.path} refuses O_DIRECT")
    short = ShortReads()
    with open_posix(store, engine) as reader, inject_faults(short):
        for docs in requests(store, 5):
            assert_batch_equal(reader.read(docs), store.expected(docs))
        assert short.shortened > 0
        assert reader.direct  # never falls back mid-flight
        assert_clean(reader)


# -- the pool's check ------------------------------------------------------------------------


@pytest.mark.skipif("io_uring" not in AVAILABLE, reason="io_uring is refused here")
def test_the_pool_refuses_a_buffer_a_read_still_targets() -> None:
    r, w = os.pipe()
    engine = ENGINES["io_uring"](depth=4)
    pool = BufferPool()
    buf = pool.acquire(4096)
    zero = np.zeros(1, dtype=np.int64)
    try:
        pending = engine.submit(r, zero, zero + 4, np.frombuffer(buf, dtype=np.uint8), zero)
        with pytest.raises(OwnershipError, match="still targets it"):
            pool.release(buf)  # the bug this issue is about: the pool says no
        assert pool.stats()["quarantined"] == 1
        assert pool.acquire(4096) is not buf  # never handed out while quarantined
        os.write(w, b"espn")
        assert pending.wait().tolist() == [4]
        assert pool.acquire(4096) is buf  # drained: back from quarantine
        assert pool.stats()["quarantined"] == 0
    finally:
        engine.close()
        os.close(r)
        os.close(w)


def test_the_canary_catches_a_write_into_a_buffer_given_back() -> None:
    pool = BufferPool()
    buf = pool.acquire(1 << 16)
    pool.release(buf)
    pool.check()
    np.frombuffer(buf, dtype=np.uint8)[1234] = 7  # what a late DMA into freed memory looks like
    with pytest.raises(OwnershipError, match="changed after it was given back"):
        pool.check()
    with pytest.raises(OwnershipError, match="changed after it was given back"):
        pool.acquire(1 << 16)


def test_a_buffer_refused_by_the_canary_is_not_counted_as_handed_out() -> None:
    """An acquire that fails its ownership check hands nothing out: the pool's room is as before."""
    pool = BufferPool(retain_bytes=1 << 16)
    buf = pool.acquire(1 << 16)
    pool.release(buf)
    np.frombuffer(buf, dtype=np.uint8)[0] = 7
    with pytest.raises(OwnershipError, match="changed after it was given back"):
        pool.acquire(1 << 16)
    again = pool.acquire(1 << 16)
    pool.release(again)
    assert pool.stats() == {"free": 1, "retained_bytes": 1 << 16, "in_use": 0, "quarantined": 0}


def test_a_full_pool_keeps_the_buffers_given_back_last() -> None:
    """Large buffers of a one-off read (a cache being filled) must not hold the pool's room so
    that every later, smaller read maps a fresh buffer: the oldest free buffers make way."""
    pool = BufferPool(retain_bytes=1 << 20)
    big = [pool.acquire(512 << 10) for _ in range(2)]
    for buf in big:
        pool.release(buf)
    assert pool.stats()["retained_bytes"] == 1 << 20
    small = pool.acquire(64 << 10)
    pool.release(small)
    stats = pool.stats()
    assert stats["retained_bytes"] == (512 << 10) + (64 << 10) and stats["free"] == 2, stats
    assert pool.acquire(64 << 10) is small  # reused, not a fresh mapping
    assert pool.acquire(512 << 10) is big[1]  # the one given back last stayed
    assert pool.acquire(2 << 20) is not None and pool.stats()["in_use"] == 3
    pool.clear()
    assert pool.stats()["free"] == 0


def test_the_pool_counts_the_buffers_it_hands_out_against_its_size() -> None:
    """Free buffers make room for those handed out, so a pool's RAM peaks at its size: a batch's
    large reads no longer come on top of a full pool of free buffers."""
    pool = BufferPool(retain_bytes=1 << 20)
    quarters = [pool.acquire(256 << 10) for _ in range(4)]
    for buf in quarters:
        pool.release(buf)
    assert pool.stats()["retained_bytes"] == 1 << 20
    half = pool.acquire(512 << 10)  # a new mapping: two free quarters make way for it
    assert pool.stats()["retained_bytes"] == 512 << 10
    quarter = pool.acquire(256 << 10)  # a free one, reused
    assert quarter in quarters and pool.stats()["retained_bytes"] == 256 << 10
    over = pool.acquire(2 << 20)  # more than the pool: handed out, nothing free is left
    assert pool.stats()["retained_bytes"] == 0
    for buf in (over, half, quarter):  # the one larger than the pool is dropped, the others kept
        pool.release(buf)
    assert pool.stats()["retained_bytes"] == (512 << 10) + (256 << 10)


def test_a_read_takes_the_smallest_free_buffer_up_to_four_times_its_size() -> None:
    """A record cache's misses vary in size from query to query: a free buffer somewhat larger
    than a read needs serves it instead of a fresh mapping, and only the smallest such, so large
    ones stay for large reads; a free buffer far larger stays for a read that needs it."""
    assert BufferPool.REUSE_LARGER == 4
    pool = BufferPool(retain_bytes=4 << 20)
    bufs = {size: pool.acquire(size) for size in (128 << 10, 512 << 10, 2 << 20)}
    for buf in bufs.values():
        pool.release(buf)
    assert pool.acquire(100 << 10) is bufs[128 << 10]  # its own class
    assert pool.acquire(200 << 10) is bufs[512 << 10]  # 256 KiB class: the 512 KiB buffer, not the 2 MiB one
    fresh = pool.acquire(64 << 10)  # the 2 MiB buffer is 32 times its class: a new mapping
    assert fresh is not bufs[2 << 20] and len(fresh) == 64 << 10
    assert pool.stats()["in_use"] == 3 and pool.stats()["retained_bytes"] == 2 << 20
    data = np.frombuffer(pool.acquire(3 << 20), dtype=np.uint8)  # a fresh private mapping, page-aligned
    assert data.__array_interface__["data"][0] % mmap.PAGESIZE == 0 and not data.any()


def test_every_posix_reader_of_a_process_reads_into_one_pool_and_a_forked_child_gets_its_own(store: Store) -> None:
    """A server of many indexes keeps one pool of read buffers, not one per index; closing one
    index's reader leaves the others' buffers alone; a child forked while it is held starts afresh
    (the parent's lock may be held at the fork, and its buffers are not the child's to reuse)."""
    first, second = open_posix(store, "threads"), open_posix(store, "threads")
    try:
        assert first.buffer_pool is second.buffer_pool
        with first.submit(np.arange(64)).records() as batch:
            assert len(batch.docs) == 64
        free = first.buffer_pool.stats()["free"]
        assert free >= 1
        first.close()
        assert second.buffer_pool.stats()["free"] == free  # still there for the other reader
        with second.submit(np.arange(64)).records():
            assert second.buffer_pool.stats()["free"] == free - 1  # it took the one the first gave back
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: a new, empty pool
            from espn.store.buffers import process_pool
            os.write(write, b"1" if process_pool() is not second.buffer_pool and not process_pool().stats()["free"]
                     else b"0")
            os._exit(0)
        os.close(write)
        assert os.read(read, 1) == b"1"
        os.close(read)
        os.waitpid(pid, 0)
    finally:
        first.close()
        second.close()


# -- ring indices: acquire / release ---------------------------------------------------------


@pytest.mark.skipif("io_uring" not in AVAILABLE, reason="io_uring is refused here")
def test_the_compiled_acquire_release_helper_reads_the_same_bytes(store: Store) -> None:
    """What a weakly ordered machine (ARM64) runs: ring indices through a C helper built at
    first use with the system compiler; it must read exactly what the plain path reads."""
    if uring_module.find_c_compiler() is None:
        pytest.skip("no C compiler here")
    engine = ENGINES["io_uring"](depth=8, atomics="compiled")
    assert engine.atomics == "compiled"
    fd = os.open(store.path, os.O_RDONLY)
    try:
        data = np.fromfile(store.path, dtype=np.uint8)
        offsets = np.arange(0, len(data) - 8192, 4096, dtype=np.int64)[::3]
        lengths = np.full(len(offsets), 8192, dtype=np.int64)
        at = np.arange(len(offsets), dtype=np.int64) * 8192
        buffer = np.frombuffer(mmap.mmap(-1, int(at[-1]) + 8192), dtype=np.uint8)
        assert (engine.submit(fd, offsets, lengths, buffer, at).wait() == 8192).all()
        for off, pos in zip(offsets.tolist(), at.tolist()):
            assert np.array_equal(buffer[pos: pos + 8192], data[off: off + 8192])
    finally:
        engine.close()
        os.close(fd)


def test_without_acquire_release_io_uring_is_passed_over_with_one_log_line(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """On a weakly ordered machine with no C compiler the ring cannot be driven safely: the
    next engine is chosen, and the one log line says why."""
    assert uring_module.ring_index_access("x86_64")[0] == "plain"
    monkeypatch.setattr(uring_module, "find_c_compiler", lambda: None)
    access, why = uring_module.ring_index_access("aarch64")
    assert access is None and "no C compiler" in why and "aarch64" in why
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    uring_module.probe.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="espn.store.engines"):
            engine = open_engine(None)
        try:
            assert engine.name != "io_uring"
        finally:
            engine.close()
        lines = [r.getMessage() for r in caplog.records if r.name == "espn.store.engines"]
        assert len(lines) == 1 and "io_uring" in lines[0] and "no C compiler" in lines[0], lines
    finally:
        uring_module.probe.cache_clear()
