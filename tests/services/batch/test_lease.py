"""The batch lease's rules (services/batch/lease.py) on a real nats-server's KV, with
the runners' clocks in the test's hands: one holder at a time, a lease that moves is
never taken, one that stops moving for its time is taken over by exactly one runner,
the old holder learns it lost it, and a released lease is free at once."""

from __future__ import annotations

import asyncio

from services.batch.lease import Leases
from services.batchstore import BatchStore, new_id


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def test_one_holder_takeover_after_silence_and_release(nc):
    kv = (await BatchStore.open(nc)).kv
    clocks = [Clock(), Clock(), Clock()]
    a, b, c = (Leases(kv, name, ttl_s=10, clock=clk) for name, clk in zip("abc", clocks))
    bid = new_id("batch_")

    mine = await a.take(bid)
    assert mine is not None
    assert await b.take(bid) is None and await c.take(bid) is None  # held: seen

    for clk in clocks:  # a renews within its time: never taken
        clk.t += 8
    assert await a.renew(mine)
    assert await b.take(bid) is None and await c.take(bid) is None  # moved: seen anew
    for clk in clocks:
        clk.t += 8
    assert await b.take(bid) is None  # unmoved for 8 s of b's clock: not yet

    for clk in clocks:  # a goes silent past the lease's time
        clk.t += 3
    taken = await asyncio.gather(b.take(bid), c.take(bid))
    assert sum(x is not None for x in taken) == 1  # exactly one takes it over
    winner = next(x for x in taken if x is not None)
    assert not await a.renew(mine)  # the old holder learns it lost it
    await a.release(mine)  # not its to release: nothing happens
    assert await a.take(bid) is None

    await (b if taken[0] else c).release(winner)
    again = await a.take(bid)  # released: free at once
    assert again is not None and again.revision > winner.revision
