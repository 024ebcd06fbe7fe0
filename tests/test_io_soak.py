"""Searches under generation swaps, closes and injected faults: nothing wrong, nothing leaked.

The real pipeline (FAISS, the posix reader with O_DIRECT where tmp_path allows it, real
rings) over the bundled sample corpus, compared with the in-memory reader of the same
generation. Faults come through the engines' public test hook (`inject_faults`); the
strict ownership policy of tests/conftest.py turns any buffer given back while a read
targets it, or written after it was given back, into an error.
"""

from __future__ import annotations

import errno
import gc
import os
import random
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from espn import Searcher
from espn.corpus import read_queries
from espn.encoders import QueryEmbeddings
from espn.store import PosixReader
from espn.store.engines import ENGINES, FaultInjector, StoreClosedError, inject_faults
from espn.store.engines.errors import TRANSIENT_ERRNOS
from espn.store.engines.ownership import LEDGER
from espn.live.live_index import LiveIndex

ROOT = Path(__file__).resolve().parents[1]
AVAILABLE = [name for name, cls in ENGINES.items() if cls.unavailable_reason() is None]
SYSCALLS = {"io_uring_enter", "io_submit", "io_getevents", "preadv"}
#: The soak's length; half a minute in CI (ESPN_SOAK_SECONDS lengthens it by hand).
SOAK_SECONDS = float(os.environ.get("ESPN_SOAK_SECONDS", "30"))


def take(queries: QueryEmbeddings, rows: list[int]) -> QueryEmbeddings:
    return QueryEmbeddings(queries.cls[rows], queries.bow[rows], queries.mask[rows])


def ranking(results: list) -> list[list[tuple[str, float]]]:
    return [[(h.doc_id, round(h.score, 4)) for h in r.hits] for r in results]


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def queries(sample_index: Path) -> QueryEmbeddings:
    with Searcher.open(sample_index, reader="memory") as s:
        texts = [text for _, text in read_queries(ROOT / "espn" / "data" / "sample_queries.jsonl")]
        return s.encoder.encode_queries(texts)


class InterruptAt(FaultInjector):
    """KeyboardInterrupt at the n-th syscall of the read path, once (a Ctrl-C landing there)."""

    def __init__(self, nth: int) -> None:
        self.nth, self.seen, self.fired = nth, 0, 0
        self.lock = threading.Lock()

    def syscall(self, name: str) -> int:
        with self.lock:
            self.seen += 1
            fire = self.seen == self.nth
            self.fired += fire
        if fire:
            raise KeyboardInterrupt
        return 0

    def point(self, name: str) -> None:
        if self.nth == 0 and name == "gather" and not self.fired:
            self.fired = 1
            raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["gather", "first", "middle"])
