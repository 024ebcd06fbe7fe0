"""The token-level centroid first stage (espn/first_stage/centroids.py) for models without a trained CLS.

A seeded synthetic collection whose token vectors mean something (each document draws its
tokens around a few topic directions; queries draw theirs from one document's topics) is
imported as precomputed embeddings with pure MaxSim scoring (w = 0), real FAISS, real files.
The reference is `Searcher.search_maxsim_exhaustive`, which reads and scores every document.
The live-index test uses the offline MiniLM encoder on 48 sample documents.
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from espn import Searcher
from helpers import write_maxsim_shards
from espn.encoders import QueryEmbeddings
from espn.errors import IndexCorruptError, InvalidParameterError
from espn.first_stage.centroids import FIRST_STAGE_DIR, TokenCentroids, postings_from_pairs
from espn.index import read_manifest
from espn.generation.format import read_current
from espn_indexing.build import BuildConfig, build_from_embeddings, build_index
from espn.live.checks import NewDocument
from espn.live.live_index import LiveIndex
from espn.store.engines import FaultInjector, inject_faults
from espn.store.engines.ownership import LEDGER
from espn.search import centroid_stage

D = 32
N_DOCS = 1500
N_TOPICS = 60
SAMPLE_CORPUS = Path(__file__).parents[1] / "espn/data/sample_corpus.jsonl"


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def collection() -> dict:
    """Words (50 per topic) around 60 topic directions; a document's tokens are words of its 3
    topics plus a little context noise; a query's 12 tokens are words of one document."""
    rng = np.random.default_rng(7)
    topics = _unit(rng.standard_normal((N_TOPICS, D)))
    words = _unit(np.repeat(topics, 50, axis=0) + 0.8 * _unit(rng.standard_normal((N_TOPICS * 50, D))))
    doc_topics = rng.integers(0, N_TOPICS, size=(N_DOCS, 3))
    counts = rng.integers(8, 40, size=N_DOCS)
    owner = np.repeat(np.arange(N_DOCS), counts)
    word = doc_topics[owner, rng.integers(0, 3, size=len(owner))] * 50 + rng.integers(0, 50, size=len(owner))
    bow = _unit(words[word] + 0.1 * _unit(rng.standard_normal((len(owner), D))))
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    cls = _unit(np.add.reduceat(bow, firsts))
    q_docs = rng.choice(N_DOCS, size=24, replace=False)
    picks = firsts[q_docs][:, None] + (rng.random((24, 12)) * counts[q_docs][:, None]).astype(np.int64)
    q_bow = _unit(words[word[picks]] + 0.2 * _unit(rng.standard_normal((24, 12, D))))
    queries = QueryEmbeddings(_unit(q_bow.mean(1)), q_bow, np.ones((24, 12), dtype=bool))
    return {"cls": cls, "bow": bow, "counts": counts, "queries": queries}


