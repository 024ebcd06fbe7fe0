"""Reading ColBERT checkpoints (colbert-ai and PyLate formats) from a local directory: which
format, the settings (`ColBERTSettings`), the Dense chain and where the backbone lies. The
encoder that runs them is `espn.encoders.colbert`, whose module doc describes both formats."""

from __future__ import annotations

import dataclasses
import string
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import parse_qsl

import torch

from ..errors import InvalidParameterError, RefusedInputError
from ..untrusted import inside_root
from .model_files import NOT_COPIED, check_remote_code, load_weights, model_file, read_model_json

__all__ = ["ColBERTSettings", "DenseLayer", "checkpoint_format", "parse_spec", "read_colbert_ai", "read_pylate",
           "refuse_remote_code", "SETTING_NAMES", "SETTING_RANGES", "WEIGHT_FILES", "weights_file", "NOT_COPIED", "COLBERT_AI_DEFAULTS",
           "PYLATE_DEFAULTS", "MIN_LENGTH", "MAX_PREFIX_CHARS", "MAX_SKIPLIST_WORDS", "MAX_SKIPLIST_WORD_CHARS"]

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")

#: colbert-ai's ColBERTConfig defaults (colbert/infra/config/settings.py) for what artifact.metadata lacks.
COLBERT_AI_DEFAULTS: dict[str, Any] = {
    "query_maxlen": 32, "doc_maxlen": 220, "query_token_id": "[unused0]", "doc_token_id": "[unused1]",
    "mask_punctuation": True, "attend_to_mask_tokens": False, "dim": 128,
}
#: PyLate's ColBERT defaults (pylate/models/colbert.py) for what config_sentence_transformers.json lacks.
PYLATE_DEFAULTS: dict[str, Any] = {
    "query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": 32, "document_length": 180,
    "do_query_expansion": True, "attend_to_expansion_tokens": False,
}
#: Settings a spec may give (`colbert:PATH?name=value&...`); booleans as 1/0/true/false,
#: skiplist_words comma-separated (empty: none), prefixes URL-encoded ("%5BQ%5D+" is "[Q] ").
SETTING_NAMES = ("query_prefix", "document_prefix", "query_length", "document_length", "do_query_expansion",
                 "attend_to_expansion_tokens", "skiplist_words", "do_lower_case")
#: Dense activations by the dotted name sentence-transformers writes.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.Tanh": torch.tanh,
    "torch.nn.modules.activation.ReLU": torch.relu,
    "torch.nn.modules.activation.GELU": torch.nn.functional.gelu,
    "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
    "torch.nn.modules.activation.SiLU": torch.nn.functional.silu,
}
_DENSE_TYPES = ("pylate.models.Dense.Dense", "pylate.models.Dense", "sentence_transformers.models.Dense",
                "sentence_transformers.models.Dense.Dense")
_TRANSFORMER_TYPES = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Transformer.Transformer")
#: The fewest tokens a query or document may have: [CLS], the marker, [SEP].
MIN_LENGTH = 3
#: A marker is one token of the vocabulary ("[Q] ", "[unused0]"); its spelling is bounded.
MAX_PREFIX_CHARS = 64
#: The skiplist is punctuation by default (32 words); a longer list is a stop-word list at most.
MAX_SKIPLIST_WORDS = 4096
MAX_SKIPLIST_WORD_CHARS = 64
#: The range of every setting, as `espn index --help` and the docs quote it. The lengths' upper
#: bound is the backbone's: config.json's max_position_embeddings (or the tokenizer's
#: model_max_length where lower); a query pads to query_length, so 10^9 would pad every query to
#: 10^9 tokens.
SETTING_RANGES = {
    "query_prefix": f"a token of the tokenizer, at most {MAX_PREFIX_CHARS} characters (empty: no marker)",
    "document_prefix": f"a token of the tokenizer, at most {MAX_PREFIX_CHARS} characters (empty: no marker)",
    "query_length": f"an integer in [{MIN_LENGTH}, the backbone's max_position_embeddings]",
    "document_length": f"an integer in [{MIN_LENGTH}, the backbone's max_position_embeddings]",
    "do_query_expansion": "a boolean (1/0/true/false)",
    "attend_to_expansion_tokens": "a boolean (1/0/true/false)",
    "skiplist_words": f"comma-separated, at most {MAX_SKIPLIST_WORDS} words of at most "
                      f"{MAX_SKIPLIST_WORD_CHARS} characters",
    "do_lower_case": "a boolean (1/0/true/false)",
}


