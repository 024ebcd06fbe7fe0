"""Match explanations (`Searcher.search(..., explain=True)`) on the sample index, generic encoder.

What is checked against what: the contributions against the pipeline's own BOW score;
the explained span against a fresh encoding of the stored passage (the vector the
encoder makes for the token at that span is the stored vector that matched); explain off
against the plain search, hit for hit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import run_espn

from espn.corpus import passage_text
from espn.errors import InvalidParameterError
from espn.search.explain import can_explain, passage_spans
from espn.maxsim import record_vectors
from espn.pooling.cluster import pool_vectors
from espn.results import PassageSpan

QUERIES = ["why does the moon turn red during a lunar eclipse", "what causes ocean tides",
           "how do search engines rank documents with BM25"]


@pytest.fixture(scope="module")
def searcher(sample_index: Path):
    from espn import Searcher

    opened = Searcher.open(sample_index)
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def explained(searcher):
    return searcher.search(QUERIES, k=8, rerank_count=5, explain=True)


def test_contributions_sum_to_the_bow_score(explained) -> None:
    for result in explained:
        reranked = [hit for hit in result.hits if hit.bow_score is not None]
        assert len(reranked) == 5 and all(hit.explanation is None for hit in result.hits[5:])
        for hit in reranked:
            e = hit.explanation
            assert e is not None and len(e.matches) > 0
            assert sum(m.contribution for m in e.matches) == pytest.approx(hit.bow_score, abs=1e-5)
            assert e.cls_part + e.bow_part == pytest.approx(hit.score, abs=1e-5)
            # Mean reduction: every contribution is the similarity over the query's vector count.
            assert all(m.contribution == pytest.approx(m.similarity / len(e.matches)) for m in e.matches)


def test_explain_off_is_the_plain_search(searcher, explained) -> None:
    plain = searcher.search(QUERIES, k=8, rerank_count=5)
    assert [h for r in plain for h in r.hits if h.explanation is not None] == []
    stripped = [[dataclasses.replace(h, explanation=None) for h in r.hits] for r in explained]
    assert [r.hits for r in plain] == stripped
    assert "explain" not in plain[0].stats.stage_ms and "explain" in explained[0].stats.stage_ms


def test_query_tokens_are_the_query_text(explained) -> None:
    for query, result in zip(QUERIES, explained):
        tokens = [m.token for m in result.hits[0].explanation.matches]
        assert "".join(tokens) == query.replace(" ", "")  # every word piece, in order ("BM25": B, M, 25)
        for m in result.hits[0].explanation.matches:
            assert query[m.query_start:m.query_end] == m.token


def test_the_span_re_encodes_to_the_matched_vector(searcher, explained) -> None:
    """Encode the stored passage afresh and pool it as the writer did (the sample index uses
    the default pool factor): the stored vector that matched is the pooled vector of exactly
    the tokens at the explained spans, and it gives the reported similarity."""
    encoder = searcher.encoder
    factor = int(searcher.manifest["store"].get("pool_factor", 1))
    q = encoder.encode_queries(QUERIES)
    checked = 0
    for i, result in enumerate(explained):
        for hit in result.hits[:3]:
            doc = searcher.document(hit.doc_id)
            passage = passage_text(doc.title, doc.text)
            tokens = encoder.tokenizer(passage, truncation=True, max_length=encoder.max_length,
                                       return_offsets_mapping=True, return_special_tokens_mask=True)
            content = [j for j, special in enumerate(tokens["special_tokens_mask"]) if not special]
            offsets = [tuple(tokens["offset_mapping"][j]) for j in content]
            fresh = encoder.encode_documents([passage]).bow  # [n, d_bow], record order
            pooled, groups = pool_vectors(fresh.astype(np.float16), factor)
            with searcher.reader.submit(np.array([searcher.ids.internal(hit.doc_id)])).records() as records:
                stored = record_vectors(records, searcher.layout)[0].numpy()  # as the search scores them
            np.testing.assert_allclose(pooled, stored, atol=1e-2)  # int8 codes with a per-vector scale
            q_vectors = q.bow[i][q.mask[i]]
            for m, q_vector in zip(hit.explanation.matches, q_vectors):
                field_start = {"title": 0, "joiner": len(doc.title), "text": len(doc.title) + 2 if doc.title else 0}
                got = sorted((field_start[s.field] + s.start, field_start[s.field] + s.end) for s in m.spans)
                merged = np.flatnonzero(groups == m.vector)  # the source tokens pooled into that vector
                assert got == sorted(offsets[t] for t in merged)
                assert float(q_vector @ stored[m.vector]) == pytest.approx(m.similarity, abs=1e-4)
                assert m.similarity == pytest.approx(float((stored @ q_vector).max()), abs=1e-5)
                # ... and each span's own text is its token (MiniLM lower-cases; "##" marks a word piece).
                for span, t in zip(sorted(m.spans, key=lambda s: field_start[s.field] + s.start), merged):
                    source = {"title": doc.title, "joiner": ". ", "text": doc.text}[span.field]
                    piece = encoder.tokenizer.convert_ids_to_tokens(tokens["input_ids"][content[t]])
                    assert piece.removeprefix("##") == encoder.tokenizer.backend_tokenizer.normalizer.normalize_str(
                        source[span.start:span.end])
                checked += 1
    assert checked >= 20


def test_best_matches_against_brute_force() -> None:
    """Synthetic: documents of 0..9 vectors, pairs in chunks smaller than their number."""
    import torch

    from espn.search.explain import best_matches

    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 10, size=12)
    lengths[3] = 0
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    vectors = torch.from_numpy(rng.normal(size=(int(offsets[-1]), 8)).astype(np.float32))
    q_bow = torch.from_numpy(rng.normal(size=(3, 5, 8)).astype(np.float32))
    pair_query, pair_doc = rng.integers(0, 3, size=30), rng.integers(0, 12, size=30)
    pair_doc[0] = 3
    best, matched = best_matches(q_bow, pair_query, vectors, offsets, pair_doc, chunk=7)
    for p, (i, d) in enumerate(zip(pair_query, pair_doc)):
        docs = vectors[offsets[d]:offsets[d + 1]].numpy()
        if len(docs) == 0:
            assert (matched[p] == -1).all() and (best[p] == 0).all()
            continue
        sim = q_bow[i].numpy() @ docs.T
        np.testing.assert_array_equal(matched[p], sim.argmax(1))
        np.testing.assert_allclose(best[p], sim.max(1), rtol=1e-5)


def test_passage_spans_split_title_joiner_and_text() -> None:
    title, text = "Tides", "The Moon pulls."
    passage = passage_text(title, text)
    spans = passage_spans(title, text, [(0, 5), (5, 6), (7, 10), (11, 15)])
    assert spans == (PassageSpan("title", 0, 5), PassageSpan("joiner", 0, 1), PassageSpan("text", 0, 3),
                     PassageSpan("text", 4, 8))
    assert passage[7:10] == text[0:3]
    assert passage_spans("", text, [(4, 8)]) == (PassageSpan("text", 4, 8),)


def test_explain_is_refused_where_it_cannot_work(searcher) -> None:
    from espn.encoders.precomputed import PrecomputedEncoder

    with pytest.raises(InvalidParameterError, match="explain"):
        can_explain(PrecomputedEncoder(d_cls=4, d_bow=4))
    with pytest.raises(InvalidParameterError, match="explain must be true or false"):
        searcher.search(["tides"], explain="yes")


def test_cli_writes_explanations_beside_the_run(sample_index: Path, tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "run.trec"
    run_espn("search", sample_index, "--queries", root / "espn/data/sample_queries.jsonl", "--out", run,
             "--k", "3", "--explain")
    lines = [json.loads(line) for line in (tmp_path / "run.trec.explain.jsonl").read_text().splitlines()]
    run_lines = run.read_text().splitlines()
    assert len(lines) == len(run_lines) == 90
    first = run_lines[0].split()
    assert (lines[0]["query_id"], lines[0]["doc_id"], lines[0]["rank"]) == (first[0], first[2], 1)
    for line in lines:
        contributions = sum(m["contribution"] for m in line["explanation"]["matches"])
        assert contributions == pytest.approx(line["bow_score"], abs=1e-5)
    refused = run_espn("search", sample_index, "--queries", root / "espn/data/sample_queries.jsonl", "--out", run,
                       "--explain", "--exhaustive", check=False)
    assert refused.returncode != 0 and "--explain" in refused.stderr.strip().splitlines()[-1]
