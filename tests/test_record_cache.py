"""The record cache (espn.store.record_cache): exact reads, every record cacheable, admission,
one copy shared by processes, recovery from a process that died mid-change, and I/O faults.

Real files (RecordWriter) read through the real posix reader with the cache in front; every
batch is compared bit for bit with the arrays that went in. Sharing runs real processes on a
real /dev/shm segment.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from espn import Searcher
from espn.errors import InvalidParameterError
from espn.store import CachedReader, StoreLayout, open_reader
from espn.store.cache_policy import FrequencySketch
from espn.store.cache_segment import SEGMENT_PREFIX, SHM_DIR, open_segment, remove_stale_segments
from espn.store.cache_slabs import class_sizes
from espn.store.engines import FaultInjector, ReadError, inject_faults
from espn.store.record_cache import OFFER_ONE_READ_IN, segment_documents
from helpers import run_threads
from test_store import Store, assert_batch_equal, random_counts, write_store

LAYOUT = StoreLayout(d_cls=32, d_bow=16, block_size=4096)
ROOT = Path(__file__).resolve().parents[1]
shared_memory = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this platform: caches stay private")


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return write_store(tmp_path, LAYOUT, random_counts(np.random.default_rng(3), 2000, LAYOUT))


def table_bytes(store: Store) -> int:
    return int(store.records["length"].sum())


def cached(store: Store, fraction: float, **options) -> CachedReader:
    """A posix reader behind a cache of `fraction` of the record bytes (and its tables)."""
    budget = int(fraction * table_bytes(store)) + (1 << 20)
    reader = open_reader("posix", store.path, store.records, store.layout, record_cache_mb=budget / 2**20, **options)
    assert isinstance(reader, CachedReader)
    return reader


def test_sketch_never_undercounts_and_ages() -> None:
    sketch = FrequencySketch(np.zeros((4, 1024), dtype=np.uint16), np.zeros(1, dtype=np.int64))
    keys = np.random.default_rng(0).zipf(1.3, size=3000) % 5000
    sketch.add(keys)
    truth = np.bincount(keys, minlength=5000)
    seen = np.flatnonzero(truth)
    assert (sketch.estimate(seen) >= truth[seen]).all()
    before = int(sketch.estimate(np.array([7]))[0])
    sketch.add(np.full(sketch.sample_size, 10**9))  # a flood of one other key triggers the reset
    assert int(sketch.estimate(np.array([7]))[0]) <= max(1, before // 2 + 1)


def test_reads_through_the_cache_match_the_file_in_request_order(store: Store) -> None:
    rng = np.random.default_rng(1)
    with cached(store, 0.1) as reader:
        hot = rng.choice(len(store.records), size=40, replace=False)
        for _ in range(4):  # misses, then hits, mixed with fresh documents and duplicates
            docs = np.concatenate([hot, rng.integers(0, len(store.records), size=30), hot[:5]])
            rng.shuffle(docs)
            assert_batch_equal(reader.read(docs), store.expected(docs))
        stats = reader.stats()
        assert stats["hits"] > 0 and 0 < stats["hit_rate"] < 1
        held = np.intersect1d(hot, reader.cached_documents())[:10]
        assert len(held) == 10
        batch = reader.read(held)
        assert_batch_equal(batch, store.expected(held))
        assert batch.bytes_read == 0 and batch.ios == 0, "documents served from RAM cost no I/O"
        assert_batch_equal(reader.read(np.zeros(0, np.int64)), store.expected(np.zeros(0, np.int64)))


def test_every_record_has_a_class_and_a_cache_of_the_table_holds_all(store: Store) -> None:
    lengths = store.records["length"]
    sizes = class_sizes(lengths)
    assert sizes[-1] >= lengths.max() and len(sizes) <= 32
    assert (sizes[np.searchsorted(sizes, lengths)] < lengths + 64).mean() > 0.5, "slots fit records closely"
    with cached(store, 1.03, record_cache_warm=True) as reader:
        assert reader.stats()["entries"] == len(lengths), "warmed with every record, the longest included"
        everything = np.arange(len(lengths))
        batch = reader.read(everything)
        assert_batch_equal(batch, store.expected(everything))
        assert batch.bytes_read == 0 and reader.stats()["too_large"] == 0


def test_a_budget_of_the_table_or_more_plans_one_slot_a_record(store: Store) -> None:
    """A budget above what every record takes plans exactly one slot per record (it
    planned more slots than records, and then a plan larger than the budget: an error)."""
    from espn.store.cache_slabs import plan_slabs

    lengths = np.asarray(store.records["length"], dtype=np.int64)
    for budget in (2 * int(lengths.sum()), 4 * int(lengths.sum())):
        plan = plan_slabs(lengths, budget, len(lengths), "tinylfu")
        assert int(plan.slots.sum()) == len(lengths) and plan.nbytes <= budget and not plan.short


def test_a_scan_does_not_flush_the_hot_set(store: Store) -> None:
    with cached(store, 0.05) as reader:
        hot = np.arange(24)
        for _ in range(8):
            reader.read(hot)
        assert set(hot) <= set(reader.cached_documents())
        for part in np.array_split(np.arange(24, len(store.records)), 40):  # one pass over the rest, each once
            reader.read(part)
        batch = reader.read(hot)
        assert batch.bytes_read == 0, "the scan evicted hot records"
        assert reader.stats()["rejected"] > 0


def _offered(reader: CachedReader) -> int:
    """Records offered to the cache so far (each is admitted or refused)."""
    stats = reader.cache.stats()
    return stats["admitted"] + stats["rejected"]


def test_a_full_cache_that_refuses_is_offered_one_read_in_four_until_it_takes_records_in(store: Store) -> None:
    with cached(store, 0.05, record_cache_warm=True) as reader:
        assert not reader.cache.free_slots().any(), "the warm fill left a class with room"
        outside = iter(np.setdiff1d(np.arange(len(store.records)), reader.cached_documents()))

        def read_each(docs: list[int]) -> int:
            """Read the documents one by one; the records offered meanwhile."""
            before = _offered(reader)
            for doc in docs:
                assert_batch_equal(reader.read(np.array([doc])), store.expected(np.array([doc])))
            return _offered(reader) - before

        # Each asked for once, so refused (TinyLFU's doorkeeper): at first every read is offered ...
        assert read_each([next(outside) for _ in range(10)]) == 10
        read_each([next(outside) for _ in range(30)])
        # ... then, the cache having taken in none of them, one read in four.
        assert read_each([next(outside) for _ in range(12)]) == 12 // OFFER_ONE_READ_IN
        # Documents asked for again come in when offered; once the cache takes records in, it is
        # offered every read again, so all of them come in (one read in four, in a cycle of eight,
        # would offer the same two for ever).
        hot = [next(outside) for _ in range(2 * OFFER_ONE_READ_IN)]
        for _ in range(6):
            read_each(hot)
        assert set(hot) <= set(reader.cached_documents().tolist())
    with cached(store, 0.5) as reader:  # room in every class: each read's record is offered, and comes in
        for doc in range(12):
            reader.read(np.array([doc]))
        assert _offered(reader) == reader.cache.stats()["admitted"] == 12


def test_concurrent_readers_get_exact_records(store: Store) -> None:
    with cached(store, 0.05) as reader:
        def work(worker: int) -> None:
            rng = np.random.default_rng(worker)
            for _ in range(30):
                docs = rng.zipf(1.5, size=25) % len(store.records)
                assert_batch_equal(reader.read(docs), store.expected(docs))

        run_threads(work, 4)
        assert reader.stats()["hits"] > 0


def test_forgotten_documents_leave_the_cache(store: Store) -> None:
    with cached(store, 0.5) as reader:
        docs = np.arange(0, 200)
        reader.read(docs)
        reader.read(docs)
        assert set(docs) <= set(reader.cached_documents())
        reader.forget(np.arange(50, 100))
        held = reader.cached_documents()
        assert not np.isin(np.arange(50, 100), held).any() and np.isin(np.arange(50), held).all()
        assert_batch_equal(reader.read(docs), store.expected(docs))


def test_budget_policy_and_reader_are_checked(store: Store) -> None:
    with pytest.raises(InvalidParameterError, match="record_cache_mb"):
        open_reader("posix", store.path, store.records, store.layout, record_cache_mb=-1)
    with pytest.raises(InvalidParameterError, match="holds no record"):
        open_reader("posix", store.path, store.records, store.layout, record_cache_mb=0.001)
    with pytest.raises(InvalidParameterError, match="not the memory reader"):
        open_reader("memory", store.path, store.records, store.layout, record_cache_mb=1)
    with pytest.raises(InvalidParameterError, match="record_cache_policy"):
        open_reader("posix", store.path, store.records, store.layout, record_cache_mb=1, record_cache_policy="fifo")
    with pytest.raises(InvalidParameterError, match="record_cache_share"):
        open_reader("posix", store.path, store.records, store.layout, record_cache_mb=1,
                    record_cache_share="../escape")
    plain = open_reader("posix", store.path, store.records, store.layout, record_cache_mb=0)
    assert not isinstance(plain, CachedReader)
    plain.close()
    with open_reader("posix", store.path, store.records, store.layout, record_cache_mb=2) as reader:
        assert isinstance(reader, CachedReader) and reader.name == "posix"
        stats = reader.describe()["record_cache"]
        assert stats["budget_bytes"] == 2 << 20 and (2 << 20) * 0.9 <= stats["bytes"] <= 2 << 20


def test_a_failed_read_offers_nothing_and_gives_its_buffers_back(store: Store) -> None:
    class FailEveryRead(FaultInjector):
        def results(self, engine: str, lengths: np.ndarray, results: np.ndarray) -> np.ndarray:
            return np.full_like(results, -errno.EIO)

    with cached(store, 0.2) as reader:
        held = np.arange(20)
        reader.read(held)
        docs = np.concatenate([held, np.arange(500, 540)])  # hits copied out, misses that fail
        with inject_faults(FailEveryRead()), pytest.raises(ReadError):
            reader.read(docs)
        assert not np.isin(np.arange(500, 540), reader.cached_documents()).any()
        assert reader.inner.buffer_pool.stats()["in_use"] == 0
        batch = reader.read(docs)  # the device is back: exact bytes
        assert_batch_equal(batch, store.expected(docs))
        assert np.isin(np.arange(500, 540), reader.cached_documents()).all()


def test_an_exception_in_the_gather_ends_the_read_of_the_hits(store: Store) -> None:
    class FailGather(FaultInjector):
        def point(self, name: str) -> None:
            if name == "gather":
                raise KeyboardInterrupt

    with cached(store, 0.2) as reader:
        docs = np.arange(30)
        reader.read(docs)
        with inject_faults(FailGather()), pytest.raises(KeyboardInterrupt):
            reader.read(np.arange(60))  # half hits (a read in flight in the segment), half misses
        assert reader.inner.buffer_pool.stats()["in_use"] == 0
        assert reader.stats()["reads_in_flight"] == 0, "the hits' read ended with the failed gather"
        assert_batch_equal(reader.read(np.arange(60)), store.expected(np.arange(60)))


def test_a_read_splits_into_its_hits_then_its_misses(store: Store) -> None:
    """The hits are handed over while the misses are still in flight (what a search scores
    first); each part is exact, and a search that drops the misses' part mid-way still ends every read."""
    with cached(store, 0.2) as reader:
        held = np.arange(0, 80, 2)
        reader.read(np.concatenate([held, np.arange(160, 200)]))
        docs = np.arange(80)
        parts = reader.submit(docs).split_in_memory()
        assert [sorted(d.tolist()) for d, _ in parts] == [held.tolist(), np.arange(1, 80, 2).tolist()]
        for i, (part_docs, read) in enumerate(parts):
            batch = read.result()
            assert batch.docs is not None and batch.docs.tolist() == part_docs.tolist()
            assert (batch.bytes_read == 0) == (i == 0)
            assert_batch_equal(batch, store.expected(part_docs))
        (_, hits), (_, misses) = reader.submit(np.arange(160, 260)).split_in_memory()  # the misses were admitted
        with hits.records():
            assert reader.stats()["reads_in_flight"] == 1
        misses.discard()
        assert reader.stats()["reads_in_flight"] == 0 and reader.inner.buffer_pool.stats()["in_use"] == 0
        everything = reader.submit(held).split_in_memory()  # nothing to wait for: one read
        assert len(everything) == 1
        everything[0][1].discard()
        assert reader.stats()["reads_in_flight"] == 0


