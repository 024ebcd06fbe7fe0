"""The prefetch cost model: a wave is taken only when what it hides exceeds what it costs."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from espn.prefetch import EXPLORE_EVERY, MIN_OUTCOMES, PrefetchModel, ScanProgress, segment_codes


def _with_reads(latency_ms: float, ms_per_kb: float) -> PrefetchModel:
    model = PrefetchModel(min_gain_ms=0.2)
    for kb in (10, 100, 1000) * 20:
        model.observe_read(kb * 1000, latency_ms + ms_per_kb * kb)
    return model


def test_before_any_measurement_the_scan_left_decides() -> None:
    model = PrefetchModel(min_gain_ms=0.2)
    assert model.wave_pays(0.5, 10, 10_000) and not model.wave_pays(0.1, 10, 10_000)
    assert model.estimates.read_latency_ms is None


def test_the_fits_recover_latency_bandwidth_and_submission_costs() -> None:
    model = _with_reads(0.5, 0.002)
    for docs in (10, 100) * 30:
        model.observe_submit(docs, 0.1 + 0.001 * docs)
    est = model.estimates
    assert est.read_latency_ms == pytest.approx(0.5, rel=0.01) and est.read_ms_per_mb == pytest.approx(2.0, rel=0.01)
    assert est.call_ms == pytest.approx(0.1, rel=0.01) and est.submit_ms_per_doc == pytest.approx(0.001, rel=0.01)


def test_a_wave_hides_at_most_the_scan_left_and_its_own_read_time() -> None:
    model = _with_reads(0.5, 0.002)  # 1 MB: 2.5 ms
    assert model.expected_gain_ms(1.0, 100, 1_000_000) == pytest.approx(1.0)
    assert model.expected_gain_ms(10.0, 100, 1_000_000) == pytest.approx(2.5)
    assert model.wave_pays(1.0, 100, 1_000_000) and not model.wave_pays(0.1, 100, 1_000_000)


def test_misses_cost_a_round_trip_so_a_latency_bound_device_gains_little() -> None:
    model = _with_reads(2.0, 0.0005)  # latency-bound: 10 KB take as long as 100 KB
    model.observe_waves(100, 100, 0)
    clean = model.expected_gain_ms(5.0, 100, 100_000)
    for _ in range(60):  # every search is left with a few misses
        model.observe_waves(100, 95, 5_000)
    assert model.estimates.miss_share == pytest.approx(1.0, abs=0.01)
    assert model.expected_gain_ms(5.0, 100, 100_000) < 0.1 < clean
    assert not model.wave_pays(5.0, 100, 100_000)


def test_a_slow_submission_or_a_slowed_scan_makes_the_model_step_aside() -> None:
    """On a contended CPU the wall time of a submit grows, and so does what the waves' reads take from the scan."""
    model = _with_reads(0.2, 0.01)
    for _ in range(60):
        model.observe_submit(50, 0.05)
    assert model.wave_pays(2.0, 50, 100_000)
    for _ in range(60):
        model.observe_slowdown(50, 2.0)  # 0.04 ms of scan lost per document
    assert not model.wave_pays(2.0, 50, 100_000)
    model = _with_reads(0.2, 0.01)
    for docs in (50, 100) * 60:
        model.observe_submit(docs, 1.5 + 0.001 * docs)  # 1.5 ms per call
    assert not model.may_pay(1.5) and not model.wave_pays(2.0, 50, 100_000)


def test_one_search_in_so_many_explores_and_zero_gain_takes_every_wave() -> None:
    model = PrefetchModel(min_gain_ms=0.2)
    assert sum(not model.may_wave() for _ in range(EXPLORE_EVERY * 3)) == 3
    always = PrefetchModel(min_gain_ms=0)
    assert all(always.may_wave() for _ in range(EXPLORE_EVERY * 2))
    threads = [threading.Thread(target=lambda: [always.observe_submit(10, 1.0) for _ in range(1000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert always.estimates.submit_ms_per_doc == pytest.approx(0.1)
    assert always.wave_pays(0.0, 10, 10**9) and always.may_pay(0.0)


def test_scan_progress_extrapolates_the_pace_and_measures_a_waves_slowdown() -> None:
    sizes = np.array([10, 20, 30, 40])
    lists = np.array([[0, 1, 2, 3], [3, 2, -1, 0]])
    codes = segment_codes(lists, sizes, [(0, 1), (1, 3), (3, 4)])
    assert codes.tolist() == [50, 80, 50]
    before = time.perf_counter()
    progress = ScanProgress(codes)
    time.sleep(0.02)  # not synchronisation: the pace under test is wall time, so some must pass
    left = progress.left_ms(0)  # 50 of 180 codes in at least 20 ms: at least 52 ms to go
    elapsed_ms = (time.perf_counter() - before) * 1000
    # Exact bounds whatever the machine's load: the pace is measured over [20 ms, elapsed_ms].
    assert 20 * 130 / 50 * 0.999 <= left <= elapsed_ms * 130 / 50
    assert progress.slowdown() is None
    started = time.perf_counter()
    progress.waved(0, 7, started, started)
    docs, slow = progress.slowdown()  # the rest of the scan took ~0 ms: no slowdown, a gain
    assert docs == 7 and slow < 0


def _serve(model: PrefetchModel, searches: int, model_ms: float, plain_ms: float) -> int:
    """`searches` searches, each taking its arm's time; returns how many followed the model."""
    followed = 0
    for _ in range(searches):
        arm = model.may_wave()
        followed += arm
        model.observe_outcome(arm, model_ms if arm else plain_ms)
    return followed


def test_the_outcome_check_stops_waves_that_slow_searches_and_resumes_them() -> None:
    model = PrefetchModel(min_gain_ms=0.2)
    searches = EXPLORE_EVERY * MIN_OUTCOMES
    # The model's searches are no slower: it keeps its arm, the plain one stays the exception.
    assert _serve(model, searches, model_ms=8.0, plain_ms=8.1) == searches - MIN_OUTCOMES
    assert model.waves_pay and model.estimates.waves_pay
    # Waves slow the searches down (a busy 2-core machine): the check stops them, and only
    # one search in EXPLORE_EVERY still follows the model.
    _serve(model, searches * 3, model_ms=11.0, plain_ms=8.6)
    assert not model.waves_pay
    assert _serve(model, searches, model_ms=11.0, plain_ms=8.6) == MIN_OUTCOMES
    # Waves pay again (a quieter machine): noticed through those searches, and resumed.
    _serve(model, searches * 12, model_ms=6.0, plain_ms=8.6)
    assert model.waves_pay
    model_ms, plain_ms = model.estimates.outcome_ms
    assert model_ms is not None and plain_ms is not None and model_ms < plain_ms
    # Without a model (min_gain_ms = 0) every search takes every wave, whatever the outcome.
    always = PrefetchModel(min_gain_ms=0)
    assert _serve(always, searches * 2, model_ms=11.0, plain_ms=8.6) == searches * 2
