"""The ANN split over cluster segments against FAISS's own plain search."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from espn.ann import IVFConfig, build_ivf, coarse_assign, default_nlist, merge_topk, search_preassigned, segment_bounds


@pytest.fixture(scope="module")
def ivf() -> tuple[faiss.IndexIVF, np.ndarray]:
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(20, 32)).astype(np.float32)
    x = centers[rng.integers(0, 20, 4000)] + 0.3 * rng.normal(size=(4000, 32)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    index = build_ivf(IVFConfig(nlist=32), 32, x)
    index.add(x)
    return index, x  # index_factory gives the IndexIVFFlat itself


@pytest.mark.parametrize("step", [0.1, 0.3, 0.5, 1.0])
def test_segments_merge_to_plain_search(ivf, step: float) -> None:
    index, x = ivf
    xq = x[:25] + 0.05
    nprobe, k = 12, 50
    index.nprobe = 3  # the split search must not depend on the shared attribute
    scores, lists = coarse_assign(index, xq, nprobe)
    top = (np.zeros((25, 0), np.float32), np.zeros((25, 0), np.int64))
    for a, b in segment_bounds(nprobe, step):
        top = merge_topk(top, search_preassigned(index, xq, k, lists[:, a:b], scores[:, a:b]), k)
    index.nprobe = nprobe
    d_ref, i_ref = index.search(xq, k)
    np.testing.assert_allclose(top[0], d_ref, rtol=1e-6)
    np.testing.assert_array_equal(top[1], i_ref)


def test_segment_bounds_cover_every_cluster_once() -> None:
    for nprobe in (1, 7, 64):
        for step in (0.05, 0.3, 1.0):
            bounds = segment_bounds(nprobe, step)
            assert bounds[0][0] == 0 and bounds[-1][1] == nprobe
            assert all(b1 == a2 for (_, b1), (a2, _) in zip(bounds, bounds[1:]))


def test_default_nlist_has_enough_training_points() -> None:
    assert default_nlist(10) == 1
    for n in (100, 5183, 1_000_000, 8_800_000):
        nlist = default_nlist(n)
        assert nlist & (nlist - 1) == 0 and n / nlist >= 39 and nlist <= 4 * n ** 0.5
