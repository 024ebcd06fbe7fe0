"""Indexes from precomputed embeddings: both shard layouts, their validation, query embeddings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from espn.encoders.precomputed import PrecomputedEncoder, load_query_embeddings
from espn.errors import CorpusError, InvalidParameterError
from espn_indexing.chunks import finished_chunks, read_chunk
from espn_indexing.precomputed import ESPN_LAYOUT, OWN_LAYOUT, import_embeddings

D_CLS, D_BOW = 16, 8


def make_shards(sizes: list[int], seed: int = 0, dtype: type = np.float16) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per shard (cls [n, D_CLS], bow [sum(counts), D_BOW], counts [n]); some documents have no vectors."""
    rng = np.random.default_rng(seed)
    shards = []
    for n in sizes:
        counts = rng.integers(0, 6, size=n)
        counts[::4] = 0
        shards.append((rng.normal(size=(n, D_CLS)).astype(dtype), rng.normal(size=(int(counts.sum()), D_BOW)).astype(dtype),
                       counts.astype(np.int64)))
    return shards


def write_espn(directory: Path, shards: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Path:
    """ESPN tooling layout: CLS/N.npy, BOW/N.npy, BOW/N.json."""
    (directory / "CLS").mkdir(parents=True)
    (directory / "BOW").mkdir()
    for number, (cls, bow, counts) in enumerate(shards):
        np.save(directory / "CLS" / f"{number}.npy", cls)
        np.save(directory / "BOW" / f"{number}.npy", bow)
        (directory / "BOW" / f"{number}.json").write_text(json.dumps(counts.tolist()))
    return directory


def write_own(directory: Path, shards: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
              ids: list[list[str]] | None = None, **meta: object) -> Path:
    """espn-precomputed layout: embeddings.json, cls/ bow/ counts/ [ids/]."""
    for folder in ("cls", "bow", "counts") + (("ids",) if ids else ()):
        (directory / folder).mkdir(parents=True)
    (directory / "embeddings.json").write_text(json.dumps(
        {"format": "espn-precomputed", "version": 1, "d_cls": D_CLS, "d_bow": D_BOW, **meta}))
    for number, (cls, bow, counts) in enumerate(shards):
        np.save(directory / "cls" / f"{number}.npy", cls)
        np.save(directory / "bow" / f"{number}.npy", bow)
        np.save(directory / "counts" / f"{number}.npy", counts)
        if ids:
            (directory / "ids" / f"{number}.txt").write_text("".join(f"{i}\n" for i in ids[number]))
    return directory


def read_back(work: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], list[dict]]:
    chunks = [read_chunk(work, c) for c in finished_chunks(work)]
    docs = []
    for chunk in chunks:
        blob = chunk.docs_blob.tobytes()
        docs += [json.loads(blob[a:b]) for a, b in zip(chunk.docs_offsets[:-1], chunk.docs_offsets[1:])]
    return (np.concatenate([c.cls for c in chunks]), np.concatenate([c.bow for c in chunks]),
            np.concatenate([c.counts for c in chunks]), [i.decode() for c in chunks for i in c.ids], docs)


def concat(shards: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.concatenate(parts) for parts in zip(*shards))  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------
# both layouts
# ---------------------------------------------------------------------------------------
def test_espn_layout_streams_into_chunks_in_numeric_shard_order(tmp_path: Path) -> None:
    """12 shards (10 and 11 sort after 9, not after 1), chunk boundaries across shards."""
    shards = make_shards([5, 7, 0, 3, 1, 4, 2, 6, 3, 5, 2, 4])
    source = write_espn(tmp_path / "src", shards)
    totals = import_embeddings(source, tmp_path / "work", chunk_size=4)
    cls, bow, counts = concat(shards)
    assert totals == {**totals, "documents": 42, "vectors": len(bow), "chunks": 11, "shards": 12,
                      "d_cls": D_CLS, "d_bow": D_BOW, "layout": ESPN_LAYOUT, "bow_reduction": "sum",
                      "score_weight": None}
    got_cls, got_bow, got_counts, ids, docs = read_back(tmp_path / "work")
    np.testing.assert_array_equal(got_cls, cls)
    np.testing.assert_array_equal(got_bow, bow)
    np.testing.assert_array_equal(got_counts, counts)
    assert ids == [str(i) for i in range(42)]
    assert docs[0] == {"title": "", "text": ""}
    assert [len(read_chunk(tmp_path / "work", c)) for c in finished_chunks(tmp_path / "work")] == [4] * 10 + [2]


