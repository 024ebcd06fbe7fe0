"""MaxSim over (query, document) pairs against a per-pair Python loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from espn.maxsim import cls_pairs, maxsim, maxsim_pairs, segment_max


def reference(q, q_mask, vectors, offsets, pair_query, pair_doc) -> list[float]:
    out = []
    for i, j in zip(pair_query.tolist(), pair_doc.tolist()):
        doc = vectors[offsets[j]: offsets[j + 1]].float()
        total = 0.0
        for t in range(q.shape[1]):
            if q_mask[i, t] and len(doc):
                total += float((doc @ q[i, t]).max())
        out.append(total)
    return out


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_pairs_match_the_loop(seed: int, reduction: str) -> None:
    rng = np.random.default_rng(seed)
    batch, lq, dim, n = (int(x) for x in (rng.integers(1, 5), rng.integers(1, 7), rng.integers(1, 9), rng.integers(1, 9)))
    n_bow = rng.integers(0, 6, n)  # documents without vectors included
    offsets = np.concatenate([[0], np.cumsum(n_bow)])
    vectors = torch.from_numpy(rng.standard_normal((int(offsets[-1]), dim)).astype(np.float16))
    q = torch.from_numpy(rng.standard_normal((batch, lq, dim)).astype(np.float32))
    q_mask = torch.from_numpy(rng.random((batch, lq)) < 0.8)
    pairs = int(rng.integers(0, 14))
    pair_query, pair_doc = rng.integers(0, batch, pairs), rng.integers(0, n, pairs)
    # A tiny chunk budget forces several chunks: chunking must not change a score.
    got = maxsim_pairs(q, q_mask, vectors, offsets, pair_query, pair_doc, reduction,
                       max_chunk_elements=int(rng.integers(1, 64)))
    want = torch.tensor(reference(q, q_mask, vectors, offsets, pair_query, pair_doc), dtype=torch.float32)
    if reduction == "mean":
        want /= q_mask.sum(1).clamp(min=1).float()[torch.from_numpy(pair_query)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_padding_values_never_score() -> None:
    q = torch.ones(1, 2, 4)
    vectors = torch.zeros(3, 4)
    vectors[2] = 100.0  # the next document's vector: must not leak into document 0
    got = maxsim_pairs(q, torch.ones(1, 2, dtype=torch.bool), vectors, np.array([0, 2, 3, 3]),
                       np.array([0, 0, 0]), np.array([0, 1, 2]))
    assert got.tolist() == [0.0, 800.0, 0.0]  # document 2 has no vectors: 0, not -inf


def test_pairs_agree_with_the_padded_reference() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(7, 16, generator=g)
    q_mask = torch.tensor([True] * 5 + [False] * 2)
    lengths = np.array([11, 1, 0, 5, 7, 3, 11, 2, 4])
    d = torch.randn(9, 11, 16, generator=g).half()
    d_mask = torch.arange(11)[None, :] < torch.from_numpy(lengths)[:, None]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    pairs = maxsim_pairs(q[None], q_mask[None], d[d_mask], offsets, np.zeros(9, np.int64), np.arange(9))
    torch.testing.assert_close(pairs, maxsim(q, q_mask, d, d_mask), rtol=1e-5, atol=1e-5)


def test_cls_pairs_are_dot_products() -> None:
    q = torch.randn(3, 8)
    d = torch.randn(5, 8).half()
    got = cls_pairs(q, d, np.array([0, 2, 2]), np.array([4, 0, 4]))
    want = torch.stack([d[4].float() @ q[0], d[0].float() @ q[2], d[4].float() @ q[2]])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("seed", range(5))
def test_the_cuda_segment_max_agrees_with_the_cpu_one(seed: int) -> None:
    """torch.segment_reduce is what runs on CUDA; here on the CPU it stands in for a GPU."""
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((50, 7)).astype(np.float32))
    starts = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 50), 9, replace=False))])
    torch.testing.assert_close(segment_max(x, starts, use_torch=True), segment_max(x, starts, use_torch=False))


# -- scoring compact records in place (espn.maxsim.score_records) ---------------------------

def _layout(dtype: str, d_cls: int, d_bow: int, rng):
    """A layout of `dtype`; residual ones carry a codec trained on unit vectors like the documents'."""
    from espn.first_stage.centroids import train_centroids
    from espn.store import StoreLayout
    from espn.store.residual import residual_bits, train_codec

    layout = StoreLayout(d_cls=d_cls, d_bow=d_bow, block_size=4096, dtype=dtype)
    if not residual_bits(dtype):
        return layout
    sample = rng.standard_normal((2000, d_bow)).astype(np.float32)
    return layout.with_codec(train_codec(train_centroids(sample, 16), sample, residual_bits(dtype)))


