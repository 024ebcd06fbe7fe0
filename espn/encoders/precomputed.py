"""Indexes built from embeddings computed elsewhere, and query embeddings computed elsewhere.

Such an index has no text encoder: `PrecomputedEncoder` records the dimensions and
the scoring convention, and refuses text. Queries then come as embeddings, in the
file format `load_query_embeddings` reads (`espn search --query-embeddings FILE`):

An ``.npz`` archive (``numpy.savez``) with

====================  ==========================  =================================
``cls``               [Q, d_cls] float            one CLS vector per query
``bow``               [sum(counts), d_bow] float  every query's BOW vectors, query
                                                  after query (flattened, like the
                                                  document shards)
``counts``            [Q] int >= 0                BOW vectors of each query
``ids`` (optional)    [Q] str or bytes            query ids for the run file;
                                                  default "0" .. "Q-1"
====================  ==========================  =================================

For example::

    np.savez("queries.npz", ids=np.array(["q1", "q2"]), cls=cls, bow=np.concatenate(bows),
             counts=np.array([len(b) for b in bows]))
"""

from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import CorpusError, InvalidParameterError
from .base import DocumentEmbeddings, Encoder, QueryEmbeddings

__all__ = ["PrecomputedEncoder", "load_query_embeddings", "BOW_REDUCTIONS"]

log = logging.getLogger(__name__)

BOW_REDUCTIONS = ("mean", "sum")

_NO_TEXT = (
    "this index was built from precomputed embeddings and has no text encoder; "
    "queries must come as embeddings (espn search --query-embeddings FILE.npz, "
    "format in espn.encoders.precomputed)"
)


