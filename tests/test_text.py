"""The full-text index on its own (espn.text): BM25 against a brute-force reference, the
query syntax, exact restriction to an allowed bitmap, pinned generations, deletes, and a
writer killed with SIGKILL between its commit and its publish."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from espn.errors import InvalidParameterError
from espn.params import HybridParams
from espn.search.hybrid import fuse
from espn.text import TextConfig, parse_query
from espn.text import engine as text_engine
from espn.text.engine import TextDocument, TextIndex, TextWriter, build_text_index, engine_files

VOCAB = ("ocean tide moon sun star planet orbit gravity water wave storm wind cloud rain river mountain "
         "volcano earthquake running runs runner quickly the of and a").split()


def _corpus(n: int, seed: int = 0, max_words: int = 30) -> list[TextDocument]:
    """Short random documents (<= 30 words): Tantivy stores document lengths up to 40 exactly."""
    rng = np.random.default_rng(seed)
    docs = []
    for number in range(n):
        words = rng.choice(VOCAB, size=int(rng.integers(3, max_words)), p=None)
        title = "common " + " ".join(rng.choice(VOCAB, size=2))
        docs.append(TextDocument(number, title, " ".join(words)))
    return docs


def _brute_bm25(index: TextIndex, docs: list[TextDocument], query: str, k1: float = 1.2, b: float = 0.75) -> dict[int, float]:
    """BM25 of every matching document, from the analyzer's terms: Σ over distinct query terms of
    idf · tf · (k1 + 1) / (tf + k1 · (1 − b + b · dl / avgdl)), idf = ln(1 + (N − n + 0.5) / (n + 0.5))."""
    from espn.corpus import passage_text

    terms = {d.doc_number: Counter(index.analyze(passage_text(d.title, d.text))) for d in docs}
    lengths = {n: sum(c.values()) for n, c in terms.items()}
    avgdl = sum(lengths.values()) / len(docs)
    scores: dict[int, float] = {}
    for term in dict.fromkeys(index.analyze(query)):
        df = sum(1 for c in terms.values() if term in c)
        idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
        for number, counts in terms.items():
            tf = counts.get(term, 0)
            if tf:
                norm = tf + k1 * (1 - b + b * lengths[number] / avgdl)
                scores[number] = scores.get(number, 0.0) + idf * tf * (k1 + 1) / norm
    return scores


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[TextIndex, list[TextDocument]]:
    docs = _corpus(60)
    directory = tmp_path_factory.mktemp("text") / "text"
    section = build_text_index(directory, docs, TextConfig())
    assert section["documents"] == 60 and section["engine"] == "tantivy"
    assert not [name for name in os.listdir(directory) if name.startswith(".")]  # no engine locks left
    return TextIndex(directory, TextConfig()), docs


@pytest.mark.parametrize("query", ["ocean", "ocean tides", "running runner moon", "storm storm wind", "the gravity of water"])
def test_bm25_equals_brute_force(small: tuple[TextIndex, list[TextDocument]], query: str) -> None:
    index, docs = small
    expected = _brute_bm25(index, docs, query)
    got = index.search(parse_query(query), limit=100)
    assert sorted(got.doc_numbers.tolist()) == sorted(expected)  # every matching document, nothing else
    for number, score in zip(got.doc_numbers.tolist(), got.scores.tolist()):
        assert score == pytest.approx(expected[number], rel=1e-5)
    assert np.all(np.diff(got.scores) <= 0)


def test_analyzer_stems_and_drops_stop_words(small: tuple[TextIndex, list[TextDocument]]) -> None:
    index, _ = small
    assert index.analyze("The Runner runs RUNNING quickly") == ["runner", "run", "run", "quick"]
    assert TextConfig(stemmer=False, stop_words=False).analyzer().analyze("The runs") == ["the", "runs"]
    with pytest.raises(InvalidParameterError, match="language"):
        TextConfig(language="klingon").validate()
    with pytest.raises(InvalidParameterError, match="stop-word"):
        TextConfig(language="greek").validate()


def test_query_syntax() -> None:
    parsed = parse_query('tides "full moon" +ocean -storm CTLA - 4 +"sea level"', "simple")
    assert [(c.occur, c.text, c.phrase) for c in parsed.clauses] == [
        ("should", "tides", False), ("should", "full moon", True), ("must", "ocean", False),
        ("must_not", "storm", False), ("should", "CTLA", False), ("should", "4", False), ("must", "sea level", True)]
    assert parsed.dense_text() == "tides full moon ocean CTLA 4 sea level" and parsed.ignored == ()
    # Lenient: what the syntax cannot read is read as text, and said so; nothing raises.
    for query, clauses, what in (('tides "full moon', ["tides", "full", "moon"], "unclosed quote at position 6"),
                                 ('a ""', ["a"], "empty phrase at position 2"),
                                 ("+-moon", ["moon"], "operator '+' at position 0")):
        parsed = parse_query(query, "simple")
        assert [c.text for c in parsed.clauses] == clauses and len(parsed.ignored) == 1 and what in parsed.ignored[0]
    only = parse_query("-moon -sun", "simple")
    assert [c.occur for c in only.clauses] == ["must_not"] * 2 and only.dense_text() == "-moon -sun"


def test_plain_text_has_no_operators() -> None:
    query = 'closed linear operators", SIAM J. -moon +sun AND (x OR y) NOT z: "a'
    parsed = parse_query(query)
    assert parsed.syntax == "plain" and parsed.ignored == () and not parsed.constrained
    assert all(c.occur == "should" and not c.phrase for c in parsed.clauses)
    assert [query[c.start:c.end] for c in parsed.clauses] == query.split()
    assert parsed.dense_text() == query  # the dense side reads it as typed
    assert parse_query(" \t ").clauses == ()
    with pytest.raises(InvalidParameterError, match="syntax must be one of plain, simple"):
        parse_query("moon", "lucene")


def test_phrases_required_and_excluded(tmp_path: Path) -> None:
    docs = [TextDocument(0, "", "the full moon rises over the ocean"), TextDocument(1, "", "moon full of craters"),
            TextDocument(2, "", "ocean storms and the moon"), TextDocument(3, "", "a quiet ocean")]
    build_text_index(tmp_path / "t", docs, TextConfig())
    index = TextIndex(tmp_path / "t", TextConfig())

    def found(query: str) -> list[int]:
        return sorted(index.search(parse_query(query, "simple"), 10).doc_numbers.tolist())

    assert found('"full moon"') == [0]
    assert found("full moon") == [0, 1, 2]
    assert found("moon +ocean") == [0, 2, 3]  # ocean required, moon only adds to the score
    assert index.search(parse_query("moon +ocean", "simple"), 10).doc_numbers[-1] == 3
    assert sorted(index.search(parse_query('"full moon" +ocean -storm'), 10).doc_numbers.tolist()) == [0, 1, 2, 3]
    assert found("+moon +ocean") == [0, 2]
    assert found("ocean -moon") == [3]
    assert found('ocean -"full moon"') == [2, 3]
    assert found('"moon rises over the ocean"') == [0]  # stop words leave their positions
    assert found("the of") == []  # only stop words: nothing to look for
    assert index.satisfying(parse_query("whatever +ocean -storm", "simple"), np.arange(4)).tolist() == [True, False, False, True]
    scores = index.term_scores(parse_query('ocean "full moon" zebra', "simple"), 0)
    assert [(c.terms, c.query_start) for c, _ in scores] == [("ocean", 0), ("full moon", 6)]
    assert sum(s for _, s in scores) == pytest.approx(
        float(index.search(parse_query('ocean "full moon"', "simple"), 1).scores[0]), rel=1e-5)
    spans = index.highlights(parse_query("moon"), "", docs[0].text)
    assert [docs[0].text[a:b] for a, b in spans] == ["moon"]


@pytest.mark.parametrize("term_set_max", [100_000, 0])  # the engine's term set / reading deeper
def test_allowed_bitmap_restricts_exactly(small: tuple[TextIndex, list[TextDocument]], monkeypatch: pytest.MonkeyPatch,
                                          term_set_max: int) -> None:
    index, docs = small
    monkeypatch.setattr(text_engine, "TERM_SET_MAX", term_set_max)
    rng = np.random.default_rng(3)
    for fraction in (0.05, 0.3, 0.9):
        allowed = rng.random(len(docs)) < fraction
        expected = _brute_bm25(index, docs, "ocean wind common")
        ranked = sorted((n for n in expected if allowed[n]), key=lambda n: -expected[n])
        got = index.search(parse_query("ocean wind common"), limit=7, allowed=allowed)
        assert len(got) == min(7, len(ranked))
        assert all(allowed[got.doc_numbers])
        assert [expected[n] for n in got.doc_numbers.tolist()] == pytest.approx([expected[n] for n in ranked[:7]], rel=1e-5)
    assert len(index.search(parse_query("ocean"), 5, allowed=np.zeros(len(docs), bool))) == 0


def _all(index: TextIndex) -> list[int]:
    return sorted(index.search(parse_query("common"), 1000).doc_numbers.tolist())


def test_generations_are_pinned(tmp_path: Path) -> None:
    docs = _corpus(20)
    build_text_index(tmp_path / "text", docs, TextConfig())
    gen0 = TextIndex(tmp_path / "text", TextConfig())
    with TextWriter(tmp_path / "work", tmp_path / "text", TextConfig()) as writer:
        writer.apply([TextDocument(20, "common", "new one"), TextDocument(21, "common", "new two")], [3, 4])
        files1 = writer.publish(tmp_path / "gen1")
        gen1 = TextIndex(tmp_path / "gen1", TextConfig())
        writer.apply([TextDocument(22, "common", "three")], [20, 0])
        files2 = writer.publish(tmp_path / "gen2", previous=files1)
    gen2 = TextIndex(tmp_path / "gen2", TextConfig())
    assert _all(gen0) == list(range(20))
    assert _all(gen1) == [n for n in range(22) if n not in (3, 4)]
    assert _all(gen2) == [n for n in range(23) if n not in (0, 3, 4, 20)]
    assert set(files2) == set(engine_files(tmp_path / "gen2")) and "meta.json" in files2
    for name, entry in files2.items():  # the recorded entries describe the published files
        assert (tmp_path / "gen2" / name).stat().st_size == entry["bytes"]
    text_engine.check_files(tmp_path / "gen2", files2, full=True)


_CRASHING_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from espn.text import TextConfig
    from espn.text.engine import TextDocument, TextWriter
    root = Path(sys.argv[1])
    writer = TextWriter(root / "work", root / "gen1", TextConfig())
    writer.apply([TextDocument(100, "common", "never published")], [5])
    print("committed", flush=True)
    time.sleep(600)  # not synchronisation: the writer stays, unpublished, until the test kills it
""")


