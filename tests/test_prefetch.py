"""The prefetch cost model: a wave is taken only when what it hides exceeds what it costs."""

from __future__ import annotations

import threading

import pytest

from espn.prefetch import PrefetchModel


def test_before_any_measurement_the_scan_left_decides() -> None:
    model = PrefetchModel(min_gain_ms=0.2)
    assert model.wave_pays(0.5, 10_000) and not model.wave_pays(0.1, 10_000)
    assert model.estimates.read_bytes_per_ms is None


def test_reads_the_scan_cannot_hide_do_not_pay_for_their_submission() -> None:
    model = PrefetchModel(min_gain_ms=0.2)
    model.observe_read(1_000_000, 2.0)  # 500 KB/ms: 100 KB take 0.2 ms
    model.observe_submit(0.1)
    assert not model.wave_pays(5.0, 100_000)  # hides at most 0.2 ms, costs 0.1
    assert model.wave_pays(5.0, 1_000_000)  # hides 2 ms
    assert not model.wave_pays(0.25, 1_000_000)  # the scan left hides 0.25 ms only


def test_wasted_reads_count_against_a_wave_where_bandwidth_limits() -> None:
    model = PrefetchModel(min_gain_ms=0.2)
    model.observe_read(1_000_000, 4.0)  # a 1 MB wave takes 4 ms
    model.observe_usefulness(100, 100)
    assert model.wave_pays(1.0, 1_000_000)
    for _ in range(60):  # most of what waves read drops out of the final list
        model.observe_usefulness(100, 20)
    assert model.estimates.useful_share == pytest.approx(0.2, abs=0.01)
    assert not model.wave_pays(1.0, 1_000_000)  # hides 0.2 x 1 ms, wastes 0.8 x 4 ms


def test_a_slow_submission_makes_the_model_step_aside() -> None:
    """On a contended CPU the wall time of a submit grows, and waves stop paying."""
    model = PrefetchModel(min_gain_ms=0.2)
    model.observe_read(100_000, 1.0)
    for _ in range(60):
        model.observe_submit(0.05)
    assert model.wave_pays(2.0, 100_000)
    for _ in range(60):
        model.observe_submit(1.5)
    assert not model.may_pay(1.5) and not model.wave_pays(2.0, 100_000)


def test_zero_gain_takes_every_wave_and_observations_are_thread_safe() -> None:
    model = PrefetchModel(min_gain_ms=0)
    threads = [threading.Thread(target=lambda: [model.observe_submit(1.0) for _ in range(1000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert model.estimates.submit_ms == pytest.approx(1.0)
    assert model.wave_pays(0.0, 10**9) and model.may_pay(0.0)
