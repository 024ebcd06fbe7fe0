"""Reading a ColBERTer checkpoint: the model (`ColBERTerModel`: DistilBERT and its heads), its
config, its weights (strictly matched to the architecture) and where it comes from (a local
directory, or a Hub snapshot fetched at load). The encoder is `espn.encoders.colberter`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import torch
from huggingface_hub import snapshot_download
from torch import nn
from transformers import DistilBertConfig, DistilBertModel

from ..errors import InvalidParameterError, RefusedInputError
from .model_files import load_weights, model_file, read_model_json, scan_model_dir

__all__ = ["CheckpointError", "ColBERTerModel", "DISTILBERT_BASE_UNCASED", "TOKENIZER_FILES", "check_supported",
           "distilbert_config", "load_strict", "read_checkpoint", "read_config", "resolve_checkpoint"]

log = logging.getLogger(__name__)

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
_HUB_PATTERNS = ["config.json", "model.safetensors", "pytorch_model.bin", *TOKENIZER_FILES]

#: config.json of `distilbert-base-uncased`, the base model of every published ColBERTer
#: checkpoint (their config.json names it in `bert_model` but does not include it).
DISTILBERT_BASE_UNCASED: dict[str, Any] = {
    "activation": "gelu",
    "attention_dropout": 0.1,
    "dim": 768,
    "dropout": 0.1,
    "hidden_dim": 3072,
    "initializer_range": 0.02,
    "max_position_embeddings": 512,
    "n_heads": 12,
    "n_layers": 6,
    "pad_token_id": 0,
    "qa_dropout": 0.1,
    "seq_classif_dropout": 0.2,
    "sinusoidal_pos_embds": False,
    "tie_weights_": True,
    "vocab_size": 30522,
}
_KNOWN_BASES = {"distilbert-base-uncased": DISTILBERT_BASE_UNCASED,
                "distilbert/distilbert-base-uncased": DISTILBERT_BASE_UNCASED}


class CheckpointError(InvalidParameterError):
    """A ColBERTer checkpoint is missing, incomplete or does not match the architecture."""


# ---------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------
class ColBERTerModel(nn.Module):
    """The ColBERTer module with the checkpoint's attribute names, so its state dict keys match."""

    def __init__(self, bert_config: Any, d_cls: int, d_bow: int, stopwords: bool) -> None:

        super().__init__()
        self.bert_model = DistilBertModel(bert_config)
        hidden = int(bert_config.dim)
        self.compressor_retrieval = nn.Linear(hidden, d_cls)
        self.compressor = nn.Linear(hidden, d_bow)
        self.stop_word_reducer = nn.Linear(d_bow, 1) if stopwords else None
        self.score_merger = nn.Parameter(torch.zeros(1))

    @property
    def hidden(self) -> int:
        return int(self.compressor.in_features)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, attention_mask [B, T] -> cls [B, d_cls], subword vectors [B, T, d_bow].

        The compressor runs before word pooling, as in the original (it is affine, so the
        order does not change the mean, and pooling 32-d vectors is cheaper than 768-d).
        """
        hidden = self.bert_model(input_ids=input_ids, attention_mask=attention_mask)[0]
        return self.compressor_retrieval(hidden[:, 0, :]), self.compressor(hidden)

    def gate(self, words: torch.Tensor) -> torch.Tensor:
        """[U, d_bow] -> [U] the contextual stop-word gate relu(stop_word_reducer(v)); 1 without one."""
        if self.stop_word_reducer is None:
            return torch.ones(len(words), dtype=words.dtype, device=words.device)
        return torch.relu(self.stop_word_reducer(words)).squeeze(-1)


def read_config(directory: Path) -> dict[str, Any]:
    """config.json, after the directory's files are checked (kinds, links, sizes: espn.encoders.model_files)."""
    path = directory / "config.json"
    scan_model_dir(directory, "colberter")
    if model_file(directory, "config.json", "colberter") is None:
        raise CheckpointError(f"{directory}: not a ColBERTer checkpoint (config.json missing)")
    try:
        config = read_model_json(path, "colberter")
    except RefusedInputError:
        raise
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config


