"""The hot-record cache (espn.store.record_cache): exact reads, frequency admission, budget.

Real files (RecordWriter) read through the real posix reader, with and without the cache in
front; every batch is compared bit for bit with the arrays that went in.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from espn import Searcher
from espn.errors import InvalidParameterError
from espn.store import CachedReader, StoreLayout, open_reader
from espn.store.record_cache import FrequencySketch
from helpers import run_threads
from server_fixtures import HTTP, running_server
from test_store import Store, assert_batch_equal, random_counts, write_store

LAYOUT = StoreLayout(d_cls=32, d_bow=16, block_size=4096)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return write_store(tmp_path, LAYOUT, random_counts(np.random.default_rng(3), 2000, LAYOUT))


def cached(store: Store, slots: int) -> CachedReader:
    """A posix reader behind a cache of exactly `slots` slots."""
    slot_bytes = CachedReader(open_reader("posix", store.path, store.records, store.layout), 1 << 20)
    budget = slots * slot_bytes.slot_bytes
    slot_bytes.close()
    reader = CachedReader(open_reader("posix", store.path, store.records, store.layout), budget)
    assert reader.stats()["slots"] == slots
    return reader


def test_sketch_never_undercounts_and_ages() -> None:
    sketch = FrequencySketch(1024)
    keys = np.random.default_rng(0).zipf(1.3, size=3000) % 5000
    sketch.add(keys)
    truth = np.bincount(keys, minlength=5000)
    seen = np.flatnonzero(truth)
    assert (sketch.estimate(seen) >= truth[seen]).all()
    assert sketch.estimate(np.array([int(seen[np.argmax(truth[seen])])]))[0] >= truth.max()
    before = int(sketch.estimate(np.array([7]))[0])
    sketch.add(np.full(sketch.sample_size, 10**9))  # a flood of one other key triggers the reset
    assert int(sketch.estimate(np.array([7]))[0]) <= max(1, before // 2 + 1)


def test_reads_through_the_cache_match_the_file(store: Store) -> None:
    rng = np.random.default_rng(1)
    with cached(store, 64) as reader:
        hot = rng.choice(len(store.records), size=40, replace=False)
        for round_ in range(4):  # misses, then hits, mixed with fresh documents and duplicates
            docs = np.concatenate([hot, rng.integers(0, len(store.records), size=30), hot[:5]])
            rng.shuffle(docs)
            assert_batch_equal(reader.read(docs), store.expected(docs))
        stats = reader.stats()
        assert stats["hits"] > 0 and 0 < stats["hit_rate"] < 1
        cached_docs = np.flatnonzero(reader.records["length"] <= reader.slot_bytes)
        hits_only = np.intersect1d(hot, cached_docs)[:10]
        batch = reader.read(hits_only)
        assert_batch_equal(batch, store.expected(hits_only))
        assert batch.bytes_read == 0 and batch.ios == 0, "documents served from RAM cost no I/O"
        assert_batch_equal(reader.read(np.zeros(0, np.int64)), store.expected(np.zeros(0, np.int64)))


def test_a_scan_does_not_flush_the_hot_set(store: Store) -> None:
    with cached(store, 32) as reader:
        fits = np.flatnonzero(store.records["length"] <= reader.slot_bytes)
        hot, cold = fits[:24], fits[24:]
        for _ in range(8):
            reader.read(hot)
        for part in np.array_split(cold, 40):  # one pass over everything else, each asked once
            reader.read(part)
        before = reader.stats()["hits"]
        batch = reader.read(hot)
        assert reader.stats()["hits"] - before == len(hot), "the scan evicted hot records"
        assert batch.bytes_read == 0
        assert reader.stats()["evicted"] < len(cold) // 4


def test_concurrent_readers_get_exact_records(store: Store) -> None:
    with cached(store, 48) as reader:
        def work(worker: int) -> None:
            rng = np.random.default_rng(worker)
            for _ in range(30):
                docs = rng.zipf(1.5, size=25) % len(store.records)
                assert_batch_equal(reader.read(docs), store.expected(docs))

        run_threads(work, 4)
        assert reader.stats()["hits"] > 0


def test_budget_and_reader_are_checked(store: Store) -> None:
    with pytest.raises(InvalidParameterError, match="record_cache_mb"):
        open_reader("posix", store.path, store.records, store.layout, record_cache_mb=-1)
    with pytest.raises(InvalidParameterError, match="holds no record"):
        open_reader("posix", store.path, store.records, store.layout, record_cache_mb=0.0001)
    with pytest.raises(InvalidParameterError, match="not the memory reader"):
        open_reader("memory", store.path, store.records, store.layout, record_cache_mb=1)
    plain = open_reader("posix", store.path, store.records, store.layout, record_cache_mb=0)
    assert not isinstance(plain, CachedReader)
    plain.close()
    with open_reader("posix", store.path, store.records, store.layout, record_cache_mb=2) as reader:
        assert isinstance(reader, CachedReader) and reader.name == "posix"
        assert reader.describe()["record_cache"]["budget_bytes"] == 2 << 20
        assert reader.nbytes >= (2 << 20) - reader.slot_bytes


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


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_serve_flag_and_metrics(sample_index: Path, tmp_path: Path) -> None:
    with running_server(sample_index, tmp_path, "--record-cache-mb", "4", "--batch-wait-ms", "0") as server:
        for _ in range(3):
            response = HTTP.post(f"{server.base_url}/v1/search", json={"query": "protein folding", "k": 10},
                                  timeout=60.0)
            assert response.status_code == 200, response.text
        text = HTTP.get(f"{server.base_url}/metrics").text
        requests, hits = _sample(text, "espn_record_cache_requests"), _sample(text, "espn_record_cache_hits")
        assert requests > 0 and hits >= requests / 3, "a repeated query is served from the cache"
        assert _sample(text, "espn_record_cache_bytes") >= 3 << 20
        # The prefetch planner's decisions are exported (present; counts depend on the machine).
        _sample(text, "espn_prefetch_waves_total")
        _sample(text, "espn_prefetch_waves_skipped_total")
        ready = HTTP.get(f"{server.base_url}/readyz").json()
        assert "record_cache" in json.dumps(ready)