class PrecomputedEncoder(Encoder):
    """The encoder of an index imported from embedding shards: dimensions and scoring, no model.

    bow_reduction:  "sum" (ColBERTer-style raw MaxSim sum) or "mean" (divided by the number
                    of query vectors, a cosine when vectors are normalised)
    learned_weight: the model's own CLS/BOW score weight w, if it has one; None = calibrate
    """

    kind = "precomputed"

    def __init__(self, d_cls: int, d_bow: int, bow_reduction: str = "mean", learned_weight: float | None = None,
                 source: str | None = None, layout: str | None = None) -> None:
        for name, value in (("d_cls", d_cls), ("d_bow", d_bow)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}")
        if bow_reduction not in BOW_REDUCTIONS:
            raise InvalidParameterError(f"bow_reduction must be one of {BOW_REDUCTIONS}, got {bow_reduction!r}")
        if learned_weight is not None and not 0.0 <= float(learned_weight) <= 1.0:
            raise InvalidParameterError(f"score weight must be in [0, 1], got {learned_weight!r}")
        self.d_cls, self.d_bow = int(d_cls), int(d_bow)
        self.bow_reduction = bow_reduction
        self.learned_weight = None if learned_weight is None else float(learned_weight)
        self.source, self.layout = source, layout

    @classmethod
    def from_import(cls, totals: Mapping[str, Any]) -> "PrecomputedEncoder":
        """The encoder matching what `indexing.precomputed.import_embeddings` returned."""
        return cls(d_cls=int(totals["d_cls"]), d_bow=int(totals["d_bow"]),
                   bow_reduction=str(totals.get("bow_reduction", "mean")),
                   learned_weight=totals.get("score_weight"), source=totals.get("source"),
                   layout=totals.get("layout"))

    # -- no text: every text entry point says what to do instead ------------------------
    def tokenize(self, texts: Sequence[str], is_query: bool) -> Mapping[str, Any]:
        raise InvalidParameterError(_NO_TEXT)

    def embed_documents(self, tokens: Mapping[str, Any]) -> DocumentEmbeddings:
        raise InvalidParameterError(_NO_TEXT)

    def embed_queries(self, tokens: Mapping[str, Any]) -> QueryEmbeddings:
        raise InvalidParameterError(_NO_TEXT)

    # -- persistence ---------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "d_cls": self.d_cls,
            "d_bow": self.d_bow,
            "bow_reduction": self.bow_reduction,
            "learned_weight": self.learned_weight,
            "source": self.source,
            "layout": self.layout,
        }

    def save(self, directory: Path) -> None:
        """Nothing to rebuild but the config; written so the encoder directory is self-describing."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "precomputed.json").write_text(json.dumps(self.config(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, directory: Path, config: Mapping[str, Any], device: str | None = None) -> "PrecomputedEncoder":
        del directory, device  # everything is in the manifest's config
        return cls(d_cls=int(config["d_cls"]), d_bow=int(config["d_bow"]),
                   bow_reduction=str(config.get("bow_reduction", "mean")),
                   learned_weight=config.get("learned_weight"), source=config.get("source"),
                   layout=config.get("layout"))


def load_query_embeddings(path: Path | str, d_cls: int | None = None,
                          d_bow: int | None = None) -> tuple[list[str], QueryEmbeddings]:
    """Read a query-embeddings .npz (format in the module docstring) -> (query ids, padded embeddings).

    d_cls / d_bow, when given (the index's), are checked so a mismatch fails here with the
    file's name rather than as a shape error inside the search. Padding: bow [Q, L, d_bow]
    with L the largest count (at least 1), zero and masked beyond each query's count.
    """
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as archive:
            names = set(archive.files)
            missing = {"cls", "bow", "counts"} - names
            if missing:
                raise CorpusError(f"{path}: missing array(s) {', '.join(sorted(missing))}; "
                                  "expected cls [Q, d_cls], bow [sum(counts), d_bow], counts [Q], optional ids [Q]")
            cls = np.asarray(archive["cls"])
            bow = np.asarray(archive["bow"])
            counts = np.asarray(archive["counts"])
            raw_ids = np.asarray(archive["ids"]) if "ids" in names else None
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise CorpusError(f"{path}: not a readable .npz archive ({exc})") from exc

    if cls.ndim != 2 or not np.issubdtype(cls.dtype, np.floating):
        raise CorpusError(f"{path}: cls must be a 2-D float array [Q, d_cls], got {cls.dtype} {cls.shape}")
    if bow.ndim != 2 or not (np.issubdtype(bow.dtype, np.floating) or bow.size == 0):
        raise CorpusError(f"{path}: bow must be a 2-D float array [sum(counts), d_bow], got {bow.dtype} {bow.shape}")
    if counts.ndim != 1 or not (np.issubdtype(counts.dtype, np.integer) or counts.size == 0):
        raise CorpusError(f"{path}: counts must be a 1-D integer array [Q], got {counts.dtype} {counts.shape}")
    counts = counts.astype(np.int64)
    queries = len(cls)
    if queries == 0:
        raise CorpusError(f"{path}: no queries")
    if len(counts) != queries:
        raise CorpusError(f"{path}: {queries} CLS rows but {len(counts)} counts")
    if (counts < 0).any():
        raise CorpusError(f"{path}: counts must be >= 0 (query {int(np.argmax(counts < 0))} has {counts.min()})")
    if int(counts.sum()) != len(bow):
        raise CorpusError(f"{path}: counts sum to {int(counts.sum())} but bow has {len(bow)} rows")
    if d_cls is not None and cls.shape[1] != d_cls:
        raise InvalidParameterError(f"{path}: query CLS vectors have {cls.shape[1]} dims, the index {d_cls}")
    if d_bow is not None and bow.shape[1] != d_bow:
        raise InvalidParameterError(f"{path}: query BOW vectors have {bow.shape[1]} dims, the index {d_bow}")
    if not (np.isfinite(cls).all() and np.isfinite(bow).all()):
        raise CorpusError(f"{path}: embeddings contain NaN or infinity")

    if raw_ids is None:
        ids = [str(i) for i in range(queries)]
    else:
        if raw_ids.ndim != 1 or len(raw_ids) != queries or raw_ids.dtype.kind not in "US":
            raise CorpusError(f"{path}: ids must be a 1-D string array of {queries} entries, "
                              f"got {raw_ids.dtype} {raw_ids.shape}")
        ids = [i.decode("utf-8") if isinstance(i, bytes) else str(i) for i in raw_ids.tolist()]
        if any(not i.strip() for i in ids):
            raise CorpusError(f"{path}: empty query id at row {next(n for n, i in enumerate(ids) if not i.strip())}")

    width = max(1, int(counts.max()))
    rows = np.repeat(np.arange(queries), counts)
    columns = np.arange(len(bow)) - np.repeat(np.cumsum(counts) - counts, counts)
    padded = np.zeros((queries, width, bow.shape[1]), dtype=np.float32)
    mask = np.zeros((queries, width), dtype=bool)
    padded[rows, columns] = bow
    mask[rows, columns] = True
    log.info("%s: %d queries, %d BOW vectors", path, queries, len(bow))
    return ids, QueryEmbeddings(cls=cls.astype(np.float32), bow=padded, mask=mask)
