"""Per-model aggregates over a sliding window, turned into `telemetry.v1.summary`.

The window is a ring of `slots` intervals of `interval_s` each (the summary period),
so every summary covers the last `slots * interval_s` seconds (less just after start;
`Summary.window_s` says how much). Like the histograms, quantiles and token rates
describe served requests (status < 400); `errors` counts the rest.

Cost per 1M tokens: a model's cost rate is the sum of its live workers' prices per
worker-hour (`TENSORBUS_COST_PER_HOUR`, per model or device kind). Over the window it
buys the model's tokens: all of them (`cost_per_1m_tokens`), or split between input
and output by where the engine time went: prefill (worker's first token minus its
queue wait; all compute for embeddings) prices prompt tokens, decode (the rest of the
compute) prices generated tokens. With continuous batching one decode step serves many
requests, so per-request times overlap; their sums are still in the proportion the
worker spent on each phase, which is all the split uses.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

from shared.telemetry import ENCODER_ENDPOINTS, ModelSummary, RequestRecord, Summary

from .sketch import DDSketch, SlidingWindow


class _ModelInterval:
    """One model's counts and sketches for one interval."""

    __slots__ = ("requests", "errors", "tokens", "input_tokens", "output_tokens", "prefill_s",
                 "decode_s", "latency", "ttft")

    def __init__(self, alpha: float) -> None:
        self.requests = 0
        self.errors = 0
        self.tokens = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.latency = DDSketch(alpha)  # total_s of served requests
        self.ttft = DDSketch(alpha)

    def merge(self, other: "_ModelInterval") -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.tokens += other.tokens
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.prefill_s += other.prefill_s
        self.decode_s += other.decode_s
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
        acc.input_tokens += rec.prompt_tokens
        acc.output_tokens += rec.completion_tokens
        prefill = rec.compute_s
        if rec.endpoint not in ENCODER_ENDPOINTS and rec.worker_ttft_s > 0:
            prefill = min(max(rec.worker_ttft_s - rec.queue_s, 0.0), rec.compute_s)
        acc.prefill_s += prefill
        acc.decode_s += rec.compute_s - prefill
        acc.latency.add(rec.total_s)
        if rec.ttft_s > 0:
            acc.ttft.add(rec.ttft_s)

    def merged(self, now: float | None = None) -> dict[str, _ModelInterval]:
        out: dict[str, _ModelInterval] = {}
        for interval in self._ring.live(now):
            for model, acc in interval.items():
                out.setdefault(model, _ModelInterval(self.alpha)).merge(acc)
        return out

    def summary(self, *, at: float, cost_per_hour: Mapping[str, float] | None = None,
                now: float | None = None) -> Summary:
        """`at`: UNIX time of the report; `cost_per_hour`: each model's cost rate now
        (the sum of its live workers' prices)."""
        span = max(self._ring.span(now), 1e-3)
        rates = cost_per_hour or {}
        models = [_model_summary(m, acc, span, rates.get(m, 0.0))
                  for m, acc in sorted(self.merged(now).items())]
        return Summary(window_s=span, at=at, models=models)


def _model_summary(model: str, acc: _ModelInterval, span: float,
                   cost_per_hour: float) -> ModelSummary:
    p50, p95, p99 = acc.latency.quantiles([0.5, 0.95, 0.99]) if acc.latency.count else (0.0,) * 3
    t50, t99 = acc.ttft.quantiles([0.5, 0.99]) if acc.ttft.count else (0.0, 0.0)
    tokens_per_s = acc.tokens / span
    spent = cost_per_hour * span / 3600.0  # what the model's workers cost over the window
    engine_s = acc.prefill_s + acc.decode_s
    cost_in = cost_out = 0.0
    if engine_s > 0:
        cost_in = _per_million(spent * acc.prefill_s / engine_s, acc.input_tokens)
        cost_out = _per_million(spent * acc.decode_s / engine_s, acc.output_tokens)
    return ModelSummary(
        model=model,
        requests=acc.requests,
        errors=acc.errors,
        throughput_rps=(acc.requests - acc.errors) / span,
        p50_s=p50, p95_s=p95, p99_s=p99,
        tokens_per_s=tokens_per_s,
        ttft_p50_s=t50, ttft_p99_s=t99,
        cost_per_1m_tokens=_per_million(spent, acc.tokens),
        cost_per_1m_input_tokens=cost_in,
        cost_per_1m_output_tokens=cost_out,
    )


def _per_million(cost: float, tokens: int) -> float:
    return cost / tokens * 1e6 if cost > 0 and tokens > 0 else 0.0