def _write_records(path, layout, rng, n_docs: int):
    """Random documents (0 to 70 BOW vectors, some with none) through the real RecordWriter."""
    from espn.store import RECORD_DTYPE, RecordWriter

    counts = rng.integers(0, 70, n_docs)
    counts[::7] = 0
    cls = rng.standard_normal((n_docs, layout.d_cls)).astype(np.float32)
    bow = rng.standard_normal((int(counts.sum()), layout.d_bow)).astype(np.float32)
    with RecordWriter(path, layout) as writer:
        rows = writer.append(cls, bow, counts)
        writer.close()
    records = np.zeros(n_docs, dtype=RECORD_DTYPE)
    records[:] = rows
    return records


def _stored(reader, docs):
    """What the records hold, decoded in float64 (int8: codes x scale exactly)."""
    from espn.store import split_records

    with reader.submit(np.asarray(docs)).records() as batch:
        flat = torch.from_numpy(batch.buffers[0]) if isinstance(batch.buffers[0], np.ndarray) else batch.buffers[0]
        cls, cls_scales, bow, bow_scales = split_records(flat, batch.starts, batch.n_bow, reader.layout)
        cls, bow = cls.double(), bow.double()
        if cls_scales is not None:
            cls, bow = cls * cls_scales.double()[:, None], bow * bow_scales.double()[:, None]
        offsets = np.concatenate([[0], np.cumsum(batch.n_bow)])
        return batch.docs.copy(), cls.numpy(), bow.numpy(), offsets


@pytest.mark.parametrize("dtype", ["int8", "float16", "residual2", "residual4"])
@pytest.mark.parametrize("reader_name", ["memory", "posix"])
def test_score_records_native_and_torch_agree_with_the_stored_vectors(tmp_path, dtype: str, reader_name: str) -> None:
    """The C kernel, the torch fallback and a float64 decode of the records give one score per
    pair, for queries of 1, 17 and 40 vectors (one, two and three column blocks), masked
    vectors, documents without vectors, duplicate pairs, and records in two read buffers."""
    from espn.maxsim import QueryScoring, score_records
    from espn.maxsim_native import load_kernel
    from espn.store import StoreLayout, open_reader

    assert load_kernel() is not None, "the native kernel was not built by pip install (gcc is required here)"
    rng = np.random.default_rng(3)
    layout = _layout(dtype, 48, 24, rng)
    records = _write_records(tmp_path / "embeddings.bin", layout, rng, 60)
    q_bow = rng.standard_normal((3, 40, layout.d_bow)).astype(np.float32)
    q_mask = np.zeros((3, 40), dtype=bool)
    q_mask[0, :1], q_mask[1, :17], q_mask[2, :40] = True, True, True
    q_mask[2, 5] = False
    queries = QueryScoring.from_arrays(rng.standard_normal((3, layout.d_cls)).astype(np.float32), q_bow, q_mask)
    with open_reader(reader_name, tmp_path / "embeddings.bin", records, layout) as reader:
        pending = reader.submit(np.arange(0, 40))
        pending.submit(np.arange(30, 60))  # a second buffer, overlapping the first
        with pending.records(select=np.arange(60)) as batch:
            assert len(batch.buffers) == 2 and sorted(batch.docs.tolist()) == list(range(60))
            pair_query = rng.integers(0, 3, 300)
            pair_doc = rng.integers(0, 60, 300)
            rows = batch.rows_of(pair_doc)
            for reduction in ("sum", "mean"):
                native = score_records(queries, batch, layout, pair_query, rows, reduction, native=True)
                fallback = score_records(queries, batch, layout, pair_query, rows, reduction, native=False)
                np.testing.assert_allclose(native, fallback, rtol=1e-5, atol=1e-5)
        docs, cls, bow, offsets = _stored(reader, np.arange(60))
    assert docs.tolist() == list(range(60))
    for p in range(0, 300, 7):
        q, d = pair_query[p], pair_doc[p]
        vectors = bow[offsets[d]: offsets[d + 1]]
        sims = vectors @ q_bow[q][q_mask[q]].astype(np.float64).T
        expected = sims.max(axis=0).sum() / q_mask[q].sum() if len(vectors) else 0.0
        assert native[1, p] == pytest.approx(expected, abs=2e-5)
        assert native[0, p] == pytest.approx(cls[d] @ queries.cls[q].double().numpy(), abs=2e-5)