def test_a_newer_version_of_a_cached_record_takes_the_place_of_the_older(store: Store) -> None:
    """A read that began before a write can offer a document's old record after the write's
    `forget`: the new version, offered later, still comes in, and only it answers."""
    with cached(store, 0.5) as reader:
        doc, file = np.array([5]), np.frombuffer(store.path.read_bytes(), dtype=np.uint8)
        old, length = int(store.records[5]["offset"]), int(store.records[5]["length"])
        new = old + 4096  # where the new version would lie (its bytes do not matter here)
        for offset in (old, new):
            reader.cache.admit(doc, np.array([offset]), np.array([length]), file, np.array([old]))
        found = {}
        for offset in (old, new):
            hit, _, read = reader.cache.lookup(doc, np.array([offset]))
            reader.cache.end_read(read)
            found[offset] = bool(hit[0])
        assert found == {old: False, new: True}
        assert reader.cache.cached_documents().tolist().count(5) == 1


def test_no_slot_a_read_holds_changes_under_it(store: Store) -> None:
    """Hits are read in place: while a batch of them is held (unscored), heavy churn through a
    small cache must evict around them (here: the records cached before it), never over them."""
    raw = store.path.read_bytes()
    with cached(store, 0.02) as reader:
        held_docs = np.arange(0, 40)
        for _ in range(3):
            reader.read(held_docs)
        fillers = np.arange(40, len(store.records))
        for part in np.array_split(fillers, 20):  # the rest of the cache, asked for twice each
            reader.read(part)
            reader.read(part)
        assert reader.stats()["entries"] == reader.stats()["slots"]
        with reader.submit(held_docs).records() as batch:
            assert batch.bytes_read == 0 and reader.stats()["reads_in_flight"] == 1
            rng = np.random.default_rng(5)
            for _ in range(60):  # each of these is asked for more often than the held ones
                churn = rng.integers(40, len(store.records), size=60)
                for _ in range(5):
                    reader.read(churn)
            assert reader.stats()["evicted"] > 0
            for row, doc in enumerate(batch.docs.tolist()):
                offset, length = int(store.records[doc]["offset"]), int(store.records[doc]["length"])
                start = int(batch.starts[row])
                got = bytes(np.asarray(batch.buffers[int(batch.buffer_of[row])])[start: start + length])
                assert got == raw[offset: offset + length], f"doc {doc} changed while it was being read"
        assert reader.stats()["reads_in_flight"] == 0


