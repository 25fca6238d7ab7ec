"""The gateway's view of the schedulers' connections (services.gateway.schedulers):
a rise of a scheduler's `reconnects` asks the retryable requests again, once; a
submission that found no scheduler waits for the next report only when one was
heard just now."""

from __future__ import annotations

import asyncio
import time

from services.gateway.schedulers import SchedulerLinks
from shared.messages import SchedLoad


def report(sid: str, reconnects: int) -> SchedLoad:
    return SchedLoad(sid, [], time.time(), reconnects)


async def test_a_rise_of_reconnects_asks_again_once_per_rise():
    lost = []
    links = SchedulerLinks(lambda: lost.append(1), expiry_s=1.0)
    links.observe(report("a", 3))  # first report: the count, no loss
    links.observe(report("b", 0))
    assert lost == []
    links.observe(report("a", 4))
    links.observe(report("a", 4))
    links.observe(report("b", 0))
    assert len(lost) == 1 and links.lost == 1


async def test_no_scheduler_heard_lately_is_no_reason_to_wait():
    links = SchedulerLinks(lambda: None, expiry_s=1.0)
    started = time.monotonic()
    assert not await links.back(time.time() + 30)
    assert time.monotonic() - started < 0.5


async def test_one_heard_just_now_is_waited_for_until_it_reports():
    links = SchedulerLinks(lambda: None, expiry_s=5.0)
    links.observe(report("a", 0))
    waiting = asyncio.create_task(links.back(time.time() + 30))
    await asyncio.sleep(0)  # the waiter is parked on the current report event
    assert not waiting.done()
    links.observe(report("a", 1))
    assert await asyncio.wait_for(waiting, 5)


async def test_a_silent_scheduler_ends_the_wait_within_its_bound():
    links = SchedulerLinks(lambda: None, expiry_s=0.2)
    links.observe(report("a", 0))
    assert not await links.back(time.time() + 30)


async def test_one_between_servers_longer_than_an_expiry_is_still_waited_for():
    """Its server died and its reconnect outlasted one expiry (a loaded machine): a
    submission that found nobody waits for its report rather than answer 503."""
    links = SchedulerLinks(lambda: None, expiry_s=1.0)
    links.observe(report("a", 0))
    links.heard_at -= 1.5  # silent for one and a half expiries
    waiting = asyncio.create_task(links.back(time.time() + 30))
    await asyncio.sleep(0)
    assert not waiting.done()
    links.observe(report("a", 1))
    assert await asyncio.wait_for(waiting, 5)
