"""Combining scale decisions: what KEDA and the local orchestrator act on.

Every scheduler publishes one ScaleDecision per model per interval to
`telemetry.v1.scale`. With several schedulers the desired count must not be the last
writer's: each one holds its own cold-start requests. `combine` takes the latest
decision of every live scheduler for one model and returns the desired replica count.
"""

from __future__ import annotations

import math
from typing import Iterable

from shared.telemetry import ScaleDecision


def combine(decisions: Iterable[ScaleDecision], target_per_replica: float = 32.0) -> int:
    """Desired replicas for one model from the latest decision of each live scheduler.

    Fleet-wide load (worker queue depth and in-flight, from heartbeats) is the same in
    every scheduler's view, so the largest decision covers it; requests held for a
    cold start are each scheduler's own, so the others' held requests are added on top.
    """
    ds = list(decisions)
    if not ds:
        return 0
    top = max(ds, key=lambda d: d.desired_replicas)
    desired = top.desired_replicas
    others_held = sum(d.held for d in ds if d is not top)
    if others_held:
        desired = max(desired, math.ceil(others_held / max(target_per_replica, 1.0)))
    hi = max((d.max_replicas for d in ds), default=0)
    return min(desired, hi) if hi else desired
