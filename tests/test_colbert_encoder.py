"""ColBERT checkpoints (colbert-ai and PyLate formats) encoded as their reference code does.

Tiny seeded checkpoints are written here with transformers (a BERT or ModernBERT of 32
hidden units over a WordPiece vocabulary made from the sample corpus), in each format. The
reference vectors are computed in the test from the raw model and the projection weights,
following colbert-ai's QueryTokenizer/DocTokenizer and PyLate's ColBERT.encode by hand (ids
built from the tokenizer's bare word pieces), never through espn's code.
"""

from __future__ import annotations

import json
import logging
import re
import string
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import BertConfig, BertModel, BertTokenizerFast

from espn.encoders import encoder_from_spec
from espn.encoders.colbert import ColBERTEncoder, checkpoint_format
from espn.errors import InvalidParameterError
from espn.search.searcher import Searcher
from helpers import run_espn

SAMPLE = Path(__file__).parents[1] / "espn" / "data" / "sample_corpus.jsonl"
QUERIES = ["How does the Sun produce energy?", "phases of the moon", "why do volcanoes erupt, and where?",
           "a query much longer than the query length allows, with many words: " + "energy " * 40]
DOCS = ["The Sun is a G-type main-sequence star; it fuses hydrogen into helium.",
        "The Moon's phases occur because we see different portions of its sunlit half.",
        "Short.", "word " * 300]
HIDDEN = 32


def _sample_passages() -> list[str]:
    """The passages a ColBERT index encodes: title, a space, text (its default --title-joiner, PyLate's BEIR passage)."""
    rows = [json.loads(line) for line in SAMPLE.open()]
    return [f"{row['title']} {row['text']}" if row.get("title") else row["text"] for row in rows]


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A WordPiece vocabulary: specials, markers, punctuation, characters and the sample's frequent words."""
    words: dict[str, int] = {}
    for passage in _sample_passages():
        for word in re.findall(r"[a-z]+", passage.lower()):
            words[word] = words.get(word, 0) + 1
    frequent = sorted(words, key=lambda w: (-words[w], w))[:400]
    chars = list(string.ascii_lowercase + string.digits)
    tokens = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]", "[unused1]"] + list(string.punctuation)
              + chars + [f"##{c}" for c in chars] + [w for w in frequent if w not in chars])
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    path.write_text("\n".join(dict.fromkeys(tokens)) + "\n")
    return path


def _tokenizer(vocab_file: Path, added: tuple[str, ...] = ()) -> BertTokenizerFast:
    words = vocab_file.read_text().split("\n")[:-1]
    tokenizer = BertTokenizerFast(vocab={word: i for i, word in enumerate(words)}, do_lower_case=True)
    if added:
        tokenizer.add_tokens(list(added))
    return tokenizer


def _bert(vocab_size: int, seed: int) -> BertModel:
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=256)
    return BertModel(config).eval()


def _seeded(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) / shape[-1] ** 0.5


def write_colbert_ai(out: Path, model: torch.nn.Module, tokenizer: Any, linear: torch.Tensor,
                     metadata: dict[str, Any] | None, nested: bool = False, safetensors: bool = True) -> Path:
    """A colbert-ai checkpoint: HF_ColBERT config, `<prefix>.`-prefixed backbone weights and a root linear.weight."""
    out.mkdir(parents=True)
    tokenizer.save_pretrained(str(out))
    config = model.config.to_dict()
    config["architectures"] = ["HF_ColBERT"]
    (out / "config.json").write_text(json.dumps(config))
    prefix = model.base_model_prefix
    state = {f"{prefix}.{key}": value.contiguous() for key, value in model.state_dict().items()}
    state["linear.weight"] = linear.contiguous()
    if safetensors:
        save_file(state, str(out / "model.safetensors"))
    else:
        torch.save(state, out / "pytorch_model.bin")
    if metadata is not None:
        (out / "artifact.metadata").write_text(json.dumps({"config": metadata} if nested else metadata))
    return out