def test_writer_killed_before_publish_loses_only_the_unpublished(tmp_path: Path) -> None:
    build_text_index(tmp_path / "text", _corpus(10), TextConfig())
    with TextWriter(tmp_path / "work", tmp_path / "text", TextConfig()) as writer:
        writer.apply([TextDocument(10, "common", "published")], [])
        writer.publish(tmp_path / "gen1")
    child = subprocess.Popen([sys.executable, "-c", _CRASHING_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "committed"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    # The work directory holds the killed writer's commit; the next writer starts from gen1.
    with TextWriter(tmp_path / "work", tmp_path / "gen1", TextConfig()) as writer:
        assert sorted(TextIndex(tmp_path / "work", TextConfig()).search(parse_query("common"), 100).doc_numbers) \
            == list(range(11))
        writer.apply([TextDocument(11, "common", "after the crash")], [2])
        writer.publish(tmp_path / "gen2")
    assert _all(TextIndex(tmp_path / "gen2", TextConfig())) == [0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11]


def _reference_fuse(docs: list[int], dense: list[float | None], lexical: list[float | None],
                    params: HybridParams) -> list[tuple[int, float]]:
    """Plain-Python fusion, written from the definitions."""
    def ranks(scores: list[float | None]) -> dict[int, int]:
        present = sorted((i for i, s in enumerate(scores) if s is not None), key=lambda i: -scores[i])  # type: ignore
        return {i: r + 1 for r, i in enumerate(present)}

    def normalised(scores: list[float | None]) -> dict[int, float]:
        present = [s for s in scores if s is not None]
        low, high = min(present, default=0.0), max(present, default=0.0)
        return {i: (1.0 if high == low else (s - low) / (high - low)) for i, s in enumerate(scores) if s is not None}

    def standardised(scores: list[float | None]) -> dict[int, float]:
        present = [s for s in scores if s is not None]
        if not present:
            return {}
        mean = sum(present) / len(present)
        sd = (sum((s - mean) ** 2 for s in present) / len(present)) ** 0.5
        z = {i: ((s - mean) / sd if sd > 0 else 0.0) for i, s in enumerate(scores) if s is not None}
        lowest = min(z.values())
        return {i: z.get(i, lowest) for i in range(len(scores))}

    out = []
    if params.fusion == "zscore":
        zd, zl = standardised(dense), standardised(lexical)
        for i, doc in enumerate(docs):
            out.append((doc, params.mix_weight * zd.get(i, 0.0) + (1 - params.mix_weight) * zl.get(i, 0.0)))
    elif params.fusion == "rrf":
        rd, rl = ranks(dense), ranks(lexical)
        for i, doc in enumerate(docs):
            out.append((doc, (1 / (params.rrf_k + rd[i]) if i in rd else 0) + (1 / (params.rrf_k + rl[i]) if i in rl else 0)))
    else:
        nd, nl = normalised(dense), normalised(lexical)
        for i, doc in enumerate(docs):
            out.append((doc, params.mix_weight * nd.get(i, 0.0) + (1 - params.mix_weight) * nl.get(i, 0.0)))
    return out


@pytest.mark.parametrize("params", [HybridParams(fusion="rrf"), HybridParams(fusion="rrf", rrf_k=5),
                                    HybridParams(fusion="mix", mix_weight=0.3), HybridParams(fusion="mix", mix_weight=1.0),
                                    HybridParams(fusion="zscore", mix_weight=0.8),
                                    HybridParams(fusion="zscore", mix_weight=0.3)])
def test_fusion_equals_python_reference(params: HybridParams) -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        m = int(rng.integers(1, 40))
        docs = rng.choice(10_000, size=m, replace=False).tolist()
        dense = [float(x) if rng.random() < 0.8 else None for x in rng.normal(size=m)]
        lexical = [float(x) if rng.random() < 0.5 else None for x in rng.gamma(2.0, size=m)]
        fused = fuse(np.array(docs), np.array([np.nan if x is None else x for x in dense]),
                     np.array([np.nan if x is None else x for x in lexical]), params)
        expected = dict(_reference_fuse(docs, dense, lexical, params))
        assert sorted(fused.doc.tolist()) == sorted(docs)
        assert fused.score.tolist() == pytest.approx([expected[d] for d in fused.doc.tolist()], abs=1e-6)
        assert np.all(np.diff(fused.score) <= 1e-12)


def test_hybrid_params_validation() -> None:
    for bad in ({"mode": "sparse"}, {"fusion": "max"}, {"lexical_k": 0}, {"mix_weight": 1.5}, {"rrf_k": True}):
        with pytest.raises(InvalidParameterError, match=next(iter(bad))):
            HybridParams().replace(**bad)