def test_searches_with_the_cache_rank_exactly_as_without(sample_index: Path) -> None:
    queries = ["protein folding", "vaccine trial results", "protein folding", "climate", "vaccine trial results"]
    with Searcher.open(sample_index, reader="posix") as plain, \
            Searcher.open(sample_index, reader="posix", reader_options={"record_cache_mb": 4}) as fast:
        for _ in range(2):
            want, got = plain.search(queries, k=10), fast.search(queries, k=10)
            for a, b in zip(want, got):
                assert [h.doc_id for h in a.hits] == [h.doc_id for h in b.hits]
                np.testing.assert_allclose([h.score for h in a.hits], [h.score for h in b.hits], rtol=1e-5)
        stats = fast.reader.describe()["record_cache"]
        assert stats["hits"] > 0 and stats["hit_rate"] > 0.3


def test_the_prefetcher_reads_from_storage_only_what_the_cache_lacks(sample_index: Path) -> None:
    """A cache filled with the table: searches with prefetch read nothing from storage and waves
    step aside (`io_bound` turns false once the misses are rare); half a table: only misses are read."""
    queries = ["protein folding", "vaccine trial results", "climate", "neural networks"]
    table_mb = (sample_index / "embeddings.bin").stat().st_size / 2**20
    with Searcher.open(sample_index, reader="posix") as plain, \
            Searcher.open(sample_index, reader="posix", reader_options={"record_cache_mb": 2 * table_mb + 2,
                                                                        "record_cache_warm": True}) as full:
        for _ in range(3):
            got = full.search(queries, k=10, prefetch=True)
        assert not full.reader.io_bound
        want = plain.search(queries, k=10, prefetch=True)
        assert [[h.doc_id for h in r.hits] for r in got] == [[h.doc_id for h in r.hits] for r in want]
        assert sum(r.stats.bytes_read for r in got) == 0 and sum(r.stats.bytes_read for r in want) > 0
        assert all(r.stats.waves == 0 for r in got)


