"""Candidate generation for models without a trained CLS vector: a token-level centroid index.

ColBERT and PyLate checkpoints score by MaxSim alone; the mean of their token vectors (the
"CLS" such an index stores) was never trained to find documents, so the IVF over it misses
what an exhaustive MaxSim finds. As PLAID and WARP do, the build clusters every stored
token vector into `C` centroids and keeps an inverted list centroid -> doc numbers (CSR:
`offsets [C+1] int64`, `docs [nnz] int32`, each (centroid, doc) pair once). At query time
each query token probes its `probe` nearest centroids; a document's approximate score is
the sum over query tokens of the best centroid score among the probed centroids it holds a
token in, and a token it holds none for counts that token's lowest probed score (WARP's
estimate of the missing similarity, so long documents are not favoured merely for
appearing in more lists). The top `candidates` go to the exact MaxSim re-rank, read from
SSD as every other search's records are.

What this keeps in RAM: the centroids (`C x d` float32) and the CSR (4 bytes per pair),
memory-mapped (`mmap_mode='r'`) so worker processes share one copy; the token vectors stay
on SSD. The delta segments of a live index get their own small CSR, computed from their
records against the same centroids (`assign_documents`) when a generation is opened.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import faiss
import numpy as np

from ..errors import IndexCorruptError, InvalidParameterError
from ..mapped import map_npy
from ..maxsim_native import centroid_estimate_native, load_kernel
from ..params import FIRST_STAGE_KINDS, MAX_CANDIDATES, MAX_PROBE
from ..store.sample import sample_vectors

__all__ = [
    "FIRST_STAGE_DIR",
    "FirstStageConfig",
    "TokenCentroids",
    "Postings",
    "default_centroid_count",
    "train_centroids",
    "assign_documents",
    "build_token_centroids",
    "wants_token_first_stage",
]

log = logging.getLogger(__name__)

FIRST_STAGE_DIR = "first_stage"


@dataclasses.dataclass(frozen=True)
class FirstStageConfig:
    """The manifest's `first_stage` section.

    kind:       one of FIRST_STAGE_KINDS ("ivf" when the section is absent)
    probe:      centroids each query token visits
    candidates: documents the centroid stage hands to the MaxSim re-rank per query
    centroids:  how many centroids the build trained (informational)
    """

    kind: str = "ivf"
    probe: int = 8
    candidates: int = 256
    centroids: int | None = None

    def validate(self) -> "FirstStageConfig":
        if self.kind not in FIRST_STAGE_KINDS:
            raise InvalidParameterError(f"first_stage must be one of {', '.join(FIRST_STAGE_KINDS)}, got {self.kind!r}")
        for name, value, high in (("first_stage_probe", self.probe, MAX_PROBE),
                                  ("first_stage_candidates", self.candidates, MAX_CANDIDATES)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise InvalidParameterError(f"{name} must be an integer in [1, {high}], got {value!r}")
        return self

    def replace(self, kind: str | None = None, probe: int | None = None,
                candidates: int | None = None) -> "FirstStageConfig":
        """A copy with the given non-None per-call overrides, validated."""
        if kind is None and probe is None and candidates is None:
            return self
        return dataclasses.replace(self, kind=self.kind if kind is None else kind,
                                   probe=self.probe if probe is None else probe,
                                   candidates=self.candidates if candidates is None else candidates).validate()

    @property
    def uses_centroids(self) -> bool:
        return self.kind in ("centroids", "union")

    @property
    def scores_every_candidate(self) -> bool:
        """Whether the stage's candidates are all scored with exact MaxSim (the centroid stages and
        exact), rather than the IVF's head re-ranked (espn.search.centroid_stage)."""
        return self.kind != "ivf"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_manifest(cls, section: Mapping[str, Any] | None) -> "FirstStageConfig":
        if not section:
            return cls()
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in section.items() if key in known}).validate()


def wants_token_first_stage(encoder_config: Mapping[str, Any]) -> bool:
    """True for encoders whose CLS vector was not trained for retrieval (ColBERT/PyLate models):
    their index gets the centroid first stage by default."""
    return encoder_config.get("has_trained_cls") is False or encoder_config.get("kind") == "colbert"


def default_centroid_count(num_tokens: int, num_documents: int) -> int:
    """A power of two near 4·√T for T token vectors (PLAID takes 16·√T; measured on SciFact the
    smaller count found as much at a quarter of the training time), at most T/32 and at least 1."""
    if num_tokens < 64:
        return 1
    target = min(4 * math.sqrt(num_tokens), num_tokens / 32)
    return max(1, 2 ** int(math.floor(math.log2(target))))


@dataclasses.dataclass
class Postings:
    """centroid -> doc numbers, CSR: offsets [C+1] int64, docs [nnz] int32 (global doc numbers)."""

    offsets: np.ndarray
    docs: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.offsets.nbytes + self.docs.nbytes)


