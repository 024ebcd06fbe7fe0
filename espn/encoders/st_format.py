"""Which checkpoints are Sentence Transformers 6's own MultiVectorEncoder saves (read without loading them).

Kept apart from `espn.encoders.multivector` (which loads the library and the model) so that the
encoder registry can route a spec without importing either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import InvalidParameterError
from ..untrusted import check_json_depth

__all__ = ["is_sentence_transformers_save", "is_visual_save", "read_save_json", "OWN_LOADER_TYPES"]

#: The modules.json types espn's own PyLate loader (espn.encoders.colbert_checkpoint) runs: a
#: Transformer, then Dense modules. A chain with anything else goes to Sentence Transformers.
OWN_LOADER_TYPES = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Transformer.Transformer",
                    "pylate.models.Dense.Dense", "pylate.models.Dense", "sentence_transformers.models.Dense",
                    "sentence_transformers.models.Dense.Dense")
#: config_sentence_transformers.json and modules.json are a few hundred bytes; a larger one is no save of ours.
_MAX_JSON_BYTES = 1 << 20


def read_save_json(path: Path) -> Any:
    """A JSON file of a Sentence Transformers save (modules.json, its configs): bounded, depth-checked,
    InvalidParameterError in one line on failure."""
    try:
        with open(path, "rb") as file:
            raw = file.read(_MAX_JSON_BYTES + 1)
        if len(raw) > _MAX_JSON_BYTES:
            raise InvalidParameterError(f"{path}: larger than {_MAX_JSON_BYTES} bytes; not a model configuration")
    except OSError as exc:
        raise InvalidParameterError(f"{path}: cannot read it as JSON ({exc})") from None
    check_json_depth(raw, str(path), error=InvalidParameterError)  # before the parser, which recurses
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise InvalidParameterError(f"{path}: cannot read it as JSON ({exc})") from None


def is_sentence_transformers_save(path: str | Path) -> bool:
    """Whether `path` is a multi-vector checkpoint for Sentence Transformers 6 to load:

    - its own MultiVectorEncoder format: `"model_type": "MultiVectorEncoder"` in
      config_sentence_transformers.json, or a modules.json naming a
      `sentence_transformers.multi_vector_encoder` module (the MultiVectorMask, a token pooling);
    - a ColBERT modules.json chain (it has a Dense module) with a module other than the
      Transformer -> Dense chain espn's own PyLate loader runs (OWN_LOADER_TYPES).

    Never a single-vector save (a config_sentence_transformers.json `model_type` other than
    MultiVectorEncoder or PyLate's ColBERT), which the library would extend with a random projection,
    and never a colbert-ai checkpoint (artifact.metadata), which espn's own loader reads."""
    path = Path(path)
    if (path / "artifact.metadata").is_file():
        return False
    st_config = path / "config_sentence_transformers.json"
    if st_config.is_file():
        found = read_save_json(st_config)
        kind = found.get("model_type") if isinstance(found, dict) else None
        if kind == "MultiVectorEncoder":
            return True
        if kind is not None and kind != "ColBERT":
            return False
    modules = path / "modules.json"
    if not modules.is_file():
        return False
    found = read_save_json(modules)
    if not isinstance(found, list):
        return False
    types = [str(m.get("type", "")) for m in found if isinstance(m, dict)]
    if any(t.startswith("sentence_transformers.multi_vector_encoder.") for t in types):
        return True
    return any(t.split(".")[-1] == "Dense" for t in types) and any(t not in OWN_LOADER_TYPES for t in types)


def is_visual_save(path: str | Path) -> bool:
    """Whether `path` is a multi-vector checkpoint whose documents are page images (ColPali, ColQwen,
    ColModernVBert): a Sentence Transformers save whose first module (the Transformer) declares an
    `image` modality in its sentence_bert_config.json, or a transformers-native late-interaction
    retriever (config.json `architectures` ending in `ForRetrieval`, which the library loads with
    text and image modalities). Read without loading the model; a file it cannot read (too
    large, not JSON) answers False, and the loader then refuses it in its own words."""
    try:
        return _declares_images(Path(path))
    except InvalidParameterError:
        return False


def _declares_images(path: Path) -> bool:
    if is_sentence_transformers_save(path):
        modules = path / "modules.json"
        where = ""
        if modules.is_file():
            found = read_save_json(modules)
            first = [m for m in found if isinstance(m, dict)] if isinstance(found, list) else []
            if first:
                where = str(min(first, key=lambda m: int(m.get("idx", 0))).get("path", ""))
        if Path(where).is_absolute() or ".." in Path(where).parts:
            return False  # the loader refuses it, naming the module
        settings = path / where / "sentence_bert_config.json"
        found = read_save_json(settings) if settings.is_file() else {}
        modalities = found.get("modality_config") if isinstance(found, dict) else None
        return isinstance(modalities, dict) and "image" in modalities
    config = path / "config.json"
    if (path / "modules.json").is_file() or not config.is_file():
        return False
    found = read_save_json(config)
    architectures = found.get("architectures") if isinstance(found, dict) else None
    return isinstance(architectures, list) and any(str(a).endswith("ForRetrieval") for a in architectures)