def test_ram_is_split_between_what_stays_resident_and_the_cache(sample_index: Path) -> None:
    from espn.store.ram_plan import plan_ram

    plan = plan_ram(sample_index, 64 << 20)
    assert plan.resident_bytes > 0 and plan.record_cache_bytes > 0
    assert plan.total_bytes <= 64 << 20
    with Searcher.open(sample_index, reader="posix", reader_options={"ram_mib": 64}) as searcher:
        described = searcher.reader.describe()
        assert described["ram"]["record_cache_bytes"] == plan.record_cache_bytes
        assert described["record_cache"]["bytes"] <= plan.record_cache_bytes
    with pytest.raises(InvalidParameterError, match=r"ram_mib=0\.0\d* is below the .* MiB that"):
        Searcher.open(sample_index, reader="posix", reader_options={"ram_mib": 0.01})
    default = plan_ram(sample_index, None, physical_bytes=1 << 40)
    assert default.record_cache_bytes in (0, int(0.25 * default.table_bytes))


def test_the_memory_budget_counts_the_plan_and_a_ram_too_small_counts_what_stays_resident(sample_index: Path) -> None:
    from espn.engine import IndexConfig
    from espn.engine.memory import estimate_bytes
    from espn.store.ram_plan import plan_ram

    plan = plan_ram(sample_index, 64 << 20)
    assert estimate_bytes(sample_index, IndexConfig(reader="posix", ram_mib=64)) == plan.total_bytes
    assert estimate_bytes(sample_index, IndexConfig(reader="posix", ram_mib=64, record_cache_mb=0)) == \
        plan.resident_bytes
    assert estimate_bytes(sample_index, IndexConfig(reader="posix", ram_mib=0.01)) == plan.resident_bytes