def postings_from_pairs(centroid_ids: np.ndarray, doc_numbers: np.ndarray, n_centroids: int) -> Postings:
    """CSR of the unique (centroid, doc) pairs among the given token assignments."""
    key = np.unique(centroid_ids.astype(np.int64) << 32 | doc_numbers.astype(np.int64))
    centroid = key >> 32
    offsets = np.zeros(n_centroids + 1, dtype=np.int64)
    np.cumsum(np.bincount(centroid, minlength=n_centroids), out=offsets[1:])
    return Postings(offsets, (key & 0xFFFFFFFF).astype(np.int32))


def train_centroids(sample: np.ndarray, n_centroids: int, seed: int = 1234, niter: int = 12) -> np.ndarray:
    """k-means (inner product over unit vectors, spherical) of a token sample: [C, d] float32."""
    sample = np.ascontiguousarray(sample, dtype=np.float32)
    n_centroids = max(1, min(n_centroids, len(sample)))
    kmeans = faiss.Kmeans(sample.shape[1], n_centroids, niter=niter, seed=seed, spherical=True,
                          max_points_per_centroid=64, verbose=False)
    kmeans.train(sample)
    return np.ascontiguousarray(kmeans.centroids, dtype=np.float32)


def assign_documents(centroids: np.ndarray, vectors: np.ndarray, offsets: np.ndarray,
                     doc_numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(centroid id, doc number) per token: vectors [T, d] of documents `doc_numbers` [n], document
    i owning rows offsets[i]:offsets[i+1] (the flat form `Reader.read` returns)."""
    quantizer = faiss.IndexFlatIP(centroids.shape[1])
    quantizer.add(np.ascontiguousarray(centroids, dtype=np.float32))
    if len(vectors) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    _, nearest = quantizer.search(np.ascontiguousarray(vectors, dtype=np.float32), 1)
    owners = np.repeat(np.asarray(doc_numbers, dtype=np.int64), np.diff(offsets))
    return nearest[:, 0], owners


class TokenCentroids:
    """The centroid first stage of one generation: centroids [C, d] float32 and one Postings per
    segment (the base's memory-mapped, each delta's computed from its records)."""

    def __init__(self, centroids: np.ndarray, parts: Sequence[Postings],
                 quantizer: faiss.IndexFlatIP | None = None) -> None:
        """quantizer: a flat index over `centroids` already built (shared, not rebuilt)."""
        self.centroids = centroids
        self.parts = list(parts)
        if quantizer is None:
            quantizer = faiss.IndexFlatIP(centroids.shape[1])
            quantizer.add(np.ascontiguousarray(centroids, dtype=np.float32))
        self._quantizer = quantizer

    @classmethod
    def open(cls, index_path: Path) -> "TokenCentroids":
        """The base's centroid index (`INDEX/first_stage/`), memory-mapped."""
        folder = Path(index_path) / FIRST_STAGE_DIR
        try:
            centroids = map_npy(folder / "centroids.npy")
            postings = Postings(map_npy(folder / "offsets.npy"), map_npy(folder / "docs.npy"))
        except (ValueError, OSError) as exc:
            raise IndexCorruptError(f"{folder}: unreadable centroid index ({exc})") from None
        if centroids.ndim != 2 or len(postings.offsets) != len(centroids) + 1 or \
                int(postings.offsets[-1]) != len(postings.docs):
            raise IndexCorruptError(f"{folder}: centroids, offsets and docs disagree")
        return cls(centroids, [postings])

    def with_parts(self, extra: Sequence[Postings]) -> "TokenCentroids":
        """The same centroids with more segments' postings (a live generation's deltas)."""
        return TokenCentroids(self.centroids, self.parts[:1] + list(extra), self._quantizer)

    @property
    def nbytes(self) -> int:
        """What the first stage holds: centroids plus every segment's postings."""
        return int(self.centroids.nbytes + sum(p.nbytes for p in self.parts))

    def candidates(self, bow: np.ndarray, mask: np.ndarray, probe: int, depth: int,
                   allowed: np.ndarray | None = None, n_docs: int | None = None) -> list[np.ndarray]:
        """Per query, the `depth` best doc numbers (int64, best first) by the centroid estimate.

        bow [B, L, d] float32 query token vectors, mask [B, L] bool; allowed [N] bool: the
        documents a result may hold (deleted ones never are), None: all; n_docs: N where it is
        known (else found in the postings, once).
        """
        return list(self.iter_candidates(bow, mask, probe, depth, allowed, n_docs))

    def iter_candidates(self, bow: np.ndarray, mask: np.ndarray, probe: int, depth: int,
                        allowed: np.ndarray | None = None, n_docs: int | None = None) -> Iterator[np.ndarray]:
        """`candidates`, query by query: a search starts reading one query's candidates while
        the next is ranked."""
        batch, length, d = bow.shape
        probe = max(1, min(probe, len(self.centroids)))
        tokens = np.ascontiguousarray(bow.reshape(batch * length, d), dtype=np.float32)
        scores, nearest = self._quantizer.search(tokens, probe)  # [B·L, probe], best first
        for i in range(batch):
            rows = np.flatnonzero(mask[i]) + i * length
            yield self._rank(scores[rows], nearest[rows], depth, allowed, n_docs)

    def _rank(self, scores: np.ndarray, nearest: np.ndarray, depth: int, allowed: np.ndarray | None,
              n_docs: int | None = None) -> np.ndarray:
        """One query: scores, nearest [Lq, probe] -> the top `depth` documents."""
        n_tokens, probe = nearest.shape
        if n_tokens == 0:
            return np.zeros(0, np.int64)
        gains = scores - scores[:, -1:]  # above each token's lowest probed score (its missing estimate)
        lib = load_kernel()
        found = None if lib is None else centroid_estimate_native(
            lib, [(part.offsets, part.docs) for part in self.parts], len(self.centroids), nearest, gains, allowed,
            len(allowed) if allowed is not None else n_docs if n_docs is not None else self.n_docs)
        unique_docs, totals = found if found is not None else self._estimate(nearest, gains, allowed)
        if len(unique_docs) > depth:
            top = np.argpartition(-totals, depth - 1)[:depth]
        else:
            top = np.arange(len(unique_docs))
        top = top[np.argsort(-totals[top], kind="stable")]
        return unique_docs[top]

    @functools.cached_property
    def n_docs(self) -> int:
        """One past the highest document number the postings name."""
        return max((int(part.docs.max()) + 1 for part in self.parts if len(part.docs)), default=0)

    def _estimate(self, nearest: np.ndarray, gains: np.ndarray,
                  allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The estimate without the native kernel: (documents met, sorted; their totals)."""
        n_tokens, probe = nearest.shape
        token_of = np.repeat(np.arange(n_tokens, dtype=np.int64), probe)
        flat_c, flat_gain = nearest.ravel(), gains.ravel()
        docs_parts, token_parts, gain_parts = [], [], []
        for part in self.parts:
            starts, stops = part.offsets[flat_c], part.offsets[flat_c + 1]
            sizes = stops - starts
            total = int(sizes.sum())
            if total == 0:
                continue
            # every posting of every probed list, gathered without a Python loop over lists
            shift = np.repeat(starts - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
            docs_parts.append(part.docs[np.arange(total, dtype=np.int64) + shift].astype(np.int64))
            token_parts.append(np.repeat(token_of, sizes))
            gain_parts.append(np.repeat(flat_gain, sizes))
        if not docs_parts:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        docs, token, gain = np.concatenate(docs_parts), np.concatenate(token_parts), np.concatenate(gain_parts)
        if allowed is not None:
            keep = allowed[docs]
            docs, token, gain = docs[keep], token[keep], gain[keep]
        # best gain per (token, doc): sort by key, then by gain descending; first of each key
        key = docs * n_tokens + token
        order = np.lexsort((-gain, key))
        key, gain = key[order], gain[order]
        first = np.ones(len(key), dtype=bool)
        first[1:] = key[1:] != key[:-1]
        unique_docs, inverse = np.unique(key[first] // n_tokens, return_inverse=True)
        return unique_docs, np.bincount(inverse, weights=gain[first])


def build_token_centroids(out: Path, vectors_of: Any, n_docs: int, n_tokens: int,
                          n_centroids: int | None = None, seed: int = 1234, block: int = 4096) -> dict[str, Any]:
    """Train centroids on a sample of the index's stored token vectors, assign every token, and
    write `out/first_stage/{centroids,offsets,docs}.npy`. Returns the manifest's numbers.

    vectors_of(doc_numbers [n] int64) -> (vectors [T, d] float, offsets [n+1] int64): the stored
    token vectors (a reader over embeddings.bin), called block by block, so memory stays bounded.
    """
    count = n_centroids or default_centroid_count(n_tokens, n_docs)
    sample = sample_vectors(vectors_of, n_docs, n_tokens, count * 64, seed, block)  # ~64 tokens per centroid
    centroids = train_centroids(sample, count, seed=seed)
    del sample
    centroid_parts, doc_parts = [], []
    for start in range(0, n_docs, block):
        numbers = np.arange(start, min(start + block, n_docs), dtype=np.int64)
        vectors, offsets = vectors_of(numbers)
        c, d = assign_documents(centroids, np.asarray(vectors, dtype=np.float32), offsets, numbers)
        # unique per block now, so the arrays held until the end are pairs, not tokens
        key = np.unique(c.astype(np.int64) << 32 | d)
        centroid_parts.append((key >> 32).astype(np.int32))
        doc_parts.append((key & 0xFFFFFFFF).astype(np.int32))
    postings = postings_from_pairs(np.concatenate(centroid_parts), np.concatenate(doc_parts), len(centroids))
    folder = Path(out) / FIRST_STAGE_DIR
    folder.mkdir(exist_ok=True)
    for name, array in (("centroids", centroids), ("offsets", postings.offsets), ("docs", postings.docs)):
        tmp = folder / f"{name}.tmp.npy"
        np.save(tmp, array)
        os.replace(tmp, folder / f"{name}.npy")
    log.info("first stage: %d centroids over %d token vectors, %d (centroid, doc) pairs, %.1f MB",
             len(centroids), n_tokens, len(postings.docs), (centroids.nbytes + postings.nbytes) / 1e6)
    return {"centroids": int(len(centroids)), "pairs": int(len(postings.docs))}
