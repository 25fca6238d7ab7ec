"""Automatic canary rollback: compare a guarded canary with prod, clear it past a margin.

Why here: the telemetry service already sees every request record with the version
that served it, and keeps windows and sketches; the scheduler sees only dispatches,
and a worker only its own share.

  1. Every request record of a model that the service has not seen starts a KV watch
     of that model's aliases (`AliasTable`, the cache the scheduler routes by).
  2. While the aliases name a canary with a `guard` (opted in per canary), records of
     the canary and of prod go into a sliding window of `guard.window_s` (ten
     slots): requests, errors (status >= 500: what the version did, not what the
     client sent) and a DDSketch of served latency per version. A new canary, or new
     margins, starts a fresh window.
  3. `check()` (every `CHECK_S`) judges each guarded canary with at least
     `min_requests` requests in the window: its error rate above prod's by more than
     `error_margin`, or (both with `min_requests` served) its p95 above prod's by more
     than `p95_margin`, clears the canary (`Registry.abort_canary`): a new alias
     revision, change `auto-rollback`, with the reason and the figures it was judged
     on. The write is revision-checked and only applies while that version is still
     the canary, so several telemetry replicas roll back once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from services.registry.store import Registry
from services.registry.alias_table import AliasTable
from shared.logging import get_logger
from shared.registry import Aliases, CanaryGuard
from shared.telemetry import RequestRecord

from .sketch import DDSketch, SlidingWindow

log = get_logger("telemetry.canary")

CHECK_S = 0.5
SLOTS = 10


class _Counts:
    __slots__ = ("requests", "errors", "latency")

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.latency = DDSketch(0.01)  # total_s of served requests

    def add(self, rec: RequestRecord) -> None:
        self.requests += 1
        if rec.status >= 500:
            self.errors += 1
        elif rec.status < 400:
            self.latency.add(rec.total_s)

    def merge(self, other: "_Counts") -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.latency.merge(other.latency)

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def p95(self) -> float:
        return self.latency.quantile(0.95) if self.latency.count else 0.0


@dataclass
class _Watch:
    """One guarded canary's window: versions -> counts per slot."""

    prod: str
    canary: str
    guard: CanaryGuard
    window: SlidingWindow[dict[str, _Counts]]


def verdict(guard: CanaryGuard, canary: _Counts, prod: _Counts) -> str:
    """Why the canary should be rolled back, or "" (not enough data, or within margins)."""
    if canary.requests < guard.min_requests:
        return ""
    if canary.error_rate - prod.error_rate > guard.error_margin:
        return (f"error rate {canary.error_rate:.1%} vs prod {prod.error_rate:.1%} "
                f"(margin {guard.error_margin:.1%})")
    served_c, served_p = canary.latency.count, prod.latency.count
    if served_c >= guard.min_requests and served_p >= guard.min_requests:
        c95, p95 = canary.p95(), prod.p95()
        if c95 > p95 * (1.0 + guard.p95_margin):
            return (f"p95 {c95 * 1000:.1f} ms vs prod {p95 * 1000:.1f} ms "
                    f"(margin {guard.p95_margin:.0%})")
    return ""


class CanaryGuardian:
    def __init__(self, registry: Registry, aliases: AliasTable | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self._clock = clock
        self.aliases = aliases or AliasTable(registry)
        self.rolled_back: list[tuple[str, str, str]] = []  # (model, version, reason)
        self._watches: dict[str, _Watch] = {}

    def observe(self, rec: RequestRecord, now: float) -> None:
        self.aliases.track(rec.model)
        watch = self._watch(rec.model, now)
        if watch is None or rec.version not in (watch.prod, watch.canary):
            return
        slot = watch.window.current(now)
        counts = slot.get(rec.version)
        if counts is None:
            counts = slot[rec.version] = _Counts()
        counts.add(rec)

    def _watch(self, model: str, now: float) -> _Watch | None:
        a: Aliases | None = self.aliases.aliases.get(model)
        if a is None or not a.canary or a.guard is None or not a.prod:
            self._watches.pop(model, None)
            return None
        w = self._watches.get(model)
        if w is None or (w.prod, w.canary, w.guard) != (a.prod, a.canary, a.guard):
            ring: SlidingWindow[dict[str, _Counts]] = SlidingWindow(
                a.guard.window_s / SLOTS, SLOTS, dict, self._clock)
            w = self._watches[model] = _Watch(a.prod, a.canary, a.guard, ring)
        return w

    def totals(self, model: str, now: float) -> tuple[_Counts, _Counts] | None:
        """(canary, prod) over the window of `model`'s guarded canary."""
        w = self._watch(model, now)
        if w is None:
            return None
        out = {w.canary: _Counts(), w.prod: _Counts()}
        for slot in w.window.live(now):
            for version, counts in slot.items():
                out[version].merge(counts)
        return out[w.canary], out[w.prod]

    async def check(self, now: float) -> None:
        for model in list(self._watches):
            w = self._watch(model, now)
            totals = self.totals(model, now)
            if w is None or totals is None:
                continue
            canary, prod = totals
            why = verdict(w.guard, canary, prod)
            if not why:
                continue
            figures = {
                "window_s": w.window.span(now),
                "canary_requests": float(canary.requests),
                "canary_error_rate": canary.error_rate,
                "canary_p95_s": canary.p95(),
                "prod_requests": float(prod.requests),
                "prod_error_rate": prod.error_rate,
                "prod_p95_s": prod.p95(),
            }
            done = await self.registry.abort_canary(model, w.canary, why, figures)
            self._watches.pop(model, None)
            if done is not None:
                self.rolled_back.append((model, w.canary, why))
                log.warning("canary_rolled_back", model=model, canary=w.canary, prod=w.prod,
                            reason=why, **figures)

    async def stop(self) -> None:
        await self.aliases.stop()
