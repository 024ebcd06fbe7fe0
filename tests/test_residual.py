"""Residual records (espn/store/residual.py): a centroid id and 2 or 4 bits per dimension.

The codec on its own (real FAISS centroids, seeded clustered vectors), then whole indexes
built with `--bow-dtype residual2|residual4`: imported embeddings scored against the int8
build of the same vectors, and the offline MiniLM encoder on 48 sample passages written to
(upserts, deletes, filters), compacted (the codec retrained and every record re-encoded),
restarted, and damaged. Real files, the real kernel and its torch counterpart.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from espn import Searcher
from helpers import write_maxsim_shards
from espn.encoders import QueryEmbeddings
from espn.errors import IndexCorruptError, InvalidParameterError
from espn.first_stage.centroids import train_centroids
from espn.generation.format import read_current
from espn.index import read_manifest
from espn.live.checks import NewDocument
from espn.live.live_index import LiveIndex
from espn.live.snapshot import restore, snapshot
from espn.store import StoreLayout, record_nbytes
from espn.store.residual import pack_codes, train_codec
from espn_indexing.build import BuildConfig, build_from_embeddings, build_index

D = 32
SAMPLE_CORPUS = Path(__file__).parents[1] / "espn/data/sample_corpus.jsonl"


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _clustered(rng: np.random.Generator, n: int, d: int = D, topics: int = 40) -> np.ndarray:
    """Unit vectors around `topics` directions, as token vectors are."""
    centres = _unit(rng.standard_normal((topics, d)))
    return _unit(centres[rng.integers(0, topics, n)] + 0.35 * _unit(rng.standard_normal((n, d))))


# -- the codec ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 4])
def test_each_dimension_decodes_into_the_bucket_its_residual_fell_in(bits: int) -> None:
    """Without normalizing, decode = centroid + the bucket's mean residual: every code is the
    bucket between the cutoffs around the residual, and its weight lies in that bucket."""
    rng = np.random.default_rng(1)
    everything = 1.7 * _clustered(rng, 9000)  # not unit length: the codec must not normalize them
    vectors, fresh = everything[:6000], everything[6000:]
    codec = train_codec(train_centroids(vectors, 32), vectors, bits)
    assert not codec.normalize and codec.cutoffs.shape == (D, (1 << bits) - 1)
    ids, packed = codec.encode(vectors)
    assert packed.shape == (len(vectors), D * bits // 8) and packed.dtype == np.uint8
    per_byte = 8 // bits
    codes = (packed[:, np.arange(D) // per_byte] >> ((np.arange(D) % per_byte) * bits)) & ((1 << bits) - 1)
    assert np.array_equal(pack_codes(codes, bits), packed)
    residual = vectors - codec.centroids[ids]
    low = np.concatenate([np.full((D, 1), -np.inf), codec.cutoffs], axis=1)
    high = np.concatenate([codec.cutoffs, np.full((D, 1), np.inf)], axis=1)
    dims = np.arange(D)[None, :]
    assert np.all(low[dims, codes] <= residual) and np.all(residual < high[dims, codes])
    assert np.all(low[:, :] <= codec.weights) and np.all(codec.weights <= high)
    decoded = codec.decode(ids, packed)
    np.testing.assert_allclose(decoded, codec.centroids[ids] + codec.weights[dims, codes], rtol=1e-6, atol=1e-6)
    # the stated error (measured on the training sample) holds for vectors the codec never saw
    error = np.sqrt(((codec.decode(*codec.encode(fresh)) - fresh) ** 2).sum(axis=1).mean())
    assert 0 < codec.rms_error and error < 1.2 * codec.rms_error


def test_four_bits_keep_more_than_two_and_unit_vectors_decode_to_unit_length() -> None:
    rng = np.random.default_rng(3)
    vectors = _clustered(rng, 8000)
    centroids = train_centroids(vectors, 64)
    two, four = train_codec(centroids, vectors, 2), train_codec(centroids, vectors, 4)
    assert two.normalize and four.normalize
    assert four.rms_error < 0.6 * two.rms_error
    decoded = four.decode(*four.encode(vectors))
    np.testing.assert_allclose(np.linalg.norm(decoded, axis=1), 1.0, atol=1e-5)
    # torch decodes on the tensors' device to the same values
    ids, packed = four.encode(vectors[:100])
    np.testing.assert_array_equal(four.decode_torch(torch.from_numpy(ids), torch.from_numpy(packed)).numpy(),
                                  decoded[:100])


def test_a_record_naming_a_centroid_outside_the_codec_is_refused() -> None:
    rng = np.random.default_rng(4)
    vectors = _clustered(rng, 500)
    codec = train_codec(train_centroids(vectors, 8), vectors, 4)
    ids, packed = codec.encode(vectors[:3])
    ids[1] = 8
    with pytest.raises(IndexCorruptError, match="outside the codec"):
        codec.decode(ids, packed)


def test_the_layout_sizes_records_and_refuses_what_does_not_fit() -> None:
    layout = StoreLayout(d_cls=D, d_bow=128, dtype="residual2")
    assert record_nbytes(100, layout) == 2 * D + 100 * (4 + 32)  # CLS fp16, then id + 32 B of codes per vector
    assert record_nbytes(100, StoreLayout(d_cls=D, d_bow=128, dtype="int8")) > 3.5 * 100 * 36
    with pytest.raises(InvalidParameterError, match="whole number of bytes"):
        StoreLayout(d_cls=D, d_bow=30, dtype="residual2")
    with pytest.raises(IndexCorruptError, match="need their codec"):
        layout.require_codec()
    rng = np.random.default_rng(5)
    vectors = _clustered(rng, 300)
    with pytest.raises(IndexCorruptError, match="does not fit"):
        StoreLayout(d_cls=D, d_bow=D, dtype="residual2").with_codec(train_codec(train_centroids(vectors, 4), vectors, 4))


# -- indexes of imported embeddings: residual against int8 ----------------------------------------

@pytest.fixture(scope="module")
def collection() -> dict:
    """Words around 50 topics; documents of 3 topics; queries of 12 tokens from one document."""
    rng = np.random.default_rng(7)
    words = _clustered(rng, 2500, topics=50)
    counts = rng.integers(8, 40, size=1200)
    owner = np.repeat(np.arange(1200), counts)
    doc_words = rng.integers(0, 2500, size=(1200, 6))
    bow = _unit(words[doc_words[owner, rng.integers(0, 6, len(owner))]] + 0.1 * _unit(rng.standard_normal((len(owner), D))))
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    q_docs = rng.choice(1200, size=40, replace=False)
    picks = firsts[q_docs][:, None] + (rng.random((40, 12)) * counts[q_docs][:, None]).astype(np.int64)
    q_bow = _unit(bow[picks] + 0.2 * _unit(rng.standard_normal((40, 12, D))))
    queries = QueryEmbeddings(_unit(q_bow.mean(1)), q_bow, np.ones((40, 12), dtype=bool))
    return {"cls": _unit(np.add.reduceat(bow, firsts)), "bow": bow, "counts": counts, "queries": queries}


@pytest.fixture(scope="module")
def builds(collection: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    source = write_maxsim_shards(tmp_path_factory.mktemp("shards") / "emb", collection["cls"], collection["bow"],
                                 collection["counts"])
    out = {}
    for dtype in ("int8", "residual2", "residual4"):
        out[dtype] = tmp_path_factory.mktemp(dtype) / "index"
        build_from_embeddings(source, out[dtype], nlist=16, chunk_size=512, first_stage="centroids", text_index=None,
                              bow_dtype=dtype)
    return out


def _top(results: list) -> list[list[str]]:
    return [[h.doc_id for h in (r.hits if hasattr(r, "hits") else r)] for r in results]


def test_residual_builds_are_smaller_and_find_the_int8_exhaustive_top10(builds: dict[str, Path],
                                                                         collection: dict) -> None:
    queries = collection["queries"]
    tokens = int(collection["counts"].sum())
    sizes = {dtype: read_manifest(path)["store"]["file_bytes"] for dtype, path in builds.items()}
    assert sizes["residual4"] < 0.75 * sizes["int8"] and sizes["residual2"] < sizes["residual4"]
    manifest = read_manifest(builds["residual2"])
    assert manifest["store"]["residual"]["bits"] == 2 and manifest["store"]["residual"]["normalize"] is True
    assert {"first_stage/residual_cutoffs.npy", "first_stage/residual_weights.npy"} <= set(manifest["files"])
    records = np.load(builds["residual2"] / "records.npy")
    assert int(records["length"].sum()) == len(records) * 2 * D + tokens * (4 + D * 2 // 8)
    with Searcher.open(builds["int8"], with_encoder=False) as searcher:
        reference = _top(searcher.search_maxsim_exhaustive(queries, k=10))
    # measured 0.9625 and 0.935 (exhaustive), 0.905 and 0.8825 (the default first stage)
    for dtype, floor in (("residual4", 0.93), ("residual2", 0.9)):
        with Searcher.open(builds[dtype], with_encoder=False, verify="full") as searcher:
            exhaustive = searcher.search_maxsim_exhaustive(queries, k=10)
            deep = searcher.search_embeddings(queries, k=10, first_stage_probe=64, first_stage_candidates=1200)
            found = _top(searcher.search_embeddings(queries, k=10))
        # the kernel scores what the exhaustive reference decodes: the same ranking and scores
        assert _top(deep) == _top(exhaustive)
        np.testing.assert_allclose([h.score for r in deep for h in r.hits],
                                   [h.score for r in exhaustive for h in r], rtol=1e-4)
        fidelity = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(_top(exhaustive), reference)])
        recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found, reference)])
        assert fidelity >= floor and recall >= floor - 0.08, (dtype, fidelity, recall)


@pytest.mark.parametrize("reader", ["posix", "memory", "mmap"])
def test_every_reader_and_the_torch_scorer_rank_residual_records_alike(builds: dict[str, Path], collection: dict,
                                                                       reader: str, monkeypatch) -> None:
    queries = collection["queries"]
    with Searcher.open(builds["residual4"], with_encoder=False, reader=reader) as searcher:
        native = searcher.search_embeddings(queries, k=10)
    import espn.maxsim as maxsim

    monkeypatch.setattr(maxsim, "load_kernel", lambda: None)
    with Searcher.open(builds["residual4"], with_encoder=False, reader=reader) as searcher:
        fallback = searcher.search_embeddings(queries, k=10)
    assert _top(native) == _top(fallback)
    np.testing.assert_allclose([h.score for r in native for h in r.hits],
                               [h.score for r in fallback for h in r.hits], rtol=1e-4)


def test_the_residual_benchmark_makes_each_arm_and_measures_it(builds: dict[str, Path], collection: dict,
                                                               tmp_path: Path, monkeypatch, capsys) -> None:
    """benchmarks.bench_residual on the int8 build: the arms are re-encoded copies, the int8
    arm's recall of its own exhaustive top 10 is 1, and every arm's speed is measured in a child."""
    from benchmarks import bench_residual, common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    queries = collection["queries"]
    npz = tmp_path / "queries.npz"
    np.savez(npz, ids=np.array([f"q{i}" for i in range(len(queries))]), cls=queries.cls, bow=queries.bow,
             mask=queries.mask)
    (tmp_path / "data" / "qrels").mkdir(parents=True)
    for split, rows in (("train", range(0, 20)), ("test", range(20, 40))):
        lines = "".join(f"q{i}\t{i}\t1\n" for i in rows)
        (tmp_path / "data" / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + lines)
    argv = ["--index", str(builds["int8"]), "--queries", str(npz), "--work", str(tmp_path / "work"),
            "--data", str(tmp_path / "data"), "--quick"]
    assert bench_residual.main(argv) == 0
    payload = json.loads((tmp_path / "residual.json").read_text())
    assert payload["arms"]["residual2"]["bytes_per_token"] < payload["arms"]["residual4"]["bytes_per_token"] \
        < payload["arms"]["int8"]["bytes_per_token"]
    for split in ("train", "test"):
        assert payload["fidelity"][split]["int8"]["exhaustive_recall"] == 1.0
        assert 0.5 < payload["fidelity"][split]["residual4"]["exhaustive_recall"] <= 1.0
    assert all(payload["speed"][arm][reader]["p50_ms"] > 0 for arm in bench_residual.ARMS
               for reader in bench_residual.READERS)
    assert payload["speed"]["residual2"]["posix"]["bytes_per_query"] < payload["speed"]["int8"]["posix"]["bytes_per_query"]
    assert "|---" in capsys.readouterr().out


def test_a_residual_build_without_the_centroid_stage_is_refused_before_encoding(tmp_path: Path) -> None:
    """Asked for explicitly, or the encoder's default (MiniLM: the IVF): one line, nothing left."""
    with pytest.raises(InvalidParameterError, match="centroid first stage"):
        BuildConfig(corpus=SAMPLE_CORPUS, out=tmp_path / "x", bow_dtype="residual4", first_stage="ivf").validate()
    with pytest.raises(InvalidParameterError, match="add --first-stage centroids"):
        build_index(BuildConfig(corpus=SAMPLE_CORPUS, out=tmp_path / "y", bow_dtype="residual2", loader_workers=0,
                                progress=False, device="cpu", fit_sample=16, text_index=None))
    assert not (tmp_path / "y").exists() and not list(tmp_path.glob("y*"))


