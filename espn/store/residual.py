"""Residual records: each token vector as its nearest first-stage centroid plus a 2- or 4-bit
code per dimension (the PLAID idea), decoded where it is scored.

The centroid index of the first stage (`espn.first_stage.centroids`) already clusters every
stored token vector; a token then costs its centroid id (4 bytes) and `d x bits / 8` bytes of
residual codes instead of `d` int8 codes and a scale. Per dimension the residuals
(vector - centroid) of a training sample are cut at their quantiles into 2^bits buckets, and
each bucket decodes to the mean of the sample's residuals that fell in it:

    decode(id, codes)[k] = centroids[id, k] + weights[k, codes[k]]

When the encoder's vectors are unit length (ColBERT and PyLate models normalize), the decoded
vector is scaled back to unit length, as ColBERT's own decompression does: it recovers part of
what the residual lost (measured on SciFact, docs/benchmarks/residual.md).

Record layout (`layout.dtype` "residual2" / "residual4", espn/store/format.py):
    [CLS d_cls x fp16][centroid ids n x int32][codes n x (d_bow x bits / 8) bytes]
padded to an even length. Codes pack LSB first: dimension k sits in byte k // (8 / bits) at
bit (k % (8 / bits)) x bits.

The codec's arrays live beside the centroids (`first_stage/residual_*.npy`); its flag for
normalizing lives in the manifest (`store.residual`). Every segment of a generation encodes
against its base's centroids; compaction retrains both and re-encodes (`recode_store`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping

import faiss
import numpy as np
import torch

from ..errors import IndexCorruptError, InvalidParameterError
from ..mapped import map_npy

__all__ = ["RESIDUAL_TYPES", "ResidualCodec", "residual_bits", "train_codec", "ID_BYTES"]

#: The storage types of residual records, by their bits per dimension.
RESIDUAL_TYPES = {"residual2": 2, "residual4": 4}
#: Bytes of a token's centroid id.
ID_BYTES = 4
#: Residuals sampled to place the bucket cutoffs.
TRAIN_SAMPLE = 1 << 18
#: A sample whose vectors' lengths all lie this close to 1 decodes to unit vectors.
UNIT_TOLERANCE = 1e-2
_FILES = ("residual_cutoffs.npy", "residual_weights.npy")


def residual_bits(dtype: str) -> int:
    """Bits per dimension of a residual storage type (0 for the others)."""
    return RESIDUAL_TYPES.get(dtype, 0)


@dataclasses.dataclass(frozen=True, eq=False)
class ResidualCodec:
    """centroids [C, d] float32; cutoffs [d, 2^bits - 1] and weights [d, 2^bits] float32."""

    centroids: np.ndarray
    cutoffs: np.ndarray
    weights: np.ndarray
    bits: int
    normalize: bool
    #: root mean square of |decoded - stored vector| over the training sample: the codec's stated error
    rms_error: float = float("nan")

    def __post_init__(self) -> None:
        d = self.centroids.shape[1] if self.centroids.ndim == 2 else -1
        buckets = 1 << self.bits
        if self.bits not in RESIDUAL_TYPES.values() or d <= 0 or (d * self.bits) % 8 or \
                self.cutoffs.shape != (d, buckets - 1) or self.weights.shape != (d, buckets):
            raise IndexCorruptError(f"residual codec: centroids {self.centroids.shape}, cutoffs {self.cutoffs.shape}, "
                                    f"weights {self.weights.shape} and {self.bits} bits disagree")
        if not (np.all(np.isfinite(self.weights)) and np.all(np.isfinite(self.cutoffs))):
            raise IndexCorruptError("residual codec: its weights or cutoffs are not finite")

    @property
    def dim(self) -> int:
        return int(self.centroids.shape[1])

    @property
    def code_bytes(self) -> int:
        """Bytes of one token's codes."""
        return self.dim * self.bits // 8

    @property
    def byte_table(self) -> np.ndarray:
        """[code_bytes, 256, 8 / bits] float32: the residuals of the dimensions each byte value of
        each code byte packs (what the native kernel decodes with: one lookup per byte). 128 KiB at
        128 dimensions, made once per codec."""
        table = self.__dict__.get("_byte_table")
        if table is None:
            per_byte = 8 // self.bits
            values = np.arange(256, dtype=np.int64)
            codes = (values[:, None] >> (np.arange(per_byte) * self.bits)) & ((1 << self.bits) - 1)  # [256, per]
            dims = np.arange(self.dim).reshape(-1, per_byte)  # [code_bytes, per]
            table = np.ascontiguousarray(self.weights[dims[:, None, :], codes[None, :, :]], dtype=np.float32)
            object.__setattr__(self, "_byte_table", table)
        return table

    # -- encoding (the writers) ---------------------------------------------------------------
    def assign(self, vectors: np.ndarray) -> np.ndarray:
        """The nearest centroid (L2) of each vector: [n] int32."""
        if len(vectors) == 0:
            return np.zeros(0, np.int32)
        _, nearest = self._quantizer.search(np.ascontiguousarray(vectors, dtype=np.float32), 1)
        return nearest[:, 0].astype(np.int32)

    def encode(self, vectors: np.ndarray, chunk: int = 16384) -> tuple[np.ndarray, np.ndarray]:
        """vectors [n, d] -> (centroid ids [n] int32, packed codes [n, code_bytes] uint8)."""
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.dim:
            raise InvalidParameterError(f"residual codec: vectors of shape {vectors.shape}, the codec's are {self.dim}-d")
        ids = self.assign(vectors)
        packed = np.empty((len(vectors), self.code_bytes), dtype=np.uint8)
        for at in range(0, len(vectors), chunk):  # a chunk of tokens at a time: [chunk, d, buckets] booleans
            residual = vectors[at:at + chunk] - self.centroids[ids[at:at + chunk]]
            codes = (residual[:, :, None] >= self.cutoffs[None]).sum(axis=2, dtype=np.uint8)
            packed[at:at + chunk] = pack_codes(codes, self.bits)
        return ids, packed

    # -- decoding (the readers and the torch scorer; the kernel decodes on its own) -----------
    def decode(self, ids: np.ndarray, packed: np.ndarray) -> np.ndarray:
        """(ids [n], packed [n, code_bytes]) -> vectors [n, d] float32."""
        return self.decode_torch(torch.from_numpy(np.asarray(ids, np.int32)),
                                 torch.from_numpy(np.asarray(packed, np.uint8))).numpy()

    def decode_torch(self, ids: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """`decode` on the tensors' device: [n] int32 ids, [n, code_bytes] uint8 -> [n, d] float32."""
        device = packed.device
        centroids, weights = self._on(device)
        ids = ids.to(torch.int64).reshape(-1)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= len(self.centroids)):
            raise IndexCorruptError(f"a residual record names a centroid outside the codec's {len(self.centroids)}")
        per_byte = 8 // self.bits
        shifts = torch.arange(per_byte, device=device, dtype=torch.uint8) * self.bits
        codes = ((packed[:, :, None] >> shifts) & ((1 << self.bits) - 1)).reshape(len(ids), self.dim).to(torch.int64)
        values = centroids.index_select(0, ids) + weights.gather(1, codes.T).T
        if self.normalize:
            values = values / values.norm(dim=1, keepdim=True).clamp_min(1e-12)
        return values

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The centroids and weights as tensors on `device` (made once per device)."""
        key = str(device)
        if key not in self._tensors:
            self._tensors[key] = (torch.tensor(np.asarray(self.centroids, np.float32), device=device),
                                  torch.tensor(np.asarray(self.weights, np.float32), device=device))
        return self._tensors[key]

    @property
    def _tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        cache = self.__dict__.get("_tensor_cache")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_tensor_cache", cache)
        return cache

    @property
    def _quantizer(self) -> faiss.IndexFlatL2:
        quantizer = self.__dict__.get("_flat")
        if quantizer is None:
            quantizer = faiss.IndexFlatL2(self.dim)
            quantizer.add(np.ascontiguousarray(self.centroids, dtype=np.float32))
            object.__setattr__(self, "_flat", quantizer)
        return quantizer

    # -- files ------------------------------------------------------------------------------
    def save(self, folder: Path) -> None:
        """Write the cutoffs and weights into `folder` (the index's first_stage/), each by rename."""
        for name, array in zip(_FILES, (self.cutoffs, self.weights)):
            tmp = Path(folder) / f"{name}.tmp"
            with open(tmp, "wb") as file:
                np.save(file, np.ascontiguousarray(array, dtype=np.float32))
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, Path(folder) / name)

    def manifest(self) -> dict[str, Any]:
        """The manifest's `store.residual` section."""
        return {"bits": self.bits, "normalize": self.normalize, "centroids": int(len(self.centroids)),
                "rms_error": round(float(self.rms_error), 6)}

    @classmethod
    def open(cls, folder: Path, dtype: str, section: Mapping[str, Any] | None) -> "ResidualCodec":
        """The codec of an index whose first_stage/ is `folder` (memory-mapped: workers share it)."""
        try:
            centroids, cutoffs, weights = (map_npy(Path(folder) / name) for name in ("centroids.npy",) + _FILES)
        except (ValueError, OSError) as exc:
            raise IndexCorruptError(f"{folder}: the residual records' codec is unreadable ({exc})") from None
        section = section or {}
        return cls(np.asarray(centroids, np.float32), np.asarray(cutoffs, np.float32),
                   np.asarray(weights, np.float32), residual_bits(dtype), bool(section.get("normalize", False)),
                   float(section.get("rms_error", float("nan"))))


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [n, d] (values < 2^bits) -> [n, d x bits / 8] uint8, LSB first."""
    per_byte = 8 // bits
    n, d = codes.shape
    grouped = codes.astype(np.uint8).reshape(n, d // per_byte, per_byte)
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits)[None, None, :]
    return np.bitwise_or.reduce(grouped << shifts, axis=2).astype(np.uint8)


def train_codec(centroids: np.ndarray, sample: np.ndarray, bits: int) -> ResidualCodec:
    """The codec of `bits` over `centroids` fitted to a sample of stored vectors [n, d]."""
    sample = np.asarray(sample, dtype=np.float32)
    if len(sample) > TRAIN_SAMPLE:
        sample = sample[np.random.default_rng(1234).choice(len(sample), TRAIN_SAMPLE, replace=False)]
    centroids = np.ascontiguousarray(centroids, dtype=np.float32)
    d, buckets = centroids.shape[1], 1 << bits
    bare = ResidualCodec(centroids, np.zeros((d, buckets - 1), np.float32), np.zeros((d, buckets), np.float32),
                         bits, False)
    residual = sample - centroids[bare.assign(sample)] if len(sample) else np.zeros((0, d), np.float32)
    if len(residual) == 0:
        cutoffs = np.zeros((d, buckets - 1), np.float32)
        weights = np.zeros((d, buckets), np.float32)
    else:
        cutoffs = np.quantile(residual, np.arange(1, buckets) / buckets, axis=0).T.astype(np.float32)
        codes = (residual[:, :, None] >= cutoffs[None]).sum(axis=2)
        weights = np.empty((d, buckets), np.float32)
        edges = np.concatenate([cutoffs[:, :1], cutoffs, cutoffs[:, -1:]], axis=1)
        for k in range(d):  # one bincount per dimension
            counts = np.bincount(codes[:, k], minlength=buckets)
            sums = np.bincount(codes[:, k], weights=residual[:, k], minlength=buckets)
            middle = (edges[k, :-1] + edges[k, 1:]) / 2  # an empty bucket decodes to its middle
            weights[k] = np.where(counts > 0, sums / np.maximum(counts, 1), middle)
    lengths = np.linalg.norm(sample, axis=1) if len(sample) else np.ones(1)
    codec = ResidualCodec(centroids, cutoffs, weights, bits, bool(np.all(np.abs(lengths - 1.0) <= UNIT_TOLERANCE)))
    if len(sample) == 0:
        return codec
    error = codec.decode(*codec.encode(sample)) - sample
    return dataclasses.replace(codec, rms_error=float(np.sqrt((error ** 2).sum(axis=1).mean())))

