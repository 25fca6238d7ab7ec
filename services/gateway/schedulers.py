"""The schedulers as this gateway hears them (their load reports): when one's
connection dropped, and whether one was heard just now.

  1. A report whose `reconnects` rose since that scheduler's last one: submissions
     this gateway sent while that scheduler was between servers may be lost (in the
     dead server, or published while no scheduler was subscribed): every retryable
     request out now is submitted once more (`on_lost`: the reply inbox's
     `path_lost`). The first report of a scheduler only sets its count.
  2. `back`: a submission that found no scheduler at all (NATS "no responders")
     while one was heard within COMEBACK x `expiry_s` waits for the next report of
     any scheduler (within the request's deadline and that bound): it was between
     servers, and is subscribed again when it reports. A scheduler whose server
     died needs its reconnect, and on a loaded machine that outlasted one expiry
     (a node-loss test's four streams ended 503 while it came back: streams are
     submitted again as `Frontend.call`'s requests are, services.gateway.continuity).
     None heard lately: the 503 stands at once.
"""

from __future__ import annotations

import asyncio
import time

from shared.messages import SchedLoad

COMEBACK = 3  # expiry periods a scheduler between servers is waited for
NO_SCHEDULER_TRIES = 10  # submissions again after "no responders" while a scheduler reports


class SchedulerLinks:
    def __init__(self, on_lost, expiry_s: float) -> None:
        self.on_lost = on_lost  # plain function: retryable requests out ask again
        self.expiry_s = expiry_s
        self.patience_s = COMEBACK * expiry_s  # how long one between servers is waited for
        self.reconnects: dict[str, int] = {}  # scheduler_id -> its latest `reconnects`
        self.heard_at = 0.0  # monotonic time of the latest report, any scheduler
        self.lost = 0  # reconnections seen
        self.waiting = 0  # submissions waiting in `back` now
        self._heard = asyncio.Event()  # set (and replaced) at every report

    def observe(self, load: SchedLoad) -> None:
        """A scheduler's load report (services.gateway.service)."""
        self.heard_at = time.monotonic()
        before = self.reconnects.setdefault(load.scheduler_id, load.reconnects)
        if load.reconnects > before:
            self.reconnects[load.scheduler_id] = load.reconnects
            self.lost += 1
            self.on_lost()
        heard, self._heard = self._heard, asyncio.Event()
        heard.set()

    async def back(self, deadline: float) -> bool:
        """Whether a scheduler reported after now, waiting (within `deadline`, UNIX
        seconds, and `patience_s`) only when one was heard within `patience_s`."""
        if time.monotonic() - self.heard_at > self.patience_s:
            return False
        heard = self._heard
        self.waiting += 1
        try:
            await asyncio.wait_for(heard.wait(),
                                   max(0.0, min(deadline - time.time(), self.patience_s)))
        except TimeoutError:
            return False
        finally:
            self.waiting -= 1
        return True
