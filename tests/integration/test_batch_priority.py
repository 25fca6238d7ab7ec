"""The batch lane through a real nats-server, gateway, scheduler and worker: a request
marked `Tensorbus-Priority: batch` (as the batch runner marks its lines) does not
delay an interactive request that arrives after it.

The engine is the hand-checkable mock encoder, one input per batch
(TENSORBUS_MAX_BATCH=1: the worker's room is one request), held by its gate so the
order of arrival is set before anything computes. What is asserted is the order the
engine computed the requests in, never a time.
"""

from __future__ import annotations

import asyncio

import msgspec

from bench.support.mock_encoder import MockEncoder
from shared import priority, subjects
from shared.errors import HEADER_CODE
from tests.support.stack import running_stack, wait_until

MODEL = "all-MiniLM-L6-v2"
BATCH = {priority.HEADER: "batch"}


class Recording(MockEncoder):
    """The mock encoder, noting which request (its marker token) each call computed."""

    def __init__(self) -> None:
        super().__init__(max_batch=1)
        self.order: list[int] = []

    def embed(self, inputs):
        out = super().embed(inputs)  # waits at the gate first
        self.order += [t for x in inputs for t in x if t in MARKERS.values()]
        return out


MARKERS = {"first": 2001, "batch": 2002, "interactive": 2003}


async def ask(nc, name: str, headers=None) -> int:
    body = msgspec.json.encode({"model": MODEL, "input": [[MARKERS[name]]]})
    msg = await nc.request(subjects.EMBEDDINGS, body, timeout=30, headers=headers)
    return int((msg.headers or {}).get(HEADER_CODE, 200))


async def test_a_batch_request_does_not_delay_an_interactive_one_behind_it(nats_server):
    eng = Recording()
    eng.gate.clear()
    async with running_stack(nats_server.url, max_batch=1) as st:
        await st.add_worker(eng, "w1")
        sched = st.scheduler
        first = asyncio.create_task(ask(st.client, "first"))
        await asyncio.to_thread(eng.entered.wait, 10)  # computing: the worker has no room
        batch = asyncio.create_task(ask(st.client, "batch", BATCH))
        await wait_until(lambda: sched.lane.count(MODEL) == 1)  # waits at the scheduler
        interactive = asyncio.create_task(ask(st.client, "interactive"))
        await wait_until(lambda: len(sched.outstanding) == 2)  # dispatched past it
        assert sched.lane.count(MODEL) == 1
        eng.gate.set()
        assert await asyncio.gather(first, batch, interactive) == [200, 200, 200]
        # Computed in the order of priority, not of arrival; the batch request ran
        # once the worker was idle.
        assert eng.order == [MARKERS["first"], MARKERS["interactive"], MARKERS["batch"]]
        assert not sched.lane.waits(MODEL) and not sched.outstanding


async def test_batch_requests_on_an_idle_fleet_all_complete_and_a_bad_lane_is_a_400(nats_server):
    eng = Recording()
    async with running_stack(nats_server.url, max_batch=1) as st:
        await st.add_worker(eng, "w1")
        codes = await asyncio.gather(*(ask(st.client, "batch", BATCH) for _ in range(5)))
        assert codes == [200] * 5 and eng.order == [MARKERS["batch"]] * 5
        body = msgspec.json.encode({"model": MODEL, "input": ["x"]})
        msg = await st.client.request(subjects.EMBEDDINGS, body, timeout=10,
                                      headers={priority.HEADER: "urgent"})
        assert msg.headers[HEADER_CODE] == "400"
        error = msgspec.json.decode(msg.data)["error"]
        assert error["code"] == "invalid_priority" and priority.HEADER in error["message"]
