"""The fleet as seen from heartbeats: which workers exist, what they serve, how busy.

Both the scheduler (routing, admission, scaling) and the gateway (`/v1/models`,
fast 404s) keep one. A worker that has not heartbeated for `expiry_s` is dropped; a
worker whose step counter stops moving while it holds work is marked stalled (not
while a step waits on a program being compiled: that is slow, not stuck); a ready
worker whose heartbeat puts its memory above `memory_high` of its limit is
`pressured`: it finishes what it holds but gets no new work until it falls back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.telemetry import Heartbeat


@dataclass
class WorkerView:
    hb: Heartbeat
    seen: float  # monotonic time of the last heartbeat
    progress_at: float  # monotonic time the step counter last moved (or idle)
    stalled: bool = False
    prefixes: frozenset[int] = frozenset()  # short keys of the prompt prefixes it caches

    def __post_init__(self) -> None:
        if self.hb.prefix_keys:
            self.prefixes = frozenset(self.hb.prefix_keys)

    @property
    def worker_id(self) -> str:
        return self.hb.worker_id

    @property
    def ready(self) -> bool:
        return self.hb.state == "ready" and not self.stalled

    @property
    def mem_fraction(self) -> float:
        """Memory in use over its limit, 0 when the worker does not report a limit."""
        limit = self.hb.mem_limit_bytes
        return self.hb.mem_used_bytes / limit if limit > 0 else 0.0

    def serves(self, model: str, version: str = "") -> bool:
        if self.hb.model != model:
            return False
        return not version or version in self.hb.versions


@dataclass
class Fleet:
    expiry_s: float = 2.0
    stall_s: float = 10.0  # holding work with no completed step this long = wedged
    memory_high: float = 1.0  # above this fraction of its memory limit: no new work
    workers: dict[str, WorkerView] = field(default_factory=dict)

    def observe(self, hb: Heartbeat, now: float | None = None) -> WorkerView:
        now = time.monotonic() if now is None else now
        prev = self.workers.get(hb.worker_id)
        if hb.state == "stopped":
            self.workers.pop(hb.worker_id, None)
            return WorkerView(hb, now, now)
        busy = hb.in_flight > 0 or hb.queue_depth > 0
        if prev is None or hb.steps != prev.hb.steps or not busy or hb.compiling:
            progress_at = now
        else:
            progress_at = prev.progress_at
        view = WorkerView(hb, now, progress_at, stalled=busy and now - progress_at > self.stall_s)
        self.workers[hb.worker_id] = view
        return view

    def excuse(self, seconds: float) -> None:
        """Time this process was not running (a stalled loop, a starved core): it
        proves no worker silent, so every worker's silence and stall clocks skip it."""
        for w in self.workers.values():
            w.seen += seconds
            w.progress_at += seconds

    def expire(self, now: float | None = None) -> list[WorkerView]:
        """Drop workers silent for longer than expiry_s; return them."""
        now = time.monotonic() if now is None else now
        gone = [w for w in self.workers.values() if now - w.seen > self.expiry_s]
        for w in gone:
            del self.workers[w.worker_id]
        return gone

    def for_model(self, model: str, version: str = "") -> list[WorkerView]:
        return [w for w in self.workers.values() if w.serves(model, version)]

    def ready(self, model: str, version: str = "") -> list[WorkerView]:
        return [w for w in self.for_model(model, version) if w.ready]

    def pressured(self, w: WorkerView) -> bool:
        return w.mem_fraction > self.memory_high

    def available(self, model: str, version: str = "") -> list[WorkerView]:
        """Ready workers that may take new work (not above the memory threshold)."""
        return [w for w in self.ready(model, version) if not self.pressured(w)]

    def warming(self, model: str) -> list[WorkerView]:
        return [w for w in self.for_model(model) if w.hb.state in ("starting", "warming")]

    def models(self) -> dict[str, list[WorkerView]]:
        out: dict[str, list[WorkerView]] = {}
        for w in self.workers.values():
            out.setdefault(w.hb.model, []).append(w)
        return out
