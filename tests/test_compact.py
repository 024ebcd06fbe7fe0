"""Compact records: int8 codec, token pooling, pooled/quantised stores through every reader,
format 1 indexes, and a compact index served by the unchanged CLI and HTTP API."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from helpers import run_espn
from server_fixtures import HTTP, running_server

import espn.store.buffers as buffers_module
from espn.errors import IndexCorruptError, InvalidParameterError
from espn.index import read_manifest
from espn.pooling.cluster import pool_documents, pool_vectors
from espn.store import READERS, KvikioReader, RecordWriter, StoreLayout, open_reader, record_nbytes
from espn.store.format import dequantize_int8, quantize_int8

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_QUERIES = ROOT / "espn" / "data" / "sample_queries.jsonl"
SAMPLE_QRELS = ROOT / "espn" / "data" / "sample_qrels.tsv"


# -- the int8 codec ----------------------------------------------------------------------------


def test_int8_decode_of_encode_is_within_half_a_step() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.standard_normal((500, 64)),
        rng.standard_normal((20, 64)) * 1e3,  # large and small magnitudes: the scale follows each vector
        rng.standard_normal((20, 64)) * 1e-3,
        np.zeros((1, 64)),
    ]).astype(np.float32)
    codes, scales = quantize_int8(x)
    assert codes.dtype == np.int8 and scales.dtype == np.float16 and np.abs(codes).max() <= 127
    decoded = dequantize_int8(torch.from_numpy(codes), torch.from_numpy(scales)).float().numpy()
    step = scales.astype(np.float32)[:, None]
    # The stated error: half a quantisation step, plus the final rounding to fp16.
    bound = step / 2 + np.abs(x) * 2.0**-11
    assert np.all(np.abs(decoded - x) <= bound + 1e-12)
    assert np.all(decoded[-1] == 0)
    # Each vector uses its whole code range (absmax maps to ±127 or one fp16 step below).
    assert np.all(np.abs(codes[:-1]).max(axis=1) >= 126)


def test_int8_refuses_non_finite_vectors() -> None:
    with pytest.raises(InvalidParameterError, match="NaN"):
        quantize_int8(np.array([[1.0, np.inf]], dtype=np.float32))


# -- pooling -----------------------------------------------------------------------------------


def test_pool_vectors_groups_partition_the_tokens_and_pooled_rows_are_their_means() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((37, 16)).astype(np.float32)
    for factor in (2, 3, 4):
        pooled, groups = pool_vectors(x, factor)
        assert len(pooled) == 37 // factor and groups.shape == (37,)
        assert set(groups.tolist()) == set(range(len(pooled)))
        for j in range(len(pooled)):
            np.testing.assert_allclose(pooled[j], x[groups == j].mean(axis=0), rtol=1e-5, atol=1e-6)
        # Pooled rows follow the text: cluster j's first token comes before cluster j+1's.
        firsts = [int(np.flatnonzero(groups == j)[0]) for j in range(len(pooled))]
        assert firsts == sorted(firsts)
        again, groups_again = pool_vectors(x.copy(), factor)
        assert np.array_equal(groups, groups_again) and np.array_equal(pooled, again)
    same, groups = pool_vectors(x, 1)
    assert np.array_equal(same, x) and np.array_equal(groups, np.arange(37))
    with pytest.raises(InvalidParameterError, match="pool factor"):
        pool_vectors(x, 0)


def test_pool_documents_keeps_documents_apart() -> None:
    rng = np.random.default_rng(2)
    counts = np.array([0, 1, 5, 12])
    bow = rng.standard_normal((int(counts.sum()), 8)).astype(np.float32)
    pooled, new_counts = pool_documents(bow, counts, 2)
    assert new_counts.tolist() == [0, 1, 2, 6] and len(pooled) == 9
    np.testing.assert_allclose(pooled[1:3], pool_vectors(bow[1:6], 2)[0])


# -- pooled and quantised stores through every reader -------------------------------------------

LAYOUTS = [
    StoreLayout(d_cls=24, d_bow=9, block_size=512, dtype="int8", pool_factor=2),  # odd d_bow: padded records
    StoreLayout(d_cls=32, d_bow=16, block_size=4096, dtype="float16", pool_factor=3),
    StoreLayout(d_cls=32, d_bow=16, block_size=4096, dtype="int8", pool_factor=1),
]


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda lay: f"{lay.dtype}-pool{lay.pool_factor}-B{lay.block_size}")
def compact_store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A store written through RecordWriter in three chunks, and the numpy reference of every record."""
    layout: StoreLayout = request.param
    rng = np.random.default_rng(layout.d_bow)
    counts = rng.integers(0, 400 if layout.block_size == 4096 else 60, size=120)
    counts[:3] = [0, 1, 2]
    cls = rng.standard_normal((len(counts), layout.d_cls)).astype(np.float32)
    bow = rng.standard_normal((int(counts.sum()), layout.d_bow)).astype(np.float32)
    path = tmp_path_factory.mktemp("compact") / "embeddings.bin"
    rows = []
    with RecordWriter(path, layout) as writer:
        ends = np.cumsum(counts)
        for part in np.array_split(np.arange(len(counts)), 3):
            a, b = int(ends[part[0]] - counts[part[0]]), int(ends[part[-1]])
            rows.append(writer.append(cls[part], bow[a:b], counts[part]))
        writer.close()
    records = np.concatenate(rows)
    # Reference: pool with the library function, then store and decode in numpy.
    ref_bow, ref_counts = pool_documents(bow, counts, layout.pool_factor)
    assert np.array_equal(records["n_bow"], ref_counts)
    assert np.array_equal(records["length"], record_nbytes(ref_counts, layout))
    return path, records, layout, reference_decode(cls, layout), reference_decode(ref_bow, layout), ref_counts


