"""Mergeable quantile sketches with a relative-error guarantee, and a sliding window.

`DDSketch` (Masson, Rim, Lee, VLDB 2019) keeps counts in logarithmic buckets: value x
goes to bucket k = ceil(log_gamma(x)) with gamma = (1 + alpha) / (1 - alpha), so the
bucket (gamma^(k-1), gamma^k] holds values within a factor gamma of each other and the
estimate 2 gamma^k / (gamma + 1) is within relative error alpha of every one of them.
A quantile query therefore returns a value within alpha of the exact order statistic
x[floor(q (n - 1))] (numpy's `method="lower"`). Sketches with the same alpha merge by
adding bucket counts, which is exact: merge(A, B) == sketch(A + B).

`SlidingWindow` is a ring of per-interval accumulators on a monotonic clock; the
telemetry summaries use it so each report covers the last N intervals, not all time.

Why this is not the `ddsketch` package or a Prometheus histogram: docs/decisions/0022.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Generic, Iterable, TypeVar

import numpy as np

T = TypeVar("T")


class DDSketch:
    """Quantiles of non-negative values (latencies, token counts) within `alpha`.

    Values <= `min_value` (including negatives from a clock step) count as zero.
    Memory is bounded by `max_bins`; past it the lowest buckets fold together, which
    only loosens the lowest quantiles (latency tails stay exact to alpha).
    """

    __slots__ = ("alpha", "min_value", "max_bins", "_gamma", "_log_gamma", "_bins",
                 "zero_count", "count", "sum", "min", "max")

    def __init__(self, alpha: float = 0.01, *, max_bins: int = 2048,
                 min_value: float = 1e-9) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        self.alpha = alpha
        self.min_value = min_value
        self.max_bins = max_bins
        self._gamma = (1.0 + alpha) / (1.0 - alpha)
        self._log_gamma = math.log(self._gamma)
        self._bins: dict[int, int] = {}
        self.zero_count = 0
        self.count = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf

    def __len__(self) -> int:
        return self.count

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan

    @property
    def bin_count(self) -> int:
        return len(self._bins)

    def _key(self, x: float) -> int:
        return math.ceil(math.log(x) / self._log_gamma)

    def _value(self, key: int) -> float:
        return 2.0 * self._gamma**key / (self._gamma + 1.0)

    def add(self, x: float, count: int = 1) -> None:
        self.count += count
        self.sum += x * count
        self.min = min(self.min, x)
        self.max = max(self.max, x)
        if x <= self.min_value:
            self.zero_count += count
            return
        k = self._key(x)
        self._bins[k] = self._bins.get(k, 0) + count
        if len(self._bins) > self.max_bins:
            self._collapse()

    def add_many(self, values: Iterable[float] | np.ndarray) -> None:
        """Vectorised `add` for a batch of values (same result as adding one by one)."""
        v = np.asarray(values, dtype=np.float64).ravel()  # v: [N]
        if v.size == 0:
            return
        self.count += int(v.size)
        self.sum += float(v.sum())
        self.min = min(self.min, float(v.min()))
        self.max = max(self.max, float(v.max()))
        pos = v[v > self.min_value]  # pos: [P]
        self.zero_count += int(v.size - pos.size)
        keys = np.ceil(np.log(pos) / self._log_gamma).astype(np.int64)
        uniq, counts = np.unique(keys, return_counts=True)
        for k, c in zip(uniq.tolist(), counts.tolist()):
            self._bins[k] = self._bins.get(k, 0) + c
        if len(self._bins) > self.max_bins:
            self._collapse()

    def merge(self, other: "DDSketch") -> None:
        """Add `other`'s values into this sketch (exact; both need the same alpha)."""
        if other.alpha != self.alpha:
            raise ValueError(f"cannot merge sketches with alpha {self.alpha} and {other.alpha}")
        if other.count == 0:
            return
        for k, c in other._bins.items():
            self._bins[k] = self._bins.get(k, 0) + c
        self.zero_count += other.zero_count
        self.count += other.count
        self.sum += other.sum
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        if len(self._bins) > self.max_bins:
            self._collapse()

    def copy(self) -> "DDSketch":
        out = DDSketch(self.alpha, max_bins=self.max_bins, min_value=self.min_value)
        out.merge(self)
        return out

    def _collapse(self) -> None:
        keys = sorted(self._bins)
        drop = keys[: len(keys) - self.max_bins]
        into = keys[len(drop)]
        self._bins[into] += sum(self._bins.pop(k) for k in drop)

    def quantile(self, q: float) -> float:
        """The q-quantile (0 <= q <= 1) within relative error alpha; NaN when empty."""
        return self.quantiles([q])[0]

    def quantiles(self, qs: Iterable[float]) -> list[float]:
        qs = list(qs)
        if any(not 0.0 <= q <= 1.0 for q in qs):
            raise ValueError(f"quantiles must be in [0, 1], got {qs}")
        if self.count == 0:
            return [math.nan] * len(qs)
        # Walk the buckets once, answering the quantiles in increasing rank order.
        order = sorted(range(len(qs)), key=lambda i: qs[i])
        out = [math.nan] * len(qs)
        keys = sorted(self._bins)
        cum, j = self.zero_count, 0
        for i in order:
            rank = qs[i] * (self.count - 1)
            while j < len(keys) and cum <= rank:
                cum += self._bins[keys[j]]
                j += 1
            # j == 0: the rank falls among the zeros.
            out[i] = self._clamp(self._value(keys[j - 1]) if j else 0.0)
        return out

    def _clamp(self, v: float) -> float:
        # The exact answer lies in [min, max]; clamping can only move the estimate closer.
        return min(max(v, self.min), self.max)