def write_pylate(out: Path, model: torch.nn.Module, tokenizer: Any, denses: list[dict[str, Any]],
                 settings: dict[str, Any]) -> Path:
    """A PyLate checkpoint: the Transformer at the root, Dense modules in 1_Dense, 2_Dense, ..."""
    out.mkdir(parents=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    for i, dense in enumerate(denses, start=1):
        where = out / f"{i}_Dense"
        where.mkdir()
        out_features, in_features = dense["weight"].shape
        (where / "config.json").write_text(json.dumps({
            "in_features": in_features, "out_features": out_features, "bias": dense.get("bias") is not None,
            "activation_function": dense.get("activation", "torch.nn.modules.linear.Identity"),
            "use_residual": dense.get("residual", False)}))
        state = {"linear.weight": dense["weight"]}
        if dense.get("bias") is not None:
            state["linear.bias"] = dense["bias"]
        if dense.get("residual_weight") is not None:
            state["residual.weight"] = dense["residual_weight"]
        save_file(state, str(where / "model.safetensors"))
        modules.append({"idx": i, "name": str(i), "path": f"{i}_Dense", "type": "pylate.models.Dense.Dense"})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "config_sentence_transformers.json").write_text(json.dumps({**settings, "similarity_fn_name": "MaxSim"}))
    return out


# -- the reference, by hand ---------------------------------------------------------
def reference_ids(tokenizer: Any, text: str, marker: str, length: int, expand: bool) -> list[int]:
    """[CLS] marker pieces[:length - 3] [SEP] (+ [MASK] up to `length` for an expanded query)."""
    pieces = tokenizer(text, add_special_tokens=False)["input_ids"]
    head = [tokenizer.cls_token_id] + ([tokenizer.convert_tokens_to_ids(marker)] if marker else [])
    ids = head + pieces[: length - len(head) - 1] + [tokenizer.sep_token_id]
    return ids + [tokenizer.mask_token_id] * (length - len(ids)) if expand else ids


def reference_vectors(model: torch.nn.Module, tokenizer: Any, chain: list[dict[str, Any]], text: str, *,
                      marker: str, length: int, is_query: bool, expand: bool, attend: bool,
                      skiplist: set[int]) -> tuple[list[int], np.ndarray]:
    """(ids, [n, d] vectors) of one text, encoded alone: the reference recipe step by step."""
    ids = reference_ids(tokenizer, text, marker, length, is_query and expand)
    real = len(reference_ids(tokenizer, text, marker, length, False))
    attention = [1] * real + [1 if attend else 0] * (len(ids) - real)
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids]), attention_mask=torch.tensor([attention])).last_hidden_state[0]
        x = hidden
        for dense in chain:
            y = x @ dense["weight"].T + (dense["bias"] if dense.get("bias") is not None else 0)
            y = torch.tanh(y) if dense.get("activation", "").endswith("Tanh") else y
            if dense.get("residual"):
                y = y + (x @ dense["residual_weight"].T if dense.get("residual_weight") is not None else x)
            x = y
        vectors = torch.nn.functional.normalize(x, dim=-1)
    keep = [True] * len(ids) if is_query else [i not in skiplist for i in ids]
    return ids, vectors[torch.tensor(keep)].numpy()


def punctuation_ids(tokenizer: Any) -> set[int]:
    return {tokenizer.convert_tokens_to_ids(p) for p in string.punctuation}


def assert_matches_reference(encoder: ColBERTEncoder, model: torch.nn.Module, tokenizer: Any,
                             chain: list[dict[str, Any]], *, q_marker: str, d_marker: str, q_len: int, d_len: int,
                             expand: bool, attend: bool) -> None:
    """Token ids identical, vector counts exact, vectors within 1e-5 (fp32), queries and documents."""
    skiplist = punctuation_ids(tokenizer)
    q = encoder.encode_queries(QUERIES)
    q_tokens = encoder.tokenize(QUERIES, is_query=True)
    for row, text in enumerate(QUERIES):
        ids, expected = reference_vectors(model, tokenizer, chain, text, marker=q_marker, length=q_len, is_query=True,
                                          expand=expand, attend=attend, skiplist=skiplist)
        kept = q_tokens["input_ids"][row][q_tokens["keep"][row]].tolist()
        assert kept == ids
        got = q.bow[row][q.mask[row]]
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=1e-5)
    d = encoder.encode_documents(DOCS)
    d_tokens = encoder.tokenize(DOCS, is_query=False)
    for row, ((_, bow), text) in enumerate(zip(d.split(), DOCS)):
        ids, expected = reference_vectors(model, tokenizer, chain, text, marker=d_marker, length=d_len,
                                          is_query=False, expand=expand, attend=attend, skiplist=skiplist)
        assert d_tokens["input_ids"][row][d_tokens["attention_mask"][row].bool()].tolist() == ids
        assert bow.shape == expected.shape
        np.testing.assert_allclose(bow, expected, atol=1e-5)