@pytest.fixture(scope="module")
def built(collection: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = write_maxsim_shards(tmp_path_factory.mktemp("shards") / "emb", collection["cls"], collection["bow"],
                                 collection["counts"])
    out = tmp_path_factory.mktemp("index") / "index"
    build_from_embeddings(source, out, nlist=32, chunk_size=512, first_stage="centroids", text_index=None)
    return out


@pytest.fixture
def index(built: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "index"
    shutil.copytree(built, copy)
    return copy


def _ranking(hits: list) -> list[str]:
    return [hit.doc_id for hit in hits]


def test_the_build_writes_a_memory_mapped_checksummed_centroid_index(built: Path) -> None:
    manifest = read_manifest(built)
    stage = manifest["first_stage"]
    assert stage["kind"] == "centroids" and stage["centroids"] >= 64
    assert f"{FIRST_STAGE_DIR}/centroids.npy" in manifest["files"] and f"{FIRST_STAGE_DIR}/docs.npy" in manifest["files"]
    centroids = TokenCentroids.open(built)
    assert isinstance(centroids.parts[0].docs, np.memmap) or not centroids.parts[0].docs.flags.owndata
    # every document is in the lists of its tokens' centroids: the CSR holds each document
    assert np.array_equal(np.unique(centroids.parts[0].docs), np.arange(N_DOCS))


def test_candidates_hold_the_exhaustive_top10(built: Path, collection: dict) -> None:
    queries = collection["queries"]
    with Searcher.open(built, with_encoder=False) as searcher:
        stage = searcher.first_stage
        exhaustive = searcher.search_maxsim_exhaustive(queries, k=10)
        found = searcher.centroids.candidates(queries.bow, queries.mask, stage.probe, stage.candidates)  # type: ignore[union-attr]
        assert all(10 <= len(docs) <= stage.candidates < N_DOCS // 4 for docs in found)
        for hits, docs in zip(exhaustive, found):
            assert {int(h.doc_id) for h in hits} <= set(docs.tolist())
        # a single probe and a short list cannot hold them all: the depth is what finds them
        narrow = searcher.centroids.candidates(queries.bow, queries.mask, 1, 10)  # type: ignore[union-attr]
        assert any({int(h.doc_id) for h in hits} != set(docs.tolist()) for hits, docs in zip(exhaustive, narrow))


def test_search_returns_the_exhaustive_ranking_and_scores(built: Path, collection: dict) -> None:
    queries = collection["queries"]
    with Searcher.open(built, with_encoder=False) as searcher:
        assert searcher.weight == 0.0 and searcher.bow_reduction == "sum"
        exhaustive = searcher.search_maxsim_exhaustive(queries, k=10)
        results = searcher.search_embeddings(queries, k=10)
        for result, reference in zip(results, exhaustive):
            assert _ranking(result.hits) == _ranking(reference)
            np.testing.assert_allclose([h.score for h in result.hits], [h.score for h in reference], rtol=1e-5)
            # pure MaxSim: the score is the bow score, sum over the query's 12 vectors (not a cosine)
            assert all(h.score == h.bow_score for h in result.hits) and result.hits[0].score > 1.5
        # the CLS-IVF first stage of the same index finds less of it (the pooled vector is the
        # weak candidate generator this stage replaces)
        ivf = searcher.search_embeddings(queries, k=10, first_stage="ivf", nprobe=2, rerank_count=50)
        overlap = np.mean([len(set(_ranking(a.hits)) & set(_ranking(b))) / 10 for a, b in zip(ivf, exhaustive)])
        assert overlap < 1.0
        with pytest.raises(InvalidParameterError, match="first_stage must be one of"):
            searcher.search_embeddings(queries, k=10, first_stage="bm25")
        with pytest.raises(InvalidParameterError, match="first_stage_probe"):
            searcher.search_embeddings(queries, k=10, first_stage_probe=0)


def test_deleted_documents_never_come_back_and_the_index_survives_reopening(index: Path, collection: dict) -> None:
    queries = collection["queries"]
    with Searcher.open(index, with_encoder=False) as searcher:
        before = searcher.search_maxsim_exhaustive(queries, k=10)
    doomed = sorted({h.doc_id for hits in before for h in hits[:3]})
    with LiveIndex.open(index) as writer:
        writer.delete(doomed)
    with Searcher.open(index, with_encoder=False) as searcher:
        exhaustive = searcher.search_maxsim_exhaustive(queries, k=10)
        # every candidate the stage may return (deep probe, long list) is live
        results = searcher.search_embeddings(queries, k=50, first_stage_probe=64, first_stage_candidates=2000)
        returned = {h.doc_id for r in results for h in r.hits}
        assert returned and not returned & set(doomed)
        found = searcher.centroids.candidates(queries.bow, queries.mask, 64, 2000, searcher.live)  # type: ignore[union-attr]
        assert not set(np.concatenate(found).tolist()) & {int(d) for d in doomed}
        default = searcher.search_embeddings(queries, k=10)
        assert [_ranking(r.hits) for r in default] == [_ranking(h) for h in exhaustive]
    # a restart: the same generation, the same answers
    with Searcher.open(index, with_encoder=False, verify="full") as reopened:
        again = reopened.search_embeddings(queries, k=10)
        assert [_ranking(r.hits) for r in again] == [_ranking(r.hits) for r in default]


def test_a_damaged_centroid_index_is_refused(index: Path) -> None:
    docs = index / FIRST_STAGE_DIR / "docs.npy"
    data = bytearray(docs.read_bytes())
    data[-1] ^= 0xFF
    docs.write_bytes(bytes(data))
    with pytest.raises(IndexCorruptError, match="checksum"):
        Searcher.open(index, with_encoder=False, verify="full")


@pytest.fixture(scope="module")
def minilm_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 sample passages with the offline MiniLM encoder and a centroid first stage."""
    out = tmp_path_factory.mktemp("minilm") / "index"
    docs = [json.loads(line) for line in SAMPLE_CORPUS.open()][:48]
    corpus = out.with_suffix(".jsonl")
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    build_index(BuildConfig(corpus=corpus, out=out, loader_workers=0, progress=False, device="cpu", fit_sample=16,
                            first_stage="centroids", score_weight=0.0, text_index=None))
    return out


def test_live_writes_are_found_deleted_ones_are_not_and_compaction_rebuilds(minilm_index: Path, tmp_path: Path) -> None:
    index = tmp_path / "index"
    shutil.copytree(minilm_index, index)
    query = "a purple elephant dancing on the moon"
    new = NewDocument("new-elephant", "A purple elephant is dancing on the moon tonight, under the stars.", "Elephants")
    with LiveIndex.open(index) as writer:
        writer.upsert([new])
        with Searcher.open(index) as searcher:
            assert searcher.first_stage.kind == "centroids"
            hits = searcher.search([query], k=5)[0].hits
            assert hits[0].doc_id == "new-elephant"
            assert _ranking(hits) == _ranking(searcher.search_maxsim_exhaustive(searcher.encode([query]), k=5)[0])
            runner_up = hits[1].doc_id
        writer.delete(["new-elephant", runner_up])
        with Searcher.open(index) as searcher:
            ids = _ranking(searcher.search([query], k=48, first_stage_candidates=100)[0].hits)
            assert "new-elephant" not in ids and runner_up not in ids and len(ids) == 47
        writer.upsert([NewDocument("new-elephant", new.text, new.title)])
        writer.compact()
    manifest = read_manifest(index / read_current(index).base)
    assert manifest["first_stage"]["kind"] == "centroids" and manifest["counts"]["documents"] == 48
    with Searcher.open(index) as compacted:
        assert compacted.live is None and len(compacted.centroids.parts) == 1  # type: ignore[union-attr]
        hits = compacted.search([query], k=5)[0].hits
        assert hits[0].doc_id == "new-elephant" and runner_up not in _ranking(hits)


class _FailSecondWave(FaultInjector):
    """The second batch of read results fails with EIO (a disk error in a later wave)."""

    def __init__(self) -> None:
        self.batches = 0

    def results(self, engine: str, lengths: np.ndarray, results: np.ndarray) -> np.ndarray:
        self.batches += 1
        return np.full_like(results, -errno.EIO) if self.batches == 2 else results


class _FailEveryRead(FaultInjector):
    def results(self, engine: str, lengths: np.ndarray, results: np.ndarray) -> np.ndarray:
        return np.full_like(results, -errno.EIO)


def test_reads_start_beside_the_stage_in_waves_and_rank_as_one_read_after_it(built: Path, collection: dict) -> None:
    """prefetch on: each query's candidates are read as soon as the stage has ranked it (a
    single query's in waves scored as they arrive); off: one read after the stage. Same candidates, same ranking;
    a wave that fails fails the search and leaves no buffer or read behind."""
    queries = collection["queries"]
    # min_hidden_ms=0: the prefetch model takes every wave (its outcome check is off)
    with Searcher.open(built, with_encoder=False, reader="posix", min_hidden_ms=0) as searcher:
        assert searcher.reader.io_bound
        after = searcher.search_embeddings(queries, k=10, prefetch=False)
        for wave in (4, 64):
            beside = searcher.search_embeddings(queries, k=10, prefetch_k=wave)
            for a, b in zip(beside, after):
                assert [(h.doc_id, h.score) for h in a.hits] == [(h.doc_id, h.score) for h in b.hits]
            # each candidate read once; waves may read a block two neighbours share twice
            assert sum(r.stats.prefetched + r.stats.missed for r in beside) == sum(r.stats.missed for r in after)
            assert beside[0].stats.waves > 1 and after[0].stats.waves == 0
            assert sum(r.stats.bytes_read for r in beside) >= sum(r.stats.bytes_read for r in after)
            # every query's reads but the last one's started while the stage ranked the next
            assert sum(r.stats.prefetched for r in beside) > 0 and beside[0].stats.hit_rate > 0.5
        assert after[0].stats.prefetched == 0 and after[0].stats.hit_rate == 0.0
        single = searcher.search_embeddings(queries[np.arange(1)], k=10, prefetch_k=4)
        assert [h.doc_id for h in single[0].hits] == [h.doc_id for h in after[0].hits]
        assert single[0].stats.prefetched == 0  # one query: its waves overlap the scoring, not the stage
        with inject_faults(_FailSecondWave()), pytest.raises(OSError, match="EIO"):
            searcher.search_embeddings(queries, k=10, prefetch_k=4)
        stats = searcher.reader.buffer_pool.stats()
        assert stats["in_use"] == 0 and stats["quarantined"] == 0 and LEDGER.outstanding() == 0, stats
        again = searcher.search_embeddings(queries, k=10)
        assert [[h.doc_id for h in r.hits] for r in again] == [[h.doc_id for h in r.hits] for r in after]


def test_a_cache_s_hits_are_scored_beside_its_misses_and_rank_as_the_memory_reader(built: Path, collection: dict
                                                                                   ) -> None:
    """posix behind a record cache of a quarter of the table: each read splits into the hits
    (scored first) and the misses; rankings and scores are the memory reader's, with and without
    waves, and a failed miss read fails the search with no read of the hits left open."""
    queries = collection["queries"]
    table_mb = (built / "embeddings.bin").stat().st_size / 2**20
    with Searcher.open(built, with_encoder=False, reader="memory") as plain, \
            Searcher.open(built, with_encoder=False, reader="posix", min_hidden_ms=0,
                          reader_options={"record_cache_mb": table_mb / 4 + 1}) as cached:
        want = plain.search_embeddings(queries, k=10)
        for prefetch in (False, True, False):
            got = cached.search_embeddings(queries, k=10, prefetch=prefetch, prefetch_k=16)
            for a, b in zip(got, want):
                assert [(h.doc_id, h.score) for h in a.hits] == [(h.doc_id, h.score) for h in b.hits]
        stats = cached.reader.describe()["record_cache"]
        assert 0 < stats["hit_rate"] < 1, stats
        with inject_faults(_FailEveryRead()), pytest.raises(OSError, match="EIO"):
            cached.search_embeddings(queries, k=10, prefetch=False)
        assert cached.reader.stats()["reads_in_flight"] == 0
        assert cached.reader.inner.buffer_pool.stats()["in_use"] == 0 and LEDGER.outstanding() == 0


def test_a_batch_reads_its_candidates_in_waves_of_bounded_bytes(built: Path, collection: dict,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's candidates are read a few at a time (READ_BYTES_IN_FLIGHT), not into one buffer
    as large as all of them; the ranking is the memory reader's."""
    queries = collection["queries"]

    def peak_buffer_bytes(cap: int) -> tuple[int, list]:
        monkeypatch.setattr(centroid_stage, "READ_BYTES_IN_FLIGHT", cap)
        with Searcher.open(built, with_encoder=False, reader="posix") as searcher:
            pool = searcher.reader.buffer_pool
            acquire, release, held, peak = pool.acquire, pool.release, [0], [0]

            def tracked_acquire(nbytes: int):
                buffer = acquire(nbytes)
                held[0] += len(buffer)
                peak[0] = max(peak[0], held[0])
                return buffer

            def tracked_release(buffer, in_flight: bool = False) -> None:
                held[0] -= len(buffer)
                release(buffer, in_flight)

            monkeypatch.setattr(pool, "acquire", tracked_acquire)
            monkeypatch.setattr(pool, "release", tracked_release)
            results = searcher.search_embeddings(queries, k=10, prefetch=False)
            assert held[0] == 0
        return peak[0], [[(h.doc_id, h.score) for h in r.hits] for r in results]

    with Searcher.open(built, with_encoder=False, reader="memory") as memory:
        want = [[(h.doc_id, h.score) for h in r.hits] for r in memory.search_embeddings(queries, k=10)]
    cap = 64 << 10
    bounded, got = peak_buffer_bytes(cap)
    unbounded, got_unbounded = peak_buffer_bytes(1 << 40)
    assert got == want and got_unbounded == want
    assert bounded <= 2 * cap < unbounded, (bounded, unbounded)  # a buffer is a power of two of the bytes


def test_the_native_estimate_ranks_exactly_as_the_numpy_one(built: Path, collection: dict, index: Path) -> None:
    """espn/native/centroid_estimate.c against the numpy estimate: the same candidates in the
    same order and the same totals, with and without an allowed mask, over a base and a delta."""
    from espn.maxsim_native import centroid_estimate_native, load_kernel

    lib = load_kernel()
    assert lib is not None, "the native kernels are built by `make install` (setup.py)"
    queries = collection["queries"]
    with Searcher.open(index, with_encoder=False) as searcher:
        doomed = [str(d) for d in range(0, N_DOCS, 7)]
    with LiveIndex.open(index) as writer:
        writer.delete(doomed)
    with Searcher.open(index, with_encoder=False) as searcher:
        assert searcher.centroids is not None and searcher.live is not None
        rng = np.random.default_rng(3)  # a second segment's postings, as a delta's would be
        n_centroids = len(searcher.centroids.centroids)
        delta = postings_from_pairs(rng.integers(0, n_centroids, 4000), rng.integers(0, N_DOCS, 4000), n_centroids)
        centroids = searcher.centroids.with_parts([delta])
        bow = np.asarray(queries.bow, dtype=np.float32)
        scores, nearest = centroids._quantizer.search(bow.reshape(-1, D), 16)
        for allowed in (None, searcher.live):
            for i in range(len(queries)):
                rows = slice(i * 12, (i + 1) * 12)
                gains = scores[rows] - scores[rows, -1:]
                native = centroid_estimate_native(lib, [(p.offsets, p.docs) for p in centroids.parts],
                                                  len(centroids.centroids), nearest[rows], gains, allowed,
                                                  searcher.num_documents)
                assert native is not None
                docs, totals = centroids._estimate(nearest[rows], gains, allowed)
                np.testing.assert_array_equal(native[0], docs)
                np.testing.assert_array_equal(native[1], totals)
        damaged = [(centroids.parts[0].offsets, np.full_like(centroids.parts[0].docs, N_DOCS * 10))]
        with pytest.raises(ValueError, match="outside the index"):
            centroid_estimate_native(lib, damaged, len(centroids.centroids), nearest[:12], scores[:12],
                                     None, searcher.num_documents)


def test_the_centroid_reads_benchmark_runs_both_arms_and_a_baseline_checkout(
        built: Path, collection: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """benchmarks.bench_centroid_reads on the tiny index: both arms rank alike, and the
    side-by-side path runs a child per checkout (this one standing in for the baseline)."""
    from benchmarks import bench_centroid_reads, common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    queries = collection["queries"]
    npz = tmp_path / "queries.npz"
    np.savez(npz, ids=np.arange(len(queries)).astype(str), cls=queries.cls, bow=queries.bow, mask=queries.mask)
    root = Path(__file__).resolve().parents[1]
    argv = ["--index", str(built), "--queries", str(npz), "--rounds", "1", "--queries-n", "3"]
    assert bench_centroid_reads.main(argv + ["--baseline", str(root)]) == 0
    payload = json.loads((tmp_path / "centroid_reads.json").read_text())
    assert all(payload["readers"][reader]["alike"] for reader in ("posix", "memory"))
    assert payload["side_by_side"]["posix"]["p50_ratio"] > 0 and "|---" in capsys.readouterr().out


_UNDER_A_DESCRIPTOR_LIMIT = """
import os, resource, sys
import numpy as np
from espn import Searcher
from espn.encoders import QueryEmbeddings
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
q = np.load(sys.argv[2])
queries = QueryEmbeddings(q["cls"], q["bow"], q["mask"])
with Searcher.open(sys.argv[1], with_encoder=False, reader="posix", min_hidden_ms=0) as searcher:
    first = searcher.search_embeddings(queries, k=10, prefetch_k=4)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(40):  # 960 queries in waves of 4, and as many single ones
        again = searcher.search_embeddings(queries, k=10, prefetch_k=4)
        searcher.search_embeddings(queries[np.arange(1)], k=10, prefetch_k=4)
    assert [[h.doc_id for h in r.hits] for r in again] == [[h.doc_id for h in r.hits] for r in first]
    print(before, len(os.listdir("/proc/self/fd")))
"""


def test_the_centroid_reads_hold_no_descriptors_under_a_limit_of_64(built: Path, collection: dict,
                                                                      tmp_path: Path) -> None:
    """The reads beside the stage under `ulimit -n 64` (stricter than the 1024 a server gets):
    nearly two thousand searches in waves open no descriptor they do not close, and rank alike."""
    queries = collection["queries"]
    npz = tmp_path / "queries.npz"
    np.savez(npz, cls=queries.cls, bow=queries.bow, mask=queries.mask)
    done = subprocess.run([sys.executable, "-c", _UNDER_A_DESCRIPTOR_LIMIT, str(built), str(npz)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = map(int, done.stdout.split())
    assert after <= before, (before, after)
