"""Per-model aggregates over a sliding window, turned into `telemetry.v1.summary`.

The window is a ring of `slots` intervals of `interval_s` each (the summary period),
so every summary covers the last `slots * interval_s` seconds (less just after start;
`Summary.window_s` says how much). Like the histograms, quantiles and token rates
describe served requests (status < 400); `errors` counts the rest.

Cost per 1M tokens: the fleet's `cost_per_hour` is split across models by their share
of live workers (by share of tokens when no worker is known), then divided by the
model's tokens per hour.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

from shared.telemetry import ModelSummary, RequestRecord, Summary

from .sketch import DDSketch, SlidingWindow


class _ModelInterval:
    """One model's counts and sketches for one interval."""

    __slots__ = ("requests", "errors", "tokens", "latency", "ttft")

    def __init__(self, alpha: float) -> None:
        self.requests = 0
        self.errors = 0
        self.tokens = 0
        self.latency = DDSketch(alpha)  # total_s of served requests
        self.ttft = DDSketch(alpha)

    def merge(self, other: "_ModelInterval") -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.tokens += other.tokens
        self.latency.merge(other.latency)
        self.ttft.merge(other.ttft)


class SummaryWindow:
    def __init__(self, interval_s: float, slots: int = 12, alpha: float = 0.01,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.alpha = alpha
        self._ring: SlidingWindow[dict[str, _ModelInterval]] = SlidingWindow(
            interval_s, slots, dict, clock)

    @property
    def window_s(self) -> float:
        return self._ring.window_s

    def add(self, rec: RequestRecord, now: float | None = None) -> None:
        interval = self._ring.current(now)
        acc = interval.get(rec.model)
        if acc is None:
            acc = interval[rec.model] = _ModelInterval(self.alpha)
        acc.requests += 1
        if rec.status >= 400:
            acc.errors += 1
            return
        acc.tokens += rec.prompt_tokens + rec.completion_tokens
        acc.latency.add(rec.total_s)
        if rec.ttft_s > 0:
            acc.ttft.add(rec.ttft_s)

    def merged(self, now: float | None = None) -> dict[str, _ModelInterval]:
        out: dict[str, _ModelInterval] = {}
        for interval in self._ring.live(now):
            for model, acc in interval.items():
                out.setdefault(model, _ModelInterval(self.alpha)).merge(acc)
        return out

    def summary(self, *, at: float, cost_per_hour: float = 0.0,
                workers: Mapping[str, int] | None = None,
                now: float | None = None) -> Summary:
        """`at`: UNIX time of the report; `workers`: live workers per model."""
        span = max(self._ring.span(now), 1e-3)
        merged = self.merged(now)
        shares = _cost_shares(merged, workers or {})
        models = [_model_summary(m, acc, span, cost_per_hour * shares.get(m, 0.0))
                  for m, acc in sorted(merged.items())]
        return Summary(window_s=span, at=at, models=models)


def _model_summary(model: str, acc: _ModelInterval, span: float,
                   cost_per_hour: float) -> ModelSummary:
    p50, p95, p99 = acc.latency.quantiles([0.5, 0.95, 0.99]) if acc.latency.count else (0.0,) * 3
    t50, t99 = acc.ttft.quantiles([0.5, 0.99]) if acc.ttft.count else (0.0, 0.0)
    tokens_per_s = acc.tokens / span
    cost = cost_per_hour / (tokens_per_s * 3600.0) * 1e6 if cost_per_hour > 0 and tokens_per_s > 0 else 0.0
    return ModelSummary(
        model=model,
        requests=acc.requests,
        errors=acc.errors,
        throughput_rps=(acc.requests - acc.errors) / span,
        p50_s=p50, p95_s=p95, p99_s=p99,
        tokens_per_s=tokens_per_s,
        ttft_p50_s=t50, ttft_p99_s=t99,
        cost_per_1m_tokens=cost,
    )


def _cost_shares(merged: Mapping[str, _ModelInterval], workers: Mapping[str, int]) -> dict[str, float]:
    total_workers = sum(workers.values())
    if total_workers:
        return {m: n / total_workers for m, n in workers.items()}
    total_tokens = sum(acc.tokens for acc in merged.values())
    if not total_tokens:
        return {}
    return {m: acc.tokens / total_tokens for m, acc in merged.items()}