# -- a written index: deltas, deletions, filters, compaction, restart, damage ------------------

@pytest.fixture(scope="module", params=["residual4", "residual2"])
def minilm_residual(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"minilm-{request.param}") / "index"
    docs = [json.loads(line) for line in SAMPLE_CORPUS.open()][:48]
    for i, doc in enumerate(docs):
        doc["metadata"] = {"shelf": "odd" if i % 2 else "even"}
    corpus = out.with_suffix(".jsonl")
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    build_index(BuildConfig(corpus=corpus, out=out, loader_workers=0, progress=False, device="cpu", fit_sample=16,
                            first_stage="centroids", score_weight=0.0, text_index=None, bow_dtype=request.param))
    return out


def _exact(searcher: Searcher, query: str, k: int, **kwargs) -> list[str]:
    return [h.doc_id for h in searcher.search_maxsim_exhaustive(searcher.encode([query]), k=k, **kwargs)[0]]


def test_a_written_residual_index_keeps_exact_maxsim_through_writes_compaction_and_restart(
        minilm_residual: Path, tmp_path: Path) -> None:
    index = tmp_path / "index"
    shutil.copytree(minilm_residual, index)
    query = "a purple elephant dancing on the moon"
    new = NewDocument("new-elephant", "A purple elephant is dancing on the moon tonight, under the stars.", "Elephants",
                      metadata={"shelf": "odd"})
    base_codec = np.load(index / "first_stage" / "residual_weights.npy")
    with LiveIndex.open(index) as writer:
        writer.upsert([new])
        with Searcher.open(index) as searcher:  # the delta is coded against the base's centroids
            assert searcher.layout.dtype == read_manifest(minilm_residual)["store"]["dtype"]
            hits = [h.doc_id for h in searcher.search([query], k=5)[0].hits]
            assert hits[0] == "new-elephant" and hits == _exact(searcher, query, 5)
            odd = searcher.search([query], k=5, filter={"shelf": "odd"})[0].hits
            assert odd[0].doc_id == "new-elephant"
            runner_up = hits[1]
            explained = searcher.search([query], k=1, explain=True)[0].hits[0]
            assert explained.doc_id == "new-elephant" and explained.explanation
        writer.delete([runner_up])
        with Searcher.open(index) as searcher:
            ids = [h.doc_id for h in searcher.search([query], k=48, first_stage_candidates=100)[0].hits]
            assert runner_up not in ids and len(ids) == 48
        # a snapshot of the written generation carries the codec; restored, it answers alike
        snapshot(index, tmp_path / "snap")
        restore(tmp_path / "snap", tmp_path / "restored")
        with Searcher.open(tmp_path / "restored", verify="full") as restored:
            assert [h.doc_id for h in restored.search([query], k=48, first_stage_candidates=100)[0].hits] == ids
        weights = tmp_path / "snap" / "first_stage" / "residual_weights.npy"
        weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
        with pytest.raises(IndexCorruptError):
            restore(tmp_path / "snap", tmp_path / "restored-again")
        assert not (tmp_path / "restored-again").exists()
        writer.compact()
    base = index / read_current(index).base
    manifest = read_manifest(base)
    assert manifest["store"]["dtype"] == read_manifest(minilm_residual)["store"]["dtype"]
    assert manifest["counts"]["documents"] == 48
    # compaction retrained the centroids and re-encoded every record against them
    assert not np.array_equal(np.load(base / "first_stage" / "residual_weights.npy"), base_codec)
    records = np.load(base / "records.npy")
    assert (base / "embeddings.bin").stat().st_size == manifest["store"]["file_bytes"]
    assert np.all(records["length"] == [record_nbytes(int(n), StoreLayout.from_manifest(manifest["store"]))
                                        for n in records["n_bow"]])
    with Searcher.open(index, verify="full") as restarted:
        hits = [h.doc_id for h in restarted.search([query], k=5)[0].hits]
        assert hits[0] == "new-elephant" and runner_up not in hits and hits == _exact(restarted, query, 5)
        even = [h.doc_id for h in restarted.search([query], k=5, filter={"shelf": "even"})[0].hits]
        assert "new-elephant" not in even and even


