"""Load reports: this scheduler's outstanding work per model, for the other schedulers
and the gateways (`SchedLoad` on `tensorbus.v1.sched.load`), and theirs for it.

  1. Publish: every heartbeat interval, and within EARLY_REPORT_S of a change of the
     tally or a refusal (at most that often). A refusal here means a gateway's view (a
     report old) let through what this scheduler would not; a gateway that heard the
     count go up refuses the rest of a burst itself, and one that heard it come down
     admits again at once.
  2. A report names every model with work here (dispatched, reserved or held), every
     model in the last one (so its count is seen going to zero), and every model
     timed here, with the cost estimate (gateways need it before a burst, not one
     interval into it).
  3. Consume: another scheduler's report counts in this one's bound
     (`Admission.observe_load`); its own is ignored.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.scheduler.admission import Admission
from services.scheduler.holds import Holds
from shared import subjects
from shared.admission import Tally
from shared.costs import Cost
from shared.messages import ModelLoad, SchedLoad, encode, sched_load_decoder

if TYPE_CHECKING:
    from shared.bus import Links

EARLY_REPORT_S = 0.02  # a change of the load goes out this soon, and reports this often at most


class LoadReports:
    def __init__(self, nc: Client, scheduler_id: str, admission: Admission, holds: Holds,
                 interval_s: float) -> None:
        self.nc = nc
        self.id = scheduler_id
        self.admission = admission
        self.holds = holds
        self.interval_s = interval_s
        self.moved = asyncio.Event()  # the tally changed, or a request was refused
        self._reported: set[str] = set()  # models with work in the last report
        self._reported_at = 0.0  # monotonic time of the last report
        self.links: Links | None = None  # the scheduler's: its drops are reported

    def changed(self) -> None:
        self.moved.set()

    def report(self) -> SchedLoad:
        """This scheduler's load now (see 2. above)."""
        adm = self.admission
        busy = {m for m, t in adm.tally.items() if t.requests} | set(self.holds.models())
        models = []
        for m in sorted(busy | self._reported | set(adm.costs.models())):
            t = adm.tally.get(m, Tally()) + self.holds.tally(m)
            cost = adm.costs.cost(m) or Cost(0.0, 0.0)
            models.append(ModelLoad(m, t.requests, t.inputs, t.tokens, cost.per_token,
                                    cost.per_batch, t.decode))
        self._reported = busy
        drops = self.links.drops if self.links is not None else 0
        return SchedLoad(self.id, models, time.time(), drops)

    async def publish(self, force: bool = False) -> None:
        """Publish the report (none with no model to name, unless `force`)."""
        self._reported_at = time.monotonic()
        report = self.report()
        if report.models or force:
            await self.nc.publish(subjects.SCHED_LOAD, encode(report))

    async def run(self, stop: asyncio.Event) -> None:
        """Publish on every change (rate-limited) and every interval, until `stop`."""
        moved = self.moved
        while not stop.is_set():
            try:
                async with asyncio.timeout(self.interval_s):
                    await moved.wait()
            except TimeoutError:
                pass
            wait = self._reported_at + EARLY_REPORT_S - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # a rate limit: changes meanwhile go in this one
            moved.clear()
            await self.publish()

    async def on_report(self, msg: Msg) -> None:
        """Another scheduler's SchedLoad (NATS callback)."""
        try:
            load = sched_load_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        self.admission.observe_load(load, time.monotonic())
