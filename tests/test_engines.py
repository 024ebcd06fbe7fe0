"""Read engines (io_uring, aio, threads) against the plain bytes of a real file.

Real files in tmp_path read with O_DIRECT where the filesystem allows it (the probe says
which), real rings and AIO contexts. Every engine is compared with the file's bytes and
with the portable threads engine: random extents of many sizes, batches far larger than
the ring, extents running past the end of an unpadded file, several submissions in flight
on one thread waited in reverse order, eight threads at once, and failed reads. The only
simulation is a refused io_uring (the syscall wrapper made to answer EPERM, as a seccomp
profile would) to check the fallback to aio. Through the posix reader each engine must
give byte for byte what the in-memory reader gives.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from espn.errors import BackendUnavailableError
from espn.store import MemoryReader, PosixReader
from espn.store.engines import ENGINE_ORDER, ENGINES, ReadEngine, open_engine
from espn.store.engines import aio as aio_module
from espn.store.engines import uring as uring_module
from espn.store.engines.threads import ThreadsEngine
from helpers import run_threads

BLOCK = 4096
FILE_SIZE = 3 * 1024 * 1024 + 1234  # unpadded: the last block is short

AVAILABLE = [name for name, cls in ENGINES.items() if cls.unavailable_reason() is None]
NATIVE = [name for name in ("io_uring", "aio") if name in AVAILABLE]


def aligned_buffer(nbytes: int) -> np.ndarray:
    """Page-aligned writable uint8 buffer (what O_DIRECT needs), like the reader's pool."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)


