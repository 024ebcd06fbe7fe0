"""Pooling groups stored beside pooled records (espn/pooling/groups.py, espn/pooling/spans.py).

The reference everywhere is the older way: re-encode the passage and pool it again
(`espn.search.explain.pooled_spans`). Explanations read from stored groups must give exactly its
spans, without a forward pass, on an index built now, after live writes, merges and base
rewrites, across a snapshot restore; an index without the files (built before them) and
damaged files fall back to re-encoding.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from espn import Searcher
from espn.cli import main as cli_main
from espn.corpus import passage_text
from espn.errors import IndexCorruptError
from espn.search.explain import passage_spans, pooled_spans
from espn.files.durable import write_json_atomic
from espn.index import read_manifest
from espn.pooling.cluster import pool_documents, pool_documents_grouped, pool_vectors
from espn.pooling.groups import (GROUP_OFFSETS_FILE, GROUPS_FILE, POOL_GROUP_FILES, PoolGroups, PoolGroupsWriter,
                                 StoredPoolGroups, concat_pool_groups, copy_pool_groups, merge_group_spans)
from espn.generation.format import read_current
from espn.store.format import RecordWriter, StoreLayout
from espn.live.compaction import CompactionPolicy, run_compaction
from espn.live.checks import NewDocument
from espn.live.live_index import LiveIndex

QUERIES = ["why does the moon turn red during a lunar eclipse", "what causes ocean tides",
           "coral reefs and warm water", "volcano eruptions and lava"]
NEW_DOCS = [NewDocument("new-coral", "Coral reefs bleach when warm water stresses the algae living in the coral."),
            NewDocument("new-volcano", "Volcano eruptions pour lava and ash; the lava cools into new volcanic rock."),
            NewDocument("new-tides", "Ocean tides rise and fall as the moon and the sun pull on the oceans.")]


# -- the files ---------------------------------------------------------------------------------

def test_writer_and_reader_round_trip_with_unknown_documents(tmp_path: Path) -> None:
    writer = PoolGroupsWriter(tmp_path)
    writer.append(np.array([0, 0, 1, 0, 1, 1, 2]), np.array([3, 0, 4]))
    writer.append_unknown(2)
    writer.append(np.array([0]), np.array([1]))
    writer.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(POOL_GROUP_FILES)  # no scratch file left
    groups = PoolGroups.open(tmp_path, 6)
    assert groups is not None and groups.groups.dtype == np.uint16
    assert [groups.of(i).tolist() for i in range(6)] == [[0, 0, 1], [], [0, 1, 1, 2], [], [], [0]]
    stored = StoredPoolGroups([None, groups], [0, 10])
    assert stored.of(3) is None and stored.of(12).tolist() == [0, 1, 1, 2] and stored.of(16) is None
    assert merge_group_spans(np.array([0, 1, 0]), [[(0, 2)], [(3, 5)], [(6, 8)]]) == [[(0, 2), (6, 8)], [(3, 5)]]


def test_a_failed_write_leaves_no_group_files(tmp_path: Path) -> None:
    writer = PoolGroupsWriter(tmp_path)
    writer.append(np.array([0, 1]), np.array([2]))
    with pytest.raises(ValueError, match="pooled row numbers"):
        writer.append(np.array([70_000]), np.array([1]))
    writer.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="do not match"):
        PoolGroupsWriter(tmp_path).append(np.array([0, 1]), np.array([3]))


def test_record_writer_stores_the_groups_it_pooled_by(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    counts = np.array([7, 1, 0, 12])
    bow = rng.standard_normal((int(counts.sum()), 8)).astype(np.float16)
    cls = rng.standard_normal((4, 8)).astype(np.float16)
    layout = StoreLayout(8, 8, 512, "int8", pool_factor=2)
    with RecordWriter(tmp_path / "embeddings.bin", layout, groups_dir=tmp_path) as writer:
        rows = writer.append(cls, bow, counts)
        writer.close()
    _, pooled_counts, expected = pool_documents_grouped(bow, counts, 2)
    assert rows["n_bow"].tolist() == pooled_counts.tolist() == pool_documents(bow, counts, 2)[1].tolist()
    groups = PoolGroups.open(tmp_path, 4)
    assert groups is not None and groups.groups.tolist() == expected.tolist()
    ends = np.cumsum(counts)
    for i, (end, count) in enumerate(zip(ends, counts)):
        assert groups.of(i).tolist() == pool_vectors(bow[end - count: end], 2)[1].tolist()
    # Unpooled layouts write no groups (explain needs none); a failed write leaves none.
    flat = tmp_path / "flat"
    flat.mkdir()
    with RecordWriter(flat / "embeddings.bin", StoreLayout(8, 8, 512), groups_dir=flat) as writer:
        writer.append(cls, bow, counts)
        writer.close()
    assert sorted(p.name for p in flat.iterdir()) == ["embeddings.bin"]
    failed = tmp_path / "failed"
    failed.mkdir()
    with pytest.raises(ValueError):
        with RecordWriter(failed / "embeddings.bin", layout, groups_dir=failed) as writer:
            writer.append(cls, bow, counts)
            writer.append(cls, bow, counts[:2])  # counts do not match
    assert sorted(p.name for p in failed.iterdir()) == ["embeddings.bin"]


def test_concat_and_copy_keep_each_documents_groups(tmp_path: Path) -> None:
    a, b, c = (tmp_path / name for name in "abc")
    for directory in (a, b, c):
        directory.mkdir()
    for directory, groups, counts in ((a, [0, 0, 1], [2, 1]), (c, [0, 1, 0, 0], [3, 1])):
        writer = PoolGroupsWriter(directory)
        writer.append(np.array(groups), np.array(counts))
        writer.finish()
    out = tmp_path / "merged"
    out.mkdir()
    assert concat_pool_groups([a, b, c], [2, 3, 2], out) == list(POOL_GROUP_FILES)
    merged = PoolGroups.open(out, 7)
    assert merged is not None
    assert [merged.of(i).tolist() for i in range(7)] == [[0, 0], [1], [], [], [], [0, 1, 0], [0]]
    assert concat_pool_groups([b], [3], tmp_path / "none") == []  # no source has groups: no files
    stored = StoredPoolGroups([PoolGroups.open(a, 2), None, PoolGroups.open(c, 2)], [0, 2, 5])
    rewritten = tmp_path / "rewritten"
    rewritten.mkdir()
    copy_pool_groups(stored, np.array([1, 3, 5, 6]), rewritten)
    kept = PoolGroups.open(rewritten, 4)
    assert kept is not None and [kept.of(i).tolist() for i in range(4)] == [[1], [], [0, 1, 0], [0]]


# -- explanations on real indexes ---------------------------------------------------------------

def _strip_groups(index: Path) -> None:
    """Make `index` what an espn before the files built: no group files in the directory or manifest."""
    manifest = read_manifest(index)
    for name in POOL_GROUP_FILES:
        (index / name).unlink()
        del manifest["files"][name]
    write_json_atomic(index / "manifest.json", manifest)


@pytest.fixture
def copy_of(sample_index: Path, tmp_path: Path):
    def make(name: str, stripped: bool = False) -> Path:
        out = tmp_path / name
        shutil.copytree(sample_index, out)
        if stripped:
            _strip_groups(out)
        return out
    return make


@pytest.fixture
def encode_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Counts the passages the encoder of the Searcher spied last re-encodes (a spy around the
    real call; the count restarts with each Searcher spied)."""
    calls: list[int] = []

    def spy(searcher: Searcher) -> Searcher:
        calls.clear()
        encoder = searcher.encoder
        real = encoder.encode_documents

        def counted(texts, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(len(texts))
            return real(texts, *args, **kwargs)

        monkeypatch.setattr(encoder, "encode_documents", counted)
        return searcher

    spy.calls = calls  # type: ignore[attr-defined]
    yield spy


def _explain(searcher: Searcher) -> list[Any]:
    return [hit for result in searcher.search(QUERIES, k=8, rerank_count=6, explain=True)
            for hit in result.hits if hit.explanation is not None]


def _check_against_reencoding(searcher: Searcher, hits: list[Any]) -> None:
    """Every match's spans are the re-encoded, re-pooled passage's spans of the matched vector."""
    encoder = searcher.encoder
    factor = int(searcher.manifest["store"]["pool_factor"])
    assert factor > 1 and hits
    by_doc = {hit.doc_id: hit for hit in hits}
    documents = {doc_id: searcher.document(doc_id) for doc_id in by_doc}
    passages = [passage_text(d.title, d.text) for d in documents.values()]
    reference = pooled_spans(encoder, passages, encoder.vector_spans(passages), factor)
    checked = 0
    for (doc_id, document), spans in zip(documents.items(), reference):
        assert spans, f"{doc_id}: the re-encoding does not match its record"
        for match in by_doc[doc_id].explanation.matches:
            assert match.spans == passage_spans(document.title, document.text, spans[match.vector])
            checked += 1
    assert checked > 20


def test_a_new_build_stores_groups_and_explains_without_encoding(sample_index: Path, encode_calls) -> None:
    manifest = read_manifest(sample_index)
    assert set(POOL_GROUP_FILES) <= set(manifest["files"])
    with encode_calls(Searcher.open(sample_index)) as searcher:
        hits = _explain(searcher)
        assert encode_calls.calls == []
        _check_against_reencoding(searcher, hits)
    # The stored groups are the ones pooling the re-encoded passages gives, document by document.
    groups = PoolGroups.open(sample_index, manifest["counts"]["documents"])
    assert groups is not None
    with Searcher.open(sample_index) as searcher:
        numbers = list(range(0, 300, 10))
        passages = [passage_text(*searcher.docs.get(n)) for n in numbers]
        fresh = searcher.encoder.encode_documents(passages)
        for number, (_, bow) in zip(numbers, fresh.split()):
            assert groups.of(number).tolist() == pool_vectors(bow.astype(np.float16), 2)[1].tolist()


def test_an_index_without_groups_explains_the_same_by_re_encoding(sample_index: Path, copy_of, encode_calls) -> None:
    old = copy_of("old", stripped=True)
    with Searcher.open(sample_index) as new_searcher:
        expected = _explain(new_searcher)
    with encode_calls(Searcher.open(old, verify="full")) as searcher:
        hits = _explain(searcher)
        assert sum(encode_calls.calls) >= len({h.doc_id for h in hits})
        _check_against_reencoding(searcher, hits)
    assert hits == expected  # same hits, same matches, same spans


def test_live_writes_merges_and_rewrites_carry_the_groups(copy_of, encode_calls) -> None:
    index = copy_of("live")
    with LiveIndex.open(index) as writer:
        for doc in NEW_DOCS:
            writer.upsert([doc])
        writer.delete(["s0002"])
    current = read_current(index)
    assert all(set(POOL_GROUP_FILES) <= set(s.files) for s in current.segments)
    with encode_calls(Searcher.open(index)) as searcher:
        hits = _explain(searcher)
        assert {"new-coral", "new-volcano", "new-tides"} <= {h.doc_id for h in hits}
        assert encode_calls.calls == []
        _check_against_reencoding(searcher, hits)
    plan = CompactionPolicy(max_segments=2, merge_factor=2).plan(current)
    assert plan is not None and plan.kind == "merge"
    assert run_compaction(LiveIndex(index), plan) is not None
    assert all(set(POOL_GROUP_FILES) <= set(s.files) for s in read_current(index).segments)
    with encode_calls(Searcher.open(index, verify="full")) as searcher:
        assert _explain(searcher) == hits and encode_calls.calls == []
    with LiveIndex.open(index) as writer:
        writer.compact()
    current = read_current(index)
    assert current.base.startswith("live/base-") and not current.segments
    assert set(POOL_GROUP_FILES) <= set(current.base_files)
    with encode_calls(Searcher.open(index, verify="full")) as searcher:
        rewritten = _explain(searcher)
        assert encode_calls.calls == []
        _check_against_reencoding(searcher, rewritten)


def test_an_old_base_with_new_deltas_re_encodes_only_the_old_documents(copy_of, encode_calls) -> None:
    index = copy_of("mixed", stripped=True)
    with LiveIndex.open(index) as writer:
        writer.upsert(NEW_DOCS)
        writer.compact()  # the new base: groups for the new documents, unknown ranges for the old ones
    manifest = read_manifest(index / read_current(index).base)
    assert set(POOL_GROUP_FILES) <= set(manifest["files"])
    with encode_calls(Searcher.open(index, verify="full")) as searcher:
        hits = _explain(searcher)
        old = {h.doc_id for h in hits if not h.doc_id.startswith("new-")}
        assert {h.doc_id for h in hits} - old and sum(encode_calls.calls) == len(old)
        _check_against_reencoding(searcher, hits)


def test_a_snapshot_restore_keeps_the_groups(copy_of, tmp_path: Path, encode_calls) -> None:
    index = copy_of("source")
    with LiveIndex.open(index) as writer:
        writer.upsert(NEW_DOCS)
    snap, restored = tmp_path / "snap", tmp_path / "restored"
    assert cli_main(["snapshot", str(index), str(snap)]) == 0
    assert cli_main(["restore", str(snap), str(restored)]) == 0
    for name in POOL_GROUP_FILES:
        assert (restored / name).read_bytes() == (index / name).read_bytes()
    with encode_calls(Searcher.open(restored, verify="full")) as searcher:
        hits = _explain(searcher)
        assert "new-coral" in {h.doc_id for h in hits} and encode_calls.calls == []
        _check_against_reencoding(searcher, hits)


def test_damaged_groups_are_refused_on_open_or_fall_back_with_a_warning(copy_of, encode_calls,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    truncated = copy_of("truncated")
    data = (truncated / GROUPS_FILE).read_bytes()
    (truncated / GROUPS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(IndexCorruptError, match=GROUPS_FILE):
        Searcher.open(truncated)
    # Unverified, explain notices the files do not fit together and re-encodes, with a warning.
    with caplog.at_level(logging.WARNING, logger="espn.pooling.groups"):
        with encode_calls(Searcher.open(truncated, verify="none")) as searcher:
            hits = _explain(searcher)
            assert encode_calls.calls and "re-encode" in caplog.text
            _check_against_reencoding(searcher, hits)
    # Groups of the right size but wrong content: each document that does not fit is re-encoded.
    scrambled = copy_of("scrambled")
    offsets = np.load(scrambled / GROUP_OFFSETS_FILE)
    lengths = np.diff(offsets)
    np.save(scrambled / GROUPS_FILE, np.repeat(lengths.astype(np.uint16), lengths))  # row numbers out of range
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="espn.pooling.spans"):
        with encode_calls(Searcher.open(scrambled, verify="none")) as searcher:
            hits = _explain(searcher)
            assert encode_calls.calls and "do not fit its record" in caplog.text
            _check_against_reencoding(searcher, hits)
