"""Filtered search: metadata columns, the filter language, the sub-index, the Searcher and the CLI.

The reference for every filter is plain Python over the corpus lines; the reference for
every filtered ranking is the exhaustive search restricted to the matching documents.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest

from espn import Searcher
from espn.ann import build_ivf, coarse_assign, IVFConfig, search_preassigned
from espn.errors import CorpusError
from espn.search.filtered import probe_matching, subset_ivf
from espn.filters import FilterCache, FilterError, canonical_filter, parse_filter
from espn.metadata import MetadataColumns, MetadataWriter
from espn_indexing.scan import scan_corpus

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_CORPUS = ROOT / "espn" / "data" / "sample_corpus.jsonl"
QUERIES = ["What causes tides in the ocean?", "How does TCP guarantee delivery?", "why is the sky blue",
           "How do bees communicate?", "inflation and interest rates", "train travel at high speed"]


@pytest.fixture(scope="module")
def searcher(sample_index: Path):
    with Searcher.open(sample_index) as s:
        yield s


@pytest.fixture(scope="module")
def corpus_metadata() -> dict[str, dict[str, Any]]:
    """doc id -> metadata, straight from the corpus file (the reference)."""
    lines = SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()
    return {d["_id"]: d.get("metadata", {}) for d in map(json.loads, lines)}


def _reference_match(meta: dict[str, Any], spec: dict[str, Any]) -> bool:
    """The filter semantics in plain Python, one document at a time."""
    results = []
    for key, value in spec.items():
        if key == "and":
            results.append(all(_reference_match(meta, f) for f in value))
        elif key == "or":
            results.append(any(_reference_match(meta, f) for f in value))
        elif key == "not":
            results.append(not _reference_match(meta, value))
        else:
            have = meta.get(key)
            values = have if isinstance(have, list) else ([] if have is None else [have])
            ops = value if isinstance(value, dict) else {"eq": value}
            for op, operand in ops.items():
                if op == "eq":
                    results.append(operand in values)
                elif op == "in":
                    results.append(any(v in operand for v in values))
                elif op == "not_in":
                    results.append(not any(v in operand for v in values))
                elif op == "exists":
                    results.append(bool(values) == operand)
                else:
                    compare = {"gt": lambda a, b: a > b, "gte": lambda a, b: a >= b,
                               "lt": lambda a, b: a < b, "lte": lambda a, b: a <= b}[op]
                    results.append(bool(values) and compare(values[0], operand))
    return all(results)


FILTERS = [
    {"topic": "oceans"},
    {"topic": {"in": ["oceans", "weather", "geology"]}},
    {"topic": {"not_in": ["oceans", "weather"]}},
    {"year": {"gte": 2000, "lt": 2010}},
    {"year": 1997},
    {"year": {"in": [1990, 2024]}},
    {"tags": "classic"},
    {"tags": {"in": ["arts", "history"]}},
    {"topic": "oceans", "year": {"gt": 2005}},
    {"or": [{"topic": "music"}, {"and": [{"tags": "science"}, {"year": {"lte": 1995}}]}]},
    {"not": {"tags": "science"}},
    {"topic": {"exists": True}},
    {"topic": "no-such-topic"},
]


@pytest.mark.parametrize("spec", FILTERS, ids=[canonical_filter(f) for f in FILTERS])
def test_filter_masks_match_the_python_reference(searcher: Searcher, corpus_metadata: dict, spec: dict) -> None:
    compiled = searcher.filtered_docs(spec)
    assert compiled is not None
    ids = searcher.ids.external(range(searcher.num_documents))
    want = np.array([_reference_match(corpus_metadata[i], spec) for i in ids])
    np.testing.assert_array_equal(compiled.mask, want)
    assert compiled.matches == int(want.sum())


def test_filtered_search_equals_the_exhaustive_reference(searcher: Searcher) -> None:
    """Every hit satisfies the filter, and the ranking is the exhaustive one over the matches."""
    queries = QUERIES[:3]
    embeddings = searcher.encoder.encode_queries(queries)
    for spec in [FILTERS[1], FILTERS[3], FILTERS[9], {"not": {"topic": "music"}}]:
        compiled = searcher.filtered_docs(spec)
        results = searcher.search(queries, k=20, rerank_count=50, filter=spec)
        reference = searcher.search_exhaustive(embeddings, k=20, rerank_count=50, allowed=compiled.mask)
        for got, want in zip(results, reference):
            numbers = [searcher.ids.internal(h.doc_id) for h in got.hits]
            assert all(compiled.mask[n] for n in numbers), spec
            assert len(got.hits) == min(20, compiled.matches)
            assert [h.doc_id for h in got.hits] == [h.doc_id for h in want], spec
            np.testing.assert_allclose([h.score for h in got.hits], [h.score for h in want], rtol=1e-5, atol=1e-6)
            assert got.stats.matched == compiled.matches


def test_prefetch_on_and_off_agree_under_a_filter(searcher: Searcher) -> None:
    spec = {"tags": "science"}
    on = searcher.search(QUERIES, k=10, filter=spec, prefetch_step=0.25)
    off = searcher.search(QUERIES, k=10, filter=spec, prefetch=False)
    for a, b in zip(on, off):
        assert [h.doc_id for h in a.hits] == [h.doc_id for h in b.hits]


def test_k_results_at_every_selectivity_on_the_index(searcher: Searcher, corpus_metadata: dict) -> None:
    """From one matching document to all of them, with one probe: k results whenever k match."""
    years = sorted({m["year"] for m in corpus_metadata.values()})
    for low in years:
        spec = {"year": {"gte": low}}
        compiled = searcher.filtered_docs(spec)
        for result in searcher.search(QUERIES[:2], k=25, nprobe=1, rerank_count=10, filter=spec):
            assert len(result.hits) == min(25, compiled.matches)
            assert all(compiled.mask[searcher.ids.internal(h.doc_id)] for h in result.hits)
    broad = searcher.search(QUERIES[:1], k=10, nprobe=1, filter={"not": {"topic": "music"}})[0]
    assert broad.stats.filter_path == "ivf"  # 286 of 300 match: more than one list's worth, so probed
    narrow = searcher.search(QUERIES[:1], k=10, nprobe=1, filter={"topic": "music"})[0]
    assert narrow.stats.filter_path == "exact" and narrow.stats.matched == 14


@pytest.fixture(scope="module")
def synthetic_ivf() -> tuple[faiss.IndexIVF, np.ndarray]:
    """20,000 random vectors in a real IVF-Flat: enough documents for a 0.1% filter."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((20_000, 32)).astype(np.float32)
    index = build_ivf(IVFConfig(nlist=64), 32, x)
    index.add(x)
    ivf = faiss.extract_index_ivf(index)
    ivf.referenced_objects = [index]  # the extracted view does not own `index`
    return ivf, x