def checkpoint_format(path: str | Path) -> str | None:
    """"colbert-ai" or "pylate" when `path` holds a ColBERT checkpoint of that format, else None."""
    path = Path(path)
    config = _read_json(path / "config.json") if (path / "config.json").is_file() else {}
    if "HF_ColBERT" in (config.get("architectures") or []) or (path / "artifact.metadata").is_file():
        return "colbert-ai"
    if (path / "modules.json").is_file():
        modules = _read_json(path / "modules.json")
        if any(str(m.get("type", "")).split(".")[-1] == "Dense" for m in modules if isinstance(m, dict)):
            return "pylate"
    if (path / "config_sentence_transformers.json").is_file():
        st = _read_json(path / "config_sentence_transformers.json")
        if any(key in st for key in ("query_prefix", "document_prefix", "do_query_expansion", "query_length")):
            return "pylate"
    return None


def parse_spec(location: str) -> tuple[str, dict[str, Any]]:
    """"PATH?name=value&..." -> (PATH, settings); names must be in SETTING_NAMES."""
    path, _, query = location.partition("?")
    overrides: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if name not in SETTING_NAMES:
            raise InvalidParameterError(f"--encoder colbert: unknown setting {name!r}; known: {', '.join(SETTING_NAMES)}")
        overrides[name] = value
    return path, overrides


def _read_json(path: Path) -> Any:
    """A JSON file of a checkpoint, bounded (espn.encoders.model_files) before it is parsed."""
    try:
        return read_model_json(path, "colbert")
    except OSError as exc:
        raise InvalidParameterError(f"{path}: cannot read it as JSON ({exc.strerror or exc})") from None


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise InvalidParameterError(f"{name} must be a boolean (1/0/true/false), got {value!r}")


def _as_length(name: str, value: Any, limit: int | None = None) -> int:
    if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
        raise InvalidParameterError(f"{name} must be an integer, got {value!r}")
    try:
        length = int(str(value).strip()) if not isinstance(value, (int, float)) else int(value)
    except (TypeError, ValueError):
        raise InvalidParameterError(f"{name} must be an integer, got {str(value)[:40]!r}") from None
    if length < MIN_LENGTH:
        raise InvalidParameterError(f"{name} must be >= {MIN_LENGTH} ([CLS], marker, [SEP]), got {length}")
    if limit is not None and length > limit:
        raise InvalidParameterError(f"{name} must be in [{MIN_LENGTH}, {limit}] (the backbone's "
                                    f"max_position_embeddings), got {length}")
    return length


def _as_prefix(name: str, value: Any) -> str:
    text = str(value)
    if len(text) > MAX_PREFIX_CHARS:
        raise InvalidParameterError(f"{name} must be a token of at most {MAX_PREFIX_CHARS} characters, "
                                    f"got {len(text)} characters")
    return text


def _as_words(value: Any) -> tuple[str, ...]:
    words = [w for w in value.split(",") if w] if isinstance(value, str) else value
    if not isinstance(words, (list, tuple)):
        raise InvalidParameterError(f"skiplist_words must be a list of words, got {type(words).__name__}")
    if len(words) > MAX_SKIPLIST_WORDS:
        raise InvalidParameterError(f"skiplist_words must hold at most {MAX_SKIPLIST_WORDS} words, got {len(words)}")
    long = next((str(w) for w in words if len(str(w)) > MAX_SKIPLIST_WORD_CHARS), None)
    if long is not None:
        raise InvalidParameterError(f"skiplist_words: each word at most {MAX_SKIPLIST_WORD_CHARS} characters, "
                                    f"got one of {len(long)}")
    return tuple(str(w) for w in words)