def distilbert_config(config: Mapping[str, Any], source: Path) -> Any:
    """The DistilBERT skeleton's config: `bert_config` if given, else the named base model's."""

    if "bert_config" in config:
        values = dict(config["bert_config"])
        if values.get("model_type", "distilbert") != "distilbert":
            raise CheckpointError(f"{source}/config.json: bert_config.model_type must be 'distilbert', "
                                  f"got {values['model_type']!r}")
    elif config.get("bert_model") in _KNOWN_BASES:
        values = dict(_KNOWN_BASES[config["bert_model"]])
    else:
        raise CheckpointError(
            f"{source}/config.json: bert_model {config.get('bert_model')!r} is not one this loader knows "
            f"({', '.join(sorted(_KNOWN_BASES))}); add its DistilBERT config as 'bert_config' to config.json"
        )
    values.pop("model_type", None)
    values.pop("architectures", None)
    return DistilBertConfig(**values)


def check_supported(config: Mapping[str, Any], source: Path) -> None:
    """The variants this encoder implements: BOW² on, no second compression (Uni-ColBERTer)."""
    problems = []
    if config.get("aggregate_unique_ids", True) is not True:
        problems.append("aggregate_unique_ids must be true (BOW² whole-word pooling)")
    if int(config.get("second_compress_dim", -1)) > -1:
        problems.append("second_compress_dim > -1 (Uni-ColBERTer) is not supported")
    if config.get("compress_to_exact_mini_mode", False):
        problems.append("compress_to_exact_mini_mode (exact-match scoring) is not supported")
    if problems:
        raise CheckpointError(f"{source}/config.json: " + "; ".join(problems))


def read_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The state dict of a checkpoint directory (safetensors preferred) and the file it came from."""
    for name in _WEIGHT_FILES:
        real = model_file(directory, name, "colberter")
        if real is None:
            continue
        # Read as data only: a pickle naming anything but tensors is refused in one line.
        return load_weights(real, "colberter", name), name
    if (directory / "pytorch_model.bin.index.json").is_file() or (directory / "model.safetensors.index.json").is_file():
        raise CheckpointError(f"{directory}: sharded checkpoints are not supported; merge the shards into one file")
    raise CheckpointError(f"{directory}: no weights ({' or '.join(_WEIGHT_FILES)})")


def load_strict(model: ColBERTerModel, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy `state` into `model`; every key consumed and every parameter filled, or fail naming them."""
    state = dict(state)
    if "score_merger" in state and state["score_merger"].dim() == 0:
        state["score_merger"] = state["score_merger"].reshape(1)  # a scalar in some exports
    # Older transformers saved DistilBERT's position ids as a buffer; it holds no learned
    # value, so it is consumed by checking that it is what the model rebuilds.
    position_key = "bert_model.embeddings.position_ids"
    if position_key in state and position_key not in model.state_dict():
        ids = state.pop(position_key)
        if not torch.equal(ids.reshape(-1).long(), torch.arange(ids.numel())):
            raise CheckpointError(f"{source}: {position_key} is not 0..{ids.numel() - 1}")
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [f"{key} {tuple(state[key].shape)} (model {tuple(expected[key].shape)})"
                  for key in sorted(set(expected) & set(state)) if state[key].shape != expected[key].shape]
    problems = []
    if missing:
        problems.append(f"missing keys: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatch: {', '.join(mismatched)}")
    if problems:
        raise CheckpointError(f"{source}: checkpoint does not match the ColBERTer architecture: " + "; ".join(problems))
    model.load_state_dict(state, strict=True)


def resolve_checkpoint(path_or_hub_name: str | Path) -> Path:
    """A local checkpoint directory, or a Hub snapshot fetched now (never later, at query time)."""
    path = Path(path_or_hub_name).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_hub_name)
    if path.exists() or name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise CheckpointError(f"{name}: no such checkpoint directory")
    try:
        log.info("fetching %s from the Hugging Face Hub", name)
        return Path(snapshot_download(repo_id=name, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # noqa: BLE001 -- hub errors are many types (network, auth, not found)
        raise CheckpointError(
            f"{name}: not a local directory and the Hub download failed ({exc}); "
            "download the checkpoint where a network exists and pass its directory"
        ) from exc
