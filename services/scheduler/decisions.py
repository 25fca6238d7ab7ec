"""Scaling decisions: what this scheduler sees of each model's demand, turned into a
ScaleDecision (the pure `services.scheduler.scaling.Autoscaler`) on `telemetry.v1.scale`.

  1. Every `scale_interval_s`, one decision for every model known (catalogue,
     registry, heartbeats, held work; served or not, idle or not).
  2. At once when a cold start holds a model's first request, or when held work
     asks for more replicas than the model's last decision did: a cold start
     begins without waiting for the interval.
"""

from __future__ import annotations

import time
from typing import Callable

from nats.aio.client import Client

from services.fleet import Fleet
from services.scheduler.catalogue import Catalogue
from services.scheduler.holds import Holds
from services.scheduler.scaling import Autoscaler, Demand
from shared import subjects
from shared.config import Config
from shared.telemetry import ScaleDecision
from shared.telemetry import encode as encode_record


class ScaleDecisions:
    def __init__(self, nc: Client, config: Config, scheduler_id: str, fleet: Fleet,
                 catalogue: Catalogue, holds: Holds, queued: Callable[[str], int],
                 waiting: Callable[[str], int] = lambda model: 0) -> None:
        self.nc = nc
        self.fleet = fleet
        self.catalogue = catalogue
        self.holds = holds
        self.queued = queued  # model -> requests dispatched here, unfinished
        self.waiting = waiting  # model -> batch requests in this scheduler's batch lane
        self.autoscaler = Autoscaler(config, scheduler_id)
        self.published: dict[str, int] = {}  # model -> desired in its last decision

    def demand(self, model: str) -> Demand:
        workers = self.fleet.for_model(model)
        ready = [w for w in workers if w.ready]
        pressured = sum(1 for w in ready if self.fleet.pressured(w))
        kind = self.catalogue.kind(model) or next((w.hb.kind for w in workers), "")
        return Demand(
            model=model, kind=kind, ready=len(ready) - pressured, pressured=pressured,
            starting=sum(1 for w in workers if w.hb.state in ("starting", "warming")),
            held=self.holds.count(model),
            queued=self.queued(model),
            queue_depth=sum(w.hb.queue_depth for w in workers),
            in_flight=sum(w.hb.in_flight for w in workers),
            batch_waiting=self.waiting(model))

    def decide(self, model: str) -> ScaleDecision:
        return self.autoscaler.decide(self.demand(model), time.monotonic())

    def all(self) -> list[ScaleDecision]:
        """One decision for every model known, served or not, idle or not."""
        models = set(self.catalogue.names()) | set(self.fleet.models()) | set(self.holds.by_model)
        return [self.decide(m) for m in sorted(models)]

    async def publish(self, decision: ScaleDecision) -> None:
        self.published[decision.model] = decision.desired_replicas
        await self.nc.publish(subjects.TELEMETRY_SCALE, encode_record(decision))

    async def publish_all(self) -> None:
        for decision in self.all():
            await self.publish(decision)

    async def held(self, model: str, n_held: int) -> None:
        """A request of `model` was just held (`n_held` now): demand goes out now, not
        at the next interval."""
        decision = self.decide(model)
        if n_held == 1 or decision.desired_replicas > self.published.get(model, 0):
            await self.publish(decision)
