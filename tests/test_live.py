"""The live index (espn/generation/segments.py, espn/live/): upsert, delete, compact, crash safety.

Everything runs on copies of the 300-document sample index with the offline MiniLM
encoder; one module-scoped encoder is shared so each write costs an encode, not a load.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from espn import Searcher
from espn.encoders import Encoder, load_encoder
from espn.errors import DocumentNotFoundError, InvalidParameterError
from espn.index import read_manifest
from espn.generation.format import read_current
from espn.generation.segments import open_view
from espn.errors import IndexLockedError
from espn.live.checks import NewDocument
from espn.live.live_index import LiveIndex

QUERIES = ["how does the sun produce energy", "purple elephant dancing on the moon", "cooking pasta with tomatoes",
           "lunar eclipse red moon", "search engines rank documents"]


@pytest.fixture(scope="module")
def encoder(sample_index: Path) -> Encoder:
    return load_encoder(sample_index / "encoder", read_manifest(sample_index)["encoder"], device="cpu")


@pytest.fixture
def index(sample_index: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "index"
    shutil.copytree(sample_index, copy)
    return copy


def _ids(searcher: Searcher, query: str, k: int = 10, **overrides: object) -> list[str]:
    return [hit.doc_id for hit in searcher.search([query], k=k, **overrides)[0].hits]


def _corpus_text(index: Path, doc_id: str) -> str:
    """Words of `doc_id`'s text in the sample corpus: a lexical query it matches (no query syntax)."""
    import re

    return " ".join(re.findall(r"[A-Za-z]+", next(d["text"] for d in _corpus_docs(index) if d["_id"] == doc_id))[:12])


def _corpus_docs(sample_index: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(__file__).parents[1] / "espn/data/sample_corpus.jsonl").open()]


def test_upsert_replace_delete_are_visible_and_exclusive(index: Path, encoder: Encoder) -> None:
    with Searcher.open(index) as before:
        assert before.generation == 0 and "s0001" in _ids(before, QUERIES[0])
    with LiveIndex.open(index, encoder=encoder) as writer:
        result = writer.upsert([NewDocument("new-1", "A purple elephant is dancing on the moon tonight."),
                                NewDocument("s0001", "Cooking pasta with fresh tomatoes and basil.")])
        assert (result.created, result.replaced) == (["new-1"], ["s0001"])
        assert writer.delete(["s0003"]).deleted == ["s0003"]
        with pytest.raises(DocumentNotFoundError, match="s0003"):
            writer.delete(["s0003"])  # already gone: nothing written
        assert writer.current().number == 2
    with Searcher.open(index) as searcher:
        assert searcher.generation == 2 and searcher.live is not None and int(searcher.live.sum()) == 300
        assert _ids(searcher, QUERIES[1], k=1) == ["new-1"]
        assert _ids(searcher, QUERIES[2], k=1) == ["s0001"]
        assert searcher.document("s0001").text.startswith("Cooking pasta")
        with pytest.raises(DocumentNotFoundError):
            searcher.document("s0003")
        # k hits come back although documents were deleted: the bitmap is applied inside FAISS.
        for query in QUERIES:
            hits = _ids(searcher, query, k=300, nprobe=searcher.nlist, rerank_count=300)
            assert len(hits) == 300 and "s0003" not in hits and len(set(hits)) == 300
            # The old version of s0001 (doc number 0) is never scored: at most one s0001 and it is the new one.
            assert hits.count("s0001") == 1


def test_a_second_writer_is_refused(index: Path) -> None:
    with LiveIndex.open(index):
        with pytest.raises(IndexLockedError, match="one writer at a time"):
            LiveIndex.open(index)
        # Another process is refused too (flock is per open file description).
        proc = subprocess.run([sys.executable, "-c", f"from espn.live.live_index import LiveIndex; LiveIndex.open({str(index)!r})"],
                              capture_output=True, text=True)
        assert proc.returncode != 0 and "IndexLockedError" in proc.stderr
    LiveIndex.open(index).close()  # released