def maxsim(q: np.ndarray, d: np.ndarray) -> float:
    return float((q @ d.T).max(axis=1).sum())


# -- fixtures -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bert_parts(vocab_file: Path) -> tuple[BertModel, BertTokenizerFast, torch.Tensor]:
    tokenizer = _tokenizer(vocab_file)
    return _bert(len(tokenizer), seed=3), tokenizer, _seeded((16, HIDDEN), seed=4)


@pytest.fixture(scope="module")
def colbert_ai_dir(tmp_path_factory: pytest.TempPathFactory, bert_parts: Any) -> Path:
    model, tokenizer, linear = bert_parts
    metadata = {"query_maxlen": 24, "doc_maxlen": 64, "dim": 16, "attend_to_mask_tokens": False}
    return write_colbert_ai(tmp_path_factory.mktemp("ckpt") / "colbert-ai", model, tokenizer, linear, metadata)


@pytest.fixture(scope="module")
def pylate_dir(tmp_path_factory: pytest.TempPathFactory, bert_parts: Any) -> Path:
    """The same weights and settings as colbert_ai_dir, in PyLate's format."""
    model, tokenizer, linear = bert_parts
    settings = {"query_prefix": "[unused0]", "document_prefix": "[unused1]", "query_length": 24,
                "document_length": 64, "do_query_expansion": True, "attend_to_expansion_tokens": False}
    return write_pylate(tmp_path_factory.mktemp("ckpt") / "pylate", model, tokenizer, [{"weight": linear}], settings)


# -- vectors ----------------------------------------------------------------------------
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("safetensors", [True, False])
def test_colbert_ai_checkpoint_encodes_like_the_reference(tmp_path: Path, bert_parts: Any, nested: bool,
                                                          safetensors: bool) -> None:
    model, tokenizer, linear = bert_parts
    metadata = {"query_maxlen": 24, "doc_maxlen": 64, "attend_to_mask_tokens": False, "dim": 16}
    path = write_colbert_ai(tmp_path / "ckpt", model, tokenizer, linear, metadata, nested=nested,
                            safetensors=safetensors)
    assert checkpoint_format(path) == "colbert-ai"
    encoder = ColBERTEncoder(path, device="cpu", query_backend="torch")
    assert (encoder.d_bow, encoder.settings.query_length, encoder.settings.document_length) == (16, 24, 64)
    assert encoder.bow_reduction == "sum" and encoder.learned_weight == 0.0 and not encoder.has_trained_cls
    assert_matches_reference(encoder, model, tokenizer, [{"weight": linear}], q_marker="[unused0]",
                             d_marker="[unused1]", q_len=24, d_len=64, expand=True, attend=False)


def test_colbert_ai_defaults_fill_what_the_metadata_lacks(tmp_path: Path, bert_parts: Any) -> None:
    model, tokenizer, linear = bert_parts
    path = write_colbert_ai(tmp_path / "ckpt", model, tokenizer, linear, None)
    s = ColBERTEncoder(path, device="cpu", query_backend="torch").settings
    assert (s.query_prefix, s.document_prefix, s.query_length, s.document_length) == ("[unused0]", "[unused1]", 32, 220)
    assert s.do_query_expansion and not s.attend_to_expansion_tokens and set(s.skiplist_words) == set(string.punctuation)


