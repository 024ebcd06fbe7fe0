"""ColBERTer (Hofstätter et al., 2022): the model ESPN's paper serves, loaded from its checkpoint.

Architecture, as in the authors' `colberter.py` and `bow2_tokenizer.py`:

- DistilBERT encodes the text (``[CLS] text [SEP]``, no query/document markers).
- CLS: ``compressor_retrieval`` (Linear hidden -> 128) on position 0.
- BOW²: ``compressor`` (Linear hidden -> 32) on every token, then the mean of the
  32-d subword vectors of each *unique whole word*. Words are the
  ``BertPreTokenizer`` split of the raw text (whitespace and punctuation; every
  punctuation character is a word of its own); each subword joins the word whose
  character span contains it; two words are the same word when their lowercased
  surface forms are equal. "Unique" follows the authors' BOW2Tokenizer, which maps
  every occurrence of a word to one id and mean-pools over all subwords of all
  occurrences, so a document stores one vector per distinct word, and a repeated
  word's vector averages its contexts (its default ``uniqueness_type="stemed"``
  matches neither branch name and falls through to ``str.lower()``, so lowercase
  equality is what the released model saw). Special tokens never join a word.
- Documents only: ``gate = relu(stop_word_reducer(v))`` with
  ``stop_word_reducer = Linear(32, 1)``; ``v <- v * gate`` (the scale stays in the
  stored vector) and words with ``gate <= 0`` are dropped. Queries are not gated.
- No L2 normalisation. Score: ``w = sigmoid(score_merger)``,
  ``score = w * (q_cls . d_cls) + (1 - w) * sum_i max_j (q_i . d_j)``.

One deliberate difference from the authors' tokenizer: a word occurrence cut by
truncation (some of its subwords beyond ``max_length``) is dropped here, where theirs
kept the mean of the surviving pieces; a word prefix is not the word, and its vector
would match the prefix's own word in queries. Complete earlier occurrences of the
same word still make its vector.

The checkpoint directory holds ``config.json`` (ColBERTer's: ``bert_model``,
``compression_dim``, ``retrieval_compression_dim``, ``use_contextualized_stopwords``,
``aggregate_unique_ids``), ``pytorch_model.bin`` or ``model.safetensors`` with the
keys ``bert_model.*``, ``compressor.{weight,bias}``, ``compressor_retrieval.{weight,bias}``,
``stop_word_reducer.{weight,bias}`` and ``score_merger``, and the tokenizer files
(``tokenizer.json`` and/or ``vocab.txt``). The DistilBERT skeleton is built from a
config: ``bert_config`` in ``config.json`` if present, else the published config of
``distilbert-base-uncased`` (held below) when ``bert_model`` names it. Nothing is
downloaded at run time; a Hub name is fetched once by ``from_pretrained`` and
``save`` copies every file into the index.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import BertPreTokenizer
from transformers import DistilBertTokenizerFast
from transformers.utils import logging as hf_logging

from ..errors import IndexCorruptError, InvalidParameterError
from ..files.checksums import sha256_file
from .base import DocumentEmbeddings, Encoder, QueryEmbeddings, VectorSpans
from .colberter_checkpoint import (DISTILBERT_BASE_UNCASED, TOKENIZER_FILES, CheckpointError, ColBERTerModel,
                                   check_supported, distilbert_config, load_strict, read_checkpoint, read_config,
                                   resolve_checkpoint)
from .model_files import check_tokenizer_files, copy_model_dir

__all__ = [
    "ColBERTerEncoder",
    "ColBERTerModel",
    "CheckpointError",
    "whole_word_index",
    "read_checkpoint",
    "DISTILBERT_BASE_UNCASED",
]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# whole-word alignment (runs in DataLoader workers)
# ---------------------------------------------------------------------------------------
def whole_word_index(texts: Sequence[str], offsets: np.ndarray, content: np.ndarray,
                     cut_at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Assign every content subword to its text's unique whole word.

    texts:   B raw strings
    offsets: [B, T, 2] int, each token's character span in its text
    content: [B, T] bool, real subwords (not special, not padding)
    cut_at:  [B] int, character where the first token dropped by truncation starts, -1 if none
    ->  word_index [B, T] int64: the token's word number within its text (0 .. num_words-1,
        numbered by first occurrence), -1 for special/padding tokens and for tokens of a
        word cut by truncation;  num_words [B] int64.

    The whole batch is pre-tokenised in one call (texts joined by a space, which always
    splits) and aligned with searchsorted; the only Python-level loop is one dict
    lookup per word to give equal lowercased words one id.
    """
    batch, length = content.shape
    word_index = np.full((batch, length), -1, dtype=np.int64)
    num_words = np.zeros(batch, dtype=np.int64)
    # Only the part of each text the tokenizer kept matters, plus one character past the
    # cut so the word straddling it is seen as one word (and then dropped).
    views = [t if c < 0 else t[: c + 1] for t, c in zip(texts, cut_at.tolist())]
    starts = np.zeros(batch, dtype=np.int64)
    if batch > 1:
        starts[1:] = np.cumsum(np.fromiter((len(v) + 1 for v in views[:-1]), np.int64, batch - 1))
    words = BertPreTokenizer().pre_tokenize_str(" ".join(views))
    tok_b, tok_t = np.nonzero(content)
    if not words or not len(tok_b):
        return word_index, num_words
    spans = np.array([span for _, span in words], dtype=np.int64)  # [W, 2] in the joined string
    ids: dict[str, int] = {}
    surface = np.fromiter((ids.setdefault(w.lower(), len(ids)) for w, _ in words), np.int64, len(words))

    tok_start = offsets[tok_b, tok_t, 0].astype(np.int64) + starts[tok_b]
    tok_end = offsets[tok_b, tok_t, 1].astype(np.int64) + starts[tok_b]
    word = np.searchsorted(spans[:, 0], tok_start, side="right") - 1
    inside = (word >= 0) & (tok_end <= spans[np.maximum(word, 0), 1])
    # The word holding the first dropped token is cut if it began before that token.
    cut = np.zeros(len(spans), dtype=bool)
    truncated = np.nonzero(cut_at >= 0)[0]
    if len(truncated):
        position = cut_at[truncated] + starts[truncated]
        holder = np.searchsorted(spans[:, 0], position, side="right") - 1
        straddles = (holder >= 0) & (spans[np.maximum(holder, 0), 0] < position) & (
            position < spans[np.maximum(holder, 0), 1])
        cut[holder[straddles]] = True
    keep = inside & ~cut[np.maximum(word, 0)]
    tok_b, tok_t, word = tok_b[keep], tok_t[keep], word[keep]
    if not len(word):
        return word_index, num_words

    # (text, lowercased word) pairs -> one slot each, numbered by first occurrence; tokens
    # are in row-major order, so slots come out grouped by text, in text order.
    pair = tok_b * len(ids) + surface[word]
    _, first, inverse = np.unique(pair, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    slot = rank[inverse.reshape(-1)]
    num_words[:] = np.bincount(tok_b[first[order]], minlength=batch)
    word_index[tok_b, tok_t] = slot - (np.cumsum(num_words) - num_words)[tok_b]
    return word_index, num_words


# ---------------------------------------------------------------------------------------
# the encoder
# ---------------------------------------------------------------------------------------
class ColBERTerEncoder(Encoder):
    """ColBERTer behind the Encoder contract: CLS 128-d, one gated 32-d vector per unique word.

    `tokenize` runs in DataLoader workers: pickling this object drops the model (the
    worker needs only the tokenizer), so a spawned worker receives megabytes, not the
    weights; `embed_*` on such a copy raises.
    """

    kind = "colberter"
    bow_reduction = "sum"

    def __init__(self, model: ColBERTerModel, tokenizer: Any, source: Path, name: str, weights_file: str,
                 device: str | None = None, max_length: int = 512, query_max_length: int | None = None) -> None:
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model: ColBERTerModel | None = model.to(self.device).eval()
        self.source, self.name, self.weights_file = Path(source), name, weights_file
        limit = int(model.bert_model.config.max_position_embeddings)
        query_max_length = max_length if query_max_length is None else query_max_length
        for label, value in (("max_length", max_length), ("query_max_length", query_max_length)):
            if not 3 <= value <= limit:
                raise InvalidParameterError(f"{label} must be in [3, {limit}], got {value}")
        self.max_length, self.query_max_length = int(max_length), int(query_max_length)
        self.d_cls = int(model.compressor_retrieval.out_features)
        self.d_bow = int(model.compressor.out_features)
        self.hidden = model.hidden
        self.stopwords = model.stop_word_reducer is not None
        self.learned_weight = float(torch.sigmoid(model.score_merger.detach().float()).item())
        self._special_ids = np.array(sorted(set(tokenizer.all_special_ids)), dtype=np.int64)
        # Two copies of the Rust tokenizer, each configured once: calls never reconfigure
        # a shared object, so concurrent document and query tokenisation cannot race.
        self._doc_tokenizer = self._backend(tokenizer, self.max_length)
        self._query_tokenizer = self._backend(tokenizer, self.query_max_length)

    @staticmethod
    def _backend(tokenizer: Any, max_length: int) -> Any:
        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        backend.enable_truncation(max_length=max_length, stride=0, strategy="longest_first", direction="right")
        backend.enable_padding(direction="right", pad_id=int(tokenizer.pad_token_id), pad_token=tokenizer.pad_token)
        return backend

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_hub_name: str | Path, device: str | None = None, max_length: int = 512,
                        query_max_length: int | None = None, name: str | None = None,
                        precision: str = "fp32") -> "ColBERTerEncoder":
        """Load a checkpoint directory (or Hub name), strictly: every key used, every parameter set.

        max_length / query_max_length: tokens per document / query, [CLS] and [SEP] included;
        precision: fp32 only (ColBERTer has no ONNX path).
        """
        if precision != "fp32":
            raise InvalidParameterError(f"colberter: no ONNX path; precision {precision!r} is refused (fp32 only)")
        directory = resolve_checkpoint(path_or_hub_name)
        config = read_config(directory)
        check_supported(config, directory)
        bert_config = distilbert_config(config, directory)
        state, weights_file = read_checkpoint(directory)
        d_cls = int(config.get("retrieval_compression_dim", -1))
        d_bow = int(config.get("compression_dim", -1))
        # Without the dims in config.json the shapes decide; strict loading still checks them.
        if d_cls < 1 and "compressor_retrieval.weight" in state:
            d_cls = int(state["compressor_retrieval.weight"].shape[0])
        if d_bow < 1 and "compressor.weight" in state:
            d_bow = int(state["compressor.weight"].shape[0])
        if d_cls < 1 or d_bow < 1:
            raise CheckpointError(f"{directory}: cannot tell the CLS/BOW dims (retrieval_compression_dim={d_cls}, "
                                  f"compression_dim={d_bow}) and the compressor weights are missing")
        stopwords = bool(config.get("use_contextualized_stopwords", "stop_word_reducer.weight" in state))
        model = ColBERTerModel(bert_config, d_cls=d_cls, d_bow=d_bow, stopwords=stopwords)
        load_strict(model, state, f"{directory / weights_file}")
        del state
        tokenizer = cls._load_tokenizer(directory)
        if len(tokenizer) > bert_config.vocab_size:
            raise CheckpointError(f"{directory}: tokenizer has {len(tokenizer)} tokens, the model's vocabulary "
                                  f"{bert_config.vocab_size}")
        if name is None:
            name = str(path_or_hub_name) if not Path(path_or_hub_name).expanduser().is_dir() else directory.name
        encoder = cls(model, tokenizer, directory, name, weights_file, device=device, max_length=max_length,
                      query_max_length=query_max_length)
        log.info("ColBERTer %s: hidden %d, CLS %d, BOW %d, stop-word gate %s, w = %.4f", name, encoder.hidden,
                 encoder.d_cls, encoder.d_bow, "on" if encoder.stopwords else "off", encoder.learned_weight)
        return encoder

    @staticmethod
    def _load_tokenizer(directory: Path) -> Any:
        if not any((directory / name).is_file() for name in ("tokenizer.json", "vocab.txt")):
            raise CheckpointError(f"{directory}: no tokenizer (tokenizer.json or vocab.txt); copy the tokenizer "
                                  "files of the checkpoint's base model (distilbert-base-uncased) there")

        check_tokenizer_files(directory, "colberter")  # a file that is not a tokenizer: one line naming it
        # config.json is ColBERTer's, not a tokenizer's; transformers warns about its model_type.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            return DistilBertTokenizerFast.from_pretrained(str(directory), local_files_only=True,
                                                           trust_remote_code=False)
        except (OSError, ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"{directory}: cannot load the tokenizer: {detail}") from None
        finally:
            hf_logging.set_verbosity(verbosity)

    # -- pickling: workers get the tokenizer only ---------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["model"] = None
        return state

    # -- tokenisation (DataLoader workers) ---------------------------------------------
    def tokenize(self, texts: Sequence[str], is_query: bool) -> Mapping[str, Any]:
        """-> input_ids, attention_mask, word_index [B, T] int64 and num_words [B] int64 (torch).

        word_index maps each subword to its text's unique-word number (see
        `whole_word_index`), -1 where a token belongs to no kept word.
        """
        texts = list(texts)
        backend = self._query_tokenizer if is_query else self._doc_tokenizer
        encodings = backend.encode_batch(texts, add_special_tokens=True) if texts else []
        batch = len(encodings)
        length = len(encodings[0].ids) if batch else 0
        input_ids = np.array([e.ids for e in encodings], dtype=np.int64).reshape(batch, length)
        attention = np.array([e.attention_mask for e in encodings], dtype=bool).reshape(batch, length)
        special = np.array([e.special_tokens_mask for e in encodings], dtype=bool).reshape(batch, length)
        offsets = np.array([e.offsets for e in encodings], dtype=np.int64).reshape(batch, length, 2)
        # Special-token strings typed in the text ("[SEP]") become special ids without the
        # special mask; they are never part of a word either.
        content = attention & ~special & ~np.isin(input_ids, self._special_ids)
        cut_at = np.fromiter((self._first_dropped(e) for e in encodings), np.int64, batch)
        word_index, num_words = whole_word_index(texts, offsets, content, cut_at)
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention.astype(np.int64)),
            "word_index": torch.from_numpy(word_index),
            "num_words": torch.from_numpy(num_words),
        }

    @staticmethod
    def _first_dropped(encoding: Any) -> int:
        """Character where the first token removed by truncation starts, -1 if nothing was removed."""
        for overflow in encoding.overflowing[:1]:
            for offset, special in zip(overflow.offsets, overflow.special_tokens_mask):
                if not special:
                    return int(offset[0])
        return -1

    # -- model (main process) ------------------------------------------------------------
    @torch.inference_mode()
    def _words(self, tokens: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> cls [B, d_cls], word vectors [U, d_bow] (mean over subwords, ungated), word's text [U]; fp32."""
        if self.model is None:
            raise RuntimeError("this ColBERTerEncoder was unpickled for tokenisation only; it has no model")
        input_ids = torch.as_tensor(tokens["input_ids"]).to(self.device, non_blocking=True)
        attention = torch.as_tensor(tokens["attention_mask"]).to(self.device, non_blocking=True)
        word_index = torch.as_tensor(tokens["word_index"]).to(self.device, non_blocking=True)
        num_words = torch.as_tensor(tokens["num_words"]).to(self.device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.device.startswith("cuda")):
            cls, vectors = self.model(input_ids, attention)
        cls, vectors = cls.float(), vectors.float()
        # Global word slots: text b's words are rows start[b] .. start[b]+num_words[b]-1.
        start = torch.cumsum(num_words, 0) - num_words
        member = word_index >= 0
        slot = (start[:, None] + word_index)[member]
        total = int(num_words.sum())
        sums = torch.zeros(total, self.d_bow, device=self.device).index_add_(0, slot, vectors[member])
        sizes = torch.zeros(total, device=self.device).index_add_(0, slot, torch.ones_like(slot, dtype=torch.float32))
        text = torch.repeat_interleave(torch.arange(len(num_words), device=self.device), num_words)
        return cls, sums / sizes[:, None], text

    def embed_documents(self, tokens: Mapping[str, Any]) -> DocumentEmbeddings:
        """Gated BOW²: vectors scaled by their gate, gated-out words (gate <= 0) never returned."""
        cls, words, text = self._words(tokens)
        assert self.model is not None
        with torch.inference_mode():
            gate = self.model.gate(words)
        keep = gate > 0
        counts = torch.bincount(text[keep], minlength=len(cls))
        return DocumentEmbeddings(
            cls=cls.cpu().numpy(),
            bow=(words * gate[:, None])[keep].cpu().numpy(),
            counts=counts.to(torch.int32).cpu().numpy(),
        )

    def embed_queries(self, tokens: Mapping[str, Any]) -> QueryEmbeddings:
        """Ungated BOW², padded to the longest query (at least one column, masked)."""
        cls, words, text = self._words(tokens)
        num_words = torch.as_tensor(tokens["num_words"])
        width = max(1, int(num_words.max())) if len(num_words) else 1
        start = (torch.cumsum(num_words, 0) - num_words).to(self.device)
        column = torch.arange(len(words), device=self.device) - start[text]
        bow = torch.zeros(len(cls), width, self.d_bow, device=self.device)
        mask = torch.zeros(len(cls), width, dtype=torch.bool, device=self.device)
        bow[text, column] = words
        mask[text, column] = True
        return QueryEmbeddings(cls=cls.cpu().numpy(), bow=bow.cpu().numpy(), mask=mask.cpu().numpy())

    def text_length(self, text: str) -> int:
        return len(text)

    def vector_spans(self, texts: Sequence[str], is_query: bool = False) -> list[VectorSpans]:
        """Every occurrence of each unique word, in word (vector) order; for documents only the
        words the stop-word gate keeps, which takes a forward pass (explanations only)."""
        texts = list(texts)
        if not texts:
            return []
        tokens = self.tokenize(texts, is_query=is_query)
        backend = self._query_tokenizer if is_query else self._doc_tokenizer
        offsets = [e.offsets for e in backend.encode_batch(texts, add_special_tokens=True)]
        word_index = tokens["word_index"].numpy()
        num_words = tokens["num_words"].numpy()
        if is_query:
            kept = [np.ones(int(n), dtype=bool) for n in num_words]
        else:
            cls, words, text = self._words(tokens)
            assert self.model is not None
            with torch.inference_mode():
                gate = (self.model.gate(words) > 0).cpu().numpy()
            bounds = np.concatenate([[0], np.cumsum(num_words)])
            kept = [gate[bounds[b]: bounds[b + 1]] for b in range(len(texts))]
        out: list[VectorSpans] = []
        for b in range(len(texts)):
            spans: VectorSpans = [[] for _ in range(int(num_words[b]))]
            for t in np.flatnonzero(word_index[b] >= 0):
                start, end = offsets[b][t]
                word = spans[word_index[b, t]]
                if word and word[-1][1] == start:  # the next subword of the same occurrence
                    word[-1] = (word[-1][0], int(end))
                else:
                    word.append((int(start), int(end)))
            out.append([span for span, keep in zip(spans, kept[b]) if keep])
        return out

    # -- scoring reference ---------------------------------------------------------------
    def score(self, queries: QueryEmbeddings, documents: DocumentEmbeddings) -> np.ndarray:
        """ColBERTer's score of every query against every document -> [B, n] float32.

        w * (q_cls . d_cls) + (1 - w) * sum over query words of the best dot product with
        a document word; a document without words contributes 0 to the second term (the
        convention of espn.maxsim). A brute-force reference for tests and small corpora.
        """
        w = self.learned_weight
        assert w is not None  # ColBERTer always has a learned weight
        q_cls, d_cls = torch.as_tensor(queries.cls, dtype=torch.float32), torch.as_tensor(documents.cls, dtype=torch.float32)
        q_bow, q_mask = torch.as_tensor(queries.bow, dtype=torch.float32), torch.as_tensor(queries.mask)
        d_bow = torch.as_tensor(documents.bow, dtype=torch.float32)
        counts = torch.as_tensor(documents.counts, dtype=torch.int64)
        owner = torch.repeat_interleave(torch.arange(len(counts)), counts)  # [V] document of each vector
        sim = torch.einsum("bld,vd->blv", q_bow, d_bow)  # [B, Lq, V]
        best = torch.full((sim.shape[0], sim.shape[1], len(counts)), -math.inf)
        best = best.scatter_reduce(2, owner.expand(sim.shape[0], sim.shape[1], -1), sim, reduce="amax")
        best = torch.where(q_mask[..., None] & torch.isfinite(best), best, torch.zeros(()))
        return (w * (q_cls @ d_cls.T) + (1 - w) * best.sum(1)).numpy()

    # -- persistence ---------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "d_cls": self.d_cls,
            "d_bow": self.d_bow,
            "hidden": self.hidden,
            "max_length": self.max_length,
            "query_max_length": self.query_max_length,
            "stopwords": self.stopwords,
            "bow_reduction": self.bow_reduction,
            "learned_weight": self.learned_weight,
            "weights": self.weights_file,
            "weights_sha256": sha256_file(self.source / self.weights_file),
        }

    def save(self, directory: Path) -> None:
        """Copy config, weights and tokenizer files into `directory/model`: the index loads offline."""
        names = {"config.json", self.weights_file, *TOKENIZER_FILES}
        # Regular files only; a Hub-cache snapshot's links are followed into its blobs/, no further.
        copy_model_dir(self.source, Path(directory) / "model", "colberter",
                       keep=lambda relative: len(relative.parts) == 1 and relative.name in names)

    @classmethod
    def load(cls, directory: Path, config: Mapping[str, Any], device: str | None = None) -> "ColBERTerEncoder":
        model_dir = Path(directory) / "model"
        if not model_dir.is_dir():
            raise IndexCorruptError(f"{model_dir}: the index's ColBERTer checkpoint is missing")
        encoder = cls.from_pretrained(model_dir, device=device, max_length=int(config.get("max_length", 512)),
                                      query_max_length=config.get("query_max_length"), name=config.get("name"))
        for key in ("d_cls", "d_bow"):
            if key in config and int(config[key]) != getattr(encoder, key):
                raise IndexCorruptError(f"{model_dir}: checkpoint has {key}={getattr(encoder, key)}, "
                                        f"the manifest {config[key]}")
        return encoder