@pytest.mark.parametrize("selectivity", [0.001, 0.01, 0.1, 0.5, 1.0])
def test_sub_index_probing_at_every_selectivity(synthetic_ivf: tuple, selectivity: float) -> None:
    """k results whenever k match; exact whenever the matches are fewer than the unfiltered scan;
    recall against brute force over the matches otherwise; at 100% the unfiltered probe list."""
    ivf, x = synthetic_ivf
    rng = np.random.default_rng(int(selectivity * 1000))
    mask = rng.random(len(x)) < selectivity
    xq = rng.standard_normal((8, 32)).astype(np.float32)
    sub, counts = subset_ivf(ivf, mask)
    assert sub.ntotal == mask.sum() and counts.sum() == mask.sum()
    nprobe, k = 16, 50
    all_scores, all_lists = coarse_assign(ivf, xq, ivf.nlist)
    sizes = np.array([ivf.invlists.list_size(i) for i in range(ivf.nlist)])
    target = np.maximum(sizes[all_lists[:, :nprobe]].sum(axis=1), k)
    scores, lists, exact = probe_matching(all_scores, all_lists, counts, target)
    got_scores, got = search_preassigned(sub, xq, k, lists, scores)
    matching = np.flatnonzero(mask)
    brute = np.argsort(-(xq @ x[matching].T), axis=1, kind="stable")[:, :k]
    recalls = []
    for i in range(len(xq)):
        found = got[i][got[i] >= 0]
        assert len(found) == min(k, len(matching))
        assert mask[found].all()
        recalls.append(len(set(found) & set(matching[brute[i]])) / len(found))
        if exact[i]:
            assert recalls[-1] == 1.0
    # The rule scans as many matches as the unfiltered search scans codes: recall as good as unfiltered's
    # (random Gaussian vectors have no cluster structure, so neither is near 1 here).
    _, plain = search_preassigned(ivf, xq, k, all_lists[:, :nprobe], all_scores[:, :nprobe])
    plain_brute = np.argsort(-(xq @ x.T), axis=1, kind="stable")[:, :k]
    plain_recall = np.mean([len(set(plain[i]) & set(plain_brute[i])) / k for i in range(len(xq))])
    assert np.mean(recalls) >= plain_recall - 0.03
    assert exact.all() == (mask.sum() <= target.min())
    if selectivity == 1.0:
        np.testing.assert_array_equal(lists, all_lists[:, :nprobe])


def test_filter_errors_name_the_problem(searcher: Searcher) -> None:
    cases = [
        ('{"topik": "x"}', "unknown field 'topik'"),
        ({"year": "1999"}, "field 'year' is integer"),
        ({"topic": 3}, "field 'topic' is keyword"),
        ({"topic": {"gte": "a"}}, "range operators apply to integer and float fields"),
        ({"and": []}, "filter.and: expected a non-empty list"),
        ({"or": {"topic": "x"}}, "filter.or: expected a non-empty list"),
        ({"not": [1]}, "filter.not: expected a JSON object"),
        ("{bad json", "not valid JSON"),
        ([1, 2], "filter: expected a JSON object"),
        ({"topic": ["a", "b"]}, 'use {"in": [...]}'),
        ({"year": {"between": [1, 2]}}, "unknown operator 'between'"),
        ({"year": {"in": []}}, "filter.year.in: expected a non-empty list"),
        ({"tags": {"exists": "yes"}}, "expected true or false"),
        ({"year": {}}, "empty operator object"),
        ({"and": [{"year": {"gt": True}}]}, "filter.and[0].year.gt"),
    ]
    for spec, message in cases:
        with pytest.raises(FilterError, match=None) as info:
            searcher.search(["ocean"], k=3, filter=spec)
        assert message in str(info.value), (spec, str(info.value))
    assert searcher.filtered_docs({}) is None  # the empty filter: every document, searched unfiltered