def test_a_damaged_residual_record_is_refused_not_scored(minilm_residual: Path, tmp_path: Path) -> None:
    index = tmp_path / "index"
    shutil.copytree(minilm_residual, index)
    records = np.load(index / "records.npy")
    manifest = read_manifest(index)
    layout = StoreLayout.from_manifest(manifest["store"], index)
    with open(index / "embeddings.bin", "r+b") as file:  # every record's first centroid id -> 2^30
        for offset in records["offset"]:
            file.seek(int(offset) + 2 * layout.d_cls)
            file.write(np.int32(1 << 30).tobytes())
    for native in (True, False):
        import espn.maxsim as maxsim

        with Searcher.open(index, verify="none") as searcher:
            if not native:
                original, maxsim.load_kernel = maxsim.load_kernel, lambda: None
            try:
                with pytest.raises(IndexCorruptError, match="outside the codec"):
                    searcher.search(["a purple elephant"], k=5)
            finally:
                if not native:
                    maxsim.load_kernel = original


def test_a_residual_codec_that_disagrees_with_its_records_is_refused(minilm_residual: Path, tmp_path: Path) -> None:
    index = tmp_path / "index"
    shutil.copytree(minilm_residual, index)
    np.save(index / "first_stage" / "residual_weights.npy", np.zeros((3, 16), np.float32))
    with pytest.raises(IndexCorruptError):
        Searcher.open(index, verify="none")



