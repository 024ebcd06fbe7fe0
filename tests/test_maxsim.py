"""MaxSim against a per-pair Python loop."""

from __future__ import annotations

import torch

from espn.maxsim import cls_scores, maxsim


def reference(q, q_mask, d, d_mask) -> list[float]:
    out = []
    for c in range(d.shape[0]):
        total = 0.0
        for i in range(q.shape[0]):
            if not q_mask[i]:
                continue
            sims = [float(q[i] @ d[c, j]) for j in range(d.shape[1]) if d_mask[c, j]]
            total += max(sims) if sims else 0.0
        out.append(total)
    return out


def test_masked_maxsim_matches_loop() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(7, 16, generator=g)
    q_mask = torch.tensor([True] * 5 + [False] * 2)
    d = torch.randn(9, 11, 16, generator=g).half()
    lengths = torch.tensor([11, 1, 0, 5, 7, 3, 11, 2, 4])
    d_mask = torch.arange(11)[None, :] < lengths[:, None]
    got = maxsim(q, q_mask, d, d_mask)
    want = reference(q, q_mask, d.float(), d_mask)
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-5)
    assert got[2] == 0.0  # a document without vectors scores 0, not -inf
    mean = maxsim(q, q_mask, d, d_mask, reduction="mean")
    torch.testing.assert_close(mean, got / 5)


def test_padding_values_never_score() -> None:
    q = torch.ones(2, 4)
    d = torch.zeros(1, 3, 4)
    d[0, 2] = 100.0  # a huge value in a padded slot
    assert maxsim(q, torch.tensor([True, True]), d, torch.tensor([[True, True, False]])).item() == 0.0


def test_cls_scores_are_dot_products() -> None:
    q = torch.randn(8)
    d = torch.randn(5, 8).half()
    torch.testing.assert_close(cls_scores(q, d), d.float() @ q)