def test_own_layout_with_ids_fp32_and_metadata(tmp_path: Path) -> None:
    shards = make_shards([3, 4], seed=1, dtype=np.float32)
    ids = [["d-a", "d-b", "d-c"], ["d-d", "d-e", "d-f", "d-g"]]
    source = write_own(tmp_path / "src", shards, ids, bow_reduction="mean", score_weight=0.25)
    totals = import_embeddings(source, tmp_path / "work", chunk_size=5)
    assert (totals["layout"], totals["documents"], totals["chunks"]) == (OWN_LAYOUT, 7, 2)
    assert (totals["bow_reduction"], totals["score_weight"]) == ("mean", 0.25)
    cls, bow, counts = concat(shards)
    got_cls, got_bow, got_counts, got_ids, _ = read_back(tmp_path / "work")
    assert got_cls.dtype == np.float16
    np.testing.assert_array_equal(got_cls, cls.astype(np.float16))
    np.testing.assert_array_equal(got_bow, bow.astype(np.float16))
    np.testing.assert_array_equal(got_counts, counts)
    assert got_ids == [i for shard in ids for i in shard]
    encoder = PrecomputedEncoder.from_import(totals)
    assert (encoder.d_cls, encoder.d_bow, encoder.bow_reduction, encoder.learned_weight) == (D_CLS, D_BOW, "mean", 0.25)


def test_corpus_supplies_ids_and_text_and_must_match(tmp_path: Path) -> None:
    shards = make_shards([2, 3])
    source = write_espn(tmp_path / "src", shards)
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"_id": f"doc{i}", "title": f"T{i}", "text": f"text {i}"} for i in range(5)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    import_embeddings(source, tmp_path / "work", chunk_size=2, corpus=corpus)
    _, _, _, ids, docs = read_back(tmp_path / "work")
    assert ids == [f"doc{i}" for i in range(5)]
    assert docs[4] == {"title": "T4", "text": "text 4"}

    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    with pytest.raises(CorpusError, match=re.escape(f"{short}: 4 documents, but the embeddings hold 5")):
        import_embeddings(source, tmp_path / "work2", chunk_size=2, corpus=short)
    long = tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"_id": "x", "text": "y"}]))
    with pytest.raises(CorpusError, match="more documents than the 5"):
        import_embeddings(source, tmp_path / "work3", chunk_size=2, corpus=long)


def test_corpus_ids_must_agree_with_the_ids_files(tmp_path: Path) -> None:
    source = write_own(tmp_path / "src", make_shards([2, 2]), [["a", "b"], ["c", "d"]])
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("a\tone\nb\ttwo\nX\tthree\nd\tfour\n")
    with pytest.raises(CorpusError, match=re.escape(f"{corpus}:3: id 'X' but the embeddings' document 2 has id 'c'")):
        import_embeddings(source, tmp_path / "work", chunk_size=3, corpus=corpus)


# ---------------------------------------------------------------------------------------
# validation: every message names the file
# ---------------------------------------------------------------------------------------
def _break(source: Path, problem: str) -> str:
    """Damage an ESPN-layout source; returns the text the error must contain."""
    if problem == "gap":
        (source / "CLS" / "1.npy").unlink()
        return f"{source / 'CLS' / '1.npy'}: missing"
    if problem == "bow-missing":
        (source / "BOW" / "2.npy").unlink()
        return f"{source / 'BOW' / '2.npy'}: missing"
    if problem == "counts-sum":
        counts = json.loads((source / "BOW" / "1.json").read_text())
        counts[0] += 1
        (source / "BOW" / "1.json").write_text(json.dumps(counts))
        return f"{source / 'BOW' / '1.json'}: counts sum to"
    if problem == "counts-length":
        counts = json.loads((source / "BOW" / "0.json").read_text())
        (source / "BOW" / "0.json").write_text(json.dumps(counts[:-1]))
        return f"{source / 'BOW' / '0.json'}: 3 counts but 0.npy has 4 CLS rows"
    if problem == "counts-not-ints":
        (source / "BOW" / "0.json").write_text('[1, "2", 3, 0]')
        return f"{source / 'BOW' / '0.json'}: expected a JSON array of integers"
    if problem == "dims":
        rows = sum(json.loads((source / "BOW" / "2.json").read_text()))
        np.save(source / "BOW" / "2.npy", np.zeros((rows, 4), np.float16))
        return f"{source / 'BOW' / '2.npy'}: BOW vectors have 4 dimensions, shard 0 has {D_BOW}"
    if problem == "extra-shard":
        np.save(source / "CLS" / "3.npy", np.zeros((1, D_CLS), np.float16))
        return f"{source / 'BOW' / '3.npy'}: missing"
    if problem == "bad-name":
        np.save(source / "CLS" / "first.npy", np.zeros((1, D_CLS), np.float16))
        return f"{source / 'CLS' / 'first.npy'}: shard files must be named N.npy"
    if problem == "duplicate":
        np.save(source / "CLS" / "01.npy", np.zeros((1, D_CLS), np.float16))
        return "two files for shard 1"
    if problem == "not-2d":
        np.save(source / "CLS" / "0.npy", np.zeros(4 * D_CLS, np.float16))
        return f"{source / 'CLS' / '0.npy'}: CLS must be a 2-D float array"
    if problem == "nan":
        cls = np.load(source / "CLS" / "1.npy")
        cls[2, 3] = np.nan
        np.save(source / "CLS" / "1.npy", cls)
        return f"{source / 'CLS' / '1.npy'}: row 2 holds NaN"
    if problem == "fp16-overflow":
        bow = np.load(source / "BOW" / "0.npy").astype(np.float32)
        bow[1, 0] = 1e6
        np.save(source / "BOW" / "0.npy", bow)
        return f"{source / 'BOW' / '0.npy'}: row 1 holds NaN, infinity or a value beyond float16"
    if problem == "empty":
        for path in list((source / "CLS").iterdir()):
            path.unlink()
        return f"{source / 'CLS'}: no shards"
    raise AssertionError(problem)


