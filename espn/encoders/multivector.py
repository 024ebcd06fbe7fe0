"""Sentence Transformers v6 `MultiVectorEncoder` checkpoints, encoded by Sentence Transformers itself.

A checkpoint saved by Sentence Transformers 6 (`MultiVectorEncoder.save`: `modules.json` with
`sentence_transformers.base.modules.transformer.Transformer`, `...base.modules.dense.Dense`,
`...multi_vector_encoder.modules.multi_vector_mask.MultiVectorMask`, `...base.modules.normalize.Normalize`
and, where the author baked one in, a `TokenPooling`; prompts in
`config_sentence_transformers.json` with `"model_type": "MultiVectorEncoder"`; query expansion
and its `attend` flag in the Transformer's `sentence_bert_config.json`) is loaded with the
library that wrote it, from a local directory, offline, without remote code. The library is the
loader because it is the definition of these checkpoints: prompts and prefix tokens, query
expansion, the per-task skiplists, the token pooling and whatever its next release adds are
its code, not a copy of it (docs/benchmarks/query-latency.md: loading through it costs no
query latency against espn's own torch path).

espn keeps the split of its encoder contract: `tokenize` is the library's `preprocess` (with the
model's query or document prompt and task, as `encode_query` / `encode_document` give them) and
runs in the tokenising worker; `embed_*` runs the module pipeline (`model(features, task=...)`)
and keeps the vectors of the scoring mask the pipeline leaves in `attention_mask`, exactly the
slice `encode_query` / `encode_document` return. On a CPU the queries' backbone runs on ONNX
Runtime (`espn.encoders.onnx`, checked against torch when the graph is made) and the modules
after it on torch, as on the torch path. The score is the model's similarity: MaxSim (sum) or
MeanMaxSim (`bow_reduction = "mean"`); no CLS mixing; the stored CLS vector is the normalised
mean of the document's vectors, for the first stage only.
"""

from __future__ import annotations

import inspect
import logging
import threading
from importlib.metadata import version
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from sentence_transformers import MultiVectorEncoder
from sentence_transformers.base.modules import Transformer
from sentence_transformers.multi_vector_encoder.modules import BaseTokenPooling
from sentence_transformers.util import batch_to_device
from transformers.utils import logging as hf_logging

from ..errors import InvalidParameterError
from ..files.checksums import sha256_file
from .backbone_config import normalised_configs
from .base import DocumentEmbeddings, Encoder, QueryEmbeddings, VectorSpans, trimmed_span
from .colbert_checkpoint import weights_file
from .model_files import check_model_dir, copy_model_dir, loading
from .int8 import check_precision, loaded_precision
from .onnx import QueryGraphOwner, checked_query_graph
from .st_format import is_sentence_transformers_save, read_save_json

__all__ = ["SentenceTransformersEncoder", "is_sentence_transformers_save", "QUERY_BACKENDS"]

log = logging.getLogger(__name__)

QUERY_BACKENDS = ("auto", "onnx", "torch")
#: Modules after the backbone that change no mask: the scoring mask is theirs to leave as it is.
_MASK_NEUTRAL = ("Dense", "Normalize")
#: Above this a module's query length is no length (a tokenizer without one says 1e30).
_MAX_QUERY_LENGTH = 1 << 20


