"""Batched, masked MaxSim: sum over query vectors of the best dot product with any document vector.

Storage is fp16; on the CPU the product is computed in fp32 (fp16 matmul is slow
there and loses precision), on CUDA in fp16 with fp32 accumulation by cuBLAS.
"""

from __future__ import annotations

import torch

__all__ = ["maxsim", "cls_scores"]


def maxsim(
    q_bow: torch.Tensor, q_mask: torch.Tensor, d_bow: torch.Tensor, d_mask: torch.Tensor, reduction: str = "sum"
) -> torch.Tensor:
    """MaxSim of one query against C documents.

    q_bow [Lq, D], q_mask [Lq] bool, d_bow [C, Ld, D], d_mask [C, Ld] bool -> [C] float32.
    Padding never scores: masked document positions are -inf before the max, masked
    query positions are dropped from the sum; a document with no vectors scores 0.
    reduction "mean" divides by the number of query vectors (a cosine, like the CLS score).

    >>> q = torch.tensor([[1.0, 0.0], [0.0, 1.0]]); qm = torch.tensor([True, True])
    >>> d = torch.tensor([[[1.0, 0.0], [0.6, 0.8]]]); dm = torch.tensor([[True, True]])
    >>> maxsim(q, qm, d, dm).tolist()
    [1.7999999523162842]
    >>> maxsim(q, qm, d, torch.tensor([[True, False]])).tolist()
    [1.0]
    """
    if d_bow.shape[0] == 0 or d_bow.shape[1] == 0:  # no documents, or none has a BOW vector
        return torch.zeros(d_bow.shape[0], dtype=torch.float32, device=d_bow.device)
    dtype = torch.float16 if d_bow.is_cuda else torch.float32
    q = q_bow.to(device=d_bow.device, dtype=dtype)
    sim = torch.einsum("qd,cld->cql", q, d_bow.to(dtype)).float()  # [C, Lq, Ld]
    sim.masked_fill_(~d_mask[:, None, :].to(sim.device), float("-inf"))
    best = sim.amax(dim=2)  # [C, Lq]
    keep = q_mask.to(sim.device)[None, :] & torch.isfinite(best)
    total = torch.where(keep, best, torch.zeros_like(best)).sum(dim=1)
    if reduction == "mean":
        total = total / q_mask.sum().clamp(min=1).to(total.dtype)
    elif reduction != "sum":
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    return total


def cls_scores(q_cls: torch.Tensor, d_cls: torch.Tensor) -> torch.Tensor:
    """Exact dot products of one query CLS [D] with C document CLS vectors [C, D] -> [C] float32."""
    return d_cls.float() @ q_cls.to(device=d_cls.device, dtype=torch.float32)
