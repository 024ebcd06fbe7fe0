"""Queries on ONNX Runtime: the graph exported from the encoder's own weights encodes like torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from espn.encoders.hf import HFEncoder, _grouped_hidden_states
from espn.errors import InvalidParameterError

QUERIES = ["what causes the tides", "a much longer question about how the immune system learns to recognise "
           "viruses after vaccination, and for how long", "dna", "protein folding in bacteria at high temperature"]


@pytest.fixture(scope="module")
def torch_encoder() -> HFEncoder:
    encoder = HFEncoder.from_pretrained(None, bow_dim=32)
    encoder.projection = np.linalg.qr(np.random.default_rng(0).standard_normal((encoder.hidden, 32)))[0].astype(np.float32)
    encoder.query_backend = "torch"
    return encoder


def _onnx(torch_encoder: HFEncoder, cache: Path | None, **options) -> HFEncoder:
    return HFEncoder(torch_encoder.model_dir, bow_dim=32, projection=torch_encoder.projection, query_backend="onnx",
                     cache_dir=cache, **options)


def test_onnx_queries_equal_torch_and_the_graph_is_cached(torch_encoder: HFEncoder, tmp_path: Path) -> None:
    encoder = _onnx(torch_encoder, tmp_path / "cache", threads=1)
    got, want = encoder.encode_queries(QUERIES), torch_encoder.encode_queries(QUERIES)
    assert encoder._query_graph() is not None and "onnxruntime" in encoder.describe()
    np.testing.assert_array_equal(got.mask, want.mask)
    np.testing.assert_allclose(got.cls, want.cls, atol=1e-5)
    np.testing.assert_allclose(got.bow, want.bow, atol=1e-5)
    (graph,) = (tmp_path / "cache").glob("hidden-*.onnx")
    stamp = graph.stat().st_mtime_ns
    again = _onnx(torch_encoder, tmp_path / "cache")  # a second process: loads, does not export
    np.testing.assert_allclose(again.encode_queries(QUERIES[:1]).cls, want.cls[:1], atol=1e-5)
    assert again._query_graph().cached and graph.stat().st_mtime_ns == stamp
    assert oct(graph.stat().st_mode & 0o777) == "0o644"
    assert encoder.model_loaded and not again.model_loaded  # a cached graph was checked before it was cached


def test_a_graph_that_differs_from_torch_is_neither_used_nor_cached(torch_encoder: HFEncoder, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("espn.encoders.onnx.GRAPH_TOLERANCE", -1.0)  # no graph can agree
    encoder = HFEncoder(torch_encoder.model_dir, bow_dim=32, projection=torch_encoder.projection,
                        query_backend="auto", cache_dir=tmp_path / "cache")
    got = encoder.encode_queries(QUERIES[:2])
    assert encoder._query_graph() is None and "torch" in encoder.describe()
    assert list((tmp_path / "cache").iterdir()) == []  # no graph, no temporary file left
    np.testing.assert_allclose(got.bow, torch_encoder.encode_queries(QUERIES[:2]).bow, atol=1e-6)


def test_a_damaged_cached_graph_is_exported_again(torch_encoder: HFEncoder, tmp_path: Path) -> None:
    _onnx(torch_encoder, tmp_path / "cache").encode_queries(QUERIES[:1])
    (graph,) = (tmp_path / "cache").glob("hidden-*.onnx")
    graph.write_bytes(graph.read_bytes()[:1000])  # truncated
    again = _onnx(torch_encoder, tmp_path / "cache")
    np.testing.assert_allclose(again.encode_queries(QUERIES[:1]).cls, torch_encoder.encode_queries(QUERIES[:1]).cls,
                               atol=1e-5)
    assert again._query_graph().cached and graph.stat().st_size > 1000


def test_an_unwritable_cache_exports_into_memory(torch_encoder: HFEncoder) -> None:
    encoder = _onnx(torch_encoder, Path("/proc/espn-cache"))  # nobody, root included, can create it
    got = encoder.encode_queries(QUERIES[2:])
    assert not encoder._query_graph().cached
    np.testing.assert_allclose(got.bow, torch_encoder.encode_queries(QUERIES[2:]).bow, atol=1e-5)


def test_length_groups_give_the_padded_batch_result(torch_encoder: HFEncoder, tmp_path: Path) -> None:
    encoder = _onnx(torch_encoder, tmp_path / "cache")
    graph = encoder._query_graph()
    tokens = encoder.tokenize(QUERIES * 3, is_query=True)
    grouped = _grouped_hidden_states(graph, tokens["input_ids"], tokens["attention_mask"])
    whole = graph.hidden_states(tokens["input_ids"], tokens["attention_mask"])
    valid = tokens["attention_mask"].bool()
    torch.testing.assert_close(grouped[valid], whole[valid], atol=1e-5, rtol=1e-5)
    assert float(grouped[~valid].abs().max()) == 0.0


def test_bad_backend_options_name_the_parameter(torch_encoder: HFEncoder) -> None:
    with pytest.raises(InvalidParameterError, match="query_backend"):
        HFEncoder(torch_encoder.model_dir, query_backend="tensorrt")
    with pytest.raises(InvalidParameterError, match="threads"):
        HFEncoder(torch_encoder.model_dir, threads=0)