class SentenceTransformersEncoder(QueryGraphOwner, Encoder):
    """A MultiVectorEncoder checkpoint's query and document vectors, as its own encode gives them."""

    kind = "multivector"
    bow_reduction = "sum"
    learned_weight = 0.0
    has_trained_cls = False

    def __init__(self, checkpoint_dir: str | Path, device: str | None = None, name: str | None = None,
                 query_backend: str = "auto", weights_sha256: str | None = None,
                 trust_remote_code: bool = False, precision: str = "fp32") -> None:
        """precision: "fp32" or int8 (espn.encoders.int8.PRECISIONS: the backbone of queries and documents
        on the quantised ONNX graph, CPU); query_backend: "auto" (ONNX Runtime for the queries' backbone
        on a CPU where it exports),
        "onnx" or "torch"; weights_sha256: the backbone weights' hash when known (the manifest's);
        trust_remote_code: allow a backbone that needs its own Python code (`--trust-remote-code`)."""
        self.checkpoint_dir = Path(checkpoint_dir)
        if not self.checkpoint_dir.is_dir():
            raise InvalidParameterError(f"colbert: {self.checkpoint_dir} is not a directory (espn loads checkpoints "
                                        "from a local directory only)")
        if query_backend not in QUERY_BACKENDS:
            raise InvalidParameterError(f"query_backend must be one of {', '.join(QUERY_BACKENDS)}, "
                                        f"got {query_backend!r}")
        hf_logging.disable_progress_bar()
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.name = name or self.checkpoint_dir.name
        # Files, links, sizes, remote code, tokenizer and weights checked before anything reads them.
        remote = check_model_dir(self.checkpoint_dir, trust_remote_code, "colbert")
        self.backbone_dir = self.checkpoint_dir / self._backbone_path()
        if self.backbone_dir.resolve() != self.checkpoint_dir.resolve():
            remote = check_model_dir(self.backbone_dir, trust_remote_code, "colbert") or remote
        #: Whether the backbone's own code runs (allowed by --trust-remote-code; in the manifest).
        self.trust_remote_code = remote
        with normalised_configs(), loading(self.checkpoint_dir, f"it with Sentence Transformers {version('sentence-transformers')}"):
            self.model = MultiVectorEncoder(str(self.checkpoint_dir), device=self.device, local_files_only=True,
                                            trust_remote_code=remote)
        self.model.eval()
        self.modules: list[tuple[str, torch.nn.Module]] = list(self.model.named_children())
        if not self.modules or not isinstance(self.modules[0][1], Transformer):
            raise InvalidParameterError(f"colbert: {self.checkpoint_dir}: the pipeline must start with a Transformer "
                                        "module (a text backbone)")
        self.backbone = self.modules[0][1]
        dim = self.model.get_embedding_dimension()
        if dim is None:
            raise InvalidParameterError(f"colbert: {self.checkpoint_dir}: the pipeline gives no embedding dimension")
        self.d_bow = self.d_cls = int(dim)
        self.similarity = str(self.model.similarity_fn_name)
        self.bow_reduction = "mean" if self.similarity == "meanmaxsim" else "sum"
        self.prompts = {task: self._prompt(task) for task in ("query", "document")}
        check_precision(precision, self.device, query_backend)
        self.precision = precision
        self.query_backend = query_backend
        self._weights_sha256 = weights_sha256
        self._graph: Any = None
        self._graph_lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, location: str | Path, device: str | None = None, trust_remote_code: bool = False,
                        precision: str = "fp32") -> "SentenceTransformersEncoder":
        path, _, query = str(location).partition("?")
        if query:
            raise InvalidParameterError(f"colbert: {path} is a Sentence Transformers save, whose settings are its own "
                                        f"(prompts, lengths, expansion in its configs); drop ?{query}")
        return cls(Path(path), device=device, trust_remote_code=trust_remote_code, precision=precision)

    # -- the checkpoint --------------------------------------------------------------
    def _backbone_path(self) -> str:
        modules = self.checkpoint_dir / "modules.json"
        found = read_save_json(modules) if modules.is_file() else []
        first = min((m for m in found if isinstance(m, dict)), key=lambda m: int(m.get("idx", 0)), default={})
        where = str(first.get("path", ""))
        if Path(where).is_absolute() or ".." in Path(where).parts:
            raise InvalidParameterError(f"colbert: {modules}: module path {where!r} leaves the checkpoint")
        return where

    def _prompt(self, task: str) -> str | None:
        """The prompt `encode_query` / `encode_document` use: the task's, else the default prompt."""
        prompts = self.model.prompts or {}
        if task in prompts:
            return prompts[task]
        if self.model.default_prompt_name is not None:
            return prompts.get(self.model.default_prompt_name)
        return None

    def _pools(self, task: str) -> bool:
        return any(isinstance(module, BaseTokenPooling) and module.applies_to(task) for _, module in self.modules)

    # -- tokenisation ----------------------------------------------------------------
    def tokenize(self, texts: Sequence[str], is_query: bool) -> Mapping[str, Any]:
        task = "query" if is_query else "document"
        features = dict(self.model.preprocess(list(texts), prompt=self.prompts[task], task=task))
        features["task"] = task
        if is_query:
            filled = self._filled(features)
            if filled is not None:
                features["truncated"] = filled
        return features

    def _filled(self, features: Mapping[str, Any]) -> torch.Tensor | None:
        """[B] bool: the queries whose tokens (prompt included) reach the query length the library
        cuts them at (the query expansion's width, else query_length or max_seq_length): read to
        that length and no further. None where the length is unknown."""
        expansion = getattr(self.backbone, "query_expansion", None)
        limit = expansion.get("length") if isinstance(expansion, dict) else None
        limit = limit or getattr(self.backbone, "query_length", None) or getattr(self.backbone, "max_seq_length", None)
        mask = features.get("attention_mask")
        if not isinstance(limit, int) or not 0 < limit <= _MAX_QUERY_LENGTH or not isinstance(mask, torch.Tensor):
            return None  # no length, or a tokenizer's "no limit" (model_max_length of 1e30)
        real = mask.bool()
        if "query_expansion_positions" in features:
            real = real & ~features["query_expansion_positions"].bool()
        return real.sum(1) >= limit

    # -- model -----------------------------------------------------------------------
    def _module_kwargs(self, name: str, module: torch.nn.Module, task: str) -> dict[str, Any]:
        """The kwargs BaseModel.forward gives module `name` (the task, where the module takes it)."""
        keys = (self.model.module_kwargs or {}).get(name, [])
        return {"task": task} if "task" in keys or "task" in getattr(module, "forward_kwargs", ()) else {}

    @torch.inference_mode()
    def _run(self, tokens: Mapping[str, Any], graph: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> vectors [B, T', D] float32 (T' after any token pooling), keep [B, T'] bool (the scoring mask)."""
        task = str(tokens["task"])
        features = batch_to_device({k: v for k, v in tokens.items() if k not in ("task", "truncated")},
                                   torch.device(self.device))
        if graph is None:
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.device.startswith("cuda")):
                features = self.model(features, task=task)
        else:
            hidden = graph.hidden_states(features["input_ids"].cpu(), features["attention_mask"].cpu())
            features[self.backbone.module_output_name] = hidden.to(self.device)
            for name, module in self.modules[1:]:
                features = module(features, **self._module_kwargs(name, module, task))
        return features["token_embeddings"].float(), features["attention_mask"].bool()

    @staticmethod
    def _mean_cls(vectors: torch.Tensor, keep: torch.Tensor) -> np.ndarray:
        sums = (vectors * keep[..., None]).sum(1)
        return torch.nn.functional.normalize(sums, p=2, dim=-1).cpu().numpy()

    def embed_documents(self, tokens: Mapping[str, Any]) -> DocumentEmbeddings:
        vectors, keep = self._run(tokens, self._document_graph())
        return DocumentEmbeddings(cls=self._mean_cls(vectors, keep), bow=vectors[keep].cpu().numpy(),
                                  counts=keep.sum(1).to(torch.int32).cpu().numpy())

    def embed_queries(self, tokens: Mapping[str, Any]) -> QueryEmbeddings:
        vectors, keep = self._run(tokens, self._query_graph())
        bow = vectors * keep[..., None]
        truncated = tokens.get("truncated")
        return QueryEmbeddings(cls=self._mean_cls(vectors, keep), bow=bow.cpu().numpy(), mask=keep.cpu().numpy(),
                               truncated=None if truncated is None else truncated.cpu().numpy())

    # -- explanations ----------------------------------------------------------------
    def _positions(self, texts: Sequence[str], is_query: bool) -> list[list[tuple[str, tuple[int, int], int]]]:
        """Per text, per kept vector in stored order: (kind, span in the text, token id); kind "text",
        "marker" (the prompt's tokens), "expansion" or "special". Pooled vectors have kind "pooled"."""
        task = "query" if is_query else "document"
        prompt = self.prompts[task] or ""
        if self._pools(task):  # a pooled vector merges tokens; the pooling's groups are not exposed
            counts = self.encode_queries(texts).mask.sum(1) if is_query else self.encode_documents(texts).counts
            return [[("pooled", (0, 0), -1)] * int(n) for n in counts]
        features = dict(self.model.preprocess(
            list(texts), prompt=self.prompts[task], task=task,
            processing_kwargs={"text": {"return_offsets_mapping": True, "return_special_tokens_mask": True}}))
        offsets = features.pop("offset_mapping")
        specials = features.pop("special_tokens_mask")
        expansion = features.get("query_expansion_positions")
        if all(type(module).__name__ in _MASK_NEUTRAL or hasattr(module, "skiplist_words")
               for _, module in self.modules[1:]):
            # Only the MultiVectorMask changes the mask, from the ids alone: no forward pass needed.
            for name, module in self.modules[1:]:
                if hasattr(module, "skiplist_words"):
                    features = module(features, **self._module_kwargs(name, module, task))
            keep = features["attention_mask"].bool()
        else:
            _, keep = self._run({**self.tokenize(texts, is_query)})
        out = []
        for row in range(len(texts)):
            entries = []
            for p in torch.nonzero(keep[row]).flatten().tolist():
                start, end = (int(x) for x in offsets[row, p])
                token = int(features["input_ids"][row, p])
                if expansion is not None and bool(expansion[row, p]):
                    entries.append(("expansion", (0, 0), token))
                elif end > len(prompt) and not bool(specials[row, p]):
                    entries.append(("text", trimmed_span(texts[row], start - len(prompt), end - len(prompt)), token))
                elif end > 0:
                    entries.append(("marker", (0, 0), token))
                else:
                    entries.append(("special", (0, 0), token))
            out.append(entries)
        return out

    def vector_spans(self, texts: Sequence[str], is_query: bool = False) -> list[VectorSpans]:
        """One entry per vector in stored order: the token's characters in the text (the prompt
        excluded), or no span for special, prompt, expansion and pooled vectors."""
        return [[[span] if kind == "text" else [] for kind, span, _ in row] for row in self._positions(texts, is_query)]

    def vector_labels(self, texts: Sequence[str], is_query: bool = False) -> list[list[tuple[str, str]]]:
        tokenizer = self.backbone.tokenizer
        return [[("special" if kind == "pooled" else kind, str(tokenizer.convert_ids_to_tokens(token)) if token >= 0
                  else "") for kind, _, token in row] for row in self._positions(texts, is_query)]

    # -- ONNX queries ----------------------------------------------------------------
    def _kept_vectors(self, texts: Sequence[str], is_query: bool, graph: Any) -> list[np.ndarray]:
        vectors, keep = self._run(self.tokenize(texts, is_query), graph)
        return [vectors[row][keep[row]].cpu().numpy() for row in range(len(texts))]

    def _make_graph(self) -> Any:
        """The backbone on ONNX Runtime, checked against torch on a probe batch (all scored positions)."""
        backbone = self.backbone.auto_model
        refusal = None
        if not {"input_ids", "attention_mask"} <= set(inspect.signature(backbone.forward).parameters):
            refusal = (f"the ONNX export takes a backbone of input_ids and attention_mask ({type(backbone).__name__} "
                       "is not)")
        elif self.model.get_backend() != "torch":
            refusal = f"the checkpoint runs on {self.model.get_backend()}, not torch"
        probe: dict[str, Any] = {}
        if refusal is None:
            tokens = self.tokenize(["a probe of the exported graph", "two"], is_query=True)
            keep = tokens["attention_mask"].bool()
            if "query_expansion_positions" in tokens:
                keep = keep | tokens["query_expansion_positions"].bool()
            probe = {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"], "keep": keep}
        weights = self._weights_file()
        return checked_query_graph(lambda: backbone, self.name, self.query_backend, self.device,
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
            "format": "sentence-transformers",
            "library": f"sentence-transformers {version('sentence-transformers')}",
            "d_cls": self.d_cls,
            "d_bow": self.d_bow,
            "similarity": self.similarity,
            "prompts": dict(self.prompts),
            "modules": [type(module).__name__ for _, module in self.modules],
            "bow_reduction": self.bow_reduction,
            "cls": "mean of the token vectors",
            "has_trained_cls": False,
            "weights_sha256": self._weights_sha256 or (sha256_file(weights) if weights else None),
            **({"trust_remote_code": True} if self.trust_remote_code else {}),
            **self.precision_config(),
        }

    def save(self, directory: Path) -> None:
        """Copy the checkpoint's data files (modules, configs, tokenizer, weights; not other frameworks'
        files) into `model/`: regular files only, links only within the checkpoint."""
        copy_model_dir(self.checkpoint_dir, Path(directory) / "model", "colbert")

    @classmethod
    def load(cls, directory: Path, config: Mapping[str, Any], device: str | None = None,
             trust_remote_code: bool = False) -> "SentenceTransformersEncoder":
        return cls(Path(directory) / "model", device=device, name=config.get("name"),
                   weights_sha256=config.get("weights_sha256"), trust_remote_code=trust_remote_code,
                   precision=loaded_precision(config, device))