@pytest.mark.parametrize("dtype", ["int8", "float16", "residual2", "residual4"])
def test_the_kernel_folds_only_real_document_vectors(tmp_path, dtype: str) -> None:
    """Every similarity negative, documents of 1 to 13 vectors (every remainder of the kernel's
    6-row tile), queries of 16 and 48 columns: a padding row (similarity 0) folded into the
    maximum would show as a score above the true one."""
    from espn.maxsim import QueryScoring, score_records
    from espn.store import RECORD_DTYPE, RecordWriter, StoreLayout, open_reader

    rng = np.random.default_rng(5)
    counts = np.arange(1, 14)
    bow = -np.abs(rng.standard_normal((int(counts.sum()), 20))).astype(np.float32)
    layout = StoreLayout(d_cls=8, d_bow=20, block_size=4096, dtype=dtype)
    if layout.bits:  # a codec fitted to these all-negative vectors (their decode stays negative)
        from espn.first_stage.centroids import train_centroids
        from espn.store.residual import train_codec
        layout = layout.with_codec(train_codec(train_centroids(bow, 4), bow, layout.bits))
    with RecordWriter(tmp_path / "embeddings.bin", layout) as writer:
        rows = writer.append(rng.standard_normal((len(counts), layout.d_cls)).astype(np.float32), bow, counts)
        writer.close()
    records = np.zeros(len(counts), dtype=RECORD_DTYPE)
    records[:] = rows
    q_bow = np.abs(rng.standard_normal((2, 40, layout.d_bow))).astype(np.float32)
    q_mask = np.zeros((2, 40), dtype=bool)
    q_mask[0, :9], q_mask[1, :40] = True, True
    queries = QueryScoring.from_arrays(rng.standard_normal((2, layout.d_cls)).astype(np.float32), q_bow, q_mask)
    pair_query = np.repeat([0, 1], len(counts))
    with open_reader("memory", tmp_path / "embeddings.bin", records, layout) as reader:
        with reader.submit(np.arange(len(counts))).records() as batch:
            scores = score_records(queries, batch, layout, pair_query, batch.rows_of(np.tile(np.arange(len(counts)),
                                                                                           2)), native=True)
        _, _, stored, offsets = _stored(reader, np.arange(len(counts)))
    for p, (q, d) in enumerate(zip(pair_query, np.tile(np.arange(len(counts)), 2))):
        sims = stored[offsets[d]: offsets[d + 1]] @ q_bow[q][q_mask[q]].astype(np.float64).T
        assert sims.max() < 0
        assert scores[1, p] == pytest.approx(sims.max(axis=0).sum(), rel=1e-5)


def test_record_batches_give_their_buffers_back(tmp_path) -> None:
    from espn.store import StoreLayout, open_reader

    rng = np.random.default_rng(0)
    layout = StoreLayout(d_cls=16, d_bow=8, block_size=4096, dtype="int8")
    records = _write_records(tmp_path / "embeddings.bin", layout, rng, 40)
    with open_reader("posix", tmp_path / "embeddings.bin", records, layout) as reader:
        pool = reader.buffer_pool  # the process's: other tests' readers may have left free buffers in it
        in_use, free = pool.stats()["in_use"], pool.stats()["free"]
        with reader.submit(np.arange(40)).records() as batch:
            assert pool.stats()["in_use"] == in_use + 1 and len(batch.addresses()) == 40
        assert pool.stats()["in_use"] == in_use and batch.buffers == []  # back, and the batch forgets it
        assert pool.stats()["free"] >= max(1, free)
        pending = reader.submit(np.arange(10))
        assert pool.stats()["in_use"] == in_use + 1
        with pytest.raises(ValueError, match="never submitted"):
            pending.records(select=np.array([11]))
        assert pool.stats()["in_use"] == in_use  # the failed hand-over released its buffer too