@dataclasses.dataclass(frozen=True)
class ColBERTSettings:
    """How texts become token ids, as the checkpoint's reference code does it.

    skiplist_rule: how skiplist words become ids: "encode" (colbert-ai: the first id of
    `tokenizer.encode(word)`) or "token" (PyLate: `convert_tokens_to_ids(word)`, the unknown
    token's id for a word not in the vocabulary, as PyLate does).
    """

    format: str
    query_prefix: str
    document_prefix: str
    query_length: int
    document_length: int
    do_query_expansion: bool
    attend_to_expansion_tokens: bool
    skiplist_words: tuple[str, ...]
    skiplist_rule: str
    do_lower_case: bool = False
    strip: bool = False

    @classmethod
    def resolve(cls, format: str, found: Mapping[str, Any], overrides: Mapping[str, Any],
                max_length: int | None = None) -> "ColBERTSettings":
        """The checkpoint's settings (`found`, in PyLate's names) with the user's `overrides` on top,
        each in its SETTING_RANGES range; max_length: the backbone's position limit (lengths above
        it are refused)."""
        merged = {**found, **overrides}
        words = _as_words(merged.get("skiplist_words", list(string.punctuation)))
        expansion = _as_bool("do_query_expansion", merged.get("do_query_expansion", True))
        return cls(
            format=format,
            query_prefix=_as_prefix("query_prefix", merged.get("query_prefix", "")),
            document_prefix=_as_prefix("document_prefix", merged.get("document_prefix", "")),
            query_length=_as_length("query_length", merged.get("query_length", 32), max_length),
            document_length=_as_length("document_length", merged.get("document_length", 180), max_length),
            do_query_expansion=expansion,
            # PyLate: "If we do not do query expansion, we do not attend to the expansion tokens".
            attend_to_expansion_tokens=expansion and _as_bool("attend_to_expansion_tokens",
                                                              merged.get("attend_to_expansion_tokens", False)),
            skiplist_words=words,
            skiplist_rule="encode" if format == "colbert-ai" else "token",
            do_lower_case=_as_bool("do_lower_case", merged.get("do_lower_case", False)),
            strip=format == "pylate",  # sentence-transformers strips each text before tokenising
        )


@dataclasses.dataclass
class DenseLayer:
    """One projection: y = activation(x Wᵀ + b) (+ x, or + x Rᵀ, with PyLate's use_residual)."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None
    activation: str
    residual: torch.Tensor | None = None  # [out, in] when use_residual and in != out
    use_residual: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = _ACTIVATIONS[self.activation](torch.nn.functional.linear(x, self.weight, self.bias))
        if self.use_residual:
            y = y + (x if self.residual is None else torch.nn.functional.linear(x, self.residual))
        return y

    def to(self, device: str) -> "DenseLayer":
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return DenseLayer(self.weight.to(device), move(self.bias), self.activation, move(self.residual),
                          self.use_residual)


def weights_file(directory: Path) -> Path | None:
    """The first of WEIGHT_FILES in `directory`, None where it has neither."""
    return next((Path(directory) / name for name in WEIGHT_FILES if (Path(directory) / name).is_file()), None)


def _load_state(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of `directory`'s model.safetensors or pytorch_model.bin (read as data: a pickle
    naming anything but tensors is refused in one line, espn.encoders.model_files)."""
    for name in WEIGHT_FILES:
        real = model_file(directory, name, "colbert")
        if real is not None:
            return load_weights(real, "colbert", name)
    raise InvalidParameterError(f"{directory}: no model.safetensors or pytorch_model.bin")


def refuse_remote_code(directory: Path, trust_remote_code: bool = False) -> bool:
    """Refuse a backbone that needs its own code (an auto_map, a model_type transformers does not
    ship) unless `trust_remote_code`; returns whether its code will run."""
    if model_file(directory, "config.json", "colbert") is None:
        raise InvalidParameterError(f"{directory}: config.json missing; not a Hugging Face model directory")
    if not isinstance(_read_json(directory / "config.json"), dict):
        raise RefusedInputError(f"colbert: refused, {directory / 'config.json'} is not a JSON object")
    return check_remote_code(directory, trust_remote_code, "colbert")