@pytest.mark.parametrize("problem", ["gap", "bow-missing", "counts-sum", "counts-length", "counts-not-ints", "dims",
                                     "extra-shard", "bad-name", "duplicate", "not-2d", "nan", "fp16-overflow", "empty"])
def test_broken_sources_fail_naming_the_file(tmp_path: Path, problem: str) -> None:
    shards = make_shards([4, 5, 3], seed=3)
    source = write_espn(tmp_path / "src", shards)
    message = _break(source, problem)
    with pytest.raises(CorpusError) as error:
        import_embeddings(source, tmp_path / "work", chunk_size=100)
    assert message in str(error.value)
    if problem not in ("nan", "fp16-overflow"):  # caught by the scan, before any chunk is written
        assert list(finished_chunks(tmp_path / "work")) == []


def test_own_layout_validation(tmp_path: Path) -> None:
    shards = make_shards([2, 3])
    source = write_own(tmp_path / "a", shards, [["x", "y"], ["z", "w"]])
    with pytest.raises(CorpusError, match=re.escape(f"{source / 'ids' / '1.txt'}: 2 ids but 1.npy has 3 CLS rows")):
        import_embeddings(source, tmp_path / "wa", chunk_size=10)
    source = write_own(tmp_path / "b", shards)
    meta = json.loads((source / "embeddings.json").read_text())
    (source / "embeddings.json").write_text(json.dumps({**meta, "d_cls": D_CLS + 1}))
    with pytest.raises(CorpusError, match=re.escape(f"CLS vectors have {D_CLS} dimensions, embeddings.json declares {D_CLS + 1}")):
        import_embeddings(source, tmp_path / "wb", chunk_size=10)
    (source / "embeddings.json").write_text(json.dumps({**meta, "version": 2}))
    with pytest.raises(CorpusError, match="unsupported version 2"):
        import_embeddings(source, tmp_path / "wb", chunk_size=10)
    (source / "embeddings.json").write_text(json.dumps({**meta, "score_weight": 3}))
    with pytest.raises(CorpusError, match="score_weight must be a number in"):
        import_embeddings(source, tmp_path / "wb", chunk_size=10)
    with pytest.raises(CorpusError, match="no precomputed embeddings found"):
        import_embeddings(tmp_path / "a" / "cls", tmp_path / "wc", chunk_size=10)
    with pytest.raises(InvalidParameterError, match="chunk_size"):
        import_embeddings(tmp_path / "a", tmp_path / "wd", chunk_size=0)


