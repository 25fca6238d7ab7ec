"""A worker whose engine wedges (the process lives and heartbeats, no step completes)
is marked stalled by the forward-progress check, gets no more work, and what it held
is answered by another worker; once its engine moves again it is back in rotation.

In-process with the hand-checkable mock engine (its gate holds a batch on the engine
thread). `Fleet.stall_s` is shortened on the scheduler's and the gateway's fleets:
there is no setting for it yet (10 s)."""

from __future__ import annotations

import asyncio

import msgspec

from shared import subjects
from tests.reliability.replies import ask
from tests.support.mock_engine import MockEncoder
from tests.support.stack import running_stack, wait_until

MODEL = "all-MiniLM-L6-v2"
STALL_S = 0.5


def body(text: str) -> bytes:
    return msgspec.json.encode({"model": MODEL, "input": [text]})


async def ready_workers(nc) -> int:
    msg = await nc.request(subjects.MODELS, b"", timeout=5)
    cards = msgspec.json.decode(msg.data)["data"]
    return next((c["ready_workers"] for c in cards if c["id"] == MODEL), 0)


async def test_a_wedged_engine_gets_no_more_work_and_its_request_is_answered(nats_server):
    wedged, healthy = MockEncoder(), MockEncoder()
    wedged.gate.clear()
    async with running_stack(nats_server.url) as st:
        st.scheduler.fleet.stall_s = st.gateway.front.fleet.stall_s = STALL_S
        await st.add_worker(wedged, "w-wedged")
        # Alone in the fleet, the wedged worker takes the first request and hangs on it.
        first = asyncio.create_task(ask(st.client, subjects.EMBEDDINGS, body("first")))
        await asyncio.to_thread(wedged.entered.wait, 10)
        await st.add_worker(healthy, "w-ok")

        await wait_until(lambda: st.scheduler.fleet.workers["w-wedged"].stalled, timeout=10)
        received: list[bytes] = []

        async def on_work(msg) -> None:
            received.append(msg.data)

        tap = await st.client.subscribe(subjects.worker_work("w-wedged"), cb=on_work)
        await st.client.flush()
        # What it held is answered by the healthy worker, once.
        reply = await first
        assert reply.code == 200 and len(reply.body["data"]) == 1
        assert st.scheduler.redispatched >= 1
        # While wedged it is out of rotation: every request goes to the other worker.
        replies = await asyncio.gather(*(ask(st.client, subjects.EMBEDDINGS, body(f"x{i}"))
                                         for i in range(30)))
        assert [r.code for r in replies] == [200] * 30
        assert received == [] and wedged.batches == []
        assert sum(healthy.batches) >= 31
        # The gateway's card counts from its own view of the heartbeats, which may see
        # the stall a beat after the scheduler does.
        await wait_until(lambda: st.gateway.front.fleet.workers["w-wedged"].stalled, timeout=10)
        assert await ready_workers(st.client) == 1
        assert st.workers["w-wedged"].state == "ready"  # it never noticed itself

        # The engine moves again: its late answer is dropped, and it takes work again.
        wedged.gate.set()
        await wait_until(lambda: not st.scheduler.fleet.workers["w-wedged"].stalled, timeout=10)
        await wait_until(lambda: st.gateway.front.fleet.workers["w-wedged"].ready, timeout=10)
        await tap.unsubscribe()
        replies = await asyncio.gather(*(ask(st.client, subjects.EMBEDDINGS, body(f"y{i}"))
                                         for i in range(40)))
        assert [r.code for r in replies] == [200] * 40
        assert sum(wedged.batches) > 1  # the held batch, then new work
        assert st.gateway.front.inbox.open_count == 0