@pytest.mark.parametrize("attend", [False, True])
def test_pylate_one_dense_with_bias_and_activation(tmp_path: Path, bert_parts: Any, attend: bool) -> None:
    model, tokenizer, _ = bert_parts
    chain = [{"weight": _seeded((12, HIDDEN), 5), "bias": _seeded((12,), 6),
              "activation": "torch.nn.modules.activation.Tanh"}]
    settings = {"query_prefix": "[unused0]", "document_prefix": "[unused1]", "query_length": 20,
                "document_length": 48, "do_query_expansion": True, "attend_to_expansion_tokens": attend}
    path = write_pylate(tmp_path / "ckpt", model, tokenizer, chain, settings)
    encoder = ColBERTEncoder(path, device="cpu", query_backend="torch")
    assert encoder.settings.attend_to_expansion_tokens is attend and encoder.d_bow == 12
    assert_matches_reference(encoder, model, tokenizer, chain, q_marker="[unused0]", d_marker="[unused1]",
                             q_len=20, d_len=48, expand=True, attend=attend)


def test_pylate_two_dense_layers_with_residual(tmp_path: Path, bert_parts: Any) -> None:
    model, tokenizer, _ = bert_parts
    chain = [{"weight": _seeded((24, HIDDEN), 7), "residual": True, "residual_weight": _seeded((24, HIDDEN), 8)},
             {"weight": _seeded((24, 24), 9), "bias": _seeded((24,), 10), "residual": True}]
    settings = {"query_prefix": "[unused0]", "document_prefix": "[unused1]", "query_length": 16,
                "document_length": 40}
    path = write_pylate(tmp_path / "ckpt", model, tokenizer, chain, settings)
    encoder = ColBERTEncoder(path, device="cpu", query_backend="torch")
    assert len(encoder.chain) == 2 and encoder.d_bow == 24
    assert_matches_reference(encoder, model, tokenizer, chain, q_marker="[unused0]", d_marker="[unused1]",
                             q_len=16, d_len=40, expand=True, attend=False)


def test_modernbert_with_added_markers_and_no_expansion(tmp_path: Path, vocab_file: Path) -> None:
    from transformers import ModernBertConfig, ModernBertModel

    tokenizer = _tokenizer(vocab_file, added=("[Q] ", "[D] "))
    torch.manual_seed(11)
    config = ModernBertConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=256,
                              pad_token_id=tokenizer.pad_token_id, cls_token_id=tokenizer.cls_token_id,
                              sep_token_id=tokenizer.sep_token_id, bos_token_id=tokenizer.cls_token_id,
                              eos_token_id=tokenizer.sep_token_id)
    model = ModernBertModel(config).eval()
    chain = [{"weight": _seeded((16, HIDDEN), 12)}]
    settings = {"query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": 20, "document_length": 48,
                "do_query_expansion": False}
    path = write_pylate(tmp_path / "ckpt", model, tokenizer, chain, settings)
    encoder = ColBERTEncoder(path, device="cpu", query_backend="auto")  # ModernBERT: torch, not ONNX
    assert encoder.prefix_ids[True] == tokenizer.convert_tokens_to_ids("[Q] ") >= len(tokenizer) - 2
    assert_matches_reference(encoder, model, tokenizer, chain, q_marker="[Q] ", d_marker="[D] ", q_len=20, d_len=48,
                             expand=False, attend=False)


def test_the_same_weights_in_both_formats_give_identical_vectors(colbert_ai_dir: Path, pylate_dir: Path) -> None:
    ai = ColBERTEncoder(colbert_ai_dir, device="cpu", query_backend="torch")
    pl = ColBERTEncoder(pylate_dir, device="cpu", query_backend="torch")
    assert (ai.settings.format, pl.settings.format) == ("colbert-ai", "pylate")
    qa, qp = ai.encode_queries(QUERIES), pl.encode_queries(QUERIES)
    np.testing.assert_array_equal(qa.mask, qp.mask)
    np.testing.assert_allclose(qa.bow, qp.bow, atol=1e-6)
    da, dp = ai.encode_documents(DOCS), pl.encode_documents(DOCS)
    np.testing.assert_array_equal(da.counts, dp.counts)
    np.testing.assert_allclose(da.bow, dp.bow, atol=1e-6)