# ---------------------------------------------------------------------------------------
# the encoder of such an index, and queries encoded elsewhere
# ---------------------------------------------------------------------------------------
def test_precomputed_encoder_refuses_text_and_round_trips(tmp_path: Path) -> None:
    encoder = PrecomputedEncoder(d_cls=128, d_bow=32, bow_reduction="sum", learned_weight=0.6)
    for call in (lambda: encoder.encode_queries(["q"]), lambda: encoder.tokenize(["d"], is_query=False)):
        with pytest.raises(InvalidParameterError, match="built from precomputed embeddings.*--query-embeddings"):
            call()
    encoder.save(tmp_path / "enc")
    config = json.loads(json.dumps(encoder.config()))
    loaded = PrecomputedEncoder.load(tmp_path / "enc", config)
    assert (loaded.kind, loaded.d_cls, loaded.d_bow, loaded.bow_reduction, loaded.learned_weight) == (
        "precomputed", 128, 32, "sum", 0.6)
    assert json.loads((tmp_path / "enc" / "precomputed.json").read_text())["d_bow"] == 32
    with pytest.raises(InvalidParameterError, match="bow_reduction"):
        PrecomputedEncoder(d_cls=4, d_bow=4, bow_reduction="max")
    with pytest.raises(InvalidParameterError, match="d_bow must be a positive integer"):
        PrecomputedEncoder(d_cls=4, d_bow=0)