def test_a_search_interrupted_part_way_leaves_no_read_behind(sample_index: Path, queries: QueryEmbeddings,
                                                             where: str) -> None:
    """A search cancelled by KeyboardInterrupt (in a prefetch wave, a miss read or the gather)
    raises it, returns every buffer, and the next searches rank exactly like the memory reader.

    Which syscall is interrupted is counted on the same search just before: how many a search
    makes depends on the prefetch model's measurements, so fixed positions may never come."""
    batch = take(queries, list(range(4)))
    with Searcher.open(sample_index, reader="memory", with_encoder=False) as ref, \
            Searcher.open(sample_index, reader="posix", with_encoder=False, min_hidden_ms=0) as s:
        want = ranking(ref.search_embeddings(batch, k=10, prefetch_step=0.2))
        counted = InterruptAt(-1)
        with inject_faults(counted):
            s.search_embeddings(batch, k=10, prefetch_step=0.2)
        assert counted.seen >= 1
        nth = {"gather": 0, "first": 1, "middle": max(1, counted.seen // 2)}[where]
        faults = InterruptAt(nth)
        with inject_faults(faults), pytest.raises(KeyboardInterrupt):
            s.search_embeddings(batch, k=10, prefetch_step=0.2)
        assert faults.fired == 1
        assert ranking(s.search_embeddings(batch, k=10, prefetch_step=0.2)) == want
        assert isinstance(s.reader, PosixReader)
        time.sleep(0.02)  # not synchronisation: a buggy engine's stray write, still queued, would land by now
        s.reader.buffer_pool.check()
        stats = s.reader.buffer_pool.stats()
        assert stats["in_use"] == 0 and stats["quarantined"] == 0, stats
        assert LEDGER.outstanding() == 0


class Weather(FaultInjector):
    """Transient errors at every syscall and in read results, at a rate another thread changes."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.rate = 0.0
        self.injected = 0

    def syscall(self, name: str) -> int:
        with self.lock:
            if name not in SYSCALLS or self.rng.random() >= self.rate:
                return 0
            self.injected += 1
            return self.rng.choice(sorted(TRANSIENT_ERRNOS))

    def results(self, engine: str, lengths: np.ndarray, results: np.ndarray) -> np.ndarray:
        with self.lock:
            draw = np.array([self.rng.random() for _ in range(len(results))])
            rate = self.rate
        results = results.copy()
        fail = draw < rate / 4
        results[fail] = -errno.EAGAIN  # a read the kernel asks to retry
        short = (draw > 1 - rate / 4) & (results == lengths) & (lengths > 4096)
        results[short] -= 1000  # a read that came back short, mid-file
        with self.lock:
            self.injected += int(fail.sum() + short.sum())
        return results


def test_soak_searches_swaps_closes_and_transient_errors(sample_index: Path, queries: QueryEmbeddings,
                                                        tmp_path: Path) -> None:
    """8 threads of mixed searches; a second thread publishes a generation (a delete), swaps in
    its Searchers and closes the old ones at once (searches still running on them) every few
    hundred ms, rotating the read engine; a third changes the rate of injected transient
    errors. 0 wrong rankings against the memory reader of the same generation, no error but
    the clear "closed" of a retired Searcher (the search is then retried on the new one), and
    descriptors, buffers and ledger claims back where they started."""
    root = tmp_path / "index"
    shutil.copytree(sample_index, root)
    gc.collect()  # what earlier tests left for the collector is not this test's
    baseline = open_descriptors()
    rng = random.Random(22)

    def open_pair(number: int) -> tuple[Searcher, Searcher]:
        engine = AVAILABLE[number % len(AVAILABLE)]
        posix = Searcher.open(root, reader="posix", with_encoder=False, verify="none", min_hidden_ms=0,
                              reader_options={"io_engine": engine, "io_depth": 8})
        memory = Searcher.open(root, reader="memory", with_encoder=False, verify="none")
        return posix, memory

    lock = threading.Lock()
    current = open_pair(0)
    readers = [current[0].reader]
    stop = threading.Event()
    counts = {"searches": 0, "closed_retries": 0, "swaps": 0}
    wrong: list[str] = []
    errors: list[BaseException] = []
    weather = Weather(seed=7)

    def searcher_thread(worker: int) -> None:
        local = random.Random(worker)
        while not stop.is_set():
            rows = local.sample(range(len(queries)), local.choice([1, 1, 2, 4]))
            params = dict(k=local.choice([5, 10, 20]), prefetch_step=local.choice([0.1, 0.3, 1.0]),
                          prefetch=local.random() < 0.8, rerank_count=local.choice([16, 64]))
            with lock:
                posix, memory = current
            try:
                got = ranking(posix.search_embeddings(take(queries, rows), **params))
                want = ranking(memory.search_embeddings(take(queries, rows), **params))
            except StoreClosedError:  # retired under us: the caller retries on the new Searcher
                with lock:
                    counts["closed_retries"] += 1
                continue
            except BaseException as exc:  # noqa: BLE001 - every other failure is a test failure
                errors.append(exc)
                return
            with lock:
                counts["searches"] += 1
            if got != want:
                wrong.append(f"generation {posix.generation}, rows {rows}, {params}: {got} != {want}")

    def swapper() -> None:
        nonlocal current
        number = 0
        try:
            with LiveIndex.open(root) as writer:
                ids = list(current[0].ids.external(np.arange(current[0].num_documents)))
                rng.shuffle(ids)
                while not stop.wait(rng.uniform(0.15, 0.45)):
                    number += 1
                    if number <= 120:
                        writer.delete([ids.pop()])  # a new generation
                    pair = open_pair(number)
                    with lock:
                        old, current = current, pair
                        readers.append(pair[0].reader)
                        counts["swaps"] += 1
                    for searcher in old:  # at once: searches may still run on them
                        searcher.close()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def forecaster() -> None:
        while not stop.wait(0.05):
            with weather.lock:
                weather.rate = rng.choice([0.0, 0.0, 0.02, 0.05, 0.15])

    threads = [threading.Thread(target=searcher_thread, args=(w,)) for w in range(8)]
    threads += [threading.Thread(target=swapper), threading.Thread(target=forecaster)]
    with inject_faults(weather):
        for thread in threads:
            thread.start()
        stop.wait(SOAK_SECONDS)
        stop.set()
        for thread in threads:
            thread.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    current[0].close()
    current[1].close()
    assert not errors, errors[:3]
    assert not wrong, wrong[:3]
    assert counts["searches"] > 50 and counts["swaps"] >= 3 and weather.injected > 50, (counts, weather.injected)
    time.sleep(0.05)  # not synchronisation: a buggy engine's stray write, still queued, would land by now
    pools = [reader.buffer_pool.stats() for reader in readers]
    assert all(p["in_use"] == 0 and p["quarantined"] == 0 for p in pools), pools
    assert LEDGER.outstanding() == 0
    del current, readers, threads
    gc.collect()
    left = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")}
    assert open_descriptors() == baseline, f"{baseline} at start; now: " + ", ".join(sorted(left.values()))
    print(f"soak: {counts}, {weather.injected} faults injected")
