"""DDSketch and the sliding window, checked against numpy's exact order statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.telemetry.sketch import DDSketch, SlidingWindow, WindowedSketch

QS = [0.0, 0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0]


def _assert_within(sketch: DDSketch, data: np.ndarray, qs=QS) -> None:
    # The guarantee is about the order statistic x[floor(q (n - 1))] = numpy "lower".
    exact = np.quantile(data, qs, method="lower")
    got = np.array(sketch.quantiles(qs))
    rel = np.abs(got - exact) / exact
    assert np.all(rel <= sketch.alpha * (1 + 1e-9)), dict(zip(qs, rel))


@pytest.mark.parametrize("alpha", [0.005, 0.01, 0.05])
def test_lognormal_latencies_within_alpha(alpha):
    rng = np.random.default_rng(7)
    # Latencies from 0.1 ms to tens of seconds: median 20 ms, heavy right tail.
    data = rng.lognormal(mean=math.log(0.02), sigma=1.5, size=50_000)
    sk = DDSketch(alpha)
    for x in data[:5_000]:
        sk.add(float(x))
    sk.add_many(data[5_000:])
    _assert_within(sk, data)
    assert sk.count == data.size
    assert sk.sum == pytest.approx(data.sum(), rel=1e-9)
    assert (sk.min, sk.max) == (data.min(), data.max())


def test_add_many_equals_add():
    data = np.random.default_rng(1).exponential(0.3, size=2_000)
    a, b = DDSketch(0.02), DDSketch(0.02)
    for x in data:
        a.add(float(x))
    b.add_many(data)
    assert a.quantiles(QS) == b.quantiles(QS) and a.zero_count == b.zero_count


def test_merge_is_exact():
    rng = np.random.default_rng(3)
    parts = [rng.lognormal(-3, 1, size=n) for n in (10, 3_000, 700)]
    merged = DDSketch(0.01)
    for part in parts:
        sk = DDSketch(0.01)
        sk.add_many(part)
        merged.merge(sk)
    whole = DDSketch(0.01)
    whole.add_many(np.concatenate(parts))
    assert merged.quantiles(QS) == whole.quantiles(QS)
    assert merged.count == whole.count
    _assert_within(merged, np.concatenate(parts))
    with pytest.raises(ValueError):
        merged.merge(DDSketch(0.02))


def test_zeros_empty_and_bounded_memory():
    assert math.isnan(DDSketch().quantile(0.5))
    sk = DDSketch(0.01)
    sk.add_many([0.0] * 60 + [1.0] * 40)
    assert sk.quantile(0.5) == 0.0 and sk.quantile(0.7) == pytest.approx(1.0, rel=0.01)
    # 1e-6..1e6 needs ~1400 buckets at alpha=1%; a 100-bucket cap folds the low ones.
    small = DDSketch(0.01, max_bins=100)
    data = np.geomspace(1e-6, 1e6, 20_000)
    small.add_many(data)
    assert small.bin_count <= 100
    _assert_within(small, data, qs=[0.95, 0.99, 1.0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=1e-6, max_value=1e6), min_size=1, max_size=300),
       st.floats(min_value=0.0, max_value=1.0))
def test_any_positive_data_any_quantile(values, q):
    sk = DDSketch(0.01)
    for v in values:
        sk.add(v)
    _assert_within(sk, np.array(values), qs=[q])


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_sliding_window_forgets_old_intervals():
    clock = FakeClock()
    win = WindowedSketch(interval_s=1.0, slots=3, clock=clock)
    win.add(10.0)
    clock.t += 1.0
    win.add(20.0)
    clock.t += 1.5
    assert win.merged().count == 2 and win.span() == pytest.approx(2.5)
    clock.t += 0.6  # the first interval is now more than 3 intervals old
    merged = win.merged()
    assert merged.count == 1 and merged.quantile(0.5) == pytest.approx(20.0, rel=0.01)
    assert win.span() == pytest.approx(3.0 - 0.9)
    clock.t += 10
    assert win.merged().count == 0


def test_sliding_window_reuses_slots_with_fresh_accumulators():
    clock = FakeClock()
    ring: SlidingWindow[list] = SlidingWindow(0.5, 2, list, clock=clock)
    ring.current().append("a")
    clock.t += 1.0  # same ring slot, two epochs later
    assert ring.current() == [] and ring.live() == [[]]