def read_colbert_ai(path: Path) -> tuple[dict[str, Any], list[DenseLayer], Path]:
    """colbert-ai: (settings in PyLate's names, [linear], backbone directory)."""
    metadata: dict[str, Any] = {}
    if (path / "artifact.metadata").is_file():
        metadata = _read_json(path / "artifact.metadata")
        if isinstance(metadata.get("config"), dict):  # older checkpoints nest it
            metadata = metadata["config"]
    meta = {**COLBERT_AI_DEFAULTS, **{k: v for k, v in metadata.items() if v is not None}}
    if not _as_bool("mask_punctuation", meta["mask_punctuation"]):
        skiplist: list[str] = []
    else:
        skiplist = list(string.punctuation)
    found = {
        "query_prefix": meta["query_token_id"], "document_prefix": meta["doc_token_id"],
        "query_length": meta["query_maxlen"], "document_length": meta["doc_maxlen"],
        "do_query_expansion": True, "attend_to_expansion_tokens": meta["attend_to_mask_tokens"],
        "skiplist_words": skiplist,
    }
    state = _load_state(path)
    if "linear.weight" not in state:
        raise InvalidParameterError(f"{path}: a colbert-ai checkpoint without the root linear.weight projection")
    linear = state["linear.weight"].float()
    if "dim" in metadata and int(metadata["dim"]) != linear.shape[0]:
        raise InvalidParameterError(f"{path}: artifact.metadata dim {metadata['dim']} != linear.weight's {linear.shape[0]}")
    return found, [DenseLayer(linear, None, "torch.nn.modules.linear.Identity")], path


def _read_dense(directory: Path) -> DenseLayer:
    config = _read_json(directory / "config.json")
    activation = str(config.get("activation_function", "torch.nn.modules.linear.Identity"))
    if activation not in _ACTIVATIONS:
        raise InvalidParameterError(f"{directory}: Dense activation {activation!r} is not supported; "
                                    f"supported: {', '.join(sorted(_ACTIVATIONS))}")
    state = {k.removeprefix("linear.") if k.startswith("linear.") else k: v.float()
             for k, v in _load_state(directory).items()}
    weight = state.get("weight")
    if weight is None or tuple(weight.shape) != (int(config["out_features"]), int(config["in_features"])):
        raise InvalidParameterError(f"{directory}: Dense weight missing or not [out_features, in_features]")
    use_residual = bool(config.get("use_residual", False))
    residual = state.get("residual.weight")
    if use_residual and weight.shape[0] != weight.shape[1] and residual is None:
        raise InvalidParameterError(f"{directory}: use_residual with in != out but no residual.weight")
    return DenseLayer(weight, state.get("bias") if config.get("bias", True) else None, activation,
                      residual if use_residual else None, use_residual)


def read_pylate(path: Path) -> tuple[dict[str, Any], list[DenseLayer], Path]:
    """PyLate: (settings, Dense chain, Transformer directory)."""
    modules = sorted(_read_json(path / "modules.json"), key=lambda m: int(m.get("idx", 0)))
    backbone: Path | None = None
    chain: list[DenseLayer] = []
    for module in modules:
        kind = str(module.get("type", ""))
        where = inside_root(path, str(module.get("path", "")), f"colbert: {path / 'modules.json'}", RefusedInputError)
        if kind in _TRANSFORMER_TYPES and backbone is None and not chain:
            backbone = where
        elif kind in _DENSE_TYPES and backbone is not None:
            chain.append(_read_dense(where))
        else:
            raise InvalidParameterError(f"{path}: modules.json module {kind!r} at {module.get('path')!r} is not "
                                        "a ColBERT Transformer -> Dense chain espn can run")
    if backbone is None or not chain:
        raise InvalidParameterError(f"{path}: modules.json needs a Transformer then at least one Dense module")
    found = dict(PYLATE_DEFAULTS)
    if (path / "config_sentence_transformers.json").is_file():
        st = _read_json(path / "config_sentence_transformers.json")
        found.update({k: st[k] for k in ("query_prefix", "document_prefix", "query_length", "document_length",
                                         "do_query_expansion", "attend_to_expansion_tokens", "skiplist_words")
                      if st.get(k) is not None})
    for source in (backbone / "sentence_bert_config.json", path / "sentence_bert_config.json"):
        if source.is_file():
            found["do_lower_case"] = bool(_read_json(source).get("do_lower_case", False))
            break
    return found, chain, backbone
