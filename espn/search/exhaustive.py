"""Brute-force references: every (live) document scored, what the pipeline and the first
stages are measured against. Same score `w·cls + (1−w)·bow` and ranking as every search."""

from __future__ import annotations

import numpy as np
import torch

from ..encoders import QueryEmbeddings
from ..maxsim import QueryScoring
from ..results import Hit
from .context import SearchContext
from .scoring import rank_hits, score_pairs

__all__ = ["score_documents", "search_maxsim_exhaustive", "search_exhaustive"]


def score_documents(context: SearchContext, queries: QueryEmbeddings, doc_numbers: np.ndarray) -> np.ndarray:
    """[2, B, n] float32: exact CLS and MaxSim of every query against documents `doc_numbers` [n]."""
    numbers = np.asarray(doc_numbers, dtype=np.int64)
    n_docs, batch = context.num_documents, len(queries)
    if len(numbers) == 0:
        return np.zeros((2, batch, 0), dtype=np.float32)
    tensors = QueryScoring.from_arrays(np.ascontiguousarray(queries.cls, dtype=np.float32), queries.bow, queries.mask)
    keys = (np.arange(batch, dtype=np.int64)[:, None] * n_docs + numbers).ravel()
    with context.reader.submit(np.unique(numbers)).records() as records:
        return score_pairs(context, tensors, records, keys, n_docs).reshape(2, batch, len(numbers))


def search_maxsim_exhaustive(context: SearchContext, queries: QueryEmbeddings, k: int,
                             block: int = 4096) -> list[list[Hit]]:
    """Brute-force MaxSim reference: every live document read and scored, the top k kept
    (score `w·cls + (1−w)·bow` as every search's). What a first stage is measured against."""
    batch, weight = len(queries), context.weight
    best = [(np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32)) for _ in range(batch)]
    for start in range(0, context.num_documents, block):
        numbers = np.arange(start, min(start + block, context.num_documents), dtype=np.int64)
        if context.live is not None:
            numbers = numbers[context.live[numbers]]
        if len(numbers) == 0:
            continue
        scored = score_documents(context, queries, numbers)
        for i in range(batch):
            docs = np.concatenate([best[i][0], numbers])
            cls, bow = np.concatenate([best[i][1], scored[0, i]]), np.concatenate([best[i][2], scored[1, i]])
            combined = weight * cls + (1 - weight) * bow
            keep = np.argsort(-combined, kind="stable")[:k]
            best[i] = (docs[keep], cls[keep], bow[keep])
    return [rank_hits(context, np.zeros(len(d), np.float32), d, d, c, b, k) for d, c, b in best]


def search_exhaustive(context: SearchContext, queries: QueryEmbeddings, k: int, rerank_count: int = 1000,
                      block: int = 65536, allowed: np.ndarray | None = None) -> list[list[Hit]]:
    """Brute-force reference: exact CLS over every document (or the `allowed` [N] bool ones),
    MaxSim over the top `rerank_count`. Deleted and replaced documents are never allowed."""
    if context.live is not None:
        allowed = context.live if allowed is None else allowed & context.live
    best_scores, best_docs = _exact_cls_top(context, queries, max(k, rerank_count), block, allowed)
    tensors = QueryScoring.from_arrays(queries.cls, queries.bow, queries.mask)
    n_docs = context.num_documents
    head = best_docs[:, : min(rerank_count, best_docs.shape[1])].numpy()
    if head.shape[1] == 0:
        return [[] for _ in range(len(queries))]
    keys = (np.arange(len(queries))[:, None] * n_docs + head).ravel()
    docs = np.unique(head)
    with context.reader.submit(docs).records() as records:
        scored = score_pairs(context, tensors, records, keys, n_docs).reshape(2, *head.shape)
    return [rank_hits(context, best_scores[i].numpy(), best_docs[i].numpy(), head[i], scored[0, i], scored[1, i], k)
            for i in range(len(queries))]


def _exact_cls_top(context: SearchContext, queries: QueryEmbeddings, keep: int, block: int,
                   allowed: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query the `keep` best (score, doc number) by the exact CLS dot product, best first."""
    xq = torch.from_numpy(np.ascontiguousarray(queries.cls, dtype=np.float32))
    best_scores = torch.full((len(queries), 0), float("-inf"))
    best_docs = torch.zeros((len(queries), 0), dtype=torch.int64)
    for start in range(0, context.num_documents, block):
        numbers = np.arange(start, min(start + block, context.num_documents))
        if allowed is not None:
            numbers = numbers[allowed[numbers]]
            if len(numbers) == 0:
                continue
        cls = context.reader.read(numbers).cls.float().cpu()
        scores = torch.cat([best_scores, xq @ cls.T], dim=1)
        merged = torch.cat([best_docs, torch.from_numpy(numbers).expand(len(queries), -1)], dim=1)
        best_scores, idx = scores.topk(min(keep, scores.shape[1]), dim=1)
        best_docs = merged.gather(1, idx)
    return best_scores, best_docs