def test_bad_writes_change_nothing(index: Path, encoder: Encoder) -> None:
    with LiveIndex.open(index, encoder=encoder) as writer:
        for upserts, deletes, match in [
            ([NewDocument("", "text")], [], "id"),
            ([NewDocument("s0005\x00", "text")], [], "control character U\\+0000"),
            ([NewDocument("tab\there", "text")], [], "control character U\\+0009"),
            ([NewDocument("sur\ud800", "text")], [], "lone surrogate U\\+D800"),
            ([NewDocument(" padded", "text")], [], "whitespace"),
            ([], ["s0001\x7f"], "control character U\\+007F"),
            ([NewDocument("a", "x", metadata={f"f{i}": i for i in range(65)})], [], "65 fields; at most 64"),
            ([NewDocument("a", "x", metadata={"tags": ["t" * 100] * 200})], [], "bytes as JSON; at most 16384"),
            ([NewDocument("a", "x", metadata={"deep": {"er": 1}})], [], "nested objects are not allowed"),
            ([NewDocument("a", "x", metadata={"deep": [["x"]]})], [], "nested lists"),
            ([NewDocument("a", "x"), NewDocument("a", "y")], [], "twice"),
            ([NewDocument("a", "   ")], [], "empty"),
            ([NewDocument("a", "x" * 100_001)], [], "at most"),
            ([NewDocument("a", "x")], ["a"], "both"),
            ([], [], "nothing"),
        ]:
            with pytest.raises(InvalidParameterError, match=match):
                writer.apply(upserts, deletes)
        with pytest.raises(DocumentNotFoundError):
            writer.apply([NewDocument("fresh", "some text")], ["no-such-id"])
    assert read_current(index).number == 0 and sorted(os.listdir(index / "live")) == ["LOCK"]


def _fresh_build(docs: list[dict], out: Path) -> None:
    """What `espn index CORPUS --out OUT` does, in this process (no second torch start-up).

    The projection is fitted on the first 16 documents (fit_sample), which no test edits,
    so a rebuild of edited documents has the same encoder state."""
    from espn_indexing.build import BuildConfig, build_index

    corpus = out.with_suffix(".jsonl")
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    build_index(BuildConfig(corpus=corpus, out=out, loader_workers=0, progress=False, device="cpu", fit_sample=16))


@pytest.fixture(scope="module")
def small_corpus(sample_index: Path) -> list[dict]:
    return _corpus_docs(sample_index)[:48]