def test_filter_cache_is_bounded() -> None:
    cache: FilterCache[str, np.ndarray] = FilterCache(max_bytes=250, size=lambda a: a.nbytes, max_entries=3)
    for i in range(5):
        cache.put(str(i), np.zeros(100, dtype=np.uint8))
    assert len(cache) == 2 and cache.bytes == 200 and cache.get("0") is None and cache.get("4") is not None
    cache.put("big", np.zeros(1000, dtype=np.uint8))  # larger than the budget: not kept
    assert cache.get("big") is None
    assert canonical_filter({"b": 1, "a": {"y": 2, "x": 1}}) == canonical_filter('{"a": {"x": 1, "y": 2}, "b": 1}')


def test_columns_round_trip_with_missing_values_and_promotion(tmp_path: Path) -> None:
    """Every type, missing values, int -> float and keyword -> list promotion, a growing dictionary."""
    docs = [
        {"src": "a", "n": 1, "x": 0.5, "ok": True, "tags": "t1"},
        {"src": "b", "n": 2, "x": 2, "tags": ["t2", "t3"]},
        {"n": None, "x": 1.5, "ok": False},
        {"src": "a", "n": 7, "tags": []},
        {},
    ]
    writer = MetadataWriter(tmp_path, len(docs))
    for i, meta in enumerate(docs):
        writer.add(i, meta)
    section = writer.finish()
    columns = MetadataColumns.open(tmp_path, {"counts": {"documents": len(docs)}, "metadata": section})
    assert columns.schema == {"src": "keyword", "n": "integer", "x": "float", "ok": "boolean", "tags": "keywords"}
    from espn.filters import compile_filter

    def match(spec: Any) -> list[int]:
        return np.flatnonzero(compile_filter(parse_filter(spec, columns.schema), columns)).tolist()

    assert match({"src": "a"}) == [0, 3]
    assert match({"src": {"not_in": ["a"]}}) == [1, 2, 4]
    assert match({"n": {"gte": 2}}) == [1, 3]
    assert match({"n": {"exists": False}}) == [2, 4]
    assert match({"x": {"lt": 1.0}}) == [0]
    assert match({"x": 2}) == [1]
    assert match({"ok": False}) == [2]
    assert match({"ok": {"exists": True}}) == [0, 2]
    assert match({"tags": {"in": ["t1", "t3"]}}) == [0, 1]
    assert match({"tags": {"exists": True}}) == [0, 1]


@pytest.mark.parametrize("lines, message", [
    ([{"_id": "a", "text": "x", "metadata": {"y": 1}}, {"_id": "b", "text": "x", "metadata": {"y": "1999"}}],
     ":2: metadata field 'y' holds keyword here but integer in earlier documents"),
    ([{"_id": "a", "text": "x", "metadata": {"y": {"nested": 1}}}], ":1: metadata field 'y': nested objects are not allowed"),
    ([{"_id": "a", "text": "x", "metadata": {"and": 1}}], ":1: metadata field name 'and' is not allowed"),
    ([{"_id": "a", "text": "x", "metadata": [1]}], ":1: 'metadata' must be a JSON object"),
    ([{"_id": "a", "text": "x", "metadata": {"l": ["a", 1]}}], "a list must hold strings only"),
])
def test_bad_metadata_in_the_corpus_names_the_line(tmp_path: Path, lines: list, message: str) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    with pytest.raises(CorpusError) as info:
        scan_corpus(corpus)
    assert message in str(info.value)


def test_cli_search_with_a_filter(sample_index: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from espn.cli import main

    queries = tmp_path / "queries.tsv"
    queries.write_text("q1\tWhat causes tides in the ocean?\nq2\thow do computers store data\n", encoding="utf-8")
    run = tmp_path / "run.trec"
    assert main(["search", str(sample_index), "--queries", str(queries), "--out", str(run), "--k", "20",
                 "--filter", '{"topic": {"in": ["oceans", "weather"]}}']) == 0
    assert "filter matches 27 of 300 documents" in capsys.readouterr().out
    with Searcher.open(sample_index, with_encoder=False) as s:
        mask = s.filtered_docs({"topic": {"in": ["oceans", "weather"]}}).mask
        docs = [line.split()[2] for line in run.read_text().splitlines()]
        assert len(docs) == 40 and all(mask[s.ids.internal(d)] for d in docs)
    for bad, message in [('{"topic": ', "filter: not valid JSON"), ('{"colour": "red"}', "unknown field 'colour'")]:
        assert main(["search", str(sample_index), "--queries", str(queries), "--out", str(run),
                     "--filter", bad]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
