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
