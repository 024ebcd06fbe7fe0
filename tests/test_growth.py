"""An index that grows: created empty in one call with nothing fitted on foreign text, searched
exactly while small, fitted on its own documents once it holds EXACT_MAX_DOCUMENTS of them and
fitted again as it grows (each base rewrite), with writes carried over a re-fit coded as the
new base codes its own. Documents are written through the library's write path with
precomputed token vectors (a ColBERT-class index: pure MaxSim, the centroid first stage once
fitted), so thousands of them cost seconds; tests/test_index_admin.py creates indexes of a
real model over HTTP, and tests/test_growth_server.py serves one through a re-fit."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from espn.files import crash_points
from espn.encoders import QueryEmbeddings, encoder_from_spec
from espn.encoders.precomputed import PrecomputedEncoder
from espn.engine.embedded import Index
from espn.errors import ConflictError
from espn.live.checks import NewDocument
from espn.live.create import NewIndex, create_index
from espn.live.encoding import EncodedDocuments
from espn.live.fitting import EXACT_MAX_DOCUMENTS, PROJECTION_MIN_DOCUMENTS
from espn.live.live_index import LiveIndex
from espn.live.status import live_stats
from espn.search.searcher import Searcher
from espn_indexing.build import build_from_embeddings

DIM = 32
TOPICS = 48


def _corpus(n: int, seed: int = 7) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """n documents of 8..40 unit token vectors around one of TOPICS topic centres: (ids, cls, bow, counts)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((TOPICS, DIM)).astype(np.float32)
    topic = rng.integers(0, TOPICS, n)
    counts = rng.integers(8, 41, n)
    bow = centres[np.repeat(topic, counts)] + 0.6 * rng.standard_normal((int(counts.sum()), DIM)).astype(np.float32)
    bow /= np.linalg.norm(bow, axis=1, keepdims=True)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    cls = np.add.reduceat(bow, starts) / counts[:, None]
    cls /= np.linalg.norm(cls, axis=1, keepdims=True)
    return [f"d{i:06d}" for i in range(n)], cls.astype(np.float16), bow.astype(np.float16), counts.astype(np.int32)


def _write(index: Path, ids: list[str], cls: np.ndarray, bow: np.ndarray, counts: np.ndarray, batch: int) -> None:
    """The documents published in batches, each as one generation, with the compaction policy run
    after each (what a server does): the base is rewritten, and fitted, as the index grows."""
    starts = np.concatenate([[0], np.cumsum(counts)])
    with LiveIndex.open(index) as writer:
        for at in range(0, len(ids), batch):
            rows = range(at, min(at + batch, len(ids)))
            upserts = [NewDocument(ids[i], f"document {ids[i]}", metadata={"topic": i % 5}) for i in rows]
            lines = [json.dumps({"title": "", "text": d.text, "metadata": d.metadata}).encode() for d in upserts]
            encoded = EncodedDocuments([d.doc_id for d in upserts], lines, cls[at:rows.stop],
                                       bow[starts[at]:starts[rows.stop]], counts[at:rows.stop])
            (outcome,) = writer.publish([writer.check(upserts, [])], [encoded])
            assert not isinstance(outcome, Exception), outcome
            writer.maintain()


def _queries(n: int = 24, seed: int = 11) -> QueryEmbeddings:
    _, cls, bow, counts = _corpus(n, seed)
    length = 8
    mask = np.zeros((n, length), dtype=bool)
    padded = np.zeros((n, length, DIM), dtype=np.float32)
    starts = np.concatenate([[0], np.cumsum(counts)])
    for i in range(n):
        take = min(length, int(counts[i]))
        padded[i, :take] = bow[starts[i] : starts[i] + take]
        mask[i, :take] = True
    return QueryEmbeddings(cls.astype(np.float32), padded, mask)


def _recall(searcher: Searcher, queries: QueryEmbeddings, k: int = 10, **params: object) -> float:
    """Mean overlap of the search's top k with the exhaustive MaxSim top k."""
    exact = searcher.search_maxsim_exhaustive(queries, k)
    found = searcher.search(["q"] * len(queries), k=k, embeddings=queries, **params)  # type: ignore[arg-type]
    return float(np.mean([len({h.doc_id for h in a.hits} & {h.doc_id for h in b}) / k
                           for a, b in zip(found, exact)]))