class DataFile:
    """Random bytes on disk, with an O_DIRECT descriptor where the filesystem allows it."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.data = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
        path.write_bytes(self.data.tobytes())
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        probe = aligned_buffer(BLOCK)
        try:
            os.preadv(self.fd, [memoryview(probe)], 0)
            self.direct = True
        except OSError:  # accepted at open, refused at read: buffered reads instead
            os.close(self.fd)
            self.fd = os.open(path, os.O_RDONLY)
            self.direct = False

    def expected(self, offsets: np.ndarray, lengths: np.ndarray, buffer_offsets: np.ndarray,
                 nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        """What a correct engine returns: counts [m] and the buffer (zeros past each count)."""
        counts = np.clip(len(self.data) - offsets, 0, lengths)
        out = np.zeros(nbytes, dtype=np.uint8)
        for off, n, at in zip(offsets.tolist(), counts.tolist(), buffer_offsets.tolist()):
            out[at: at + n] = self.data[off: off + n]
        return counts, out


@pytest.fixture()
def data_file(tmp_path: Path) -> Iterator[DataFile]:
    f = DataFile(tmp_path / "data.bin", FILE_SIZE)
    yield f
    os.close(f.fd)


@pytest.fixture(params=AVAILABLE)
def engine(request: pytest.FixtureRequest) -> Iterator[ReadEngine]:
    e = ENGINES[request.param](depth=16)
    yield e
    e.close()


def random_extents(rng: np.random.Generator, m: int, file_size: int, max_blocks: int = 16,
                   past_end: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """m block-aligned extents of 1..max_blocks blocks (some running past the end of the file)."""
    limit = file_size + (2 * BLOCK if past_end else 0)
    blocks = rng.integers(1, max_blocks + 1, m)
    lengths = blocks * BLOCK
    offsets = rng.integers(0, max(1, (limit - BLOCK) // BLOCK), m) * BLOCK
    if not past_end:
        lengths = np.minimum(lengths, (-(-file_size // BLOCK)) * BLOCK - offsets)
    buffer_offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return offsets.astype(np.int64), lengths.astype(np.int64), buffer_offsets


def read(engine: ReadEngine, f: DataFile, offsets: np.ndarray, lengths: np.ndarray,
         buffer_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    buffer = aligned_buffer(int((buffer_offsets + lengths).max()))
    counts = engine.submit(f.fd, offsets, lengths, buffer, buffer_offsets).wait()
    return counts, buffer


def check(f: DataFile, offsets: np.ndarray, lengths: np.ndarray, buffer_offsets: np.ndarray, counts: np.ndarray,
          buffer: np.ndarray) -> None:
    want_counts, want = f.expected(offsets, lengths, buffer_offsets, len(buffer))
    np.testing.assert_array_equal(counts, want_counts)
    # Bytes past a short count are the caller's to zero-fill; compare only what was read.
    got = buffer.copy()
    for at, n, length in zip(buffer_offsets.tolist(), counts.tolist(), lengths.tolist()):
        got[at + n: at + length] = 0
    np.testing.assert_array_equal(got, want)


# -- bytes ---------------------------------------------------------------------------------


def test_registry_order_and_default() -> None:
    assert ENGINE_ORDER == ("io_uring", "aio", "threads")
    e = open_engine(None)
    try:
        assert e.name == AVAILABLE[0]
    finally:
        e.close()


def io_uring_expected() -> bool:
    """Linux 6.1+, no seccomp filter, io_uring not disabled by sysctl: the probe must say yes."""
    try:
        release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
        status = Path("/proc/self/status").read_text()
        disabled = Path("/proc/sys/kernel/io_uring_disabled")
        sysctl_ok = not disabled.exists() or disabled.read_text().strip() == "0"
    except (OSError, ValueError):
        return False
    return release >= (6, 1) and "Seccomp:\t0" in status and sysctl_ok


def test_io_uring_and_aio_run_where_nothing_refuses_them() -> None:
    if not io_uring_expected():
        pytest.skip("old kernel, seccomp filter or sysctl: io_uring may rightly be refused here")
    reasons = {name: ENGINES[name].unavailable_reason() for name in ("io_uring", "aio")}
    assert reasons == {"io_uring": None, "aio": None}


@pytest.mark.parametrize("seed", [0, 1])
def test_random_extents_match_the_file_and_the_threads_engine(engine: ReadEngine, data_file: DataFile,
                                                               seed: int) -> None:
    rng = np.random.default_rng(seed)
    offsets, lengths, at = random_extents(rng, 300, FILE_SIZE, max_blocks=40)
    counts, buffer = read(engine, data_file, offsets, lengths, at)
    check(data_file, offsets, lengths, at, counts, buffer)
    ref = ThreadsEngine(depth=4)
    try:
        ref_counts, ref_buffer = read(ref, data_file, offsets, lengths, at)
    finally:
        ref.close()
    np.testing.assert_array_equal(counts, ref_counts)
    np.testing.assert_array_equal(buffer, ref_buffer)


def test_batches_far_larger_than_the_ring(engine: ReadEngine, data_file: DataFile) -> None:
    # depth 16: a 16-entry ring, 5000 extents handed over in slices as slots free up
    rng = np.random.default_rng(2)
    offsets, lengths, at = random_extents(rng, 5000, FILE_SIZE, max_blocks=1)
    counts, buffer = read(engine, data_file, offsets, lengths, at)
    check(data_file, offsets, lengths, at, counts, buffer)


def test_extents_past_the_end_of_an_unpadded_file_come_back_short(engine: ReadEngine,
                                                                   data_file: DataFile) -> None:
    last = FILE_SIZE // BLOCK * BLOCK  # the short last block starts here
    offsets = np.array([last, last - BLOCK, last + BLOCK, 0, last - 3 * BLOCK], dtype=np.int64)
    lengths = np.array([BLOCK, 2 * BLOCK, BLOCK, BLOCK, 8 * BLOCK], dtype=np.int64)
    at = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    counts, buffer = read(engine, data_file, offsets, lengths, at)
    assert counts.tolist() == [FILE_SIZE - last, BLOCK + FILE_SIZE - last, 0, BLOCK, 3 * BLOCK + FILE_SIZE - last]
    check(data_file, offsets, lengths, at, counts, buffer)
    rng = np.random.default_rng(3)
    offsets, lengths, at = random_extents(rng, 400, FILE_SIZE, max_blocks=3, past_end=True)
    counts, buffer = read(engine, data_file, offsets, lengths, at)
    assert (counts < lengths).any()
    check(data_file, offsets, lengths, at, counts, buffer)


def test_several_submissions_in_flight_waited_in_reverse_order(engine: ReadEngine, data_file: DataFile) -> None:
    rng = np.random.default_rng(4)
    sizes = [5, 40, 1, 300, 16, 2]  # some beyond the depth (16), so some wait in the backlog
    jobs = []
    for m in sizes:
        offsets, lengths, at = random_extents(rng, m, FILE_SIZE, max_blocks=4)
        buffer = aligned_buffer(int((at + lengths).max()))
        jobs.append((offsets, lengths, at, buffer, engine.submit(data_file.fd, offsets, lengths, buffer, at)))
    for offsets, lengths, at, buffer, pending in reversed(jobs):
        counts = pending.wait()
        check(data_file, offsets, lengths, at, counts, buffer)
        assert pending.wait() is counts or np.array_equal(pending.wait(), counts)  # idempotent


def test_eight_threads_at_once(engine: ReadEngine, data_file: DataFile) -> None:
    rng = np.random.default_rng(5)
    requests = [random_extents(rng, int(rng.integers(1, 200)), FILE_SIZE, max_blocks=8) for _ in range(48)]

    def work(worker: int) -> None:
        for offsets, lengths, at in requests[worker::8]:
            # two in flight per thread, waited out of order
            first = aligned_buffer(int((at + lengths).max()))
            second = aligned_buffer(int((at + lengths).max()))
            p1 = engine.submit(data_file.fd, offsets, lengths, first, at)
            p2 = engine.submit(data_file.fd, offsets, lengths, second, at)
            check(data_file, offsets, lengths, at, p2.wait(), second)
            check(data_file, offsets, lengths, at, p1.wait(), first)

    run_threads(work)


def test_zero_length_extents_and_an_empty_submission(engine: ReadEngine, data_file: DataFile) -> None:
    offsets = np.array([0, BLOCK, 2 * BLOCK], dtype=np.int64)
    lengths = np.array([BLOCK, 0, BLOCK], dtype=np.int64)
    at = np.array([0, BLOCK, BLOCK], dtype=np.int64)
    counts, buffer = read(engine, data_file, offsets, lengths, at)
    assert counts.tolist() == [BLOCK, 0, BLOCK]
    check(data_file, offsets, lengths, at, counts, buffer)
    empty = np.zeros(0, dtype=np.int64)
    assert len(engine.submit(data_file.fd, empty, empty, aligned_buffer(BLOCK), empty).wait()) == 0


# -- errors --------------------------------------------------------------------------------


def test_a_bad_descriptor_raises_ebadf_and_the_engine_goes_on(engine: ReadEngine, data_file: DataFile) -> None:
    rng = np.random.default_rng(6)
    offsets, lengths, at = random_extents(rng, 100, FILE_SIZE, max_blocks=2)
    good_buffer = aligned_buffer(int((at + lengths).max()))
    good = engine.submit(data_file.fd, offsets, lengths, good_buffer, at)  # in flight meanwhile
    bad_fd = os.open(os.devnull, os.O_RDONLY)
    os.close(bad_fd)  # a descriptor number that is certainly closed
    with pytest.raises(OSError) as info:
        engine.submit(bad_fd, offsets, lengths, aligned_buffer(int((at + lengths).max())), at).wait()
    assert info.value.errno == errno.EBADF
    check(data_file, offsets, lengths, at, good.wait(), good_buffer)
    counts, buffer = read(engine, data_file, offsets, lengths, at)
    check(data_file, offsets, lengths, at, counts, buffer)


def test_misaligned_direct_read_raises_einval_after_the_others(engine: ReadEngine, data_file: DataFile) -> None:
    if not data_file.direct:
        pytest.skip("the filesystem of tmp_path refuses O_DIRECT")
    offsets = np.array([0, 100, BLOCK], dtype=np.int64)  # 100: not block-aligned
    lengths = np.full(3, BLOCK, dtype=np.int64)
    at = np.arange(3, dtype=np.int64) * BLOCK
    buffer = aligned_buffer(3 * BLOCK)
    with pytest.raises(OSError) as info:
        engine.submit(data_file.fd, offsets, lengths, buffer, at).wait()
    assert info.value.errno == errno.EINVAL
    np.testing.assert_array_equal(buffer[2 * BLOCK:], data_file.data[BLOCK: 2 * BLOCK])  # the others finished


def test_bad_arguments_are_value_errors(engine: ReadEngine, data_file: DataFile) -> None:
    one = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="outside the buffer"):
        engine.submit(data_file.fd, one, one + 2 * BLOCK, aligned_buffer(BLOCK), one)
    with pytest.raises(ValueError, match="one length"):
        engine.submit(data_file.fd, np.zeros(2, dtype=np.int64), one + BLOCK, aligned_buffer(BLOCK), one)


@pytest.mark.parametrize("name", NATIVE)
def test_eagain_is_retried_until_the_read_completes(name: str) -> None:
    # A non-blocking pipe with nothing in it: the kernel answers EAGAIN, the engine asks
    # again, and the read completes once a writer has filled it.
    r, w = os.pipe()
    os.set_blocking(r, False)
    e = ENGINES[name](depth=4)
    timer = threading.Timer(0.05, lambda: os.write(w, b"espn"))
    try:
        buffer = aligned_buffer(BLOCK)
        zero = np.zeros(1, dtype=np.int64)
        timer.start()
        counts = e.submit(r, zero, zero + 4, buffer, zero).wait()
        assert counts.tolist() == [4] and buffer[:4].tobytes() == b"espn"
    finally:
        timer.join()
        e.close()
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("name", NATIVE)
def test_native_engines_wait_on_the_submitting_thread_and_close(name: str, data_file: DataFile) -> None:
    e = ENGINES[name](depth=8)
    offsets, lengths, at = random_extents(np.random.default_rng(8), 50, FILE_SIZE, max_blocks=2)
    buffer = aligned_buffer(int((at + lengths).max()))
    pending = e.submit(data_file.fd, offsets, lengths, buffer, at)
    caught: list[BaseException] = []
    other = threading.Thread(target=lambda: caught.extend(_raises(pending.wait)))
    other.start()
    other.join()
    assert len(caught) == 1 and isinstance(caught[0], RuntimeError) and "thread" in str(caught[0])
    check(data_file, offsets, lengths, at, pending.wait(), buffer)
    queue = e._local.queue  # type: ignore[attr-defined]
    if name == "io_uring":
        assert not os.get_inheritable(queue.fd)
    e.close()
    e.close()  # idempotent
    assert queue.closed
    with pytest.raises(ValueError, match="closed"):
        e.submit(data_file.fd, offsets, lengths, buffer, at)


def _raises(fn) -> list[BaseException]:  # type: ignore[no-untyped-def]
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the test thread
        return [exc]
    return []


# -- fallback when io_uring is refused ------------------------------------------------------


@pytest.fixture()
def refused_io_uring(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """io_uring_setup answers EPERM, as under Docker's default seccomp profile."""

    def refuse(entries: int, params: np.ndarray) -> int:
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(uring_module, "io_uring_setup", refuse)
    uring_module.probe.cache_clear()
    yield
    uring_module.probe.cache_clear()  # the next probe sees the real syscall again