def test_a_snapshot_whose_codec_is_a_link_or_a_fifo_is_refused(minilm_residual: Path, tmp_path: Path) -> None:
    """The codec files come from outside with a snapshot: a link out (to a byte-identical copy,
    so only the link is wrong) and a FIFO are refused in one line, and nothing is restored."""
    snapshot(minilm_residual, tmp_path / "snap")
    codec = tmp_path / "snap" / "first_stage"
    outside = tmp_path / "outside.npy"
    shutil.copyfile(codec / "residual_weights.npy", outside)
    (codec / "residual_weights.npy").unlink()
    (codec / "residual_weights.npy").symlink_to(outside)
    with pytest.raises(IndexCorruptError, match="outside|link") as linked:
        restore(tmp_path / "snap", tmp_path / "linked")
    shutil.copyfile(outside, tmp_path / "weights.npy")
    (codec / "residual_weights.npy").unlink()
    shutil.move(tmp_path / "weights.npy", codec / "residual_weights.npy")
    cutoffs = codec / "residual_cutoffs.npy"
    cutoffs.unlink()
    os.mkfifo(cutoffs)
    with pytest.raises(IndexCorruptError, match="FIFO") as fifo:
        restore(tmp_path / "snap", tmp_path / "fifo")
    assert "\n" not in str(linked.value) + str(fifo.value)
    assert not (tmp_path / "linked").exists() and not (tmp_path / "fifo").exists()