def _fresh_build(out: Path, ids: list[str], cls: np.ndarray, bow: np.ndarray, counts: np.ndarray) -> Path:
    """`espn index --embeddings` of the same documents, in the same order, stored as the created index stores them."""
    source = out.with_name(out.name + "-shards")
    for folder in ("cls", "bow", "counts", "ids"):
        (source / folder).mkdir(parents=True)
    (source / "embeddings.json").write_text(json.dumps({"format": "espn-precomputed", "version": 1, "d_cls": DIM,
                                                        "d_bow": DIM, "bow_reduction": "sum", "score_weight": 0.0}))
    np.save(source / "cls" / "0.npy", cls)
    np.save(source / "bow" / "0.npy", bow)
    np.save(source / "counts" / "0.npy", counts)
    (source / "ids" / "0.txt").write_text("".join(f"{i}\n" for i in ids))
    build_from_embeddings(source, out, bow_dtype="int8", text_index=None, first_stage="centroids")
    return out


@contextlib.contextmanager
def hooked(write_at: Callable[[str], None]) -> Iterator[None]:
    """The named crash points' hook set to `write_at` for the block, unset after: only the timing of
    what a test does meanwhile is arranged."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(crash_points, "_checkpoint", write_at)
        yield


@pytest.fixture()
def created(tmp_path: Path) -> Path:
    encoder = PrecomputedEncoder(DIM, DIM, bow_reduction="sum", learned_weight=0.0)
    return create_index(tmp_path / "grown", encoder, NewIndex(first_stage="centroids", text_index=None))


def test_a_created_index_is_empty_answers_searches_and_encoded_nothing(tmp_path: Path) -> None:
    encoder = encoder_from_spec("minilm", bow_dim=None)  # the real default model, offline
    seen: list[str] = []
    tokenize = encoder.tokenize

    def counted(texts, is_query):  # type: ignore[no-untyped-def]
        seen.extend(texts)
        return tokenize(texts, is_query)

    encoder.tokenize = counted  # type: ignore[method-assign]  # every text the model is given is recorded
    created = create_index(tmp_path / "made", encoder)
    assert seen == []  # nothing, of the sample corpus or any other, was encoded into it
    manifest = json.loads((created / "manifest.json").read_text())
    assert manifest["counts"] == {"documents": 0, "bow_vectors": 0} and manifest["fit"]["exact"] is True
    assert manifest["first_stage"]["kind"] == "exact" and manifest["ann"]["nlist"] == 1
    assert manifest["encoder"]["projection"] is None  # no PCA fitted on foreign text
    assert manifest["fit"]["projection"] == 64  # fitted on its own token vectors once it has enough
    assert manifest["text"]["documents"] == 0
    assert (created / "docs.jsonl").stat().st_size == 0 and (created / "embeddings.bin").stat().st_size == 0
    with Searcher.open(created) as searcher:
        assert searcher.search(["ocean tides"], k=3)[0].hits == []
        assert searcher.search(["ocean tides"], k=3, mode="hybrid")[0].hits == []
    assert live_stats(created)["exact"] is True and live_stats(created)["rebuild_recommended"] is False


def test_small_is_exact_and_the_first_fit_is_on_its_own_documents(created: Path) -> None:
    n = EXACT_MAX_DOCUMENTS + 400
    ids, cls, bow, counts = _corpus(n)
    small = EXACT_MAX_DOCUMENTS * 3 // 4
    _write(created, ids[:small], cls[:small], bow[: int(counts[:small].sum())], counts[:small], batch=small // 4)
    queries = _queries()
    with Searcher.open(created) as searcher:
        assert searcher.manifest["fit"]["exact"] is True
        exact = searcher.search_maxsim_exhaustive(queries, 10)
        found = searcher.search(["q"] * len(queries), k=10, embeddings=queries)
        for a, b in zip(found, exact):  # every document scored: the exhaustive reference's ranking
            assert [h.doc_id for h in a.hits] == [h.doc_id for h in b]
            np.testing.assert_allclose([h.score for h in a.hits], [h.score for h in b], rtol=1e-5)
        filtered = searcher.search(["q"], k=5, embeddings=queries[:1], filter={"topic": 3})[0]
        assert filtered.hits and all(int(h.doc_id[1:]) % 5 == 3 for h in filtered.hits)
        assert filtered.stats.filter_path == "exact"
    _write(created, ids[small:], cls[small:], bow[int(counts[:small].sum()):], counts[small:], batch=400)
    with LiveIndex.open(created) as writer:
        writer.refit()
    stats = live_stats(created)
    assert stats["exact"] is False and stats["fitted_on_documents"] == n and stats["live_documents"] == n
    fresh = _fresh_build(created.parent / "fresh", ids, cls, bow, counts)
    with Searcher.open(created) as searcher, Searcher.open(fresh) as built:
        fit = searcher.manifest["fit"]
        assert fit["documents"] == n and searcher.nlist > 1 and searcher.manifest["first_stage"]["kind"] == "centroids"
        assert searcher.manifest["first_stage"]["centroids"] == built.manifest["first_stage"]["centroids"] > 1
        assert searcher.nlist == built.nlist
        grown = searcher.search(["q"] * len(queries), k=10, embeddings=queries)
        fresh_hits = built.search(["q"] * len(queries), k=10, embeddings=queries)
        for a, b in zip(grown, fresh_hits):  # fitted on its own documents: it ranks as a fresh build of them
            assert [h.doc_id for h in a.hits] == [h.doc_id for h in b.hits]
        assert _recall(searcher, queries, first_stage="exact") == 1.0  # the exact stage stays a request away


def test_writes_during_a_refit_are_carried_over_coded_for_the_new_base(created: Path) -> None:
    """A re-fit trains a new quantizer and (residual records) a new codec: what was written while it
    ran is re-coded and listed anew at the swap, so it is found exactly as before."""
    n = max(EXACT_MAX_DOCUMENTS, 2048) + 200  # fitted, on enough documents for the recall bar below
    ids, cls, bow, counts = _corpus(n + 50, seed=3)
    end = int(counts[:n].sum())
    _write(created, ids[:n], cls[:n], bow[:end], counts[:n], batch=n)
    late = EncodedDocuments(ids[n:], [b'{"title": "", "text": "late"}'] * 50, cls[n:], bow[end:], counts[n:])

    def write_at(step: str) -> None:
        if step == "compact-staged":  # another writer publishes while the new base waits for its swap
            with LiveIndex(created) as other:
                upserts = [NewDocument(i, "late") for i in ids[n:]]
                assert not isinstance(other.publish([other.check(upserts, [])], [late])[0], Exception)

    with hooked(write_at), LiveIndex(created) as writer:
        writer.refit()
    stats = live_stats(created)
    assert stats["live_documents"] == n + 50 and stats["delta_documents"] == 50 and not stats["exact"]
    with Searcher.open(created) as searcher:
        queries = QueryEmbeddings(cls[n:].astype(np.float32), np.zeros((50, 1, DIM), np.float32),
                                  np.zeros((50, 1), dtype=bool))
        starts = np.concatenate([[0], np.cumsum(counts)])
        for i in range(3):  # each late document's own tokens find it first, through the fitted stage
            tokens = bow[starts[n + i] : starts[n + i] + 8].astype(np.float32)
            query = QueryEmbeddings(queries.cls[i : i + 1], tokens[None], np.ones((1, len(tokens)), dtype=bool))
            assert searcher.search(["q"], k=1, embeddings=query)[0].hits[0].doc_id == ids[n + i]
        assert _recall(searcher, _queries()) >= 0.95


def test_the_embedded_index_creates_writes_searches_and_refits(tmp_path: Path) -> None:
    """espn.Index, with the default model: what the getting-started page shows."""
    encoder_from_spec("minilm", bow_dim=None)  # loads offline, from the wheel of the default model
    with Index.create(tmp_path / "embedded") as index:
        assert index.search(["ocean tides"], k=3)[0].hits == []
        index.add([{"id": "moon", "text": "The Moon pulls the oceans into tides."},
                   {"id": "tea", "text": "Green tea is steeped in water below boiling."}])
        assert index.search(["what causes ocean tides"], k=1)[0].hits[0].doc_id == "moon"
        index.delete(["moon"])
        assert [h.doc_id for h in index.search(["ocean tides"], k=2)[0].hits] == ["tea"]
        index.refit()
        assert index.stats()["live_documents"] == 1 and index.document("tea").text.startswith("Green")
    with Index.open(tmp_path / "embedded") as again:  # across a restart
        assert [h.doc_id for h in again.search(["tea"], k=5)[0].hits] == ["tea"]


def test_writes_during_a_refit_leave_its_progress_file_alone(created: Path) -> None:
    """A compaction reports its progress through live/COMPACT.json.tmp, renamed into place, without
    the writer lock; every writer that takes the lock meanwhile runs crash recovery, which removes
    `*.tmp` files: the running compaction's must stay, or its rename fails and the re-fit with it.
    Once no compaction runs, a leftover one is removed as before."""
    n = 300
    ids, cls, bow, counts = _corpus(n + 10, seed=5)
    end = int(counts[:n].sum())
    _write(created, ids[:n], cls[:n], bow[:end], counts[:n], batch=n)
    live = created / "live"
    kept: list[bool] = []

    def write_at(step: str) -> None:
        if step == "compact-records":  # the progress caught between its write and its rename
            (live / "COMPACT.json.tmp").write_text("{}")
            late = EncodedDocuments(ids[n:], [b'{"title": "", "text": "late"}'] * 10, cls[n:], bow[end:], counts[n:])
            with LiveIndex(created) as other:  # takes the writer lock: crash recovery runs
                assert not isinstance(other.publish([other.check([NewDocument(i, "late") for i in ids[n:]], [])],
                                                    [late])[0], Exception)
            kept.append((live / "COMPACT.json.tmp").is_file())
            (live / "COMPACT.json.tmp").replace(live / "COMPACT.json")

    with hooked(write_at), LiveIndex(created) as writer:
        writer.refit()
    assert kept == [True]
    assert live_stats(created)["live_documents"] == n + 10 and live_stats(created)["refit_running"] is None
    (live / "COMPACT.json.tmp").write_text("{}")  # what a compaction killed mid-write leaves
    with LiveIndex(created) as writer:
        writer.delete([ids[0]])
    assert not (live / "COMPACT.json.tmp").exists()


def _maxsim(projection: np.ndarray, query: np.ndarray, document: np.ndarray) -> float:
    """MaxSim of model-space vectors both projected as espn.store.projection projects them."""
    q, d = (v @ projection for v in (query, document))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    return float((q @ d.T).max(axis=1).sum())


def test_a_projection_fitted_once_on_its_own_vectors_and_what_comes_later_goes_through_it(tmp_path: Path) -> None:
    """A created index asked for a 16-d projection keeps the model's 32-d vectors while exact; its
    first fitted base fits the PCA on its own records and projects them, the writes carried over
    that re-fit and those after it are projected as they are stored, queries in the model's
    dimensions go through it, and later re-fits keep it (the dropped dimensions are gone)."""
    encoder = PrecomputedEncoder(DIM, DIM, bow_reduction="sum", learned_weight=0.0)
    index = create_index(tmp_path / "projected", encoder, NewIndex(first_stage="centroids", text_index=None,
                                                                   bow_dim=16))
    n, small, fitted = PROJECTION_MIN_DOCUMENTS, EXACT_MAX_DOCUMENTS // 2, EXACT_MAX_DOCUMENTS + 100
    ids, cls, bow, counts = _corpus(n + 60, seed=13)
    starts = np.concatenate([[0], np.cumsum(counts)])
    _write(index, ids[:small], cls[:small], bow[: starts[small]], counts[:small], batch=small)
    with Searcher.open(index) as exact:  # small: exact, the model's own vectors
        assert exact.manifest["fit"]["exact"] and exact.manifest["fit"]["projection"] == 16 and exact.layout.d_bow == DIM

    def publish(rows: range) -> None:  # one generation, no compaction
        with LiveIndex.open(index) as writer:
            upserts = [NewDocument(ids[i], f"document {ids[i]}") for i in rows]
            lines = [json.dumps({"title": "", "text": d.text}).encode() for d in upserts]
            encoded = EncodedDocuments(ids[rows.start : rows.stop], lines, cls[rows.start : rows.stop],
                                       bow[starts[rows.start] : starts[rows.stop]], counts[rows.start : rows.stop])
            assert not isinstance(writer.publish([writer.check(upserts, [])], [encoded])[0], Exception)

    publish(range(small, fitted))
    with LiveIndex(index) as writer:  # fitted, but on too few documents for the projection: not projected yet
        writer.refit()
    with Searcher.open(index) as early:
        assert not early.manifest["fit"]["exact"] and early.layout.d_bow == DIM and "projection" not in early.manifest["store"]
    publish(range(fitted, n))  # the re-fit below is the first with PROJECTION_MIN_DOCUMENTS

    def write_at(step: str) -> None:  # 30 documents written while the first fit runs: carried over, projected
        if step == "compact-staged":
            rows = range(n, n + 30)
            late = EncodedDocuments([ids[i] for i in rows], [b'{"title": "", "text": "late"}'] * 30, cls[n : n + 30],
                                    bow[starts[n] : starts[n + 30]], counts[n : n + 30])
            with LiveIndex(index) as other:
                upserts = [NewDocument(ids[i], "late") for i in rows]
                assert not isinstance(other.publish([other.check(upserts, [])], [late])[0], Exception)

    with hooked(write_at), LiveIndex(index) as writer:
        writer.refit()
    _write(index, ids[n + 30 :], cls[n + 30 :], bow[starts[n + 30] :], counts[n + 30 :], batch=30)  # after the fit
    with Searcher.open(index) as searcher:
        store = searcher.manifest["store"]
        assert store["d_bow"] == 16 and store["projection"] == "projection.npy" and not searcher.manifest["fit"]["exact"]
        projection = np.load(searcher.index.path / "projection.npy")
        assert projection.shape == (DIM, 16)
        for doc in (5, n - 1, n + 10, n + 45):  # in the fitted base, carried over, written after the fit
            own = bow[starts[doc] : starts[doc] + 8].astype(np.float32)
            query = QueryEmbeddings(cls[doc : doc + 1].astype(np.float32), own[None], np.ones((1, len(own)), bool))
            expected = _maxsim(projection, own, bow[starts[doc] : starts[doc + 1]].astype(np.float32))
            scores = searcher.score_documents(query, np.array([searcher.ids.internal(ids[doc])]))
            assert abs(float(scores[1, 0, 0]) - expected) < 0.05  # int8 rounding of the projected records
            assert searcher.search(["q"], k=1, embeddings=query)[0].hits[0].doc_id == ids[doc]
        assert _recall(searcher, _queries()) >= 0.95
        first = (searcher.index.path / "projection.npy").read_bytes()
    with LiveIndex(index) as writer:  # a later re-fit keeps the projection the records went through
        writer.refit()
    with Searcher.open(index) as again:  # and across a restart
        assert (again.index.path / "projection.npy").read_bytes() == first and again.layout.d_bow == 16
        assert again.search(["q"], k=1, embeddings=query)[0].hits[0].doc_id == ids[n + 45]
    moved = EncodedDocuments(["moved"], [b'{"title": "", "text": "moved"}'], cls[:1], bow[:8, :16], np.array([8], np.int32),
                             stored=True, projection="0" * 64)  # stored vectors of an index that fitted another
    with LiveIndex(index) as writer, pytest.raises(ConflictError, match="another index's fitted projection"):
        writer.publish([writer.check([NewDocument("moved", "moved")], [])], [moved])
    assert live_stats(index)["live_documents"] == n + 60  # nothing of it written


def test_the_default_model_fits_its_projection_on_its_own_documents(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The real MiniLM path end to end, with the exact and projection thresholds lowered so that 120
    sample passages reach them: the first re-fit projects the stored 384-d vectors to 64, queries (and an explained
    search) go through the projection, and the ranking is the one the model's own vectors gave."""
    from espn.live import fitting

    monkeypatch.setattr(fitting, "EXACT_MAX_DOCUMENTS", 100)
    monkeypatch.setattr(fitting, "PROJECTION_MIN_DOCUMENTS", 100)
    corpus = [json.loads(line) for line in (Path(__file__).parents[1] / "espn/data/sample_corpus.jsonl")
              .read_text().splitlines()[:120]]
    queries = ["what causes ocean tides", "how do solar eclipses happen", "which planets are gas giants"]
    with Index.create(tmp_path / "minilm") as index:
        index.add([{"id": d["_id"], "title": d["title"], "text": d["text"]} for d in corpus[:110]])
        before = [[h.doc_id for h in r.hits] for r in index.search(queries, k=5)]  # exact, 384-d
        index.refit()
        after = [[h.doc_id for h in r.hits] for r in index.search(queries, k=5, first_stage="exact")]
        assert index.stats()["exact"] is False
        index.add([{"id": d["_id"], "title": d["title"], "text": d["text"]} for d in corpus[110:]])  # after the fit
        late = corpus[115]
        assert index.search([late["title"]], k=1)[0].hits[0].doc_id == late["_id"]
        explained = index.search(queries[:1], k=1, explain=True)[0].hits[0]
    manifest = json.loads(next((tmp_path / "minilm" / "live").glob("base-*/manifest.json")).read_text())
    assert manifest["store"]["d_bow"] == 64 and manifest["store"]["projection"] == "projection.npy"
    # 64 of 384 dimensions kept: the best hit of each query stays, most of the top 5 with it (a wrong
    # projection, or queries not projected as the records are, keeps neither; SciFact's nDCG is in
    # docs/benchmarks/live-index.md)
    assert all(a[0] == b[0] for a, b in zip(after, before))
    assert np.mean([len(set(a) & set(b)) / 5 for a, b in zip(after, before)]) >= 0.6
    why = explained.explanation  # computed from the projected query and records: it adds up to the score
    assert why is not None and why.matches and abs(why.cls_part + why.bow_part - explained.score) < 1e-3


