"""Overload, short: the scheduler refuses what exceeds its queue bound at once (429
with Retry-After, answered while the engine is still busy), accepted requests all
succeed, requests whose deadline passes in the queue are never computed, and the
service is back to normal the moment the load stops. bench/overload.py is the long
version with latencies and memory.

The real encoder behind a recording wrapper: it notes every input it computes, and a
gate can hold a batch on the engine thread."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import msgspec
import pytest_asyncio

from shared import subjects
from tests.reliability.conftest import ENCODER
from tests.reliability.replies import ask, assert_refused
from bench.support.load import LOST, open_loop, summary
from tests.support.stack import running_stack, wait_until

QUEUE = 8  # max_queue_per_worker: one worker, so the fleet holds 8 requests at most


class Recording:
    """Wraps an engine: records each input computed; `gate` holds a batch."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.computed: set[tuple[int, ...]] = set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def warmup(self, progress: bool = True) -> int:
        return 0  # the wrapped engine is warm already

    def embed(self, inputs):
        self.entered.set()
        self.gate.wait()
        self.computed.update(tuple(x[1:-1]) for x in inputs)  # without [CLS] / [SEP]
        return self.inner.embed(inputs)


def tagged(i: int) -> bytes:
    """A request whose one input is identifiable in what the engine computed."""
    return msgspec.json.encode({"model": ENCODER, "input": [[1000 + i, 2000 + i]]})


def tag(i: int) -> tuple[int, ...]:
    return (1000 + i, 2000 + i)


@pytest_asyncio.fixture
async def overload_stack(nats_server, minilm):
    engine = Recording(minilm)
    async with running_stack(nats_server.url, max_queue_per_worker=QUEUE, max_batch=16) as st:
        await st.add_worker(engine, "enc-overload")
        yield st, engine


async def test_ten_times_capacity_is_refused_at_once_and_expired_work_never_runs(overload_stack):
    st, engine = overload_stack
    engine.gate.clear()
    blocker = asyncio.create_task(ask(st.client, subjects.EMBEDDINGS, tagged(0)))
    await asyncio.to_thread(engine.entered.wait, 10)
    # Queued behind the held batch: three with a short deadline, four without.
    short = [asyncio.create_task(ask(st.client, subjects.EMBEDDINGS, tagged(i),
                                     headers={"Tensorbus-Timeout": "0.3"})) for i in (1, 2, 3)]
    long = [asyncio.create_task(ask(st.client, subjects.EMBEDDINGS, tagged(i))) for i in (4, 5, 6, 7)]
    await wait_until(lambda: len(st.scheduler.outstanding) == QUEUE)
    # Ten times what the fleet holds arrives now: all of it is refused while the
    # engine is still held, so no refusal waited for a model.
    excess = await asyncio.gather(*(ask(st.client, subjects.EMBEDDINGS, tagged(100 + i))
                                    for i in range(10 * QUEUE)))
    assert not engine.gate.is_set()
    for r in excess:
        assert_refused(r, 429, "capacity", "overloaded")
    for r in await asyncio.gather(*short):
        assert_refused(r, 504, code="deadline_exceeded")
    engine.gate.set()
    assert [r.code for r in await asyncio.gather(blocker, *long)] == [200] * 5
    # The expired ones were dropped before compute; the refused ones never reached it.
    assert {tag(i) for i in (0, 4, 5, 6, 7)} <= engine.computed
    assert not engine.computed & ({tag(i) for i in (1, 2, 3)} | {tag(100 + i) for i in range(80)})
    r = await ask(st.client, subjects.EMBEDDINGS, tagged(999))  # normal again at once
    assert r.code == 200


async def test_sustained_overload_answers_everything_and_leaves_nothing_behind(overload_stack):
    st, _ = overload_stack
    bodies = [tagged(i) for i in range(50)]
    outcomes = await open_loop(st.client, subjects.EMBEDDINGS, bodies, rate=300, seconds=2,
                               timeout=20)
    codes = Counter(o.status for o in outcomes)
    assert set(codes) <= {200, 429}, summary(outcomes)  # nothing lost, nothing else
    assert codes[200] >= QUEUE and codes[429] > 0 and LOST not in codes
    assert all(o.retry_after and o.retry_after > 0 for o in outcomes if o.status == 429)
    # Bounded state: nothing outstanding, no open inbox, no task, no queue left over.
    await wait_until(lambda: not st.gateway._tasks, timeout=10)
    assert st.scheduler.outstanding == {} and not any(st.scheduler.load.values())
    assert st.gateway.front.inbox.open_count == 0
    assert st.workers["enc-overload"].runner.queue_depth == 0
    replies = await asyncio.gather(*(ask(st.client, subjects.EMBEDDINGS, tagged(i)) for i in range(4)))
    assert [r.code for r in replies] == [200] * 4
