"""The encoder contract: text -> one CLS vector and a bag of BOW vectors per text.

The indexer splits encoding in two halves so that tokenisation runs in DataLoader
worker processes and only the model runs in the main process: `tokenize` must be
picklable and cheap, `embed_documents` / `embed_queries` take its output.
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import InvalidParameterError

__all__ = ["DocumentEmbeddings", "QueryEmbeddings", "Encoder", "VectorSpans", "overflowed", "trimmed_span",
           "PAGE_MODALITY", "reads_pages"]

#: For each BOW vector of one text, in the order the vectors are stored (a document's
#: record, a query's unmasked columns), the character spans `(start, end)` of the text it
#: came from: one span for a token, several for a word pooled over its occurrences.
VectorSpans = list[list[tuple[int, int]]]


def overflowed(encoded: Any) -> np.ndarray | None:
    """[B] bool: which texts a fast tokenizer's call (truncation on) cut, from each encoding's
    overflow; None for a slow tokenizer, which keeps no encodings."""
    encodings = getattr(encoded, "encodings", None)
    if not encodings:
        return None
    return np.array([bool(encoding.overflowing) for encoding in encodings], dtype=bool)


def trimmed_span(text: str, start: int, end: int) -> tuple[int, int]:
    """`text[start:end]` clipped to the text and without the whitespace at its ends (a byte-level BPE
    token's offsets hold the space before its word): the characters a token came from. A token of
    whitespace alone keeps its span."""
    start, end = max(0, start), min(len(text), end)
    low, high = start, end
    while low < high and text[low].isspace():
        low += 1
    while high > low and text[high - 1].isspace():
        high -= 1
    return (low, high) if low < high else (start, end)


@dataclasses.dataclass
class DocumentEmbeddings:
    """Embeddings of a batch of documents, BOW vectors flattened.

    cls:    [n, d_cls] float32
    bow:    [sum(counts), d_bow] float32, document i's vectors are rows
            counts[:i].sum() .. counts[:i+1].sum()
    counts: [n] int32, may be 0 (every word gated out)
    grids:  pages only: [n, 4] int32, each page's patch grid in its vectors
            (espn.pages.grids.GRID_FIELDS, zeros: not one grid); None for text
    """

    cls: np.ndarray
    bow: np.ndarray
    counts: np.ndarray
    grids: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not (self.cls.ndim == 2 and self.bow.ndim == 2 and self.counts.ndim == 1):
            raise ValueError(f"embeddings of {self.cls.ndim}, {self.bow.ndim} and {self.counts.ndim} dimensions "
                             "(cls and bow take 2, counts 1)")
        if len(self.cls) != len(self.counts) or int(self.counts.sum()) != len(self.bow):
            raise ValueError(f"{len(self.cls)} CLS vectors, {len(self.counts)} counts summing to "
                             f"{int(self.counts.sum())}, and {len(self.bow)} BOW vectors disagree")
        if self.grids is not None and self.grids.shape != (len(self.counts), 4):
            raise ValueError(f"page grids of shape {self.grids.shape} for {len(self.counts)} pages (4 a page)")

    def __len__(self) -> int:
        return len(self.counts)

    def split(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per-document (cls [d_cls], bow [count, d_bow]) views; for tests and small batches."""
        ends = np.cumsum(self.counts)
        starts = ends - self.counts
        return [(self.cls[i], self.bow[s:e]) for i, (s, e) in enumerate(zip(starts, ends))]


@dataclasses.dataclass
class QueryEmbeddings:
    """Embeddings of a batch of queries, BOW vectors padded.

    cls:  [B, d_cls] float32
    bow:  [B, L, d_bow] float32, zero where mask is False
    mask: [B, L] bool
    truncated: [B] bool, the queries the model did not read to their end (longer than its query
          length: espn.search.long_queries); None where the encoder does not say
    """

    cls: np.ndarray
    bow: np.ndarray
    mask: np.ndarray
    truncated: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.cls)

    def __getitem__(self, rows: slice | np.ndarray) -> "QueryEmbeddings":
        return QueryEmbeddings(self.cls[rows], self.bow[rows], self.mask[rows],
                               None if self.truncated is None else self.truncated[rows])


#: The modality of an encoder whose documents are page images.
PAGE_MODALITY = "image"


def reads_pages(encoder_config: Mapping[str, Any]) -> bool:
    """Whether an index's encoder (its manifest entry, or a build's) reads page images: the one
    question every part that treats pages apart asks."""
    return encoder_config.get("modality", "text") == PAGE_MODALITY


