"""Records in IVF-list order (espn.store.record_order): the build writes them so, reads are
unchanged, and a probed list's candidates coalesce into fewer reads than in doc order."""

from __future__ import annotations

import json
from pathlib import Path

import faiss
import numpy as np
import pytest

from espn.errors import IndexCorruptError
from espn.store import StoreLayout, open_reader, plan_extents
from espn.store.record_order import RECORD_ORDER, ivf_list_order, write_in_order
from test_store import assert_batch_equal, random_counts, write_store

LAYOUT = StoreLayout(d_cls=16, d_bow=8, block_size=512)


def test_write_in_order_keeps_every_record_and_follows_the_order(tmp_path: Path) -> None:
    store = write_store(tmp_path, LAYOUT, random_counts(np.random.default_rng(5), 400, LAYOUT))
    order = np.random.default_rng(6).permutation(len(store.records))
    records, size = write_in_order(store.path, store.records, order, LAYOUT.block_size, tmp_path / "ordered.bin")
    assert size == (tmp_path / "ordered.bin").stat().st_size and size % LAYOUT.block_size == 0
    assert (np.diff(records["offset"][order]) > 0).all(), "records lie in the order given"
    np.testing.assert_array_equal(records["length"], store.records["length"])
    with open_reader("posix", tmp_path / "ordered.bin", records, LAYOUT) as reader:
        docs = np.arange(len(records))
        assert_batch_equal(reader.read(docs), store.expected(docs))


def test_ivf_list_order_lists_each_document_once() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 8)).astype(np.float32)
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(8), 8, 7, faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    index.add(x)
    order = ivf_list_order(index)
    np.testing.assert_array_equal(np.sort(order), np.arange(500))
    _, assign = index.quantizer.search(x, 1)
    assert (np.diff(assign[order, 0]) >= 0).all(), "list 0's documents, then list 1's, ..."


def test_the_build_lays_records_out_by_list(scifact_index: Path) -> None:
    manifest = json.loads((scifact_index / "manifest.json").read_text())
    assert manifest["store"]["record_order"] == RECORD_ORDER
    records = np.load(scifact_index / "records.npy")
    order = ivf_list_order(faiss.read_index(str(scifact_index / "ann.faiss")))
    assert (np.diff(records["offset"][order]) > 0).all()
    assert manifest["store"]["file_bytes"] == (scifact_index / "embeddings.bin").stat().st_size


def test_candidates_of_a_list_coalesce(tmp_path: Path) -> None:
    """Clustered documents: the candidates of a few probed lists cost fewer reads in list order."""
    rng = np.random.default_rng(1)
    layout = StoreLayout(d_cls=16, d_bow=8, block_size=4096)
    n = 4000
    store = write_store(tmp_path, layout, np.full(n, 6), chunks=1)  # 128-byte records: 32 per block
    centres = rng.normal(size=(16, 16)).astype(np.float32)
    x = centres[rng.integers(0, 16, size=n)] + 0.1 * rng.normal(size=(n, 16)).astype(np.float32)
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(16), 16, 16, faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    index.add(x)
    index.nprobe = 2
    records, _ = write_in_order(store.path, store.records, ivf_list_order(index), layout.block_size,
                                tmp_path / "ordered.bin")
    _, candidates = index.search(x[:50], 100)
    doc_order = [len(plan_extents(store.records["offset"][c], store.records["length"][c], 4096)) for c in candidates]
    list_order = [len(plan_extents(records["offset"][c], records["length"][c], 4096)) for c in candidates]
    assert np.mean(list_order) < 0.5 * np.mean(doc_order), (np.mean(list_order), np.mean(doc_order))


@pytest.mark.parametrize("shuffled", [False, True])
def test_reader_checks_the_furthest_record(tmp_path: Path, shuffled: bool) -> None:
    store = write_store(tmp_path, LAYOUT, random_counts(np.random.default_rng(2), 50, LAYOUT))
    records = store.records.copy()
    if shuffled:  # the furthest record is not the last one
        records[[0, -1]] = records[[-1, 0]]
    records["offset"][np.argmax(records["offset"])] += 10 * LAYOUT.block_size
    with pytest.raises(IndexCorruptError, match="ends at byte"):
        open_reader("posix", store.path, records, LAYOUT)