def test_refused_io_uring_falls_back_to_aio_with_one_log_line(refused_io_uring: None,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    if aio_module.probe() is not None:
        pytest.skip(f"AIO unavailable here too: {aio_module.probe()}")
    reason = ENGINES["io_uring"].unavailable_reason()
    assert reason is not None and "EPERM" in reason and "seccomp" in reason
    with caplog.at_level(logging.INFO, logger="espn.store.engines"):
        e = open_engine(None)
    try:
        assert e.name == "aio"
    finally:
        e.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "espn.store.engines"]
    assert len(lines) == 1 and "aio" in lines[0] and "io_uring" in lines[0] and "EPERM" in lines[0], lines
    with pytest.raises(BackendUnavailableError, match="io_uring.*EPERM"):
        open_engine("io_uring")


def test_reader_reports_the_fallback_engine(refused_io_uring: None, tmp_path: Path) -> None:
    from test_store import LAYOUTS, random_counts, write_store

    store = write_store(tmp_path, LAYOUTS[1], random_counts(np.random.default_rng(0), 50, LAYOUTS[1]))
    with PosixReader(store.path, store.records, store.layout) as reader:
        assert reader.engine == ("aio" if "aio" in AVAILABLE else "threads")


# -- through the posix reader --------------------------------------------------------------


