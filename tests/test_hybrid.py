"""Lexical and hybrid search through the Searcher and the CLI, on the bundled sample index
(built by `espn index`, which adds the full-text index by default): modes, union, fusion,
filters and the live index's deletions on both sides, query syntax, explain, and an index
built without a full-text index (dense only, then `espn text-index`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import run_espn

from espn import Searcher
from espn.cli import main as cli_main
from espn.errors import InvalidParameterError
from espn.search.hybrid import fuse
from espn.search.lexical import TextIndexMissingError
from espn.generation.segments import open_view
from espn.text import parse_query
from espn.text.config import TextConfig
from espn.text.directory import add_text_index

QUERY = "why does the moon turn red during a lunar eclipse"


@pytest.fixture(scope="module")
def searcher(sample_index: Path):
    with Searcher.open(sample_index, verify="none") as opened:
        yield opened


def _ids(result) -> list[str]:
    return [hit.doc_id for hit in result.hits]


def test_index_has_a_checksummed_text_index(sample_index: Path) -> None:
    manifest = json.loads((sample_index / "manifest.json").read_text())
    assert manifest["text"]["engine"] == "tantivy" and manifest["text"]["documents"] == 300
    assert manifest["text"]["analyzer"] == {"language": "english", "stemmer": True, "stop_words": True,
                                            "ascii_fold": False, "max_token_chars": 40}
    text_files = [name for name in manifest["files"] if name.startswith("text/")]
    assert "text/meta.json" in text_files and len(text_files) > 3
    assert manifest["hybrid"]["fusion"] == "zscore" and manifest["hybrid"]["mix_weight"] == 0.8


def test_lexical_mode_is_the_text_index_ranking(searcher: Searcher) -> None:
    (result,) = searcher.search([QUERY], k=8, mode="lexical")
    expected = searcher.text.search(parse_query(QUERY), 8)
    assert _ids(result) == searcher.ids.external(expected.doc_numbers)
    assert [h.score for h in result.hits] == pytest.approx(expected.scores.tolist())
    assert all(h.cls_score is None and h.bow_score is None and h.lexical_score == h.score for h in result.hits)
    assert result.stats.mode == "lexical" and "lexical" in result.stats.stage_ms


def test_hybrid_scores_lexical_only_documents_with_maxsim_and_fuses_the_pool(searcher: Searcher) -> None:
    # A shallow dense head, so most of the lexical side's documents are outside it.
    (union,) = searcher.search([QUERY], k=200, mode="hybrid", rerank_count=5)
    (lists,) = searcher.search([QUERY], k=200, mode="hybrid", rerank_count=5, union=False)
    lexical_only = [h for h in lists.hits if h.dense_score is None]
    assert lexical_only, "some documents only the lexical side found"
    by_id = {h.doc_id: h for h in union.hits}
    for hit in lexical_only:  # with union they were read and re-ranked: a late-interaction score each
        got = by_id[hit.doc_id]
        assert got.bow_score is not None and got.cls_score is not None and got.dense_score is not None
        assert got.dense_score == pytest.approx(searcher.weight * got.cls_score + (1 - searcher.weight) * got.bow_score,
                                                abs=1e-5)
    # The fused order is `fuse` of the pool's two score lists, nothing else.
    hits = union.hits
    fused = fuse(np.arange(len(hits)), np.array([np.nan if h.dense_score is None else h.dense_score for h in hits]),
                 np.array([np.nan if h.lexical_score is None else h.lexical_score for h in hits]),
                 searcher.hybrid_params(mode="hybrid"))
    assert fused.doc.tolist() == list(range(len(hits)))
    assert [h.score for h in hits] == pytest.approx(fused.score.tolist(), abs=1e-6)
    assert union.stats.mode == "hybrid" and union.stats.hybrid["fusion"] == "zscore"
    for fusion in ("rrf", "mix", "zscore"):
        (top,) = searcher.search([QUERY], k=5, mode="hybrid", fusion=fusion)
        assert len(top.hits) == 5 and np.all(np.diff([h.score for h in top.hits]) <= 0)


@pytest.mark.parametrize("mode", ["lexical", "hybrid"])
def test_filters_restrict_both_sides_exactly(searcher: Searcher, mode: str) -> None:
    query_filter = {"topic": "astronomy"}
    (result,) = searcher.search(["moon planet star orbit"], k=10, mode=mode, filter=query_filter)
    assert result.hits and result.stats.matched == 14
    for hit in result.hits:
        assert searcher.docs.metadata(searcher.ids.internal(hit.doc_id))["topic"] == "astronomy"
    # Exact on the lexical side: the top of the text index among exactly the filter's documents.
    mask = searcher.filtered_docs(query_filter).mask
    expected = searcher.text.search(parse_query("moon planet star orbit"), 100, allowed=mask)
    lexical = {h.doc_id: h.lexical_score for h in result.hits if h.lexical_score is not None}
    allowed_scores = dict(zip(searcher.ids.external(expected.doc_numbers), expected.scores.tolist()))
    assert lexical and all(allowed_scores[d] == pytest.approx(s) for d, s in lexical.items())


def test_required_and_excluded_words_hold_on_both_sides(searcher: Searcher) -> None:
    for mode in ("lexical", "hybrid"):
        (result,) = searcher.search(["red shadow +moon -eclipse"], k=20, mode=mode, syntax="simple")
        assert result.hits
        for hit in result.hits:
            title, text = searcher.docs.get(searcher.ids.internal(hit.doc_id))
            terms = set(searcher.text.analyze(f"{title} {text}"))
            assert "moon" in terms and "eclips" not in terms, (mode, hit.doc_id)
    (phrase,) = searcher.search(['"lunar eclipse"'], k=10, mode="lexical", syntax="simple")
    assert phrase.hits and all("lunar eclipse" in " ".join(searcher.docs.get(searcher.ids.internal(h.doc_id))).lower()
                               for h in phrase.hits)


def test_syntax_is_lenient_and_says_what_it_ignored(searcher: Searcher) -> None:
    plain, simple = (searcher.search(['moon "red', "+-eclipse"], k=5, mode="hybrid", syntax=syntax)
                     for syntax in ("plain", "simple"))
    assert all(r.hits and r.stats.syntax == "plain" and r.stats.ignored == [] for r in plain)
    assert [r.stats.ignored for r in simple] == [["unclosed quote at position 5: read as text"],
                                                 ["operator '+' at position 0 before another operator: read as text"]]
    # Plain: the dense side reads the text as typed (the same encoding as a dense search of it).
    assert searcher.dense_queries(['-moon "red'], mode="hybrid") == ['-moon "red']
    assert searcher.dense_queries(['-moon "red'], mode="hybrid", syntax="simple") == ['red']
    with pytest.raises(InvalidParameterError, match="mode must be one of"):
        searcher.search(["moon"], mode="sparse")
    with pytest.raises(InvalidParameterError, match="syntax must be one of"):
        searcher.search(["moon"], mode="hybrid", syntax="lucene")


def test_explain_shows_lexical_matches_beside_maxsim(searcher: Searcher) -> None:
    (result,) = searcher.search(['"lunar eclipse" moon'], k=3, mode="hybrid", explain=True)
    for hit in result.hits:
        assert hit.explanation is not None and hit.explanation.matches  # the MaxSim side
        if hit.lexical_score is not None:
            assert hit.lexical_matches
            assert sum(m.score for m in hit.lexical_matches) == pytest.approx(hit.lexical_score, rel=1e-4)
            title, text = searcher.docs.get(searcher.ids.internal(hit.doc_id))
            for match in hit.lexical_matches:
                words = {({"title": title, "text": text}[s.field])[s.start:s.end].lower() for s in match.spans}
                assert words and all(w.startswith(("lunar", "eclips", "moon")) for w in words), words
    assert "explain" in result.stats.stage_ms


def test_index_without_text_index_stays_dense_then_gets_one(sample_index: Path, tmp_path: Path, capsys) -> None:
    old = tmp_path / "old"
    shutil.copytree(sample_index, old)
    manifest = json.loads((old / "manifest.json").read_text())
    for key in ("text", "hybrid"):
        manifest.pop(key)
    manifest["files"] = {n: e for n, e in manifest["files"].items() if not n.startswith("text/")}
    shutil.rmtree(old / "text")
    (old / "manifest.json").write_text(json.dumps(manifest))  # as an index built before this feature
    with Searcher.open(old) as s:
        assert s.text is None and s.search([QUERY], k=3)[0].hits
        with pytest.raises(TextIndexMissingError, match="espn text-index"):
            s.search([QUERY], mode="hybrid")
    assert cli_main(["search", str(old), "--queries", str(_queries(tmp_path)), "--out", str(tmp_path / "run"),
                     "--mode", "lexical"]) == 1
    assert "needs a full-text index" in capsys.readouterr().err.strip().splitlines()[-1]
    run_espn("text-index", old, "--text-no-stemmer")
    open_view(old, verify="full").close()  # every file, the new text/ ones too, against the manifest
    with Searcher.open(old) as s:
        assert s.manifest["text"]["analyzer"]["stemmer"] is False
        assert s.search(["eclipse"], k=3, mode="lexical")[0].hits


def _queries(tmp_path: Path) -> Path:
    path = tmp_path / "queries.jsonl"
    path.write_text("".join(json.dumps({"_id": f"q{i}", "text": t}) + "\n"
                            for i, t in enumerate([QUERY, "ocean tides +moon", "how do volcanoes erupt"])))
    return path


def test_cli_search_modes_write_trec_runs(sample_index: Path, tmp_path: Path, capsys) -> None:
    """`espn search --mode` (in this process: the command's main, argv to exit status)."""
    queries = _queries(tmp_path)
    assert cli_main(["search", str(sample_index), "--queries", str(queries), "--out", str(tmp_path / "hybrid.trec"),
                     "--k", "10", "--mode", "hybrid", "--fusion", "rrf", "--explain"]) == 0
    lines = (tmp_path / "hybrid.trec").read_text().splitlines()
    assert {line.split()[0] for line in lines} == {"q0", "q1", "q2"}
    with Searcher.open(sample_index, verify="none") as s:  # the run is the library's ranking
        expected = s.search([QUERY], k=10, mode="hybrid", fusion="rrf")[0]
    assert [line.split()[2] for line in lines if line.startswith("q0 ")] == _ids(expected)
    explained = [json.loads(line) for line in (tmp_path / "hybrid.trec.explain.jsonl").read_text().splitlines()]
    assert explained and all("lexical_matches" in line and "dense_score" in line for line in explained)
    (tmp_path / "quoted.jsonl").write_text(json.dumps({"_id": "b", "text": 'moon "red'}) + "\n")
    for syntax in ("plain", "simple"):
        assert cli_main(["search", str(sample_index), "--queries", str(tmp_path / "quoted.jsonl"), "--out",
                         str(tmp_path / syntax), "--mode", "hybrid", "--query-syntax", syntax]) == 0
        assert {line.split()[0] for line in (tmp_path / syntax).read_text().splitlines()} == {"b"}


def test_calibrate_fits_the_mix_weight_into_the_manifest(sample_index: Path, tmp_path: Path) -> None:
    index = tmp_path / "index"
    shutil.copytree(sample_index, index)
    data = Path(__file__).resolve().parents[1] / "espn" / "data"
    assert cli_main(["calibrate", str(index), "--queries", str(data / "sample_queries.jsonl"), "--qrels",
                     str(data / "sample_qrels.tsv"), "--hybrid"]) == 0
    hybrid = json.loads((index / "manifest.json").read_text())["hybrid"]
    assert 0.0 <= hybrid["mix_weight"] <= 1.0 and hybrid["calibrated_on"].endswith("sample_qrels.tsv")
    with Searcher.open(index) as s:
        assert s.hybrid_defaults.mix_weight == hybrid["mix_weight"]


def test_deleted_documents_never_leak_through_the_text_side(sample_index: Path, tmp_path: Path) -> None:
    live = tmp_path / "live"
    shutil.copytree(sample_index, live)
    with Searcher.open(live) as s:
        top = [h.doc_id for h in s.search(["lunar eclipse"], k=3, mode="lexical")[0].hits]
    run_espn("delete", live, top[0])
    with Searcher.open(live) as s:
        for mode in ("lexical", "hybrid"):
            got = [h.doc_id for h in s.search(["lunar eclipse"], k=10, mode=mode)[0].hits]
            assert top[0] not in got and top[1] in got, mode
            filtered = s.search(["lunar eclipse"], k=10, mode=mode, filter={"topic": "astronomy"})[0]
            assert top[0] not in [h.doc_id for h in filtered.hits]
    # The text side is kept live: an added document is found by its words, a replaced one by
    # its new words only, and a compaction (a new base, renumbered) keeps all of it.
    from espn.live.checks import NewDocument
    from espn.live.live_index import LiveIndex

    with LiveIndex.open(live) as writer:
        writer.upsert([NewDocument("eclipse-new", "A lunar eclipse seen from the zyxolith observatory")])
        writer.upsert([NewDocument(top[1], "Now about tidal zyxolith forces, nothing else")])
    for step in ("written", "compacted"):
        with Searcher.open(live) as s:
            for mode in ("lexical", "hybrid"):
                got = [h.doc_id for h in s.search(["lunar eclipse"], k=10, mode=mode)[0].hits]
                assert "eclipse-new" in got and top[0] not in got and top[1] not in got, (step, mode, got)
                assert sorted(h.doc_id for h in s.search(["zyxolith"], k=10, mode="lexical")[0].hits) == \
                    sorted(["eclipse-new", top[1]]), step
        assert cli_main(["compact", str(live)]) == 0
    with pytest.raises(InvalidParameterError, match="already has a full-text index"):
        add_text_index(live, TextConfig())
