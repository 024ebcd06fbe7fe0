"""The opt-in int8 encoder: the ONNX graph quantised, measured against fp32 and refused below its budget.

Checkpoints are the fixtures written by PyLate 1.6.0 and Sentence Transformers 6.2 (tests/model_fixtures/);
the graph cache lives under each test's own HOME.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

import espn.encoders.int8 as int8
from espn.choices import INT8_MIN_OVERLAP, PRECISIONS
from espn.encoders import encoder_from_spec, load_encoder
from espn.errors import InvalidParameterError
from espn.search.searcher import Searcher
from helpers import run_espn

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "model_fixtures"
MODERNBERT = FIXTURES / "pylate-1.6-modernbert"
ST_MODERNBERT = FIXTURES / "st-6.2-modernbert-prompts-expansion"
SAMPLE = ROOT / "espn" / "data" / "sample_corpus.jsonl"
QUERIES = ["what causes ocean tides", "how do vaccines train the immune system"]


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))  # the graph cache: ~/.cache/espn/onnx
    return tmp_path


@pytest.mark.parametrize("checkpoint", [MODERNBERT, ST_MODERNBERT], ids=lambda p: p.name)
def test_int8_encodes_queries_and_documents_within_the_budget(checkpoint: Path, home: Path) -> None:
    exact = encoder_from_spec(f"colbert:{checkpoint}", device="cpu")
    encoder = encoder_from_spec(f"colbert:{checkpoint}", device="cpu", precision="int8")
    assert encoder.precision == "int8" and encoder.int8_fidelity is not None  # type: ignore[attr-defined]
    assert encoder.int8_fidelity.overlap >= INT8_MIN_OVERLAP  # type: ignore[attr-defined]
    config = encoder.config()
    assert config["precision"] == "int8" and config["int8_fidelity"]["top10_overlap"] >= INT8_MIN_OVERLAP
    for got, want in ((encoder.encode_queries(QUERIES).bow, exact.encode_queries(QUERIES).bow),
                      (encoder.encode_documents(QUERIES).bow, exact.encode_documents(QUERIES).bow)):
        assert got.shape == want.shape and not np.array_equal(got, want)  # the int8 graph ran, documents too
        np.testing.assert_allclose(got, want, atol=0.05)
    cached = sorted(p.name for p in (home / ".cache" / "espn" / "onnx").iterdir())
    assert any(name.endswith("-int8.onnx") for name in cached) and any(name.endswith("-int8.json") for name in cached)
    again = encoder_from_spec(f"colbert:{checkpoint}", device="cpu", precision="int8")  # measured once, cached
    assert again.config()["int8_fidelity"] == config["int8_fidelity"]


def test_below_the_budget_int8_is_refused_and_an_index_falls_back_to_fp32(
        home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    monkeypatch.setattr(int8, "INT8_MIN_OVERLAP", 1.01)  # no encoder can keep more than all of the top 10
    with pytest.raises(InvalidParameterError, match="below the budget 1.01; refused") as refused:
        encoder_from_spec(f"colbert:{MODERNBERT}", device="cpu", precision="int8")
    assert "\n" not in str(refused.value) and "int8-unchecked" in str(refused.value)
    unchecked = encoder_from_spec(f"colbert:{MODERNBERT}", device="cpu", precision="int8-unchecked")
    assert unchecked._query_graph().precision == "int8"  # noqa: SLF001  # the test checks which graph runs
    # An index recorded as int8 whose graph now measures below the budget encodes in fp32, with a warning.
    unchecked.save(tmp_path / "encoder")
    config = {**unchecked.config(), "precision": "int8"}
    with caplog.at_level(logging.WARNING, logger="espn.encoders.onnx"):
        loaded = load_encoder(tmp_path / "encoder", config, device="cpu")
        q = loaded.encode_queries(QUERIES)
    assert "encoding in fp32" in caplog.text and loaded._query_graph().precision == "fp32"  # type: ignore[attr-defined]  # noqa: SLF001
    exact = encoder_from_spec(f"colbert:{MODERNBERT}", device="cpu").encode_queries(QUERIES)
    np.testing.assert_allclose(q.bow, exact.bow, atol=1e-4)


def test_precision_is_refused_where_there_is_no_onnx_graph(home: Path) -> None:
    with pytest.raises(InvalidParameterError, match="precision must be one of"):
        encoder_from_spec(f"colbert:{MODERNBERT}", device="cpu", precision="int4")
    with pytest.raises(InvalidParameterError, match="CPU path"):
        int8.check_precision("int8", "cuda", "auto")
    from espn.encoders.colbert import ColBERTEncoder

    with pytest.raises(InvalidParameterError, match="query_backend='torch' has none"):
        ColBERTEncoder(MODERNBERT, device="cpu", query_backend="torch", precision="int8")
    assert PRECISIONS[0] == "fp32"


def test_espn_index_records_int8_and_searches_with_it(home: Path, tmp_path: Path) -> None:
    out = tmp_path / "index"
    run_espn("index", SAMPLE, "--out", out, "--encoder", f"colbert:{ST_MODERNBERT}", "--encoder-precision", "int8",
             "--no-progress", "--device", "cpu", "--bow-dtype", "float16", "--no-text-index")
    encoder = json.loads((out / "manifest.json").read_text())["encoder"]
    assert encoder["precision"] == "int8" and encoder["int8_fidelity"]["top10_overlap"] >= INT8_MIN_OVERLAP
    reference = json.loads((ST_MODERNBERT / "reference.json").read_text())
    with Searcher.open(out) as searcher:
        queries = searcher.encode(reference["queries"])
        hits = searcher.search_exhaustive(queries, k=10, rerank_count=searcher.num_documents)
    overlap = np.mean([len({h.doc_id for h in found} & set(top)) / 10 for found, top in zip(hits, reference["top10"])])
    assert overlap >= INT8_MIN_OVERLAP, overlap  # int8 documents and queries, against the library's fp32 top 10


def test_an_int8_index_opens_in_fp32_on_a_gpu(caplog: pytest.LogCaptureFixture) -> None:
    """No CUDA device here: what the loader decides for one, without one (the decision only)."""
    with caplog.at_level(logging.WARNING, logger="espn.encoders.int8"):
        assert int8.loaded_precision({"precision": "int8"}, "cuda:0") == "fp32"
    assert "encodes in fp32" in caplog.text
    assert int8.loaded_precision({"precision": "int8"}, "cpu") == "int8"
    assert int8.loaded_precision({}, "cpu") == "fp32"
