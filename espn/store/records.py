"""What a read returns: `ReadBatch` (parsed CLS and BOW tensors) and `RecordBatch` (the
records where the reads left them, for the native scorer)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol, Sequence, Union

import numpy as np
import torch

__all__ = ["Buffer", "ReadBatch", "RecordBatch"]

#: What a backend's fetch may return as its buffer: 1-D uint8, host numpy or a torch tensor.
Buffer = Union[np.ndarray, torch.Tensor]


class _Releasable(Protocol):
    """What a RecordBatch holds on to until it is released (a pending read's parts)."""

    def release(self) -> None: ...


@dataclasses.dataclass
class ReadBatch:
    """The embeddings of `n` documents: CLS rows, and every BOW vector concatenated.

    cls:        [n, d_cls] float16 on the reader's device
    vectors:    [T, d_bow] float16, the BOW vectors of document 0, then 1, ... (no padding)
    offsets:    [n + 1] int64 (numpy): document i owns vectors[offsets[i]:offsets[i + 1]]
    bytes_read: bytes actually requested from storage (0 for memory; an estimate for mmap)
    ios:        read requests issued (after coalescing)
    docs:       [n] int64 the document number of each row (rows follow the request order of
                `read`; `PendingRead.result(select=...)` rows follow the order reads completed)

    `bow` and `mask` give the padded view ([n, L, d_bow] with zeros past each document's
    vectors, [n, L] bool, L = max(1, longest)) for callers that want one; the search path
    scores the flat form and never pads.
    """

    cls: torch.Tensor
    vectors: torch.Tensor
    offsets: np.ndarray
    bytes_read: int
    ios: int
    docs: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.cls.shape[0])

    def rows_of(self, doc_numbers: np.ndarray) -> np.ndarray:
        """[m] int64 the row holding each of `doc_numbers` (each must be in the batch)."""
        docs = self.docs if self.docs is not None else np.arange(len(self))
        order = np.argsort(docs, kind="stable")
        return order[np.searchsorted(docs[order], doc_numbers)]

    @property
    def n_bow(self) -> np.ndarray:
        """[n] int64 BOW vectors per document."""
        return np.diff(self.offsets)

    @functools.cached_property
    def _padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        n_bow = self.n_bow
        n, length = len(n_bow), max(1, int(n_bow.max()) if len(n_bow) else 0)
        device = self.vectors.device
        mask = torch.arange(length, device=device)[None, :] < torch.from_numpy(n_bow).to(device)[:, None]
        bow = torch.zeros((n, length, self.vectors.shape[1]), dtype=self.vectors.dtype, device=device)
        bow[mask] = self.vectors
        return bow, mask

    @property
    def bow(self) -> torch.Tensor:
        return self._padded[0]

    @property
    def mask(self) -> torch.Tensor:
        return self._padded[1]


@dataclasses.dataclass
class RecordBatch:
    """Documents' records where the reads left them, not parsed: what `espn.maxsim.score_records`
    scores without gathering or decoding them first (`PendingRead.records`).

    docs:      [n] int64 document number of each row (rows in the order the reads completed)
    n_bow:     [n] int64 its BOW vectors
    buffers:   the buffers holding the records (1-D uint8: numpy on the host, or a torch tensor
               on the reader's device), one per read
    buffer_of: [n] int64 which buffer holds each row's record
    starts:    [n] int64 byte position of each row's record in its buffer
    bytes_read, ios: what the reads cost

    The buffers belong to the reader's pool: call `release()` (or use it as a context
    manager) once scored, and never use the batch after that.
    """

    docs: np.ndarray
    n_bow: np.ndarray
    buffers: list[Buffer]
    buffer_of: np.ndarray
    starts: np.ndarray
    bytes_read: int
    ios: int
    _parts: Sequence[_Releasable] = dataclasses.field(default_factory=list, repr=False)

    def __len__(self) -> int:
        return len(self.docs)

    def rows_of(self, doc_numbers: np.ndarray) -> np.ndarray:
        """[m] int64 the row holding each of `doc_numbers` (each must be in the batch)."""
        order = np.argsort(self.docs, kind="stable")
        return order[np.searchsorted(self.docs[order], doc_numbers)]

    def addresses(self) -> np.ndarray:
        """[n] int64 host address of each row's record (host buffers only: the native scorer's input)."""
        bases = np.array([_host_address(buffer) for buffer in self.buffers], dtype=np.int64)
        return bases[self.buffer_of] + self.starts if len(self.buffers) else np.zeros(0, np.int64)

    def release(self) -> None:
        """Give the buffers back to the reader (idempotent)."""
        parts, self._parts = self._parts, []
        self.buffers = []
        for part in parts:
            part.release()

    def __enter__(self) -> "RecordBatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _host_address(buffer: Buffer) -> int:
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise ValueError("records on a GPU have no host address; score them with torch")
        return int(buffer.data_ptr())
    return int(buffer.__array_interface__["data"][0])