def test_a_compaction_due_again_when_it_ends_runs_the_next_without_waiting_for_a_write(created: Path) -> None:
    """Writes published while a base rewrite ran are carried onto the new base as one delta, which
    can make the policy due again the moment it ends. The server's compaction thread then runs
    the next one itself: an index whose writes stopped right then would otherwise keep that
    delta, and a base fitted on the documents it had before, until some later write."""
    from espn.engine.config import IndexConfig
    from espn.engine.writing import Writing

    first, n = 400, 1200
    ids, cls, bow, counts = _corpus(n, seed=9)
    end = int(counts[:first].sum())
    with LiveIndex(created) as writer:  # one delta over the empty base: a rewrite is due
        upserts = [NewDocument(i, "early") for i in ids[:first]]
        early = EncodedDocuments(ids[:first], [b'{"title": "", "text": "early"}'] * first, cls[:first], bow[:end],
                                 counts[:first])
        assert not isinstance(writer.publish([writer.check(upserts, [])], [early])[0], Exception)
    late = EncodedDocuments(ids[first:], [b'{"title": "", "text": "late"}'] * (n - first), cls[first:], bow[end:],
                            counts[first:])
    published: list[str] = []

    def write_at(step: str) -> None:
        if step == "compact-staged" and not published:  # twice the new base's documents, while it waits to swap
            published.append(step)
            with LiveIndex(created) as other:
                upserts = [NewDocument(i, "late") for i in ids[first:]]
                assert not isinstance(other.publish([other.check(upserts, [])], [late])[0], Exception)

    compacted: list[str] = []
    writing = Writing(created, IndexConfig(write_wait_s=60.0), on_publish=lambda generation: None,
                      on_compacted=lambda kind, seconds: compacted.append(kind))
    try:
        with hooked(write_at):
            writing.maybe_compact()
            writing.wait_idle()  # no write after the first rewrite: the second is the thread's own
    finally:
        writing.close()
    assert published and compacted == ["rewrite", "rewrite"]
    stats = live_stats(created)
    assert stats["live_documents"] == n and stats["base_documents"] == n and stats["delta_segments"] == 0
    assert stats["fitted_on_documents"] == n and stats["refit_running"] is None