def test_searcher_ranks_alike_with_and_without_the_kernel(sample_index, monkeypatch) -> None:
    from espn import Searcher
    from espn import maxsim_native

    queries = ["ocean tides and the moon", "how do vaccines train the immune system"]
    with Searcher.open(sample_index, reader="posix") as searcher:
        native = searcher.search(queries, k=20)
        monkeypatch.setattr(maxsim_native, "load_kernel", lambda: None)
        fallback = searcher.search(queries, k=20)
    for a, b in zip(native, fallback):
        assert [h.doc_id for h in a.hits] == [h.doc_id for h in b.hits]
        np.testing.assert_allclose([h.score for h in a.hits], [h.score for h in b.hits], atol=1e-5)


@pytest.mark.parametrize("dtype", ["int8", "residual4"])
def test_pairs_scored_on_several_threads_are_one_threads_scores(tmp_path, dtype: str) -> None:
    """The kernel's pairs cut into ranges scored at once on pool threads give exactly one call's
    scores, and a damaged record in the last range is refused as it is in one call."""
    from espn.errors import IndexCorruptError
    from espn.maxsim import QueryScoring
    from espn.maxsim_native import MIN_PAIRS_PER_THREAD, load_kernel, score_pairs_native
    from espn.store import open_reader

    kernel = load_kernel()
    assert kernel is not None, "the native kernel was not built by pip install (gcc is required here)"
    rng = np.random.default_rng(9)
    layout = _layout(dtype, 32, 24, rng)
    records = _write_records(tmp_path / "embeddings.bin", layout, rng, 60)
    queries = QueryScoring.from_arrays(rng.standard_normal((2, layout.d_cls)).astype(np.float32),
                                       rng.standard_normal((2, 20, layout.d_bow)).astype(np.float32),
                                       np.ones((2, 20), dtype=bool))
    bow_t, valid = queries.columns()
    n_pairs = 4 * MIN_PAIRS_PER_THREAD + 3
    pair_query, pair_doc = rng.integers(0, 2, n_pairs), np.sort(rng.integers(0, 59, n_pairs))
    pair_doc[-1] = 59  # the last range's own document
    with open_reader("memory", tmp_path / "embeddings.bin", records, layout) as reader:
        with reader.submit(np.arange(60)).records() as batch:
            buffer = np.array(batch.buffers[0], dtype=np.uint8)  # a copy this test may damage
            addresses = buffer.__array_interface__["data"][0] + batch.starts.astype(np.int64)
            rows = batch.rows_of(pair_doc)
            n_bow, last = batch.n_bow.copy(), int(batch.rows_of(np.array([59]))[0])
    args = (kernel, addresses, n_bow, layout.d_cls, layout.d_bow, layout.dtype, queries.cls.numpy(), bow_t, valid,
            pair_query, rows, layout.codec)
    one = score_pairs_native(*args, threads=1)
    for threads in (2, 3, 64):
        many = score_pairs_native(*args, threads=threads)
        np.testing.assert_array_equal(many[0], one[0])
        np.testing.assert_array_equal(many[1], one[1])
    if layout.codec is not None:
        assert n_bow[last] > 0
        at = int(batch.starts[last]) + 2 * layout.d_cls  # the record's first centroid id (int32)
        buffer[at : at + 4] = np.frombuffer(np.int32(len(layout.codec.centroids) + 5).tobytes(), dtype=np.uint8)
        for threads in (1, 3):
            with pytest.raises(IndexCorruptError, match="outside the codec"):
                score_pairs_native(*args, threads=threads)


def test_the_library_asks_openmp_for_passive_waits_unless_told_otherwise() -> None:
    """Idle OpenMP threads that spin (torch's, FAISS's) starve the kernel's own threads on a small
    machine: `espn.Searcher` sets OMP_WAIT_POLICY=PASSIVE before it loads torch, as the CLI does,
    and leaves a value the user set."""
    import os
    import subprocess
    import sys

    code = "import os, espn; espn.Searcher; print(os.environ['OMP_WAIT_POLICY'])"
    for given, expected in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if given is not None:
            env["OMP_WAIT_POLICY"] = given
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == expected, done.stderr[-2000:]
