"""Combining scale decisions: what KEDA, the local orchestrator and the gateway read.

Every scheduler publishes one ScaleDecision per known model per interval to
`telemetry.v1.scale` (and one at once when a request is held for a cold start). With
several schedulers the desired count must be neither the last writer's nor a plain
sum of the decisions:

- the load the workers report in heartbeats (queue depth, in flight, KV slots) is
  the same in every scheduler's view: summed, it would be counted once per scheduler;
- the requests a scheduler holds for a cold start, and those it dispatched and has
  not seen finish (`held`, `queued`), are its own: no other scheduler sees them.

So `combine` sums what is each scheduler's own (held + queued over the live
schedulers) and turns that sum into replicas with the model's target, takes the
largest decision (the shared heartbeat view, each scheduler's minimum, scale-down
window and memory pressure), keeps the larger of the two, and clamps it to the
model's bounds. `LiveDecisions` keeps the latest decision of each scheduler and
forgets one whose scheduler went silent.
"""

from __future__ import annotations

import math
from typing import Iterable

from shared.config import Config, bad_config, parse_fleet
from shared.telemetry import ScaleDecision

NOT_SERVED = "not served (fleet bounds 0:0)"  # the reason of a MODEL=0:0 decision
DECISION_TTL_S = 10.0  # a scheduler silent this long no longer counts (5 intervals)


def check_settings(config: Config) -> None:
    """Exit 78 (`bad_config`) when the fleet settings cannot mean anything."""
    try:
        parse_fleet(config.fleet)
    except ValueError as exc:
        raise bad_config(str(exc)) from None
    if config.min_workers < 0 or config.max_workers < config.min_workers:
        raise bad_config(f"TENSORBUS_MIN_WORKERS={config.min_workers} and TENSORBUS_MAX_WORKERS="
                         f"{config.max_workers}: need 0 <= MIN <= MAX")
    if not 0 < config.memory_high <= 1:
        raise bad_config(f"TENSORBUS_MEMORY_HIGH={config.memory_high}: a fraction in (0, 1]")
    for name in ("idle_to_zero_s", "scale_down_s"):
        if getattr(config, name) < 0:
            raise bad_config(f"TENSORBUS_{name.upper()} must not be negative")
    if config.target_queue_per_replica <= 0:
        raise bad_config("TENSORBUS_TARGET_QUEUE_PER_REPLICA must be above 0")
    if config.target_slots_per_replica < 0:
        raise bad_config("TENSORBUS_TARGET_SLOTS_PER_REPLICA must not be negative "
                         "(0: three quarters of TENSORBUS_DECODE_SLOTS)")


def combine(decisions: Iterable[ScaleDecision], target_per_replica: float | None = None) -> int:
    """Desired replicas for one model from the latest decision of each live scheduler.

    `target_per_replica` is used for decisions that do not carry their own target."""
    ds = list(decisions)
    if not ds:
        return 0
    desired = max(d.desired_replicas for d in ds)
    own = sum(d.held + d.queued for d in ds)
    if own:
        target = next((d.target_per_replica for d in ds if d.target_per_replica > 0),
                      target_per_replica or 32.0)
        desired = max(desired, math.ceil(own / max(target, 1e-9)))
    hi = max(d.max_replicas for d in ds)
    if hi or any(d.reason == NOT_SERVED for d in ds):
        desired = min(desired, hi)
    return desired


class LiveDecisions:
    """The latest ScaleDecision of every scheduler, per model; silent ones expire.

    `now` is the reader's own monotonic clock at receipt: a decision's `at` is another
    process's wall clock and is not compared here."""

    def __init__(self, ttl_s: float = DECISION_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._by_model: dict[str, dict[str, tuple[float, ScaleDecision]]] = {}

    def observe(self, d: ScaleDecision, now: float) -> None:
        self._by_model.setdefault(d.model, {})[d.scheduler_id] = (now, d)

    def expire(self, now: float) -> set[str]:
        """Forget decisions older than the TTL; returns the models that lost one."""
        changed = set()
        for model, per in self._by_model.items():
            for sid in [s for s, (t, _) in per.items() if now - t > self.ttl_s]:
                del per[sid]
                changed.add(model)
        return changed

    def models(self) -> list[str]:
        return sorted(m for m, per in self._by_model.items() if per)

    def latest(self, model: str) -> list[ScaleDecision]:
        return [d for _, d in self._by_model.get(model, {}).values()]

    def desired(self, model: str) -> int:
        return combine(self.latest(model))

    def held(self, model: str) -> int:
        return sum(d.held for d in self.latest(model))

    def batch_waiting(self, model: str) -> int:
        return sum(d.batch_waiting for d in self.latest(model))

    def kind(self, model: str) -> str:
        return next((d.kind for d in self.latest(model) if d.kind), "")