class SlidingWindow(Generic[T]):
    """A ring of `slots` accumulators, each covering `interval_s` of a monotonic clock.

    `current()` is the accumulator for now (a fresh one from `factory` when its slot
    was last used a full ring ago); `live()` lists the ones inside the window.
    """

    def __init__(self, interval_s: float, slots: int, factory: Callable[[], T],
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0 or slots < 1:
            raise ValueError("interval_s must be > 0 and slots >= 1")
        self.interval_s = interval_s
        self.slots = slots
        self._factory = factory
        self._clock = clock
        self._origin = clock()
        self._epochs = [-1] * slots
        self._items: list[T | None] = [None] * slots

    @property
    def window_s(self) -> float:
        return self.interval_s * self.slots

    def _epoch(self, now: float | None) -> tuple[float, int]:
        now = self._clock() if now is None else now
        return now, math.floor((now - self._origin) / self.interval_s)

    def current(self, now: float | None = None) -> T:
        _, e = self._epoch(now)
        i = e % self.slots
        if self._epochs[i] != e:
            self._items[i] = self._factory()
            self._epochs[i] = e
        return self._items[i]  # type: ignore[return-value]

    def live(self, now: float | None = None) -> list[T]:
        _, e = self._epoch(now)
        return [item for epoch, item in zip(self._epochs, self._items)
                if item is not None and e - self.slots < epoch <= e]

    def span(self, now: float | None = None) -> float:
        """Seconds the live accumulators cover: the window, or less just after start."""
        now, e = self._epoch(now)
        first = self._origin + (e - self.slots + 1) * self.interval_s
        return max(now - max(first, self._origin), 0.0)


class WindowedSketch:
    """Quantiles over the last `interval_s * slots` seconds."""

    def __init__(self, interval_s: float, slots: int, alpha: float = 0.01,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.alpha = alpha
        self._ring: SlidingWindow[DDSketch] = SlidingWindow(
            interval_s, slots, lambda: DDSketch(alpha), clock)

    def add(self, x: float, now: float | None = None) -> None:
        self._ring.current(now).add(x)

    def merged(self, now: float | None = None) -> DDSketch:
        out = DDSketch(self.alpha)
        for sketch in self._ring.live(now):
            out.merge(sketch)
        return out

    def span(self, now: float | None = None) -> float:
        return self._ring.span(now)