# -- settings, refusals, hf: ------------------------------------------------------------
def test_spec_settings_override_the_checkpoint(pylate_dir: Path) -> None:
    encoder = encoder_from_spec(f"colbert:{pylate_dir}?query_length=10&attend_to_expansion_tokens=1"
                                "&skiplist_words=", device="cpu")
    assert isinstance(encoder, ColBERTEncoder)
    assert encoder.settings.query_length == 10 and encoder.settings.attend_to_expansion_tokens
    assert encoder.encode_queries(["phases of the moon"]).mask.shape == (1, 10)
    tokens = encoder.tokenize(["Short, isn't it?"], is_query=False)
    assert bool(tokens["keep"][tokens["attention_mask"].bool()].all())  # an empty skiplist keeps punctuation
    with pytest.raises(InvalidParameterError, match="unknown setting 'query_len'"):
        encoder_from_spec(f"colbert:{pylate_dir}?query_len=10")
    with pytest.raises(InvalidParameterError, match="query_prefix '\\[QX\\]' is not a token"):
        encoder_from_spec(f"colbert:{pylate_dir}?query_prefix=[QX]")
    with pytest.raises(InvalidParameterError, match="must be >= 3"):
        encoder_from_spec(f"colbert:{pylate_dir}?document_length=2")


def test_remote_code_and_unknown_layouts_are_refused_in_one_line(tmp_path: Path, colbert_ai_dir: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    for source in colbert_ai_dir.iterdir():
        (remote / source.name).write_bytes(source.read_bytes())
    config = json.loads((colbert_ai_dir / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "x--modeling.Model"}}))
    with pytest.raises(InvalidParameterError, match="needs remote code") as info:
        ColBERTEncoder(remote, device="cpu")
    assert "\n" not in str(info.value)
    with pytest.raises(InvalidParameterError, match="neither a colbert-ai checkpoint"):
        ColBERTEncoder(tmp_path, device="cpu")
    proc = run_espn("index", SAMPLE, "--out", tmp_path / "x", "--encoder", f"colbert:{remote}", "--no-progress",
                    check=False)
    assert proc.returncode != 0 and "needs remote code" in proc.stderr and "Traceback" not in proc.stderr