def reference_decode(x: np.ndarray, layout: StoreLayout) -> np.ndarray:
    if layout.dtype == "float16":
        return x.astype(np.float16)
    codes, scales = quantize_int8(x)
    return (codes.astype(np.float32) * scales.astype(np.float32)[:, None]).astype(np.float16)


def test_compact_records_read_back_identically_by_every_reader(compact_store, fake_kvikio: ModuleType) -> None:
    path, records, layout, ref_cls, ref_bow, ref_counts = compact_store
    docs = np.random.default_rng(3).integers(0, len(records), size=50)
    docs[:3] = [0, 1, 2]
    starts = np.concatenate([[0], np.cumsum(ref_counts)])
    want_bow = np.concatenate([ref_bow[starts[d]: starts[d + 1]] for d in docs])
    for name in READERS:  # kvikio through the fake, standing in for a GPU (tests/fakes)
        with open_reader(name, path, records, layout) as reader:
            batch = reader.read(docs)
        assert batch.vectors.dtype == torch.float16, name
        assert np.array_equal(batch.n_bow, ref_counts[docs]), name
        np.testing.assert_array_equal(batch.cls.numpy().view(np.uint16), ref_cls[docs].view(np.uint16), err_msg=name)
        np.testing.assert_array_equal(batch.vectors.numpy().view(np.uint16), want_bow.view(np.uint16), err_msg=name)


