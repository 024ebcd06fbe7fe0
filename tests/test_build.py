"""The build job through the real CLI: content, alignment, checksums, bad input (crashes, resume and shards:
test_build_crashes.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import espn.encoders.hf as hf
from espn.corpus import iter_corpus
from espn.encoders import load_encoder
from espn.errors import IndexCorruptError
from espn.index import IndexDirectory
from espn.pooling.cluster import pool_vectors
from espn.store import open_reader
from espn.store.format import StoreLayout, record_nbytes
from espn_indexing.build import BuildConfig, build_index

from helpers import CONTENT_FILES, digest, run_espn


def test_index_matches_encoder_output(scifact_index: Path, scifact_subset: Path) -> None:
    index = IndexDirectory.open(scifact_index, verify="full")
    manifest = index.manifest
    docs = list(iter_corpus(scifact_subset))
    assert manifest["counts"]["documents"] == len(docs) == 160
    assert manifest["store"]["block_size"] == 4096 and manifest["encoder"]["d_bow"] == 64
    layout = StoreLayout.from_manifest(manifest["store"])
    records = index.load_array("records.npy")

    # Placement: where records.npy says, each IVF list's records together (store.record_order),
    # no two overlapping, never straddling a block needlessly.
    assert manifest["store"]["record_order"] == "ivf_lists"
    by_offset = np.sort(records, order="offset")
    assert np.all(by_offset["offset"][1:] >= by_offset["offset"][:-1] + by_offset["length"][:-1])
    assert np.array_equal(records["length"], record_nbytes(records["n_bow"], layout))
    first_block = records["offset"] // layout.block_size
    last_block = (records["offset"] + records["length"] - 1) // layout.block_size
    assert np.array_equal(last_block - first_block + 1, np.maximum(1, -(-records["length"] // layout.block_size)))
    assert (scifact_index / "embeddings.bin").stat().st_size % layout.block_size == 0

    # Content: each record holds the encoder's output for that document, pooled and stored as the
    # manifest says (the default build: pooled by 2, int8).
    assert layout.dtype == "int8" and layout.pool_factor == 2
    encoder = load_encoder(scifact_index / "encoder", manifest["encoder"])
    expected = encoder.encode_documents([d.full_text for d in docs[:40]])
    with open_reader("memory", scifact_index / "embeddings.bin", records, layout) as reader:
        got = reader.read(np.arange(40))
    ids = [bytes(x).decode() for x in index.load_array("ids.npy")[:40]]
    assert ids == [d.doc_id for d in docs[:40]]
    for i, (cls, bow) in enumerate(expected.split()):
        n = int(records["n_bow"][i])
        pooled = pool_vectors(bow.astype(np.float16).astype(np.float32), layout.pool_factor)[0]
        assert n == len(pooled) and int(got.mask[i].sum()) == n
        # Batches were padded differently at build time (float summation order only); int8 adds at
        # most half a step, absmax / 254, per element.
        np.testing.assert_allclose(got.cls[i].float().numpy(), cls, atol=2e-3 + np.abs(cls).max() / 254)
        # The same clusters up to near-ties: every stored vector has its reference twin, and back.
        stored = got.bow[i, :n].float().numpy()
        cosine = (stored / np.linalg.norm(stored, axis=1, keepdims=True)) @ \
            (pooled / np.linalg.norm(pooled, axis=1, keepdims=True)).T
        assert cosine.max(axis=1).min() > 0.99 and cosine.max(axis=0).min() > 0.99


def test_documents_text_and_ids_are_stored(scifact_index: Path, scifact_subset: Path) -> None:
    from espn import Searcher

    first = next(iter_corpus(scifact_subset))
    with Searcher.open(scifact_index, with_encoder=False) as searcher:
        doc = searcher.document(first.doc_id)
        assert (doc.title, doc.text) == (first.title, first.text)
        with pytest.raises(KeyError):
            searcher.document("no-such-id")


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corruption_detected_on_open(scifact_index: Path, tmp_path: Path, damage: str) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(scifact_index, copy)
    path = copy / "embeddings.bin"
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(5000)
            byte = f.read(1)
            f.seek(5000)
            f.write(bytes([byte[0] ^ 0x01]))
    else:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 4096)
    with pytest.raises(IndexCorruptError, match="embeddings.bin"):
        IndexDirectory.open(copy)
    (tmp_path / "q.tsv").write_text("q1\tvitamin d\n")
    proc = run_espn("search", copy, "--queries", tmp_path / "q.tsv", "--out", tmp_path / "run", check=False)
    assert proc.returncode == 1
    assert "embeddings.bin" in proc.stderr and "Traceback" not in proc.stderr


def test_existing_index_needs_force(scifact_index: Path, scifact_subset: Path) -> None:
    before = digest(scifact_index / "manifest.json")
    proc = run_espn("index", scifact_subset, "--out", scifact_index, check=False)
    assert proc.returncode == 1 and "--force" in proc.stderr
    assert digest(scifact_index / "manifest.json") == before


GOOD = {"_id": "a", "title": "Alpha", "text": "The first document is about alpha particles."}


@pytest.mark.parametrize(
    "lines, message",
    [
        ([json.dumps(GOOD), "{not json", json.dumps({**GOOD, "_id": "c"})], r"corpus.jsonl:2: malformed JSON"),
        ([json.dumps(GOOD), json.dumps({"title": "x", "text": "y"})], r"corpus.jsonl:2: missing '_id'"),
        ([json.dumps(GOOD), json.dumps({"_id": "b", "text": 5})], r"corpus.jsonl:2: 'text'"),
        ([json.dumps(GOOD), json.dumps({**GOOD, "text": "again"})], r"duplicate document id 'a'"),
        ([], r"no documents"),
        ([json.dumps(GOOD), json.dumps({**GOOD, "_id": "a\x00"})], r"corpus.jsonl:2: document id 'a\\x00' contains "
                                                                     r"the control character U\+0000"),
        ([json.dumps({**GOOD, "_id": "b\ud800"})], r"corpus.jsonl:1: document id 'b\\ud800' is not valid UTF-8: "
                                                    r"a lone surrogate U\+D800"),
    ],
    ids=["malformed-json", "missing-id", "wrong-type", "duplicate-id", "empty", "nul-in-id", "surrogate-in-id"],
)
def test_bad_corpus_fails_with_one_clear_line(tmp_path: Path, lines: list[str], message: str) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "index"
    proc = run_espn("index", corpus, "--out", out, "--no-progress", check=False)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    import re

    assert re.search(message, errors[0]), errors[0]
    assert not out.exists()


def test_skip_bad_counts_and_skips(tmp_path: Path) -> None:
    rows = [json.dumps({**GOOD, "_id": f"d{i}", "text": f"document number {i} about topic {i % 3}"}) for i in range(40)]
    rows.insert(5, "{broken")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(rows) + "\n")
    proc = run_espn("index", corpus, "--out", tmp_path / "index", "--skip-bad", "--no-progress")
    assert "corpus.jsonl:6" in proc.stderr
    assert IndexDirectory.open(tmp_path / "index").num_documents == 40


def test_tsv_corpus_and_unreadable_file(tmp_path: Path) -> None:
    tsv = tmp_path / "collection.tsv"
    tsv.write_text("".join(f"{i}\tpassage {i} on the subject of {['rivers', 'stars', 'bread'][i % 3]}\n" for i in range(30)))
    run_espn("index", tsv, "--out", tmp_path / "index", "--no-progress")
    assert IndexDirectory.open(tmp_path / "index").num_documents == 30
    proc = run_espn("index", tmp_path / "missing.jsonl", "--out", tmp_path / "other", check=False)
    assert proc.returncode == 1 and "missing.jsonl: no such file" in proc.stderr


def test_partitions_place_documents_by_the_hash_of_their_id(tmp_path: Path) -> None:
    from espn.partitioning import HASH_NAME, owner

    tsv = tmp_path / "collection.tsv"
    tsv.write_text("".join(f"p{i}\tpassage {i} about {['rivers', 'stars', 'bread', 'trains'][i % 4]}\n" for i in range(90)))
    run_espn("index", tsv, "--out", tmp_path / "parts", "--partitions", "3", "--no-progress")
    seen = []
    encoders = set()
    for p in range(3):
        part = IndexDirectory.open(tmp_path / "parts" / f"part-{p}", verify="full")
        assert part.manifest["partition"] == {"index": p, "count": 3, "by": HASH_NAME}
        ids = [bytes(x).decode() for x in part.load_array("ids.npy")]
        assert all(owner(doc_id, 3) == p for doc_id in ids)  # the rule the router follows for writes
        seen += ids
        encoders.add(part.manifest["files"]["encoder/projection.npy"]["sha256"])
        assert 15 <= part.num_documents <= 45  # a hash spreads 90 ids about evenly
    assert sorted(seen) == sorted(f"p{i}" for i in range(90))
    assert len(encoders) == 1  # one shared projection: scores compare across partitions


# -- errors found early, empty documents, worker processes (issue 12) ------------------


def _corpus(path: Path, count: int, extra: list[str] | None = None, at: int | None = None) -> Path:
    rows = [json.dumps({"_id": f"d{i}", "title": f"Topic {i % 7}", "text": f"document {i} about subject {i % 5}"})
            for i in range(count)]
    if extra:
        position = len(rows) if at is None else at
        rows[position:position] = extra
    path.write_text("\n".join(rows) + "\n")
    return path


def test_bad_line_after_the_fit_sample_is_one_line_before_encoding(tmp_path: Path) -> None:
    """The tokenising worker used to meet it and print 'Caught CorpusError in DataLoader worker' + a traceback."""
    corpus = _corpus(tmp_path / "corpus.jsonl", 300, ["{broken"], at=290)
    out = tmp_path / "index"
    proc = run_espn("index", corpus, "--out", out, "--no-progress", check=False)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "DataLoader worker" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "corpus.jsonl:291: malformed JSON" in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "index.partial" / "chunks").exists()  # nothing was encoded


def test_duplicate_ids_are_found_before_the_model_loads(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "corpus.jsonl", 40, [json.dumps({"_id": "d3", "title": "", "text": "again"})])
    # An encoder that cannot load: had the model been loaded before the scan, this would be the error.
    model = tmp_path / "no-model"
    model.mkdir()
    proc = run_espn("index", corpus, "--out", tmp_path / "index", "--no-progress", "--encoder", f"hf:{model}",
                    check=False)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "corpus.jsonl:41: duplicate document id 'd3' (first on line 4)" in errors[0], errors
    assert "PCA" not in proc.stderr  # the encoder was never fitted
    assert not (tmp_path / "index.partial").exists()


def test_empty_documents_are_indexed_with_one_warning(tmp_path: Path) -> None:
    empties = [json.dumps({"_id": "empty-1", "title": "", "text": ""}),
               json.dumps({"_id": "empty-2", "title": " ", "text": "  "})]
    corpus = _corpus(tmp_path / "corpus.jsonl", 30, empties, at=10)
    out = tmp_path / "index"
    proc = run_espn("index", corpus, "--out", out, "--no-progress")
    warnings = [line for line in proc.stderr.splitlines() if "no text" in line]
    assert len(warnings) == 1 and "2 document(s) have no text" in warnings[0], proc.stderr[-2000:]

    from espn import Searcher

    with Searcher.open(out) as searcher:
        assert searcher.num_documents == 32
        assert searcher.document("empty-1").text == ""
        records = IndexDirectory.open(out).load_array("records.npy")
        ids = [bytes(x).decode() for x in IndexDirectory.open(out).load_array("ids.npy")]
        assert int(records["n_bow"][ids.index("empty-1")]) == 0
        # Every document, the empty ones included, can be ranked and re-ranked.
        (result,) = searcher.search(["subject 3"], k=32, nprobe=searcher.nlist, rerank_count=32)
        assert {h.doc_id for h in result.hits} >= {"empty-1", "empty-2"}
        assert all(np.isfinite(h.score) for h in result.hits)


def test_search_checks_arguments_before_loading_anything(sample_index: Path, tmp_path: Path) -> None:
    queries = Path(__file__).resolve().parents[1] / "espn" / "data" / "sample_queries.jsonl"
    # --k 0 is refused even before the index path is looked at.
    proc = run_espn("search", tmp_path / "no-index", "--queries", queries, "--out", tmp_path / "run", "--k", "0",
                    check=False)
    assert proc.returncode == 1 and "k must be an integer in [1, 10000], got 0" in proc.stderr
    proc = run_espn("search", sample_index, "--queries", queries, "--out", tmp_path / "missing" / "run", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"directory {tmp_path / 'missing'} does not exist" in proc.stderr
    assert "queries/s" not in proc.stdout  # refused before the search ran


def test_search_takes_reader_io_options(sample_index: Path, tmp_path: Path) -> None:
    queries = Path(__file__).resolve().parents[1] / "espn" / "data" / "sample_queries.jsonl"
    proc = run_espn("search", sample_index, "--queries", queries, "--out", tmp_path / "run", "--k", "10",
                    "--reader", "posix", "--io-engine", "threads", "--io-depth", "4", "--max-extent-bytes", "65536",
                    "--no-direct")
    assert "reader=posix" in proc.stdout
    proc = run_espn("search", sample_index, "--queries", queries, "--out", tmp_path / "run2", "--reader", "mmap",
                    "--io-depth", "4", check=False)
    assert proc.returncode == 1 and "posix reader only" in proc.stderr


def test_exhaustive_search_honours_rerank_count_zero(sample_index: Path, tmp_path: Path) -> None:
    queries = tmp_path / "q.tsv"
    queries.write_text("q1\tphotosynthesis in plants\n")
    run_espn("search", sample_index, "--queries", queries, "--out", tmp_path / "run", "--k", "5", "--exhaustive",
             "--rerank-count", "0")
    from espn import Searcher

    with Searcher.open(sample_index) as searcher:
        q = searcher.encoder.encode_queries(["photosynthesis in plants"])  # type: ignore[union-attr]
        (hits,) = searcher.search_exhaustive(q, k=5, rerank_count=0)
    assert all(h.bow_score is None for h in hits)  # CLS order only
    lines = [line.split() for line in (tmp_path / "run").read_text().splitlines()]
    assert [(line[2], float(line[4])) for line in lines] == [(h.doc_id, round(h.score, 6)) for h in hits]


def test_run_file_keeps_the_order_of_tied_scores(tmp_path: Path) -> None:
    """With w = 0 every score below the re-ranked head is 0: sorting by score must not reorder them."""
    from espn.evaluation import evaluate, write_run

    ranked = {"q": [("z", 0.9), ("b", 0.0), ("y", 0.0), ("a", 0.0)]}
    write_run(tmp_path / "run", ranked)
    rows = [line.split() for line in (tmp_path / "run").read_text().splitlines()]
    scores = [float(r[4]) for r in rows]
    assert [r[2] for r in rows] == ["z", "b", "y", "a"] and scores == sorted(scores, reverse=True)
    assert len(set(scores)) == 4
    # The relevant document at rank 2 stays at rank 2 for the evaluation too.
    from espn.evaluation import strictly_decreasing

    run = {"q": dict(strictly_decreasing(ranked["q"]))}
    assert evaluate(run, {"q": {"b": 1}})["RR@10"] == 0.5


def test_a_corpus_within_the_fit_sample_runs_through_the_model_once(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The fit's forward passes are the encode's: the same index, byte for byte, from half the model time."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(Path("espn/data/sample_corpus.jsonl").read_text().splitlines(True)[:40]))
    embedded: list[int] = []
    forward = hf.HFEncoder._forward
    monkeypatch.setattr(hf.HFEncoder, "_forward",
                        lambda self, tokens, graph=None: embedded.append(len(tokens["input_ids"])) or
                        forward(self, tokens, graph))
    build_index(BuildConfig(corpus=corpus, out=tmp_path / "once", batch_size=16))
    assert sum(embedded) == 40  # each document once: the fit's batches were reused
    embedded.clear()
    monkeypatch.setattr(hf, "FIT_REUSE_BYTES", 0)  # nothing may be kept: the encode runs the model again
    build_index(BuildConfig(corpus=corpus, out=tmp_path / "twice", batch_size=16))
    assert sum(embedded) == 80
    for name in CONTENT_FILES + ("encoder/projection.npy",):
        assert digest(tmp_path / "once" / name) == digest(tmp_path / "twice" / name), name