def test_hf_spec_of_a_colbert_checkpoint_loads_it_as_colbert(pylate_dir: Path, colbert_ai_dir: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    for path in (pylate_dir, colbert_ai_dir):
        with caplog.at_level(logging.WARNING, logger="espn.encoders"):
            encoder = encoder_from_spec(f"hf:{path}", device="cpu")
        assert isinstance(encoder, ColBERTEncoder)
        assert f"loading it as --encoder colbert:{path}" in caplog.text
    assert "colbert:PATH" in run_espn("index", "--help").stdout


# -- an index ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def colbert_index(tmp_path_factory: pytest.TempPathFactory, pylate_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("colbert-index") / "index"
    run_espn("index", SAMPLE, "--out", out, "--encoder", f"colbert:{pylate_dir}", "--no-progress", "--nlist", "4",
             "--bow-dtype", "float16")  # the pool factor of a ColBERT index is 1 unless told
    return out


def test_exhaustive_search_returns_the_reference_maxsim_ranking(colbert_index: Path, bert_parts: Any) -> None:
    model, tokenizer, linear = bert_parts
    passages = _sample_passages()
    ids = [json.loads(line)["_id"] for line in SAMPLE.open()]
    skiplist = punctuation_ids(tokenizer)
    kwargs: dict[str, Any] = {"marker": "[unused1]", "length": 64, "is_query": False, "expand": True,
                              "attend": False, "skiplist": skiplist}
    docs = [reference_vectors(model, tokenizer, [{"weight": linear}], p, **kwargs)[1] for p in passages]
    with Searcher.open(colbert_index) as searcher:
        assert searcher.encoder is not None and searcher.encoder.kind == "colbert"
        assert searcher.weight == 0.0 and searcher.bow_reduction == "sum"
        q = searcher.encoder.encode_queries(QUERIES[:3])
        hits = searcher.search_exhaustive(q, k=10, rerank_count=len(ids))
    for i, text in enumerate(QUERIES[:3]):
        _, qv = reference_vectors(model, tokenizer, [{"weight": linear}], text, marker="[unused0]", length=24,
                                  is_query=True, expand=True, attend=False, skiplist=skiplist)
        scores = np.array([maxsim(qv, d) for d in docs])
        # The records hold fp16 vectors: the ranking is the reference's on fp16-rounded vectors,
        # the scores the fp32 reference's within 0.5%.
        stored = np.array([maxsim(qv, d.astype(np.float16).astype(np.float32)) for d in docs])
        order = np.argsort(-stored, kind="stable")[:10]
        got = hits[i]
        assert [h.doc_id for h in got] == [ids[j] for j in order]
        np.testing.assert_allclose([h.score for h in got], scores[order], rtol=5e-3)
        np.testing.assert_allclose([h.bow_score for h in got], scores[order], rtol=5e-3)
        top = np.sort(scores)[::-1][:10]
        np.testing.assert_allclose(scores[order], top, rtol=5e-3)  # the fp32 top 10, up to fp16 ties


def test_the_index_reloads_the_identical_encoder_offline(colbert_index: Path, pylate_dir: Path) -> None:
    manifest = json.loads((colbert_index / "manifest.json").read_text())
    assert manifest["encoder"]["kind"] == "colbert" and manifest["encoder"]["settings"]["query_length"] == 24
    assert manifest["store"]["pool_factor"] == 1
    fresh = ColBERTEncoder(pylate_dir, device="cpu", query_backend="torch")
    with Searcher.open(colbert_index) as searcher:
        loaded = searcher.encoder
        assert isinstance(loaded, ColBERTEncoder) and loaded.settings == fresh.settings
        np.testing.assert_allclose(loaded.encode_queries(QUERIES).bow, fresh.encode_queries(QUERIES).bow, atol=1e-5)
        np.testing.assert_allclose(loaded.encode_documents(DOCS).bow, fresh.encode_documents(DOCS).bow, atol=1e-6)


def test_explain_labels_markers_and_expansion_tokens(colbert_index: Path) -> None:
    query = "phases of the moon"
    with Searcher.open(colbert_index) as searcher:
        result = searcher.search([query], k=3, explain=True)[0]
        assert isinstance(searcher.encoder, ColBERTEncoder)
        pieces = len(searcher.encoder.tokenizer(query, add_special_tokens=False)["input_ids"])
    matches = result.hits[0].explanation.matches
    assert len(matches) == 24  # every query vector, expansion included
    kinds = [m.kind for m in matches]
    assert kinds[:2] == ["special", "marker"] and kinds[2:2 + pieces] == ["text"] * pieces
    assert kinds[2 + pieces] == "special" and set(kinds[3 + pieces:]) == {"expansion"}
    assert [m.token for m in matches[:2]] == ["[CLS]", "[unused0]"] and matches[-1].token == "[MASK]"
    text = matches[2:2 + pieces]
    assert all(query[m.query_start:m.query_end] == m.token for m in text)
    assert "".join(m.token for m in text) == query.replace(" ", "")  # the pieces, in order, cover the query
    assert abs(sum(m.contribution for m in matches) - result.hits[0].bow_score) < 1e-3


def test_live_writes_encode_with_the_same_recipe(colbert_index: Path, tmp_path: Path, pylate_dir: Path) -> None:
    import shutil

    from espn.live.checks import NewDocument
    from espn.live.live_index import LiveIndex

    index = tmp_path / "index"
    shutil.copytree(colbert_index, index)
    text = "A purple elephant is dancing on the moon tonight."
    with LiveIndex.open(index) as writer:
        writer.upsert([NewDocument("new-1", text)])
    encoder = ColBERTEncoder(pylate_dir, device="cpu", query_backend="torch")
    q = encoder.encode_queries(["elephant dancing on the moon"])
    expected = maxsim(q.bow[0][q.mask[0]], encoder.encode_documents([text]).bow)
    with Searcher.open(index) as searcher:
        n = searcher.num_documents
        hits = {hit.doc_id: hit.score for hit in searcher.search_exhaustive(q, k=n, rerank_count=n)[0]}
    assert hits["new-1"] == pytest.approx(expected, rel=5e-3)


def test_onnx_query_path_matches_torch(pylate_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("onnxruntime", reason="onnxruntime not installed: the ONNX query path is not available")
    monkeypatch.setenv("HOME", str(tmp_path))  # the graph cache goes under ~/.cache/espn/onnx
    onnx = ColBERTEncoder(pylate_dir, device="cpu", query_backend="onnx")
    torch_path = ColBERTEncoder(pylate_dir, device="cpu", query_backend="torch")
    assert onnx._query_graph() is not None  # noqa: SLF001  # the test checks which path ran
    np.testing.assert_allclose(onnx.encode_queries(QUERIES).bow, torch_path.encode_queries(QUERIES).bow, atol=1e-4)


@pytest.mark.parametrize("record_cache", [False, True], ids=["memory", "posix-half-cached"])
def test_a_written_colbert_index_filtered_hybrid_explained_after_a_restart(colbert_index: Path, tmp_path: Path,
                                                                           record_cache: bool) -> None:
    """Where the features meet: a ColBERT index takes an upsert (with metadata) and a delete, is
    reopened, and its centroid first stage under a filter, explained and in hybrid mode, returns the
    exhaustive MaxSim ranking of the allowed documents: never the deleted or the filtered-out. Also
    read through a record cache holding half the table, so that searches score its hits while its
    misses are read (and, asked twice, what the first asking admitted)."""
    import shutil

    from espn.live.checks import NewDocument
    from espn.live.live_index import LiveIndex

    index = tmp_path / "index"
    shutil.copytree(colbert_index, index)
    text = "A purple elephant is dancing on the moon tonight."
    with LiveIndex.open(index) as writer:
        writer.upsert([NewDocument("new-1", text, metadata={"topic": "astronomy", "year": 2026})])
        writer.delete(["s0001"])  # an astronomy passage: the filter alone would let it through
    astronomy = {"topic": "astronomy"}
    half = (index / "embeddings.bin").stat().st_size / 2**21
    opened = {"reader": "posix", "reader_options": {"record_cache_mb": half, "record_cache_warm": True}} \
        if record_cache else {}
    with Searcher.open(index, **opened) as searcher:  # a restart: everything comes from disk
        assert searcher.first_stage.kind == "centroids"
        n = searcher.num_documents
        everything = {"first_stage_probe": 64, "first_stage_candidates": n}  # the stage hands MaxSim every match
        for _ in range(2 if record_cache else 1):
            dense = searcher.search([text], k=5, filter=astronomy, explain=True, **everything)[0]
            default = searcher.search([text], k=5, filter=astronomy)[0]
            hybrid = searcher.search([text], k=5, filter=astronomy, mode="hybrid")[0]
        if record_cache:
            cache = searcher.reader.describe()["record_cache"]
            assert 0 < cache["hits"] < cache["requests"], cache
        ids = searcher.ids.external(np.arange(n))
        live = searcher.live if searcher.live is not None else np.ones(n, dtype=bool)
        allowed = np.array([bool(ok) and searcher.document(doc_id).metadata.get("topic") == "astronomy"
                            for doc_id, ok in zip(ids, live)])
        reference = searcher.search_exhaustive(searcher.encode([text]), k=5, rerank_count=n, allowed=allowed)[0]
    assert "s0001" in ids and not live[list(ids).index("s0001")] and allowed.sum() >= 5
    assert [h.doc_id for h in dense.hits] == [h.doc_id for h in reference]
    np.testing.assert_allclose([h.score for h in dense.hits], [h.score for h in reference], rtol=1e-4)
    assert dense.hits[0].doc_id == "new-1"  # its own text: every token finds itself
    for hit in dense.hits:  # the explanation adds up to the MaxSim it explains
        assert abs(sum(m.contribution for m in hit.explanation.matches) - hit.bow_score) < 1e-3
    allowed_ids = {doc_id for doc_id, ok in zip(ids, allowed) if ok} - {"s0001"}
    for result in (default, hybrid):
        assert result.hits and {h.doc_id for h in result.hits} <= allowed_ids
    assert hybrid.hits[0].doc_id == "new-1" and hybrid.hits[0].lexical_score is not None