@pytest.mark.parametrize("name", AVAILABLE)
@pytest.mark.parametrize("layout", [0, 1], ids=["B512", "B4096"])
def test_posix_reader_through_each_engine_equals_the_memory_reader(name: str, layout: int, tmp_path: Path) -> None:
    from test_store import LAYOUTS, random_counts, write_store

    lay = LAYOUTS[layout]
    rng = np.random.default_rng(layout)
    store = write_store(tmp_path, lay, random_counts(rng, 400, lay), pad=False)  # unpadded: short last read
    n = len(store.records)
    requests = [rng.integers(0, n, 64), np.arange(n), np.array([n - 1, 0, n - 1]), rng.integers(0, n, 700)]
    with MemoryReader(store.path, store.records, lay) as ref, \
            PosixReader(store.path, store.records, lay, io_engine=name, io_depth=8) as reader:
        assert reader.engine == name
        for docs in requests:
            want, got = ref.read(docs), reader.read(docs)
            assert np.array_equal(got.cls.numpy().view(np.uint16), want.cls.numpy().view(np.uint16))
            assert np.array_equal(got.vectors.numpy().view(np.uint16), want.vectors.numpy().view(np.uint16))
            assert np.array_equal(got.offsets, want.offsets)
        # prefetch waves: two submitted, then both waited, the later first
        first, second = reader.submit(requests[0]), reader.submit(requests[3])
        for pending, docs in ((second, requests[3]), (first, requests[0])):
            got, want = pending.result(), ref.read(docs)
            assert np.array_equal(got.vectors.numpy().view(np.uint16), want.vectors.numpy().view(np.uint16))