@pytest.fixture(scope="module")
def small_index(small_corpus: list[dict], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 sample documents: a compaction-equals-build test that encodes ~100 documents in all."""
    out = tmp_path_factory.mktemp("small") / "index"
    _fresh_build(small_corpus, out)
    return out


def test_compact_ranks_like_a_fresh_build(small_index: Path, small_corpus: list[dict], tmp_path: Path) -> None:
    index = tmp_path / "index"
    shutil.copytree(small_index, index)
    docs = small_corpus
    added = [{"_id": "new-1", "title": "Elephants", "text": "A purple elephant is dancing on the moon tonight."},
             {"_id": "new-2", "title": "", "text": "Tomatoes, basil and olive oil make a simple pasta sauce."}]
    replaced = {"_id": "s0040", "title": "Eclipses", "text": "During a total lunar eclipse the moon turns red."}
    with LiveIndex.open(index) as writer:
        writer.upsert([NewDocument(d["_id"], d["text"], d["title"]) for d in added])
        writer.apply([NewDocument(replaced["_id"], replaced["text"], replaced["title"])], ["s0020", "s0030"])
        writer.delete(["new-2"])
        writer.compact()
        assert writer.stats()["delta_segments"] == 0
    # The same documents in doc-number order: survivors of the base, then the deltas' (the fit
    # sample, the first 16 documents, is untouched, so the fresh build fits the same PCA).
    fresh_docs = [d for d in docs if d["_id"] not in ("s0020", "s0030", "s0040")] + [added[0], replaced]
    _fresh_build(fresh_docs, tmp_path / "fresh")
    with Searcher.open(index) as compacted, Searcher.open(tmp_path / "fresh") as fresh:
        assert compacted.num_documents == fresh.num_documents == 47 and compacted.live is None
        assert compacted.defaults == fresh.defaults
        for query in QUERIES:
            a = compacted.search([query], k=20, nprobe=compacted.nlist)[0].hits
            b = fresh.search([query], k=20, nprobe=fresh.nlist)[0].hits
            assert [h.doc_id for h in a] == [h.doc_id for h in b]
            np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=2e-3)
    # The old base was collected; its full-text index (text/) stays until the live writer keeps
    # text indexes (issue 24's second round adds text/ to what its collector removes).
    assert sorted(set(os.listdir(index)) - {"text"}) == ["encoder", "live", "manifest.json"]


def test_an_open_generation_keeps_its_files(index: Path, encoder: Encoder) -> None:
    reader = Searcher.open(index)
    expected = _ids(reader, QUERIES[0])
    with LiveIndex.open(index, encoder=encoder) as writer:
        writer.upsert([NewDocument("new-1", "The sun fuses hydrogen into helium in its core.")])
        writer.delete(["s0001"])
        writer.compact()
    assert (index / "embeddings.bin").exists(), "a reader still holds generation 0"
    assert _ids(reader, QUERIES[0]) == expected and reader.document("s0001").doc_id == "s0001"
    newer = reader.refresh()
    assert newer is not None and newer.generation == 3 and "s0001" not in _ids(newer, QUERIES[0])
    reader.close()
    with LiveIndex.open(index) as writer:
        assert "embeddings.bin" in writer.collect_garbage() or not (index / "embeddings.bin").exists()
    assert _ids(newer, QUERIES[0])
    newer.close()


def test_searches_during_writes_never_fail_nor_see_half_a_batch(index: Path, encoder: Encoder) -> None:
    """Each batch replaces pair-a and pair-b together; a reader must see both from one batch."""
    with LiveIndex.open(index, encoder=encoder) as writer:
        writer.upsert([NewDocument("pair-a", "version 0 of the pair"), NewDocument("pair-b", "version 0 of the pair")])
    stop = threading.Event()
    errors: list[BaseException] = []
    seen: list[int] = []

    def read() -> None:
        searcher = Searcher.open(index, verify="none")
        try:
            while not stop.is_set():
                newer = searcher.refresh()
                if newer is not None:
                    searcher.close()
                    searcher = newer
                a, b = (searcher.document(x).text for x in ("pair-a", "pair-b"))
                assert a == b, f"half a batch: {a!r} vs {b!r}"
                assert _ids(searcher, "version of the pair", k=5)
                seen.append(searcher.generation)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)
        finally:
            searcher.close()

    thread = threading.Thread(target=read)
    thread.start()
    try:
        with LiveIndex.open(index, encoder=encoder) as writer:
            for version in range(1, 6):
                text = f"version {version} of the pair"
                writer.upsert([NewDocument("pair-a", text), NewDocument("pair-b", text)])
    finally:
        stop.set()
        thread.join()
    assert not errors, errors[0]
    assert len(set(seen)) >= 2, "the reader never saw a new generation"


CRASHER = textwrap.dedent("""
    import os, signal, sys
    import espn.files.crash_points as crash_points
    from espn.live.checks import NewDocument
    from espn.live.compaction import Plan, run_compaction
    from espn.live.live_index import LiveIndex
    step = sys.argv[2]
    def checkpoint(name):
        if name == step:
            os.kill(os.getpid(), signal.SIGKILL)
    crash_points._checkpoint = checkpoint
    writer = LiveIndex(sys.argv[1])
    if sys.argv[3] == "merge":
        run_compaction(writer, Plan("merge", tuple(s.name for s in writer.current().segments)))
    elif sys.argv[3] == "rewrite":
        writer.compact()
    elif sys.argv[3] == "refit":
        writer.refit()
    elif sys.argv[3] == "group":
        from espn.live.commit import GroupCommit
        commit = GroupCommit(writer)
        futures = [commit.submit([NewDocument("crash-new", "a document written while the writer was killed"),
                                  NewDocument("s0005", "a replacement written while the writer was killed")]),
                   commit.submit(deletes=["s0006"])]
        [f.result() for f in futures]
    else:
        writer.apply([NewDocument("crash-new", "a document written while the writer was killed"),
                      NewDocument("s0005", "a replacement written while the writer was killed")],
                     ["s0006"])
""")


# tests/test_live_restart.py kills a real server in a merge's swap ("swap-renamed") as well.
@pytest.mark.parametrize("step, job", [("appended", "write"), ("tombstones", "write"), ("text-published", "write"),
                                       ("generation", "write"), ("published", "write"), ("queued", "group"),
                                       ("merge-built", "merge"), ("compact-records", "rewrite"),
                                       ("swap-carried", "rewrite"), ("text-published", "rewrite"),
                                       ("compact-records", "refit"), ("swap-carried", "refit"),
                                       ("swap-renamed", "refit")])
def test_kill_9_leaves_exactly_the_acknowledged_writes(index: Path, encoder: Encoder, step: str, job: str) -> None:
    with LiveIndex.open(index, encoder=encoder) as writer:
        writer.upsert([NewDocument("acked", "an acknowledged document about volcanoes erupting")])
        writer.delete(["s0007"])
        writer.upsert([NewDocument("acked-2", "a second acknowledged document")])
    acked = read_current(index)
    proc = subprocess.run([sys.executable, "-c", CRASHER, str(index), step, job], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    published = step == "published"
    current = read_current(index)
    assert current.number == acked.number + (1 if published else 0)
    with Searcher.open(index, verify="full") as searcher:
        assert searcher.document("acked").doc_id == "acked" and searcher.document("acked-2").doc_id == "acked-2"
        with pytest.raises(DocumentNotFoundError):
            searcher.document("s0007")
        if published:
            assert searcher.document("s0005").text.startswith("a replacement")
            with pytest.raises(DocumentNotFoundError):
                searcher.document("s0006")
        else:
            assert searcher.document("s0006").doc_id == "s0006"
            assert not searcher.document("s0005").text.startswith("a replacement")
            with pytest.raises(DocumentNotFoundError):
                searcher.document("crash-new")
        assert _ids(searcher, "volcanoes erupting", k=1) == ["acked"]
        # The text side is the same generation's: what it finds is exactly what the vectors hold.
        assert _ids(searcher, "volcanoes erupting", k=1, mode="lexical") == ["acked"]
        crashed = _ids(searcher, "written while the writer was killed", k=200, mode="lexical")
        assert ("crash-new" in crashed) == published and "s0007" not in crashed
        assert ("s0006" in _ids(searcher, _corpus_text(index, "s0006"), k=200, mode="lexical")) == (not published)
    # The next writer cleans up and works; the index then verifies in full.
    with LiveIndex.open(index, encoder=encoder) as writer:
        writer.upsert([NewDocument("after", "written after the crash about glaciers")])
        writer.compact()
    view = open_view(index, verify="full")
    view.close()
    with Searcher.open(index) as searcher:
        assert _ids(searcher, "glaciers crash", k=1, mode="lexical") == ["after"]
        assert "s0007" not in _ids(searcher, _corpus_text(index, "s0007"), k=200, mode="lexical")
    assert not any(p.name.endswith(".tmp") or p.name.startswith("stage-") for p in (index / "live").iterdir())


def _espn(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "espn.cli", *args], capture_output=True, text=True)


def test_cli_add_delete_stats(index: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "more.jsonl"
    corpus.write_text(json.dumps({"_id": "cli-1", "title": "Volcanoes", "text": "Lava flows from an erupting volcano."})
                      + "\n" + json.dumps({"_id": "s0001", "text": "The sun, replaced from the command line."}) + "\n")
    done = _espn("add", str(index), str(corpus), "--no-progress", "--loader-workers", "0")
    assert done.returncode == 0 and "1 added, 1 replaced; generation 1 published" in done.stdout, done.stderr
    ids = tmp_path / "ids.txt"
    ids.write_text("s0002\n\nno-such-id\n")
    failed = _espn("delete", str(index), "s0003", "--ids-file", str(ids))
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines()[-1] == "espn delete: error: no document with id 'no-such-id'"
    # Ids are exact UTF-8 bytes: invalid UTF-8 on the command line is refused by name, before anything is written.
    bad = subprocess.run([sys.executable, "-m", "espn.cli", "delete", str(index), b"s0002\xff"], capture_output=True)
    assert bad.returncode == 1
    assert bad.stderr.decode().strip().splitlines()[-1] == (
        "espn delete: error: id to delete 's0002\\udcff' is not valid UTF-8: a lone surrogate U+DCFF at character 5")
    stats = json.loads(_espn("stats", str(index)).stdout)  # the failed deletes wrote nothing
    assert stats["generation"] == 1 and stats["delta_documents"] == 2 and stats["deleted_or_replaced"] == 1
    assert stats["live_documents"] == 301 and stats["rebuild_recommended"] is False
    with Searcher.open(index) as searcher:
        assert _ids(searcher, "erupting volcano lava", k=1) == ["cli-1"]
        assert searcher.document("s0003").doc_id == "s0003"


def test_filters_follow_writes_and_compaction(index: Path, encoder: Encoder) -> None:
    """Metadata of added documents becomes columns of their segment; a filter compiles over every
    segment, never matches a deleted or replaced version, and holds after compaction."""
    with Searcher.open(index) as before:
        astronomy = set(np.flatnonzero(before.filtered_docs({"topic": "astronomy"}).mask))
        assert 0 < len(astronomy) < 300
    with LiveIndex.open(index, encoder=encoder) as writer:
        writer.upsert([
            NewDocument("new-1", "A purple elephant is dancing on the moon tonight.",
                        metadata={"topic": "circus", "year": 2031, "venue": "big top"}),
            NewDocument("s0001", "Cooking pasta with fresh tomatoes and basil.", metadata={"topic": "test-kitchen"}),
        ])
        writer.delete(["s0003"])
        generation = writer.current().number
        with pytest.raises(InvalidParameterError, match="year"):  # an integer field given a keyword
            writer.upsert([NewDocument("new-2", "Another text.", metadata={"year": "last year"})])
        with pytest.raises(InvalidParameterError, match="metadata"):
            writer.upsert([NewDocument("new-3", "Another text.", metadata={"year": {"nested": 1}})])
        assert writer.current().number == generation  # nothing published by the refused writes

    def check(searcher: Searcher) -> None:
        for spec, expected in [({"topic": "circus"}, {"new-1"}), ({"year": {"gte": 2030}}, {"new-1"}),
                               ({"venue": {"exists": True}}, {"new-1"}), ({"topic": "test-kitchen"}, {"s0001"})]:
            result = searcher.search(["moon"], k=5, filter=spec)[0]
            assert {h.doc_id for h in result.hits} == expected and result.stats.matched == len(expected), spec
        # s0001 was astronomy before its replacement, s0003 is deleted: neither matches any more.
        hits = searcher.search(["sun stars planets"], k=300, filter={"topic": "astronomy"})[0].hits
        got = {h.doc_id for h in hits}
        assert "s0001" not in got and "s0003" not in got and len(got) >= len(astronomy) - 2
        not_circus = searcher.filtered_docs({"not": {"topic": "circus"}})
        assert not_circus is not None and not_circus.matches == 300 - 1  # 300 live documents, one circus

    with Searcher.open(index) as searcher:
        assert searcher.generation == generation
        check(searcher)
    with LiveIndex.open(index, encoder=encoder) as writer:
        writer.compact()
    with Searcher.open(index) as searcher:
        assert searcher.live is None and searcher.num_documents == 300
        check(searcher)


def test_a_group_publishes_writes_in_order_as_one_generation(index: Path, encoder: Encoder) -> None:
    """Writes published together apply as if one after the other; a failing write fails alone."""
    from espn.live.checks import check_write

    writer = LiveIndex(index, encoder=encoder)
    writes = [([NewDocument("g-1", "first version of g-1")], []),
              ([NewDocument("g-2", "a document about glaciers")], ["s0001"]),
              ([], ["g-1"]),                                       # sees g-1 from the first write
              ([NewDocument("g-3", "never published")], ["no-such-id"]),  # fails alone
              ([NewDocument("g-1", "second version of g-1")], []),        # created again after its delete
              ([NewDocument("g-2", "g-2 replaced in the same group")], [])]
    requests = [check_write(upserts, deletes) for upserts, deletes in writes]
    outcomes = writer.publish(requests, [writer.encode(upserts) for upserts, _ in writes])
    assert isinstance(outcomes[3], DocumentNotFoundError)
    results = [o for o in outcomes if not isinstance(o, Exception)]
    assert {r.generation for r in results} == {1} and read_current(index).number == 1
    assert [(r.created, r.replaced, r.deleted) for r in results] == [
        (["g-1"], [], []), (["g-2"], [], ["s0001"]), ([], [], ["g-1"]), (["g-1"], [], []), ([], ["g-2"], [])]
    current = read_current(index)
    assert len(current.segments) == 1 and current.segments[0].documents == 2  # superseded versions never stored
    with Searcher.open(index) as searcher:
        assert searcher.document("g-1").text == "second version of g-1"
        assert searcher.document("g-2").text == "g-2 replaced in the same group"
        for gone in ("g-3", "s0001"):
            with pytest.raises(DocumentNotFoundError):
                searcher.document(gone)


def test_a_delete_writes_a_tombstone_of_a_few_bytes(index: Path) -> None:
    """Per-write work follows what the write changes: no bitmap over every document."""
    with LiveIndex.open(index) as writer:
        before = set(os.listdir(index / "live"))
        for doc_id in ("s0001", "s0002", "s0003"):
            writer.delete([doc_id])
    current = read_current(index)
    new = set(os.listdir(index / "live")) - before
    assert new <= {"gen-000001.json", "gen-000002.json", "gen-000003.json", "tomb-000001.npy", "tomb-000002.npy",
                   "tomb-000003.npy", "CURRENT", "text-work", "text-000003"}
    # The text side's share: a deletion file and meta.json; its segments are links to the base's.
    text = current.side["text"]["directory"]
    written = set(os.listdir(index / "live" / text)) - set(os.listdir(index / "text"))
    assert written and all((index / "live" / text / name).stat().st_size < 4096 for name in written), written
    # Single deletes merge into few small files (here one of 3 entries, then more as they grow).
    assert [t.count for t in current.tombstones] == [2, 1] or [t.count for t in current.tombstones] == [3]
    assert all((index / "live" / t.file).stat().st_size < 256 for t in current.tombstones)
    assert current.deleted_count == 3 and current.live_documents == 297
    needed = {f.path for f in current.needed_files()}
    assert {f"live/{t.file}" for t in current.tombstones} <= needed and "embeddings.bin" in needed


def test_writes_during_a_compaction_are_carried_over(index: Path, encoder: Encoder) -> None:
    """A base rewrite works from a snapshot without the writer lock: writes published while it
    runs (adds, replacements, deletes of old and of new documents) are carried onto the new base."""
    import espn.files.crash_points as crash_points

    with LiveIndex.open(index, encoder=encoder) as writer:
        writer.upsert([NewDocument("before", "written before the compaction about coral reefs")])
        writer.delete(["s0002"])
    during = LiveIndex(index, encoder=encoder)

    def write_meanwhile(step: str) -> None:
        if step == "compact-staged":  # the new base is complete; the writer lock is free
            during.apply([NewDocument("during-1", "written during the compaction about desert dunes"),
                          NewDocument("during-2", "another write during the compaction"),
                          NewDocument("s0003", "s0003 replaced during the compaction: a purple xylophone orchestra")],
                         ["s0004", "before"])
            during.delete(["during-2"])

    original, crash_points._checkpoint = crash_points._checkpoint, write_meanwhile
    try:
        LiveIndex(index).compact()
    finally:
        crash_points._checkpoint = original
    current = read_current(index)
    assert current.base.startswith("live/base-") and current.base_documents == 300  # s0002 dropped, "before" in
    assert len(current.segments) == 1 and current.segments[0].first == current.base_documents
    with Searcher.open(index, verify="full") as searcher:
        assert searcher.num_documents == current.total and searcher.live is not None
        assert _ids(searcher, "desert dunes", k=1) == ["during-1"]
        assert _ids(searcher, "purple xylophone orchestra", k=1) == ["s0003"]
        assert searcher.document("s0003").text.startswith("s0003 replaced")
        for gone in ("s0002", "s0004", "before", "during-2"):
            with pytest.raises(DocumentNotFoundError):
                searcher.document(gone)
        hits = _ids(searcher, "the", k=400, nprobe=searcher.nlist, rerank_count=400)
        assert len(hits) == len(set(hits)) == 300 - 3 + 2  # s0003's old version, s0004, before gone; 2 added
    with LiveIndex.open(index, encoder=encoder) as writer:  # and the index takes writes as usual after
        writer.upsert([NewDocument("later", "written after the compaction")])


def test_a_merge_keeps_doc_numbers_and_rankings(index: Path, encoder: Encoder) -> None:
    from espn.live.compaction import CompactionPolicy, run_compaction

    with LiveIndex.open(index, encoder=encoder) as writer:
        for i in range(5):
            writer.upsert([NewDocument(f"m-{i}", f"merge probe {i} about volcano number {i}")])
        writer.delete(["m-1"])
    policy = CompactionPolicy(max_segments=3, merge_factor=3)
    plan = policy.plan(read_current(index))
    assert plan is not None and plan.kind == "merge" and len(plan.segments) == 3
    with Searcher.open(index) as before:
        expected = {q: before.search([q], k=10, nprobe=before.nlist)[0].hits for q in QUERIES + ["volcano"]}
        total = before.num_documents
    assert run_compaction(LiveIndex(index), plan) is not None
    current = read_current(index)
    assert len(current.segments) == 3 and current.total == total and current.deleted_count == 1
    with Searcher.open(index, verify="full") as after:
        for query, hits in expected.items():
            got = after.search([query], k=10, nprobe=after.nlist)[0].hits
            assert [h.doc_id for h in got] == [h.doc_id for h in hits]
            np.testing.assert_allclose([h.score for h in got], [h.score for h in hits], rtol=0, atol=1e-6)
        with pytest.raises(DocumentNotFoundError):
            after.document("m-1")
    assert policy.plan(current) is None


def test_a_retired_searcher_closes_when_its_last_lease_ends(index: Path) -> None:
    from espn.search.live_searcher import LiveSearcher

    live = LiveSearcher(Searcher.open(index))
    first = live.current
    with live.lease() as leased:
        with LiveIndex.open(index) as writer:
            writer.delete(["s0001"])
        assert live.refresh() and live.current is not first
        assert leased is first and first.view is not None and first.view._lock_fd is not None  # still in use
        assert _ids(leased, QUERIES[0])  # and still searchable
    assert first.view._lock_fd is None  # closed by the release, not by a timer
    with live.lease() as searcher:
        assert searcher.generation == 1
    live.close()
    assert live.current.view is not None and live.current.view._lock_fd is None


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_descriptors_do_not_grow_with_writes_or_metadata_fields(index: Path, encoder: Encoder) -> None:
    """Each generation maps its arrays without holding descriptors and shares the base's reader,
    so a worker's descriptors stay flat however many writes and metadata fields there are."""
    from espn.search.live_searcher import LiveSearcher

    with LiveIndex.open(index, encoder=encoder) as writer:  # a delta with many metadata fields
        writer.upsert([NewDocument("fields", "a document with many fields", metadata={f"f{i}": i for i in range(60)})])
    live = LiveSearcher(Searcher.open(index))
    with live.lease() as searcher:
        _ids(searcher, QUERIES[0])
    baseline = _open_fds()
    writer = LiveIndex(index)
    for i in range(12):  # each generation held open its maps before: +10 or more descriptors a write
        writer.delete([f"s{i + 10:04d}"])
        assert live.refresh()
        with live.lease() as searcher:
            assert _ids(searcher, QUERIES[i % len(QUERIES)])
    with live.lease() as searcher:
        assert searcher.generation == 13 and searcher.filtered_docs({"f7": 7}).matches == 1
    assert _open_fds() <= baseline + 2
    live.close()


def test_recovery_tolerates_a_staging_directory_its_owner_removes_meanwhile(index: Path, encoder: Encoder,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A compaction (in another worker) removes its staging directory without the writer lock;
    a writer's recovery that listed it a moment before must not fail the write (ENOENT)."""
    from espn.live import staging as live

    other = LiveIndex(index, encoder=encoder)
    staging = live.Staging(other, "compact", 0.0)
    unused = live.lock_is_free

    def owner_finishes_first(path: Path, unlink: bool = False) -> bool:
        if path == staging.path:
            staging.close()  # rmtree, then the lock goes: between our listing and our removal
        return unused(path, unlink)

    monkeypatch.setattr(live, "lock_is_free", owner_finishes_first)
    writer = LiveIndex(index, encoder=encoder)
    result = writer.delete(["s0001"])
    assert result.deleted == ["s0001"] and not staging.path.exists()
