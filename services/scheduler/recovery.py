"""Recovery of lost work: what this scheduler dispatched and may never be answered
for is dispatched again (the gateway keeps the first answer per request id, and a
worker ignores a generation it already runs).

  1. A worker that expires (missed heartbeats), reports `stopped` or `unhealthy`, or
     is wedged (`recover` with `gone`): its outstanding work goes to the others,
     except a generation whose requester resumes it itself (`GenerateWork.resumes`,
     a gateway's deterministic one-choice generation): the requester is told
     (a WorkError with code `worker_lost`) and sends it again from the last token it
     delivered, so one attempt only computes it and nothing is generated for nobody.
     A request re-dispatched `max_redispatch` times because its workers were lost
     ends with a 500 at the next loss, rather than taking the fleet down in turn.
  2. A worker whose heartbeat's `reconnects` rose: its connection dropped, and what
     went to it or came back from it through the lost server may be gone: the same.
  3. This scheduler's own connection dropped and came back (`_reconnected`): the
     work it dispatched through the lost server, and the `WorkDone`s that were on
     their way to it, may be gone: all its outstanding work goes out again; and a
     load report goes out at once with its own `reconnects`, from which every
     gateway learns that submissions it sent meanwhile may be lost, and submits its
     retryable ones again (docs/decisions/0053-node-loss.md).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from services.scheduler.admission import Admission
from services.scheduler.loads import LoadReports
from services.scheduler.routed import Routed
from shared.bus import Links
from shared.errors import ServiceError, internal
from shared.logging import get_logger
from shared.messages import GenerateWork, WorkRequest
from shared.telemetry import Heartbeat

log = get_logger("scheduler")


class Recovery:
    """The scheduler's part that sends lost work again. It shares the scheduler's
    books (`outstanding`: request id -> its Outstanding; `load`: worker id -> requests
    outstanding here) and gives each lost request back to `resend` (the scheduler's
    admit-or-refuse)."""

    def __init__(self, *, outstanding: dict, load: dict[str, int], routed: Routed,
                 admission: Admission, loads: LoadReports, links: Links,
                 resend: Callable[[WorkRequest], Awaitable[None]],
                 refuse: Callable[[WorkRequest, ServiceError], Awaitable[None]],
                 max_redispatch: int = 2) -> None:
        self.outstanding = outstanding
        self.load = load
        self.routed = routed
        self.admission = admission
        self.loads = loads
        self.resend = resend
        self.refuse = refuse  # a WorkError to the request's requester
        self.max_redispatch = max_redispatch
        self.losses: dict[str, int] = {}  # request id -> workers lost under it (outstanding)
        self.told = 0  # requesters told their worker was lost (they resume)
        self.given_up = 0  # requests ended at the re-dispatch cap
        self.redispatched = 0  # requests sent again, all told
        self._reconnects: dict[str, int] = {}  # worker_id -> its latest `reconnects`
        self._recovering: set[asyncio.Task] = set()
        links.on_back.append(self._on_back)

    def _on_back(self) -> None:
        task = asyncio.get_running_loop().create_task(self._reconnected())
        self._recovering.add(task)
        task.add_done_callback(self._recovering.discard)

    async def _reconnected(self) -> None:
        await self.loads.publish(force=True)
        for worker_id in {o.worker_id for o in self.outstanding.values()}:
            await self.recover(worker_id, "scheduler reconnected")

    async def worker_reconnected(self, hb: Heartbeat) -> None:
        """Its heartbeat's `reconnects` rose: what it held is sent again."""
        if hb.reconnects > self._reconnects.setdefault(hb.worker_id, hb.reconnects):
            self._reconnects[hb.worker_id] = hb.reconnects
            await self.recover(hb.worker_id, "worker reconnected")

    async def recover(self, worker_id: str, why: str, gone: bool = False) -> None:
        """Send the unfinished work of a lost worker (`gone`), or of a lost path, to
        the others."""
        lost = [o for o in self.outstanding.values() if o.worker_id == worker_id]
        self.load.pop(worker_id, None)
        self.routed.forget(worker_id)
        if lost:
            log.warning("redispatching", worker_id=worker_id, requests=len(lost), reason=why)
        for o in lost:
            self.outstanding.pop(o.work.request_id, None)
            self.admission.finished(o.work)
            work = o.work
            if gone and await self._lost(work, worker_id, why):
                continue
            work.attempt += 1
            self.redispatched += 1
            await self.resend(work)
        if gone:  # the counts of requests no longer here go (held, finished, told)
            self.losses = {rid: n for rid, n in self.losses.items() if rid in self.outstanding}

    async def _lost(self, work: WorkRequest, worker_id: str, why: str) -> bool:
        """A request whose worker was lost: its requester told (it resumes it), or
        ended at the cap -> True; else False (dispatched again)."""
        rid = work.request_id
        if isinstance(work, GenerateWork) and work.resumes and work.reply:
            self.told += 1
            await self.refuse(work, ServiceError(
                503, f"worker {worker_id} was lost ({why})",
                code="worker_lost"))
            return True
        lost = self.losses[rid] = self.losses.get(rid, 0) + 1
        if lost <= self.max_redispatch:
            return False
        self.given_up += 1
        self.losses.pop(rid, None)
        log.warning("redispatch_cap", request_id=rid, losses=lost, cap=self.max_redispatch)
        await self.refuse(work, internal(
            f"the request's worker was lost {lost} times (the last: {worker_id}, {why}); "
            f"not dispatched again past TENSORBUS_MAX_REDISPATCH={self.max_redispatch}"))
        return True
