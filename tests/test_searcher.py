"""The query pipeline on a real index: prefetch vs sequential, vs an exhaustive reference, threads, bounds."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from espn import InvalidParameterError, Searcher
from espn.search.context import Timer
from espn.search.dense import search_dense

QUERIES = [
    "How do volcanoes form?", "What causes tides in the ocean?", "best way to store vegetables",
    "How does TCP guarantee delivery?", "why is the sky blue", "what is an index in a database",
    "How do bees communicate?", "inflation and interest rates", "How do plants make food from sunlight",
    "train travel at high speed", "what is a black hole", "how vaccines train the immune system",
]


@pytest.fixture(scope="module")
def searcher(sample_index: Path):
    # min_hidden_ms=0: every wave runs, so the prefetch path is what these tests exercise
    # (on a 300-document index the cost model would skip them all; see the test below).
    with Searcher.open(sample_index, min_hidden_ms=0) as s:
        yield s


def ranking(results) -> list[list[str]]:
    return [[h.doc_id for h in r.hits] for r in results]


def test_prefetch_and_sequential_paths_agree(searcher: Searcher) -> None:
    for step in (0.1, 0.3, 1.0):
        fast = searcher.search(QUERIES, k=20, prefetch_step=step)
        slow = searcher.search(QUERIES, k=20, prefetch_step=step, prefetch=False)
        assert ranking(fast) == ranking(slow)
        for a, b in zip(fast, slow):
            np.testing.assert_allclose([h.score for h in a.hits], [h.score for h in b.hits], rtol=1e-5, atol=1e-6)
        assert all(r.stats.prefetched == 0 and r.stats.hit_rate == 0.0 for r in slow)


def test_a_search_that_can_take_no_wave_scans_every_list_in_one_call(searcher: Searcher,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each further FAISS call and merge costs the scan ~30 us: without waves there is one call
    (the test above shows it ranks as the segmented scan does)."""
    from espn.ann import segment_bounds
    from espn.search import dense

    probed: list[int] = []
    real = dense.search_preassigned

    def counted(*args, **kwargs):
        probed.append(args[3].shape[1])  # list_ids [n, m]: the lists this call scans
        return real(*args, **kwargs)

    monkeypatch.setattr(dense, "search_preassigned", counted)
    nprobe = searcher.params().nprobe
    searcher.search(QUERIES[:2], k=20, prefetch=False)
    assert probed == [nprobe]
    probed.clear()
    waved = searcher.search(QUERIES[:2], k=20, prefetch_step=0.3)
    assert len(probed) == len(segment_bounds(nprobe, 0.3)) > 1 and sum(probed) == nprobe
    assert all(r.stats.waves > 0 for r in waved)


def test_prefetch_estimates_only_where_reads_can_be_hidden(searcher: Searcher, sample_index: Path) -> None:
    with Searcher.open(sample_index, reader="memory") as memory:
        memory.search(QUERIES[:2], k=10)
        assert memory.prefetch_estimates is None
    searcher.search(QUERIES[:2], k=10)
    estimates = searcher.prefetch_estimates
    assert estimates is not None and estimates.outcome_ms[0] is not None


def test_cost_model_skips_waves_that_cannot_hide_anything(searcher: Searcher, sample_index: Path) -> None:
    with Searcher.open(sample_index, min_hidden_ms=1e9) as never:
        skipped = never.search(QUERIES, k=20, prefetch_step=0.2)
    taken = searcher.search(QUERIES, k=20, prefetch_step=0.2)
    assert all(r.stats.waves == 0 and r.stats.waves_skipped > 0 and r.stats.prefetched == 0 for r in skipped)
    assert all(r.stats.waves > 0 and r.stats.waves_skipped == 0 and r.stats.prefetched > 0 for r in taken)
    assert ranking(skipped) == ranking(taken)


def test_min_hidden_ms_is_checked(sample_index: Path) -> None:
    with Searcher.open(sample_index, min_hidden_ms=0.5) as s:
        assert s.context.prefetch.may_pay(0.6) and not s.context.prefetch.may_pay(0.4)
    with pytest.raises(InvalidParameterError, match="min_hidden_ms"):
        Searcher.open(sample_index, min_hidden_ms=-1)


def test_pipeline_equals_exhaustive_reference(searcher: Searcher) -> None:
    """Every cluster probed and everything re-ranked: the candidate sets agree, so must the rankings."""
    results = searcher.search(QUERIES, k=50, nprobe=searcher.nlist, rerank_count=searcher.num_documents)
    reference = searcher.search_exhaustive(searcher.encoder.encode_queries(QUERIES), k=50,
                                           rerank_count=searcher.num_documents)
    for got, want in zip(results, reference):
        assert [h.doc_id for h in got.hits] == [h.doc_id for h in want]
        np.testing.assert_allclose([h.score for h in got.hits], [h.score for h in want], rtol=1e-5, atol=1e-6)


def test_scores_follow_the_formula(searcher: Searcher) -> None:
    w = searcher.weight
    result = searcher.search(["ocean tides and the moon"], k=30, rerank_count=10)[0]
    head, tail = result.hits[:10], result.hits[10:]
    for hit in head:
        assert hit.score == pytest.approx(w * hit.cls_score + (1 - w) * hit.bow_score, abs=1e-5)
    assert all(h.bow_score is None for h in tail)
    scores = [h.score for h in result.hits]
    assert scores == sorted(scores, reverse=True)  # trec_eval sorts by score: the order must survive
    tail_cls = [h.cls_score for h in tail]
    assert tail_cls == sorted(tail_cls, reverse=True)


