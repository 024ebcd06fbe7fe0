"""The embedding store: record layout on disk, and every reader against the written arrays.

Real files in tmp_path, written with RecordWriter from random documents (n_bow 0, 1, and
records larger than a block), read back through each reader and compared bit for bit
with the fp16 arrays that went in. The kvikio GPU path cannot run here (no CUDA, no
kvikio): here it reports itself unavailable with the install command, and it joins the
reader-agreement test through the fake kvikio of tests/fakes (standing in for a GPU);
tests/test_kvikio.py tests the rest of its logic through the same fake.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import mmap
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from espn.errors import BackendUnavailableError, IndexCorruptError
from espn.store import (
    READERS,
    RECORD_DTYPE,
    KvikioReader,
    PosixReader,
    RecordWriter,
    StoreLayout,
    default_reader_name,
    open_reader,
    plan_extents,
)
from espn.store.engines import StoreClosedError
from helpers import run_threads

CPU_READERS = ["posix", "mmap", "memory"]


@dataclasses.dataclass
class Store:
    """A written store and the fp16 arrays that went into it (the reference)."""

    path: Path
    records: np.ndarray
    layout: StoreLayout
    cls: np.ndarray  # [N, d_cls] float16
    bow: list[np.ndarray]  # N x [n_bow, d_bow] float16

    def expected(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Brute-force padded reference: cls [n, d_cls], bow [n, L, d_bow], mask [n, L]."""
        counts = [len(self.bow[d]) for d in docs]
        length = max([1, *counts])
        bow = np.zeros((len(docs), length, self.layout.d_bow), dtype=np.float16)
        mask = np.zeros((len(docs), length), dtype=bool)
        for i, d in enumerate(docs):
            bow[i, : counts[i]] = self.bow[d]
            mask[i, : counts[i]] = True
        return self.cls[np.asarray(docs, dtype=np.int64)].reshape(-1, self.layout.d_cls), bow, mask


def write_store(
    directory: Path, layout: StoreLayout, counts: np.ndarray, seed: int = 0, chunks: int = 3, pad: bool = True
) -> Store:
    """Write random documents in a few chunks (the writer resumes across chunks)."""
    rng = np.random.default_rng(seed)
    counts = np.asarray(counts, dtype=np.int64)
    cls = rng.standard_normal((len(counts), layout.d_cls)).astype(np.float16)
    bow = [rng.standard_normal((int(c), layout.d_bow)).astype(np.float16) for c in counts]
    path = directory / "embeddings.bin"
    writer = RecordWriter(path, layout)
    rows = []
    for part in np.array_split(np.arange(len(counts)), chunks):
        flat = np.concatenate([bow[i] for i in part] + [np.zeros((0, layout.d_bow), np.float16)])
        rows.append(writer.append(cls[part], flat, counts[part]))
    if pad:
        writer.close()
    else:
        writer.__exit__(None, None, None)  # closed without the final block padding
    return Store(path, np.concatenate(rows), layout, cls, bow)