class Encoder(abc.ABC):
    """Turns text into CLS and BOW vectors; one subclass per model family.

    `kind` names the family in the manifest and the registry; `modality` what it reads as
    documents. `from_pretrained` makes a fresh encoder from a model (what `espn index --encoder`
    names), `save` writes what the query side needs (config, projection) into an index's
    `encoder/` directory and `load` rebuilds the identical encoder from it offline.
    """

    kind: str = ""
    #: What the encoder reads as documents: "text" (passages) or "image" (pages; queries are text).
    modality: str = "text"

    @property
    def reads_pages(self) -> bool:
        """Whether its documents are page images (an index of pages) rather than passages."""
        return self.modality == PAGE_MODALITY
    #: "fp32", or an int8 precision where the encoder has an ONNX graph (espn.encoders.int8).
    precision: str = "fp32"
    d_cls: int
    d_bow: int
    #: How the BOW score is normalised: "mean" (MaxSim sum / number of query
    #: vectors, a cosine like the CLS score) or "sum" (ColBERTer's raw sum).
    bow_reduction: str = "mean"
    #: The learned score weight, if the model has one (ColBERTer); None = calibrate.
    learned_weight: float | None = None
    #: Whether the model trained its CLS vector for retrieval (ColBERTer, the HF sentence
    #: encoders). ColBERT checkpoints have none: their CLS vector is a mean of token vectors.
    has_trained_cls: bool = True

    @classmethod
    def from_pretrained(cls, *args: Any, **options: Any) -> "Encoder":
        """A fresh (unfitted) encoder from a model: a directory (or, where the family allows, a Hub
        name) and the family's options (device, trust_remote_code, precision, ...)."""
        raise InvalidParameterError(f"the {cls.kind or cls.__name__} encoder is not made from a model")

    def prepare_precision(self) -> None:
        """Ready the encoder's precision before anything is encoded; an encoder without an int8 path
        refuses any precision but fp32 (InvalidParameterError, one line)."""
        if self.precision != "fp32":
            raise InvalidParameterError(f"the {self.kind} encoder has no ONNX path: precision {self.precision!r} "
                                        "is refused (fp32 only)")

    # -- tokenisation: runs in DataLoader worker processes -------------------------
    @abc.abstractmethod
    def tokenize(self, texts: Sequence[str], is_query: bool) -> Mapping[str, Any]:
        """Tokenise a batch; the result is passed back to `embed_*` unchanged."""

    def text_length(self, text: str) -> int:
        """A cheap length estimate used to bucket texts into batches of similar length."""
        return len(text)

    def batch_order(self, texts: Sequence[str]) -> list[int]:
        """The order documents are cut into batches in: by length, so that a batch pads little.
        The build, the online writer and the fit all batch this way, so the same documents
        make the same batches."""
        return sorted(range(len(texts)), key=lambda i: self.text_length(texts[i]))

    # -- model: runs in the main process -------------------------------------------
    @abc.abstractmethod
    def embed_documents(self, tokens: Mapping[str, Any]) -> DocumentEmbeddings:
        ...

    @abc.abstractmethod
    def embed_queries(self, tokens: Mapping[str, Any]) -> QueryEmbeddings:
        ...

    def vector_spans(self, texts: Sequence[str], is_query: bool = False) -> list[VectorSpans]:
        """Where each BOW vector of each text came from, for match explanations.

        Must follow `embed_documents` / `embed_queries` exactly (truncation, dropped tokens,
        pooling), so that entry j describes stored vector j. Runs only when asked for.
        """
        raise NotImplementedError(f"the {self.kind or type(self).__name__} encoder cannot map its vectors to text")

    def vector_labels(self, texts: Sequence[str], is_query: bool = False) -> list[list[tuple[str, str]]] | None:
        """(kind, token) for each BOW vector, in the order of `vector_spans`, where the encoder keeps
        vectors that come from no text: kind "text", "special" ([CLS], [SEP]), "marker" or
        "expansion" (a query's mask padding). None: every vector is text (the default)."""
        return None

    def encode_documents(self, texts: Sequence[str]) -> DocumentEmbeddings:
        return self.embed_documents(self.tokenize(texts, is_query=False))

    def encode_queries(self, texts: Sequence[str]) -> QueryEmbeddings:
        return self.embed_queries(self.tokenize(texts, is_query=True))

    # -- index-time fitting and persistence ----------------------------------------
    def fit(self, sample_texts: Sequence[str], batch_size: int = 32, reuse: bool = False) -> None:
        """Fit index-time state (a projection) on a sample of documents; default: nothing.

        reuse: the sample is the whole corpus, about to be embedded in the same batches
        (`batch_order`, `batch_size`): an encoder may keep what the fit computed, and
        `embed_documents` use it instead of running the model a second time."""

    @property
    def needs_fit(self) -> bool:
        return False

    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """JSON-able description stored in the manifest under `encoder`."""

    @abc.abstractmethod
    def save(self, directory: Path) -> None:
        """Write what `load` needs into `directory` (the index's `encoder/`)."""

    @classmethod
    @abc.abstractmethod
    def load(cls, directory: Path, config: Mapping[str, Any], device: str | None = None) -> "Encoder":
        """Rebuild the encoder saved by `save`, offline."""
