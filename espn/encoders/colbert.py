"""ColBERT checkpoints (colbert-ai and PyLate formats), encoded exactly as their reference code does.

Two formats are read from a local directory (never from a hub):

- **colbert-ai** (`colbert-ir/colbertv2.0`, `answerdotai/answerai-colbert-small-v1`,
  `mixedbread-ai/mxbai-colbert-large-v1`): `config.json` with `architectures: ["HF_ColBERT"]`,
  the backbone's weights under its prefix (`bert.`, ...) plus a root `linear.weight`
  (hidden -> dim, no bias), settings in `artifact.metadata` (flat, or nested under `config`),
  colbert-ai's defaults for what it lacks.
- **PyLate / sentence-transformers** (`lightonai/GTE-ModernColBERT-v1`, anything trained with
  PyLate): `modules.json` naming a Transformer and one or more Dense modules (activation,
  bias and PyLate's `use_residual` as each Dense `config.json` says),
  `config_sentence_transformers.json` for the prefixes, lengths and expansion settings,
  `sentence_bert_config.json` for `do_lower_case`.

The recipe (colbert-ai's QueryTokenizer/DocTokenizer and `ColBERT.query/doc`, PyLate's
`ColBERT.tokenize/encode`, which agree): the text is tokenised to `length - 1` tokens
(truncation keeps `[SEP]`), the marker token id is inserted right after `[CLS]`; a query with
expansion is padded to `query_length` with the mask token, attended or not as the checkpoint
says, and keeps every position; without expansion a query keeps its real tokens. A document
keeps its real tokens except the skiplist (punctuation) ones, `[CLS]`, marker and `[SEP]`
included. The backbone's last hidden state goes through the Dense chain and is L2-normalised.
The score of a document is the model's MaxSim: the sum over the query vectors of the best dot
product (`bow_reduction = "sum"`, no CLS mixing). These models have no trained CLS vector
(`has_trained_cls = False`); the CLS vector stored for the first stage is the normalised mean
of the text's vectors.

Settings the checkpoint lacks or gets wrong can be given in the spec:
`colbert:PATH?query_length=32&attend_to_expansion_tokens=1` (see `SETTING_NAMES`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer
from transformers.utils import logging as hf_logging

from ..errors import InvalidParameterError
from ..files.checksums import sha256_file
from .backbone_config import normalised_configs
from .base import DocumentEmbeddings, Encoder, QueryEmbeddings, VectorSpans, overflowed, trimmed_span
from .colbert_checkpoint import (SETTING_NAMES, ColBERTSettings, DenseLayer, checkpoint_format, weights_file,
                                 parse_spec, read_colbert_ai, read_pylate, refuse_remote_code)
from .model_files import check_model_dir, copy_model_dir, loading, position_limit, read_model_json
from .int8 import check_precision, loaded_precision
from .onnx import QueryGraphOwner, checked_query_graph

__all__ = ["ColBERTEncoder", "ColBERTSettings", "DenseLayer", "checkpoint_format", "parse_spec", "SETTING_NAMES"]

log = logging.getLogger(__name__)


def _insert_after_cls(values: torch.Tensor, fill: int) -> torch.Tensor:
    """[B, T] -> [B, T + 1] with `fill` at column 1 (PyLate's insert_prefix_token, colbert-ai's _insert_prefix_token)."""
    column = torch.full((values.shape[0], 1), fill, dtype=values.dtype)
    return torch.cat([values[:, :1], column, values[:, 1:]], dim=1)


class ColBERTEncoder(QueryGraphOwner, Encoder):
    """A ColBERT checkpoint's query and document token vectors, scored by MaxSim (sum)."""

    kind = "colbert"
    bow_reduction = "sum"
    learned_weight = 0.0
    has_trained_cls = False

    def __init__(self, checkpoint_dir: str | Path, overrides: Mapping[str, Any] | None = None,
                 device: str | None = None, name: str | None = None, query_backend: str = "auto",
                 weights_sha256: str | None = None, trust_remote_code: bool = False, precision: str = "fp32") -> None:
        """overrides: settings by SETTING_NAMES over the checkpoint's; precision: "fp32" or int8
        (espn.encoders.int8.PRECISIONS; queries and documents through the quantised ONNX graph, CPU);
        query_backend: "auto"
        (ONNX Runtime on a CPU where it is installed and the backbone exports), "onnx" or "torch";
        trust_remote_code: allow a backbone that needs its own Python code (`--trust-remote-code`);
        without it such a checkpoint is refused in one line."""
        hf_logging.disable_progress_bar()
        self.checkpoint_dir = Path(checkpoint_dir)
        if not self.checkpoint_dir.is_dir():
            raise InvalidParameterError(f"colbert: {self.checkpoint_dir} is not a directory (espn loads checkpoints "
                                        "from a local directory only)")
        # Files, links, sizes, remote code, tokenizer and weights checked before anything reads them.
        remote = check_model_dir(self.checkpoint_dir, trust_remote_code, "colbert")
        fmt = checkpoint_format(self.checkpoint_dir)
        if fmt is None:
            raise InvalidParameterError(f"colbert: {self.checkpoint_dir} holds neither a colbert-ai checkpoint "
                                        "(config.json HF_ColBERT, artifact.metadata) nor a PyLate one (modules.json with Dense)")
        unknown = sorted(set(overrides or {}) - set(SETTING_NAMES))
        if unknown:
            raise InvalidParameterError(f"colbert: unknown settings {unknown}; known: {', '.join(SETTING_NAMES)}")
        reader = read_colbert_ai if fmt == "colbert-ai" else read_pylate
        found, chain, backbone_dir = reader(self.checkpoint_dir)
        if backbone_dir.resolve() != self.checkpoint_dir.resolve():
            remote = check_model_dir(backbone_dir, trust_remote_code, "colbert")
        remote = refuse_remote_code(backbone_dir, trust_remote_code) or remote
        #: Whether the backbone's own code runs (allowed by --trust-remote-code; in the manifest).
        self.trust_remote_code = remote
        self.name = name or self.checkpoint_dir.name
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.backbone_dir = backbone_dir
        # normalised_configs: a config.json another transformers release wrote (PyLate 1.6's 5.3) read in memory.
        with loading(backbone_dir, "the tokenizer"), normalised_configs():
            self.tokenizer = AutoTokenizer.from_pretrained(str(backbone_dir), trust_remote_code=remote)
        # Lengths past the backbone's positions are refused here, before the model loads (and
        # again when an index opens: its manifest's settings come through this constructor).
        limit = position_limit(read_model_json(backbone_dir / "config.json", "colbert"), self.tokenizer)
        self.settings = ColBERTSettings.resolve(fmt, found, overrides or {}, max_length=limit)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report lists linear.weight as unexpected: it is ours
        try:
            with loading(backbone_dir, "the model"), normalised_configs():
                model, info = AutoModel.from_pretrained(str(backbone_dir), output_loading_info=True,
                                                        dtype=torch.float32, trust_remote_code=remote)
        finally:
            hf_logging.set_verbosity(verbosity)
        missing = [key for key in info.get("missing_keys", ()) if not key.startswith("pooler.")]
        if missing:
            raise InvalidParameterError(f"colbert: {backbone_dir}: backbone weights missing ({', '.join(missing[:3])}"
                                        f"{', ...' if len(missing) > 3 else ''}); is the weight prefix the backbone's?")
        self.model = model.to(self.device).eval()
        self._forward_keys = set(inspect.signature(self.model.forward).parameters)
        hidden = int(self.model.config.hidden_size)
        if chain[0].weight.shape[1] != hidden:
            raise InvalidParameterError(f"colbert: the projection takes {chain[0].weight.shape[1]}-d input, "
                                        f"the backbone gives {hidden}")
        self.chain = [layer.to(self.device) for layer in chain]
        self.d_bow = int(chain[-1].weight.shape[0])
        self.d_cls = self.d_bow
        self._resolve_ids()
        if query_backend not in ("auto", "onnx", "torch"):
            raise InvalidParameterError(f"query_backend must be auto, onnx or torch, got {query_backend!r}")
        check_precision(precision, self.device, query_backend)
        self.precision = precision
        self.query_backend = query_backend
        self._weights_sha256 = weights_sha256
        self._graph: Any = None
        self._graph_lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, location: str | Path, device: str | None = None, trust_remote_code: bool = False,
                        precision: str = "fp32") -> "ColBERTEncoder":
        """From a spec's location, "PATH" or "PATH?name=value&..."."""
        path, overrides = parse_spec(str(location))
        return cls(Path(path), overrides, device=device, trust_remote_code=trust_remote_code, precision=precision)

    def _resolve_ids(self) -> None:
        """Marker, mask and skiplist ids, refusing what the tokenizer cannot honour."""
        s, tok = self.settings, self.tokenizer
        self.prefix_ids: dict[bool, int | None] = {}
        for is_query, prefix, name in ((True, s.query_prefix, "query_prefix"), (False, s.document_prefix, "document_prefix")):
            if not prefix:
                self.prefix_ids[is_query] = None
                continue
            token_id = tok.convert_tokens_to_ids(prefix)
            if not isinstance(token_id, int) or (token_id == tok.unk_token_id and prefix != tok.unk_token):
                raise InvalidParameterError(f"colbert: {name} {prefix!r} is not a token of the tokenizer in "
                                            f"{self.backbone_dir}; pass the checkpoint's marker: colbert:PATH?{name}=...")
            self.prefix_ids[is_query] = token_id
        self.mask_id = tok.mask_token_id
        if s.do_query_expansion and self.mask_id is None:
            raise InvalidParameterError(f"colbert: query expansion needs a mask token and {self.backbone_dir}'s "
                                        "tokenizer has none; pass colbert:PATH?do_query_expansion=0")
        if tok.pad_token_id is None:  # PyLate pads with the mask token (or EOS) where there is no pad token
            tok.pad_token = tok.mask_token if tok.mask_token is not None else tok.eos_token
        if s.skiplist_rule == "encode":
            ids = {tok.encode(word, add_special_tokens=False)[0] for word in s.skiplist_words
                   if tok.encode(word, add_special_tokens=False)}
        else:
            ids = {tok.convert_tokens_to_ids(word) for word in s.skiplist_words}
        self.skiplist_ids = torch.tensor(sorted(i for i in ids if i is not None), dtype=torch.int64)

    # -- tokenisation ----------------------------------------------------------------
    def _prepare(self, texts: Sequence[str]) -> tuple[list[str], list[int]]:
        """Texts as the reference tokenises them (stripped, lowercased) and each one's leading cut."""
        out, shifts = [], []
        for text in texts:
            cut = len(text) - len(text.lstrip()) if self.settings.strip else 0
            text = text.strip() if self.settings.strip else text
            out.append(text.lower() if self.settings.do_lower_case else text)
            shifts.append(cut)
        return out, shifts

    def _encode(self, texts: Sequence[str], is_query: bool, offsets: bool = False) -> dict[str, torch.Tensor]:
        """input_ids, attention_mask (+ token_type_ids), keep [B, T] bool (the positions that become
        vectors) and text [B, T] bool (positions holding text), as the reference builds them."""
        s = self.settings
        prefix_id = self.prefix_ids[is_query]
        length = s.query_length if is_query else s.document_length
        expand = is_query and s.do_query_expansion
        prepared, _ = self._prepare(texts)
        encoded = self.tokenizer(prepared, padding="max_length" if expand else "longest", truncation="longest_first",
                                 max_length=length - 1 if prefix_id is not None else length, return_tensors="pt",
                                 return_special_tokens_mask=True, return_offsets_mapping=offsets)
        out = {key: encoded[key] for key in ("input_ids", "attention_mask", "token_type_ids", "offset_mapping")
               if key in encoded}
        text = (encoded["attention_mask"].bool() & ~encoded["special_tokens_mask"].bool())
        real = encoded["attention_mask"].bool()
        if prefix_id is not None:
            out["input_ids"] = _insert_after_cls(out["input_ids"], prefix_id)
            out["attention_mask"] = _insert_after_cls(out["attention_mask"], 1)
            if "token_type_ids" in out:
                out["token_type_ids"] = _insert_after_cls(out["token_type_ids"], 0)
            if offsets:
                out["offset_mapping"] = torch.cat([out["offset_mapping"][:, :1], torch.zeros_like(
                    out["offset_mapping"][:, :1]), out["offset_mapping"][:, 1:]], dim=1)
            text, real = _insert_after_cls(text, False), _insert_after_cls(real, True)
        if expand:
            out["input_ids"][~real] = int(self.mask_id)  # type: ignore[arg-type]  # checked in _resolve_ids
            if s.attend_to_expansion_tokens:
                out["attention_mask"].fill_(1)
            keep = torch.ones_like(real)
        elif is_query:
            keep = real
        else:
            keep = real & ~torch.isin(out["input_ids"], self.skiplist_ids)
        out["keep"], out["text"] = keep, text
        out["expansion"] = ~real if expand else torch.zeros_like(real)
        truncated = overflowed(encoded)
        if truncated is not None:
            out["truncated"] = torch.from_numpy(truncated)
        return out

    def tokenize(self, texts: Sequence[str], is_query: bool) -> Mapping[str, Any]:
        return self._encode(texts, is_query)

    def vector_spans(self, texts: Sequence[str], is_query: bool = False) -> list[VectorSpans]:
        """One entry per vector in stored order: the token's characters, or no span for [CLS],
        the marker, [SEP] and query expansion tokens (see `vector_labels`)."""
        encoded = self._encode(texts, is_query, offsets=True)
        _, shifts = self._prepare(texts)
        out: list[VectorSpans] = []
        for row, shift in enumerate(shifts):
            keep, text, offsets = encoded["keep"][row], encoded["text"][row], encoded["offset_mapping"][row]
            out.append([[trimmed_span(texts[row], int(offsets[p, 0]) + shift, int(offsets[p, 1]) + shift)]
                        if text[p] else [] for p in torch.nonzero(keep).flatten().tolist()])
        return out

    def vector_labels(self, texts: Sequence[str], is_query: bool = False) -> list[list[tuple[str, str]]]:
        """(kind, token) per vector in stored order; kind: "text", "special" ([CLS], [SEP]),
        "marker" (the query or document marker) or "expansion" (a query's mask padding)."""
        encoded = self._encode(texts, is_query)
        marker = self.prefix_ids[is_query] is not None
        out = []
        for row in range(len(texts)):
            tokens = self.tokenizer.convert_ids_to_tokens(encoded["input_ids"][row].tolist())
            text, expansion = encoded["text"][row].tolist(), encoded["expansion"][row].tolist()
            labels = []
            for p in torch.nonzero(encoded["keep"][row]).flatten().tolist():
                kind = ("text" if text[p] else "expansion" if expansion[p] else "marker" if marker and p == 1
                        else "special")
                labels.append((kind, str(tokens[p])))
            out.append(labels)
        return out

    # -- model -----------------------------------------------------------------------
    @torch.inference_mode()
    def _vectors(self, tokens: Mapping[str, Any], graph: Any = None) -> torch.Tensor:
        """[B, T, d_bow] L2-normalised token vectors (every position; `keep` says which count)."""
        inputs = {key: tokens[key].to(self.device) for key in ("input_ids", "attention_mask", "token_type_ids")
                  if key in tokens and key in self._forward_keys}
        if graph is not None:
            hidden = graph.hidden_states(inputs["input_ids"].cpu(), inputs["attention_mask"].cpu()).to(self.device)
        else:
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.device.startswith("cuda")):
                hidden = self.model(**inputs).last_hidden_state.float()
        for layer in self.chain:
            hidden = layer(hidden)
        return torch.nn.functional.normalize(hidden, p=2, dim=-1)

    @staticmethod
    def _mean_cls(sums: torch.Tensor) -> np.ndarray:
        return torch.nn.functional.normalize(sums, p=2, dim=-1).cpu().numpy()

    def embed_documents(self, tokens: Mapping[str, Any]) -> DocumentEmbeddings:
        vectors = self._vectors(tokens, self._document_graph())
        keep = tokens["keep"].to(self.device)
        cls = self._mean_cls((vectors * keep[..., None]).sum(1))
        return DocumentEmbeddings(cls=cls, bow=vectors[keep].cpu().numpy(),
                                  counts=keep.sum(1).to(torch.int32).cpu().numpy())

    def embed_queries(self, tokens: Mapping[str, Any]) -> QueryEmbeddings:
        vectors = self._vectors(tokens, self._query_graph())
        keep = tokens["keep"].to(self.device)
        bow = vectors * keep[..., None]
        truncated = tokens.get("truncated")
        return QueryEmbeddings(cls=self._mean_cls(bow.sum(1)), bow=bow.cpu().numpy(), mask=keep.cpu().numpy(),
                               truncated=None if truncated is None else truncated.numpy())

    # -- ONNX queries ----------------------------------------------------------------
    def _kept_vectors(self, texts: Sequence[str], is_query: bool, graph: Any) -> list[np.ndarray]:
        tokens = self._encode(texts, is_query)
        vectors = self._vectors(tokens, graph)
        return [vectors[row][tokens["keep"][row].to(self.device)].cpu().numpy() for row in range(len(texts))]

    def _make_graph(self) -> Any:
        """The backbone on ONNX Runtime, checked against torch on a probe batch (all kept positions)."""
        refusal = None
        if not {"input_ids", "attention_mask"} <= self._forward_keys:
            refusal = f"the ONNX export takes a backbone of input_ids and attention_mask ({type(self.model).__name__} is not)"
        weights = self._weights_file()
        probe = self._encode(["a probe of the exported graph", "two"], is_query=True) if refusal is None else {}
        return checked_query_graph(lambda: self.model, self.name, self.query_backend, self.device,
                                   self._weights_sha256 or (sha256_file(weights) if weights else self.name),
                                   torch.get_num_threads(), None, probe, refusal)

    # -- persistence -----------------------------------------------------------------
    def _weights_file(self) -> Path | None:
        return weights_file(self.backbone_dir)

    def config(self) -> dict[str, Any]:
        weights = self._weights_file()
        return {
            "kind": self.kind,
            "name": self.name,
            "format": self.settings.format,
            "d_cls": self.d_cls,
            "d_bow": self.d_bow,
            "settings": dataclasses.asdict(self.settings),
            "bow_reduction": self.bow_reduction,
            "cls": "mean of the token vectors",
            "weights_sha256": self._weights_sha256 or (sha256_file(weights) if weights else None),
            **({"trust_remote_code": True} if self.trust_remote_code else {}),
            **self.precision_config(),
        }

    def save(self, directory: Path) -> None:
        """Copy the checkpoint's data files (tokenizer, configs, weights; not other frameworks' files)
        into `model/`: regular files only, links only within the checkpoint (espn.encoders.model_files)."""
        copy_model_dir(self.checkpoint_dir, Path(directory) / "model", "colbert")

    @classmethod
    def load(cls, directory: Path, config: Mapping[str, Any], device: str | None = None,
             trust_remote_code: bool = False) -> "ColBERTEncoder":
        """The saved checkpoint with the settings the index was built with (not today's defaults)."""
        settings = dict(config.get("settings") or {})
        overrides = {key: settings[key] for key in SETTING_NAMES if key in settings}
        if "skiplist_words" in overrides:
            overrides["skiplist_words"] = list(overrides["skiplist_words"])
        return cls(Path(directory) / "model", overrides, device=device, name=config.get("name"),
                   weights_sha256=config.get("weights_sha256"), trust_remote_code=trust_remote_code,
                   precision=loaded_precision(config, device))