def test_posix_reader_default_engine_is_io_uring_here(tmp_path: Path) -> None:
    from test_store import LAYOUTS, random_counts, write_store

    store = write_store(tmp_path, LAYOUTS[1], random_counts(np.random.default_rng(0), 50, LAYOUTS[1]))
    with PosixReader(store.path, store.records, store.layout) as reader:
        assert reader.engine == AVAILABLE[0]
        if io_uring_expected():
            assert reader.engine == "io_uring"


def test_close_waits_for_a_read_running_in_the_callers_thread(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """One extent is read in the caller's thread, not the pool's. close() must wait for it too: the
    posix reader closes its descriptor right after, and a soak run once read a reused number (an
    io_uring ring: ESPIPE). The real read is held at its start until close() has been called."""
    from espn.store.engines import threads as threads_module

    path = tmp_path / "data.bin"
    payload = np.random.default_rng(0).integers(0, 256, 8192, dtype=np.uint8)
    path.write_bytes(payload.tobytes())
    started, release = threading.Event(), threading.Event()
    real_read = threads_module.read_fully

    def held_read(*args: object, **kwargs: object) -> int:
        started.set()
        assert release.wait(30)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(threads_module, "read_fully", held_read)
    engine = ThreadsEngine(depth=4)
    fd = os.open(path, os.O_RDONLY)
    buffer = np.zeros(4096, dtype=np.uint8)
    got: list[np.ndarray] = []
    reader = threading.Thread(target=lambda: got.append(engine.submit(fd, np.array([4096]), np.array([4096]), buffer,
                                                                      np.array([0])).wait()))
    reader.start()
    assert started.wait(30)
    closer = threading.Thread(target=engine.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive(), "close() returned while a read was still running in its caller's thread"
    release.set()
    closer.join(30)
    reader.join(30)
    os.close(fd)
    assert not closer.is_alive() and got and got[0].tolist() == [4096]
    assert np.array_equal(buffer, payload[4096:])
    with pytest.raises(Exception, match="closed"):
        engine.submit(fd, np.array([0]), np.array([16]), buffer, np.array([0]))