def test_kvikio_device_buffers_decode_on_the_device(compact_store, fake_kvikio: ModuleType,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode on the scoring device: torch buffers (CPU tensors STANDING IN FOR CUDA MEMORY)."""
    path, records, layout, ref_cls, ref_bow, ref_counts = compact_store

    class Done:
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    monkeypatch.setattr(KvikioReader, "_is_cuda_device", lambda self: True)
    monkeypatch.setattr(buffers_module, "_record_event", lambda device: Done())
    docs = np.arange(len(records))[::7]
    with open_reader("kvikio", path, records, layout) as reader:
        assert reader.device_buffers
        batch = reader.read(docs)
    starts = np.concatenate([[0], np.cumsum(ref_counts)])
    want = np.concatenate([ref_bow[starts[d]: starts[d + 1]] for d in docs])
    np.testing.assert_array_equal(batch.vectors.numpy().view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(batch.cls.numpy().view(np.uint16), ref_cls[docs].view(np.uint16))


def test_layout_checks_its_options() -> None:
    with pytest.raises(InvalidParameterError, match="dtype"):
        StoreLayout(8, 8, dtype="int4")
    with pytest.raises(InvalidParameterError, match="pool_factor"):
        StoreLayout(8, 8, pool_factor=0)
    with pytest.raises(IndexCorruptError, match="rebuild"):
        StoreLayout.from_manifest({"d_cls": 8, "d_bow": 8, "block_size": 4096, "dtype": "binary"})


# -- whole indexes: the unchanged CLI and HTTP API on a compact index; format 1 still opens --------


def test_the_default_build_is_compact(sample_index: Path) -> None:
    """`espn index` with no storage options pools by 2 and stores int8 (the measured defaults)."""
    manifest = read_manifest(sample_index)
    assert manifest["format_version"] == 2
    store = manifest["store"]
    assert store["dtype"] == "int8" and store["pool_factor"] == 2 and store["scale"] == "per_vector"
    counts = manifest["counts"]
    assert counts["bow_vectors"] <= counts["bow_vectors_encoded"] // 2 + counts["documents"]
    records = np.load(sample_index / "records.npy")
    assert np.array_equal(records["length"], record_nbytes(records["n_bow"], StoreLayout.from_manifest(store)))


def test_compact_index_through_the_cli(sample_index: Path, tmp_path: Path) -> None:
    run_file = tmp_path / "run.trec"
    done = run_espn("search", sample_index, "--queries", SAMPLE_QUERIES, "--qrels", SAMPLE_QRELS,
                    "--out", run_file, "--k", "10")
    assert "nDCG@10" in done.stdout
    ndcg = float(done.stdout.split("nDCG@10")[1].split()[0].strip(":= "))
    assert ndcg > 0.5, done.stdout
    lines = run_file.read_text().splitlines()
    assert lines and all(len(line.split()) == 6 for line in lines)


def test_compact_index_through_http(sample_index: Path, tmp_path: Path) -> None:
    from espn import Searcher

    with Searcher.open(sample_index, reader="posix") as searcher:
        expected = [h.doc_id for h in searcher.search(["heart disease risk"], k=5)[0].hits]
    with running_server(sample_index, tmp_path) as server:
        response = HTTP.post(f"{server.base_url}/v1/search", json={"query": "heart disease risk", "k": 5}, timeout=60)
        assert response.status_code == 200, response.text
        hits = response.json()["results"]
        assert [h["id"] for h in hits] == expected
        assert all(h["bow_score"] != 0 for h in hits)


def test_format_1_index_still_opens(tmp_path: Path) -> None:
    """An index written before format 2 (no dtype/pool keys, format_version 1) reads as fp16."""
    from espn import Searcher

    source = tmp_path / "embeddings"
    rng = np.random.default_rng(4)
    counts = rng.integers(1, 30, size=40)
    (source / "CLS").mkdir(parents=True)
    (source / "BOW").mkdir()
    np.save(source / "CLS" / "0.npy", rng.normal(size=(40, 16)).astype(np.float16))
    np.save(source / "BOW" / "0.npy", rng.normal(size=(int(counts.sum()), 8)).astype(np.float16))
    (source / "BOW" / "0.json").write_text(json.dumps(counts.tolist()))
    index = tmp_path / "index"
    run_espn("index", "--embeddings", source, "--out", index, "--nlist", "2", "--no-progress")
    with Searcher.open(index) as searcher:
        from espn.encoders import QueryEmbeddings

        q = QueryEmbeddings(torch.from_numpy(rng.normal(size=(3, 16)).astype(np.float32)),
                            torch.from_numpy(rng.normal(size=(3, 4, 8)).astype(np.float32)),
                            torch.ones((3, 4), dtype=torch.bool))
        want = [[(h.doc_id, h.score) for h in r.hits] for r in searcher.search_embeddings(q, k=5)]
    old = tmp_path / "old"
    shutil.copytree(index, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format_version"] = 1
    for key in ("pool_factor", "scale"):
        manifest["store"].pop(key)
    (old / "manifest.json").write_text(json.dumps(manifest))
    with Searcher.open(old) as searcher:
        assert [[(h.doc_id, h.score) for h in r.hits] for r in searcher.search_embeddings(q, k=5)] == want
    manifest["format_version"] = 99
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexCorruptError, match="rebuild"):
        Searcher.open(old)

    # The storage options on the command line; a bad one is one clear line, nothing written.
    compact = tmp_path / "compact"
    run_espn("index", "--embeddings", source, "--out", compact, "--nlist", "2", "--no-progress",
             "--pool-factor", "3", "--bow-dtype", "int8")
    store = read_manifest(compact)["store"]
    assert (store["dtype"], store["pool_factor"]) == ("int8", 3)
    assert (compact / "embeddings.bin").stat().st_size < (index / "embeddings.bin").stat().st_size / 3
    with Searcher.open(compact) as searcher:
        assert all(len(r.hits) == 5 for r in searcher.search_embeddings(q, k=5))
    bad = run_espn("index", "--embeddings", source, "--out", tmp_path / "bad", "--pool-factor", "0", check=False)
    assert bad.returncode != 0 and "pool_factor" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "bad").exists()


# -- whole-word pooling for the generic encoder ------------------------------------------------


def test_whole_word_pooling_keeps_one_vector_per_content_word() -> None:
    from espn.encoders.hf import HFEncoder

    encoder = HFEncoder.from_pretrained(None, bow_dim=None, bow_pooling="words")
    text = "The tokenization of hypertension, in 2019 (a study)."
    docs = encoder.encode_documents([text, "Of the ... !"])
    # tokenization, hypertension, 2019, study: stop words and punctuation are gated out.
    assert docs.counts.tolist() == [4, 0]
    tokens = encoder.tokenize([text], is_query=False)
    _, hidden, mask = encoder._forward(tokens)
    pieces = encoder.tokenizer.convert_ids_to_tokens(tokens["input_ids"][0].tolist())
    first_word = (tokens["word_ids"][0] == 0) & mask[0]
    assert "".join(p.removeprefix("##") for p, k in zip(pieces, first_word.tolist()) if k) == "tokenization"
    assert int(first_word.sum()) > 1  # a word of several subwords: their mean, normalised
    expected = torch.nn.functional.normalize(hidden[0, first_word].mean(0), dim=-1).numpy()
    np.testing.assert_allclose(docs.bow[0], expected, atol=1e-5)
    # Explanations map each word vector to its whole word in the text.
    spans = encoder.vector_spans([text, "Of the ... !"])
    assert [[text[a:b] for (a, b) in word] for word in spans[0]] == [["tokenization"], ["hypertension"], ["2019"], ["study"]]
    assert spans[1] == []
    # Queries keep every token; the choice travels with the index's encoder config.
    assert "word_ids" not in encoder.tokenize([text], is_query=True)
    assert encoder.config()["bow_pooling"] == "words"
    with pytest.raises(InvalidParameterError, match="bow_pooling"):
        HFEncoder.from_pretrained(None, bow_pooling="letters")