def test_load_query_embeddings_pads_and_masks(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    counts = np.array([2, 0, 3])
    bow = rng.normal(size=(5, D_BOW)).astype(np.float32)
    cls = rng.normal(size=(3, D_CLS)).astype(np.float16)
    path = tmp_path / "q.npz"
    np.savez(path, ids=np.array(["q1", "q2", "q3"]), cls=cls, bow=bow, counts=counts)
    ids, queries = load_query_embeddings(path, d_cls=D_CLS, d_bow=D_BOW)
    assert ids == ["q1", "q2", "q3"]
    assert queries.cls.dtype == np.float32 and queries.bow.shape == (3, 3, D_BOW)
    assert queries.mask.tolist() == [[True, True, False], [False, False, False], [True, True, True]]
    np.testing.assert_array_equal(queries.bow[0, :2], bow[:2])
    np.testing.assert_array_equal(queries.bow[2], bow[2:])
    assert not queries.bow[0, 2].any() and not queries.bow[1].any()
    np.testing.assert_array_equal(queries.cls, cls.astype(np.float32))

    np.savez(tmp_path / "noids.npz", cls=cls, bow=bow, counts=counts)
    assert load_query_embeddings(tmp_path / "noids.npz")[0] == ["0", "1", "2"]


@pytest.mark.parametrize("arrays, message", [
    ({"cls": np.zeros((2, D_CLS)), "bow": np.zeros((3, D_BOW))}, "missing array(s) counts"),
    ({"cls": np.zeros((2, D_CLS)), "bow": np.zeros((3, D_BOW)), "counts": np.array([1, 1])}, "counts sum to 2 but bow has 3 rows"),
    ({"cls": np.zeros((2, D_CLS)), "bow": np.zeros((2, D_BOW)), "counts": np.array([2])}, "2 CLS rows but 1 counts"),
    ({"cls": np.zeros((2, D_CLS)), "bow": np.zeros((2, D_BOW)), "counts": np.array([3, -1])}, "counts must be >= 0"),
    ({"cls": np.zeros((1, D_CLS)), "bow": np.full((1, D_BOW), np.nan), "counts": np.array([1])}, "NaN or infinity"),
    ({"cls": np.zeros((1, D_CLS)), "bow": np.zeros((1, D_BOW)), "counts": np.array([1]), "ids": np.array([" "])}, "empty query id"),
    ({"cls": np.zeros((1, D_CLS + 1)), "bow": np.zeros((1, D_BOW)), "counts": np.array([1])}, f"{D_CLS + 1} dims, the index {D_CLS}"),
])
def test_bad_query_embeddings_fail_clearly(tmp_path: Path, arrays: dict, message: str) -> None:
    path = tmp_path / "q.npz"
    np.savez(path, **arrays)
    with pytest.raises((CorpusError, InvalidParameterError), match=re.escape(message)):
        load_query_embeddings(path, d_cls=D_CLS, d_bow=D_BOW)
    with pytest.raises(CorpusError, match="not a readable .npz"):
        (tmp_path / "junk.npz").write_bytes(b"not a zip")
        load_query_embeddings(tmp_path / "junk.npz")


# ---------------------------------------------------------------------------------------
# end to end through the CLI: espn index --embeddings DIR, espn search --query-embeddings
# ---------------------------------------------------------------------------------------
ESPN = Path(sys.executable).with_name("espn")


def run_espn(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ESPN), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def brute_force(q_cls: np.ndarray, q_bow: list[np.ndarray], cls: np.ndarray, bow: np.ndarray, counts: np.ndarray,
                w: float, reduction: str) -> np.ndarray:
    """[Q, N] w·cls + (1−w)·MaxSim, one document at a time; no vectors -> no BOW score."""
    ends = np.cumsum(counts)
    scores = np.zeros((len(q_cls), len(cls)))
    for i, query in enumerate(q_bow):
        for n in range(len(cls)):
            doc = bow[ends[n] - counts[n] : ends[n]].astype(np.float64)
            maxsim = (query.astype(np.float64) @ doc.T).max(1).sum() if len(doc) and len(query) else 0.0
            if reduction == "mean":
                maxsim /= max(1, len(query))
            scores[i, n] = w * float(q_cls[i].astype(np.float64) @ cls[n]) + (1 - w) * maxsim
    return scores


@pytest.mark.parametrize("layout", [ESPN_LAYOUT, OWN_LAYOUT])
def test_index_and_search_from_precomputed_shards(tmp_path: Path, layout: str) -> None:
    shards = make_shards([9, 7, 11], seed=7)
    cls, bow, counts = concat(shards)
    n = len(cls)
    if layout == ESPN_LAYOUT:
        source = write_espn(tmp_path / "src", shards)
        doc_ids = [str(i) for i in range(n)]
        w_expected, reduction = None, "sum"  # ColBERTer's raw sum; w: the index default
    else:
        doc_ids = [f"doc-{i}" for i in range(n)]
        split = np.cumsum([len(s[0]) for s in shards])[:-1]
        source = write_own(tmp_path / "src", shards, [list(p) for p in np.split(np.array(doc_ids), split)],
                           bow_reduction="mean", score_weight=0.25)
        w_expected, reduction = 0.25, "mean"
    index = tmp_path / "index"
    built = run_espn("index", "--embeddings", str(source), "--out", str(index), "--nlist", "1", "--chunk-size", "8")
    assert built.returncode == 0, built.stderr
    manifest = json.loads((index / "manifest.json").read_text())
    assert manifest["counts"] == {**manifest["counts"], "documents": n, "bow_vectors": int(counts.sum())}
    assert manifest["encoder"]["kind"] == "precomputed"
    assert manifest["score"]["bow_reduction"] == reduction, "the build must use import_embeddings' bow_reduction"
    w = manifest["score"]["w"]
    if w_expected is not None:
        assert w == pytest.approx(w_expected), "the build must use import_embeddings' score_weight"

    # Queries made elsewhere: perturbed copies of three documents' vectors.
    rng = np.random.default_rng(11)
    picks = [0, 12, 26]
    ends = np.cumsum(counts)
    q_bow = [bow[ends[p] - counts[p] : ends[p]].astype(np.float32) + 0.1 * rng.normal(size=(counts[p], D_BOW)).astype(np.float32)
             if counts[p] else rng.normal(size=(2, D_BOW)).astype(np.float32) for p in picks]
    q_cls = (cls[picks].astype(np.float32) + 0.1 * rng.normal(size=(3, D_CLS))).astype(np.float32)
    queries = tmp_path / "queries.npz"
    np.savez(queries, ids=np.array(["qa", "qb", "qc"]), cls=q_cls, bow=np.concatenate(q_bow),
             counts=np.array([len(b) for b in q_bow]))
    run_file = tmp_path / "run.txt"
    searched = run_espn("search", str(index), "--query-embeddings", str(queries), "--out", str(run_file),
                        "--k", str(n), "--rerank-count", str(n), "--nprobe", "1")
    assert searched.returncode == 0, searched.stderr
    expected = brute_force(q_cls, q_bow, cls.astype(np.float32), bow.astype(np.float32), counts, w, reduction)
    run: dict[str, dict[str, float]] = {}
    for line in run_file.read_text().splitlines():
        qid, _, doc, _, score, _ = line.split()
        run.setdefault(qid, {})[doc] = float(score)
    assert sorted(run) == ["qa", "qb", "qc"]
    for row, qid in enumerate(["qa", "qb", "qc"]):
        assert sorted(run[qid]) == sorted(doc_ids)
        for doc, score in run[qid].items():
            assert score == pytest.approx(expected[row, doc_ids.index(doc)], rel=1e-4, abs=1e-4), (qid, doc)

    # Text queries cannot be encoded: the error says how to search this index.
    text_queries = tmp_path / "q.tsv"
    text_queries.write_text("q1\tsome text\n")
    refused = run_espn("search", str(index), "--queries", str(text_queries), "--out", str(tmp_path / "r2.txt"))
    assert refused.returncode == 1 and "--query-embeddings" in refused.stderr