def random_counts(rng: np.random.Generator, n: int, layout: StoreLayout) -> np.ndarray:
    """n_bow per doc: mostly small, some 0 and 1, a few records of 2-3 blocks."""
    big = (3 * layout.block_size // 2 - layout.d_cls) // layout.d_bow  # ~1.5 blocks of BOW
    counts = rng.integers(0, 24, size=n)
    counts[rng.random(n) < 0.15] = 0
    counts[rng.random(n) < 0.15] = 1
    counts[rng.random(n) < 0.1] = rng.integers(big, 2 * big, size=1)
    counts[:3] = [0, 1, 2 * big]
    return counts


LAYOUTS = [StoreLayout(d_cls=16, d_bow=8, block_size=512), StoreLayout(d_cls=32, d_bow=16, block_size=4096)]


@pytest.fixture(params=LAYOUTS, ids=lambda lay: f"B{lay.block_size}")
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    rng = np.random.default_rng(request.param.block_size)
    return write_store(tmp_path, request.param, random_counts(rng, 300, request.param))


def assert_batch_equal(batch, expected: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    cls, bow, mask = expected
    assert batch.cls.dtype == torch.float16 and batch.bow.dtype == torch.float16 and batch.mask.dtype == torch.bool
    assert batch.cls.shape == cls.shape and batch.bow.shape == bow.shape and batch.mask.shape == mask.shape
    # Bitwise: fp16 went in, fp16 comes out.
    np.testing.assert_array_equal(batch.cls.numpy().view(np.uint16), cls.view(np.uint16))
    np.testing.assert_array_equal(batch.bow.numpy().view(np.uint16), bow.view(np.uint16))
    np.testing.assert_array_equal(batch.mask.numpy(), mask)


def direct_io_supported(path: Path, block_size: int) -> bool:
    """Probe the test filesystem: can we open with O_DIRECT and read one aligned block?"""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    buf = mmap.mmap(-1, block_size)
    try:
        os.preadv(fd, [memoryview(buf)], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        buf.close()


# -- the file ------------------------------------------------------------------------------


def test_records_lie_where_records_npy_says(store: Store) -> None:
    lay = store.layout
    data = store.path.read_bytes()
    rec = store.records
    assert rec.dtype == RECORD_DTYPE
    assert len(data) % lay.block_size == 0
    for i, (offset, length, n_bow) in enumerate(rec.tolist()):
        assert n_bow == len(store.bow[i])
        assert length == (lay.d_cls + n_bow * lay.d_bow) * 2
        want = store.cls[i].tobytes() + store.bow[i].tobytes()
        assert data[offset : offset + length] == want
        first, last = offset // lay.block_size, (offset + length - 1) // lay.block_size
        # The fewest blocks its length needs: one for a small record, ceil(length / B) for a large one.
        assert last - first + 1 == max(1, -(-length // lay.block_size)), f"record {i} straddles a boundary needlessly"
    ends = rec["offset"] + rec["length"]
    assert np.all(rec["offset"][1:] >= ends[:-1]), "records overlap"
    assert (rec["length"] > lay.block_size).any() and (rec["n_bow"] == 0).any() and (rec["n_bow"] == 1).any()


# -- every reader against the reference ----------------------------------------------------


@pytest.mark.parametrize("name", CPU_READERS)
def test_reader_returns_what_was_written(store: Store, name: str) -> None:
    rng = np.random.default_rng(1)
    n = len(store.records)
    requests = [
        rng.integers(0, n, size=40),  # unsorted, with duplicates
        np.array([5, 5, 5, 0, n - 1, 0]),
        np.arange(n)[::-1].copy(),  # everything, reversed
        np.array([n - 1]),  # the last record, next to the end of the file
        [2, 0, 1],  # a plain list
    ]
    with open_reader(name, store.path, store.records, store.layout) as reader:
        for docs in requests:
            batch = reader.read(docs)
            assert_batch_equal(batch, store.expected(np.asarray(docs)))
            assert batch.cls.device.type == "cpu"


@pytest.mark.parametrize("name", CPU_READERS)
def test_documents_without_bow_vectors(store: Store, name: str) -> None:
    empty = np.flatnonzero(store.records["n_bow"] == 0)[:5]
    with open_reader(name, store.path, store.records, store.layout) as reader:
        batch = reader.read(empty)
    assert batch.bow.shape == (len(empty), 1, store.layout.d_bow)
    assert not batch.mask.any() and not batch.bow.any()
    assert_batch_equal(batch, store.expected(empty))


def test_readers_agree(store: Store, fake_kvikio: ModuleType) -> None:
    # kvikio joins through the fake kvikio, which STANDS IN FOR A GPU here (no CUDA, no
    # kvikio on this machine): the reader's planning, pooling and futures are real, the
    # bytes come from the fake's POSIX preads into host buffers.
    docs = np.random.default_rng(2).integers(0, len(store.records), size=64)
    batches = {}
    for name, cls in READERS.items():
        assert cls.is_available(), name
        with open_reader(name, store.path, store.records, store.layout) as reader:
            batches[name] = reader.read(docs)
    assert set(CPU_READERS) | {"kvikio"} == set(batches)
    ref = batches.pop("posix")
    for name, batch in batches.items():
        assert torch.equal(batch.cls, ref.cls) and torch.equal(batch.bow, ref.bow), name
        assert torch.equal(batch.mask, ref.mask), name


@pytest.mark.parametrize("name", CPU_READERS)
def test_records_as_a_memmap(store: Store, name: str, tmp_path: Path) -> None:
    np.save(tmp_path / "records.npy", store.records)
    records = np.load(tmp_path / "records.npy", mmap_mode="r")
    docs = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    with open_reader(name, store.path, records, store.layout) as reader:
        assert_batch_equal(reader.read(docs), store.expected(docs))


@pytest.mark.parametrize("name", CPU_READERS)
def test_unpadded_file_reads_to_the_end(tmp_path: Path, name: str) -> None:
    # A writer closed without padding leaves a file that ends mid-block: the last
    # aligned read is short, and the reader must cope.
    lay = StoreLayout(d_cls=16, d_bow=8, block_size=512)
    store = write_store(tmp_path, lay, [3, 0, 40, 5, 7], pad=False)
    assert store.path.stat().st_size % lay.block_size != 0
    docs = np.array([4, 2, 0, 4])
    with open_reader(name, store.path, store.records, lay) as reader:
        assert_batch_equal(reader.read(docs), store.expected(docs))


@pytest.mark.parametrize("name", CPU_READERS)
def test_a_read_that_completes_after_close_is_refused_not_scored_from_freed_memory(store: Store, name: str) -> None:
    """A search submitted on a reader that a generation swap then closes: memory and mmap hand out
    the array that close() frees, so a fetch completing after close must raise StoreClosedError
    (the native scorer reads records by address; before, it scored whatever memory followed)."""
    docs = np.arange(min(8, len(store.records)))
    reader = open_reader(name, store.path, store.records, store.layout)
    pending, unparsed = reader.submit(docs), reader.submit(docs)
    reader.close()
    if name in ("memory", "mmap"):  # their fetch runs at completion, after the close
        for finish in (pending.result, unparsed.records):
            with pytest.raises(StoreClosedError):
                finish()
        return
    # posix had every read in flight before close returned: refused or whole, never garbage.
    try:
        assert_batch_equal(pending.result(), store.expected(docs))
        unparsed.records().release()
    except StoreClosedError:
        pass


@pytest.mark.parametrize("name", CPU_READERS)
def test_empty_request(store: Store, name: str) -> None:
    with open_reader(name, store.path, store.records, store.layout) as reader:
        for docs in (np.zeros(0, dtype=np.int64), []):
            batch = reader.read(docs)
            assert batch.cls.shape == (0, store.layout.d_cls)
            assert batch.bow.shape == (0, 1, store.layout.d_bow) and batch.mask.shape == (0, 1)
            assert batch.bytes_read == 0 and batch.ios == 0 and len(batch) == 0


@pytest.mark.parametrize("name", CPU_READERS)
def test_bad_doc_numbers_raise_value_error(store: Store, name: str) -> None:
    n = len(store.records)
    with open_reader(name, store.path, store.records, store.layout) as reader:
        for docs in ([0, n], [-1], np.array([n + 100])):
            with pytest.raises(ValueError, match=rf"\[0, {n}\)"):
                reader.read(docs)
        with pytest.raises(ValueError, match="integers"):
            reader.read(np.array([0.5]))
        with pytest.raises(ValueError, match="1-D"):
            reader.read(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="closed"):
        reader.read([0])


@pytest.mark.parametrize("name", CPU_READERS)
def test_concurrent_reads_equal_serial_reads(store: Store, name: str) -> None:
    rng = np.random.default_rng(3)
    n = len(store.records)
    requests = [rng.integers(0, n, size=int(rng.integers(1, 80))) for _ in range(48)]
    with open_reader(name, store.path, store.records, store.layout) as reader:
        serial = [reader.read(docs) for docs in requests]
        results: list = [None] * len(requests)

        def work(worker: int) -> None:
            for i in range(worker, len(requests), 8):
                results[i] = reader.read(requests[i])

        run_threads(work)
    for want, got in zip(serial, results):
        assert torch.equal(want.cls, got.cls) and torch.equal(want.bow, got.bow) and torch.equal(want.mask, got.mask)
        assert want.bytes_read == got.bytes_read and want.ios == got.ios


# -- posix ---------------------------------------------------------------------------------


def test_posix_uses_o_direct_where_the_filesystem_allows(store: Store) -> None:
    supported = direct_io_supported(store.path, store.layout.block_size)
    with PosixReader(store.path, store.records, store.layout) as reader:
        assert reader.direct == supported
        docs = np.arange(0, len(store.records), 7)
        assert_batch_equal(reader.read(docs), store.expected(docs))
    # Where the filesystem refuses O_DIRECT, the buffered fallback was just checked: a pass, and
    # the next test forces the refusal everywhere.


def test_posix_falls_back_when_o_direct_is_refused(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_open = os.open

    def open_like_tmpfs(path, flags, *args):  # type: ignore[no-untyped-def]
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_like_tmpfs)
    monkeypatch.setattr("espn.store.posix._warned_no_direct", False)
    with caplog.at_level(logging.WARNING, logger="espn.store.posix"):
        reader = PosixReader(store.path, store.records, store.layout)
    assert not reader.direct
    assert any("O_DIRECT" in r.getMessage() for r in caplog.records)
    docs = np.array([7, 3, 3, 0])
    with reader:
        assert_batch_equal(reader.read(docs), store.expected(docs))
    with PosixReader(store.path, store.records, store.layout, direct=False) as buffered:
        assert not buffered.direct
        assert_batch_equal(buffered.read(docs), store.expected(docs))


def test_posix_coalesces_adjacent_blocks(store: Store) -> None:
    lay = store.layout
    docs = np.arange(40)  # consecutive documents: consecutive blocks
    rec = store.records[docs]
    first = rec["offset"] // lay.block_size
    last = (rec["offset"] + rec["length"] - 1) // lay.block_size
    blocks = int(last.max() - first.min() + 1)
    with PosixReader(store.path, store.records, lay) as reader:
        batch = reader.read(docs)
        assert batch.ios < len(docs)
        assert batch.ios == -(-blocks * lay.block_size // reader.max_extent_bytes)
        assert batch.bytes_read == blocks * lay.block_size
        # One block per request when the cap is one block: coalescing is what saved them.
    with PosixReader(store.path, store.records, lay, max_extent_bytes=lay.block_size) as reader:
        capped = reader.read(docs)
        assert capped.ios == blocks and capped.bytes_read == batch.bytes_read
        assert torch.equal(capped.bow, batch.bow)
    with open_reader("mmap", store.path, store.records, lay) as reader:
        assert reader.read(docs).ios == blocks


def test_posix_options_are_checked(store: Store) -> None:
    with pytest.raises(ValueError, match="io_threads"):
        PosixReader(store.path, store.records, store.layout, io_threads=0)
    with pytest.raises(ValueError, match="unknown option"):
        open_reader("posix", store.path, store.records, store.layout, threads=4)


def test_truncated_file_is_reported(store: Store, tmp_path: Path) -> None:
    short = tmp_path / "short.bin"
    short.write_bytes(store.path.read_bytes()[: store.layout.block_size])
    with pytest.raises(IndexCorruptError):
        PosixReader(short, store.records, store.layout)


# -- extent planning (shared by posix and kvikio) -------------------------------------------


def test_plan_extents_merges_adjacent_and_keeps_gaps() -> None:
    b = 512
    plan = plan_extents(np.array([0, 600, 2048]), np.array([100, 100, 100]), b)
    # blocks 0 and 1 are adjacent: one extent; block 4 after a gap: another
    assert plan.file_offsets.tolist() == [0, 2048]
    assert plan.lengths.tolist() == [1024, 512]
    assert plan.starts.tolist() == [0, 600, 1024]
    # duplicates and order do not add requests
    plan = plan_extents(np.array([2048, 0, 2048, 600]), np.array([100, 100, 100, 100]), b)
    assert len(plan) == 2 and plan.starts.tolist() == [1024, 0, 1024, 600]
    # a record spanning several blocks, split by the cap, stays contiguous in the buffer
    plan = plan_extents(np.array([1024]), np.array([5 * b]), b, max_extent_bytes=2 * b)
    assert plan.file_offsets.tolist() == [1024, 2048, 3072]
    assert plan.lengths.tolist() == [1024, 1024, 512]
    assert plan.buffer_offsets.tolist() == [0, 1024, 2048] and plan.starts.tolist() == [0]
    empty = plan_extents(np.zeros(0, np.int64), np.zeros(0, np.int64), b)
    assert len(empty) == 0 and empty.nbytes == 0


@pytest.mark.parametrize("seed", range(5))
def test_plan_extents_against_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    b = 512
    size = 64 * b
    data = rng.integers(0, 256, size=size, dtype=np.uint8)
    n = int(rng.integers(1, 60))
    lengths = rng.integers(1, 3 * b, size=n)
    offsets = rng.integers(0, size - lengths)
    cap = int(rng.choice([b, 3 * b, 1 << 20]))
    plan = plan_extents(offsets, lengths, b, max_extent_bytes=cap)

    # Aligned, capped, sorted, non-overlapping, laid end to end in the buffer.
    assert np.all(plan.file_offsets % b == 0) and np.all(plan.lengths % b == 0)
    assert np.all(plan.lengths <= max(b, cap - cap % b)) and np.all(plan.lengths > 0)
    assert np.all(plan.file_offsets[1:] >= plan.file_offsets[:-1] + plan.lengths[:-1])
    assert plan.buffer_offsets.tolist() == (np.cumsum(plan.lengths) - plan.lengths).tolist()
    assert plan.nbytes == int(plan.lengths.sum())
    # Exactly the union of the records' blocks is read.
    wanted = {blk for o, l in zip(offsets, lengths) for blk in range(o // b, (o + l - 1) // b + 1)}
    read = {blk for o, l in zip(plan.file_offsets, plan.lengths) for blk in range(o // b, (o + l) // b)}
    assert read == wanted
    # Simulate the reads: each record is found at its start in the buffer.
    buf = np.zeros(plan.nbytes, dtype=np.uint8)
    for fo, ln, bo in zip(plan.file_offsets, plan.lengths, plan.buffer_offsets):
        buf[bo : bo + ln] = data[fo : fo + ln]
    for o, l, s in zip(offsets, lengths, plan.starts):
        np.testing.assert_array_equal(buf[s : s + l], data[o : o + l])


# -- registry and the optional backend ------------------------------------------------------


def test_registry() -> None:
    assert set(READERS) == {"posix", "kvikio", "mmap", "memory"}
    assert all(READERS[name].name == name for name in READERS)
    assert default_reader_name(device="cpu") == "posix"
    with pytest.raises(ValueError, match="unknown reader"):
        open_reader("nope", Path("x"), np.zeros(0, RECORD_DTYPE), LAYOUTS[0])


def test_kvikio_unavailable_here_says_how_to_install(store: Store) -> None:
    # The GPU path itself (CuFile.pread into CUDA memory, gather on the GPU) cannot run on
    # this CPU-only machine; its extent planning is covered by the plan_extents tests.
    if KvikioReader.is_available():
        pytest.skip("kvikio and CUDA are present: the unavailable path does not apply")
    assert "pip install \"espn[kvikio]\"" in (KvikioReader.unavailable_reason() or "")
    assert default_reader_name() == "posix"
    with pytest.raises(BackendUnavailableError, match=r'pip install "espn\[kvikio\]"'):
        open_reader("kvikio", store.path, store.records, store.layout)
    with pytest.raises(BackendUnavailableError):
        KvikioReader(store.path, store.records, store.layout)
    reader = open_reader(None, store.path, store.records, store.layout)
    assert isinstance(reader, PosixReader)
    reader.close()


def test_importing_the_store_imports_no_optional_backend() -> None:
    code = "import sys, espn.store; bad = {'kvikio', 'cupy'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)