def test_prefetch_stats(searcher: Searcher) -> None:
    results = searcher.search(QUERIES, k=10, prefetch_step=0.2)
    for r in results:
        assert 0.0 <= r.stats.hit_rate <= 1.0
        assert r.stats.prefetched > 0 and r.stats.bytes_read > 0 and r.stats.ios > 0
        assert {"encode", "quantizer", "ann", "prefetch_wait", "miss_read", "total"} <= set(r.stats.stage_ms)
    assert np.mean([r.stats.hit_rate for r in results]) > 0.5


def test_concurrent_calls_equal_serial_calls(searcher: Searcher) -> None:
    cases = [(q, n) for q in QUERIES for n in (2, searcher.nlist)]
    serial = {case: ranking(searcher.search([case[0]], k=10, nprobe=case[1]))[0] for case in cases}
    barrier = threading.Barrier(8)

    def worker(offset: int) -> list[tuple[tuple[str, int], list[str]]]:
        barrier.wait()  # all eight threads search at once
        return [(cases[(i + offset) % len(cases)],
                 ranking(searcher.search([cases[(i + offset) % len(cases)][0]], k=10,
                                         nprobe=cases[(i + offset) % len(cases)][1]))[0])
                for i in range(24)]

    with ThreadPoolExecutor(8) as pool:
        outcomes = [item for f in [pool.submit(worker, 3 * t) for t in range(8)] for item in f.result()]
    assert len(outcomes) == 8 * 24
    for case, got in outcomes:
        assert got == serial[case], case


def test_batch_equals_single_queries(searcher: Searcher) -> None:
    batch = ranking(searcher.search(QUERIES, k=10))
    single = [ranking(searcher.search([q], k=10))[0] for q in QUERIES]
    assert batch == single


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"k": 0}, "k"), ({"k": 10**6}, "k"), ({"nprobe": 0}, "nprobe"), ({"nprobe": 10**6}, "nprobe"),
        ({"prefetch_step": 0.0}, "prefetch_step"), ({"prefetch_step": 1.5}, "prefetch_step"),
        ({"prefetch_k": -1}, "prefetch_k"), ({"rerank_count": 10**7}, "rerank_count"), ({"k": "ten"}, "k"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_parameters_name_themselves(searcher: Searcher, kwargs: dict, name: str) -> None:
    with pytest.raises(InvalidParameterError, match=name):
        searcher.search(["anything"], **kwargs)


@pytest.mark.parametrize("queries", [[""], ["   "], [None], "a string, not a list", ["x" * 20_000]])
def test_bad_queries(searcher: Searcher, queries) -> None:
    with pytest.raises(InvalidParameterError):
        searcher.search(queries)


def test_k_larger_than_corpus_returns_everything(searcher: Searcher) -> None:
    hits = searcher.search(["volcano"], k=5000, nprobe=searcher.nlist)[0].hits
    assert len(hits) == searcher.num_documents == len({h.doc_id for h in hits})


def test_early_rerank_in_the_prefetch_thread_gives_the_same_ranking(sample_index: Path, searcher: Searcher) -> None:
    """The GPU behaviour (MaxSim inside the prefetch waves), forced on the CPU."""
    with Searcher.open(sample_index, early_rerank=True, min_hidden_ms=0) as early:
        assert early.early_rerank and not searcher.early_rerank
        a = early.search(QUERIES, k=20, prefetch_step=0.2)
        b = searcher.search(QUERIES, k=20, prefetch_step=0.2)
    assert ranking(a) == ranking(b)
    assert [r.stats.hit_rate for r in a] == [r.stats.hit_rate for r in b]


def test_a_failed_read_fails_the_search_cleanly(sample_index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O error in a prefetch wave reaches the caller as that error; the searcher still works."""
    with Searcher.open(sample_index, min_hidden_ms=0) as s:
        real = s.reader._submit
        calls = {"n": 0}

        def failing_once(offsets, lengths):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == 1:
                raise OSError(5, "Input/output error")
            return real(offsets, lengths)

        monkeypatch.setattr(s.reader, "_submit", failing_once)
        with pytest.raises(OSError, match="Input/output error"):
            s.search(QUERIES[:2], k=5, prefetch_step=0.2)
        assert len(s.search(QUERIES[:2], k=5, prefetch_step=0.2)[0].hits) == 5


def test_scores_below_the_head_never_tie_even_with_w_zero(searcher: Searcher, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(searcher, "weight", 0.0)
    hits = searcher.search(["ocean tides and the moon"], k=60, rerank_count=10)[0].hits
    scores = [h.score for h in hits]
    assert all(a > b for a, b in zip(scores[9:], scores[10:]))  # strictly falling below the head


def test_allowed_mask_is_applied_inside_the_ann_search(searcher: Searcher) -> None:
    """The hook deletions and filters use: k results from the allowed documents only, equal to
    the exhaustive reference restricted to them (and never fewer while enough are allowed)."""
    embeddings = searcher.encoder.encode_queries(QUERIES[:4])
    allowed = np.zeros(searcher.num_documents, dtype=bool)
    allowed[::3] = True
    params = searcher.params(k=10, nprobe=searcher.nlist, rerank_count=50)
    results = search_dense(searcher.context, embeddings, params, Timer(), allowed=allowed)
    reference = searcher.search_exhaustive(embeddings, k=10, rerank_count=50, allowed=allowed)
    for result, ref in zip(results, reference):
        numbers = [searcher.ids.internal(h.doc_id) for h in result.hits]
        assert len(numbers) == 10 and all(allowed[n] for n in numbers)
        assert [h.doc_id for h in result.hits] == [h.doc_id for h in ref]