# -- one copy shared by processes ------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from test_store import write_store
    from espn.store import open_reader, StoreLayout
    records = np.load({records!r})
    reader = open_reader("posix", {path!r}, records, StoreLayout(d_cls=32, d_bow=16, block_size=4096),
                         record_cache_mb={mb!r}, record_cache_share={share!r})
    reader.read(np.arange({first}, {stop}))
    print(reader.describe()["record_cache"]["segment"], flush=True)
    {then}
""")


def run_child(store: Store, tmp_path: Path, share: str, first: int, stop: int, then: str = "reader.close()",
              mb: float = 4.0) -> subprocess.Popen:
    np.save(tmp_path / "records.npy", store.records)
    code = CHILD.format(tests=str(ROOT / "tests"), records=str(tmp_path / "records.npy"), path=str(store.path),
                        mb=mb, share=share, first=first, stop=stop, then=then)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)


@shared_memory
def test_processes_with_one_key_share_one_copy_removed_by_the_last(store: Store, tmp_path: Path) -> None:
    share = f"test-{os.getpid()}-share"
    with open_reader("posix", store.path, store.records, store.layout, record_cache_mb=4.0,
                     record_cache_share=share) as reader:
        segment = Path(reader.describe()["record_cache"]["segment"])
        assert segment.parent == SHM_DIR and segment.name.startswith(SEGMENT_PREFIX)
        child = run_child(store, tmp_path, share, 100, 160)
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0 and out.strip() == str(segment), "the child mapped the same segment"
        batch = reader.read(np.arange(100, 160))
        assert batch.bytes_read == 0, "what another process read is served from the shared copy"
        assert_batch_equal(batch, store.expected(np.arange(100, 160)))
        assert np.isin(np.arange(100, 160), segment_documents(segment)).all()
        assert segment.exists(), "the child's close left the segment to its other user"
    assert not segment.exists(), "the last process to detach removes it"


@shared_memory
def test_a_process_that_died_mid_change_empties_the_cache_and_a_dead_segment_is_removed(
        store: Store, tmp_path: Path) -> None:
    share = f"test-{os.getpid()}-dirty"
    with open_reader("posix", store.path, store.records, store.layout, record_cache_mb=4.0,
                     record_cache_share=share) as reader:
        reader.read(np.arange(40))
        # The child takes the lock, marks a change begun and dies in it (SIGKILL: nothing runs after).
        child = run_child(store, tmp_path, share, 60, 80, then="import os, signal\n"
                          "with reader.cache.segment.lock():\n"
                          "    reader.cache.store.header[2] = 1\n"
                          "    os.kill(os.getpid(), signal.SIGKILL)")
        child.communicate(timeout=120)
        assert child.returncode == -signal.SIGKILL
        batch = reader.read(np.arange(40))
        assert batch.bytes_read > 0, "a cache a writer died changing is emptied, never trusted"
        assert_batch_equal(batch, store.expected(np.arange(40)))
        assert reader.stats()["resets"] == 1
    orphan = run_child(store, tmp_path, f"test-{os.getpid()}-orphan", 0, 10,
                       then="import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    path = Path(orphan.stdout.readline().strip()) if orphan.stdout is not None else None
    orphan.wait(timeout=120)
    assert path is not None and path.exists(), "a killed process cannot remove its segment"
    assert path in remove_stale_segments(SHM_DIR)
    assert not path.exists()


def test_under_a_small_descriptor_limit(store: Store, tmp_path: Path) -> None:
    """`ulimit -n 1024`: many cached readers opened and closed in turn leak no descriptor."""
    code = textwrap.dedent(f"""
        import os, resource, sys, numpy as np
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
        from espn.store import open_reader, StoreLayout
        records = np.load({str(tmp_path / 'records.npy')!r})
        layout = StoreLayout(d_cls=32, d_bow=16, block_size=4096)
        before = len(os.listdir("/proc/self/fd"))
        for i in range(600):
            with open_reader("posix", {str(store.path)!r}, records, layout, record_cache_mb=2.0,
                             record_cache_share=f"fd-{os.getpid()}-{{i % 3}}") as reader:
                reader.read(np.arange(i % 50, i % 50 + 20))
        print(len(os.listdir("/proc/self/fd")) - before)
    """)
    np.save(tmp_path / "records.npy", store.records)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.strip()) <= 2


def test_a_tmpfs_without_room_leaves_the_cache_private(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A page touched past a full tmpfs is a SIGBUS: a segment larger than what /dev/shm has free
    (a container's is 64 MiB) is refused at creation and the process keeps its own."""
    small = tmp_path / "shm"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (not root?): {mounted.stderr.decode().strip()}")
    try:
        made: list[int] = []
        segment = open_segment(4 << 20, "room", "test", lambda buffer: made.append(len(buffer)), lambda _: False,
                               directory=small)
        assert not segment.shared and made == [4 << 20]
        assert "has 1 MiB free and the cache needs 4 MiB" in caplog.text
        segment.close()
        assert not list(small.iterdir()), "nothing is left in the small tmpfs"
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_an_orphaned_lock_file_is_removed(tmp_path: Path) -> None:
    (tmp_path / f"{SEGMENT_PREFIX}gone-1234.lock").write_bytes(b"")
    (tmp_path / "unrelated.lock").write_bytes(b"")
    assert remove_stale_segments(tmp_path) == [tmp_path / f"{SEGMENT_PREFIX}gone-1234"]
    assert [p.name for p in tmp_path.iterdir()] == ["unrelated.lock"]


def test_the_embedded_index_is_planned_and_cached_as_a_server_serves_it(sample_index: Path) -> None:
    """espn.Index opens with IndexConfig's RAM plan and record cache, warmed, as `espn serve` does."""
    from espn import Index
    from espn.engine import IndexConfig
    from espn.store.ram_plan import plan_ram

    plan = plan_ram(sample_index, 64 << 20)
    with Index.open(sample_index, IndexConfig(reader="posix", ram_mib=64)) as index:
        reader = index.stats()["reader"]
        assert reader["ram"]["record_cache_bytes"] == plan.record_cache_bytes
        assert 0 < reader["record_cache"]["bytes"] <= plan.record_cache_bytes  # filled at open
        hits = [h.doc_id for h in index.search(["what causes ocean tides"], k=5)[0].hits]
    with Searcher.open(sample_index, reader="posix") as plain:
        assert [h.doc_id for h in plain.search(["what causes ocean tides"], k=5)[0].hits] == hits
