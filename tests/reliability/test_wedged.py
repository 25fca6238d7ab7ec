"""A worker whose engine wedges (the process lives and heartbeats, no step completes)
is marked stalled by the forward-progress check, gets no more work, and what it held
is answered by another worker; once its engine moves again it is back in rotation.
A step that waits on a program being compiled is slow, not wedged: its worker keeps
its work.

In-process with the hand-checkable mock engine (its gate holds a batch on the engine
thread). `Fleet.stall_s` is shortened on the scheduler's and the gateway's fleets:
there is no setting for it yet (10 s)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import msgspec

from shared import subjects
from shared.telemetry import heartbeat_decoder
from tests.reliability.replies import ask
from bench.support.mock_encoder import MockEncoder
from tests.support.mock_engine import MockDecoder
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
        assert st.scheduler.recovery.redispatched >= 1
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


class CompilingDecoder(MockDecoder):
    """Its decode step waits on `gate` the way a JAX engine's step waits on a program
    nobody compiled yet, and says so (`stats().compiling`, as engine/programs.py
    counts it)."""

    def __init__(self) -> None:
        super().__init__(name="tensorbus-demo-lm")  # bundled: the gateway has its tokenizer
        self.waiting, self.waited_s = False, 0.0
        self._lock = threading.Lock()

    def stats(self, prefixes: int = 0):
        with self._lock:
            return dataclasses.replace(super().stats(prefixes), compiling=self.waiting,
                                       compile_waited_s=self.waited_s)

    def step_async(self):
        with self._lock:
            self.waiting, t0 = True, time.perf_counter()
        try:
            return super().step_async()
        finally:
            with self._lock:
                self.waiting, self.waited_s = False, self.waited_s + time.perf_counter() - t0


async def test_a_step_waiting_on_a_compile_is_slow_not_stalled(nats_server):
    """Its heartbeats say it compiles; over many times the stall limit the scheduler
    neither marks it stalled nor sends its request elsewhere, the request is answered
    once the compile ends, and the compile's time is not learned as the model's cost."""
    engine = CompilingDecoder()
    engine.gate.clear()
    async with running_stack(nats_server.url) as st:
        st.scheduler.fleet.stall_s = st.gateway.front.fleet.stall_s = STALL_S
        worker = await st.add_worker(engine, "w-compiling", kind="decoder")
        said: list[float] = []  # sent_at of its heartbeats that say it compiles

        async def on_beat(msg) -> None:
            hb = heartbeat_decoder.decode(msg.data)
            if hb.worker_id == "w-compiling" and hb.compiling:
                said.append(hb.sent_at)

        beats = await st.client.subscribe(subjects.TELEMETRY_WORKERS, cb=on_beat)
        body = msgspec.json.encode({"model": engine.name, "prompt": "the", "max_tokens": 4,
                                    "temperature": 0})
        call = asyncio.create_task(ask(st.client, subjects.COMPLETIONS, body, timeout=60))
        await asyncio.to_thread(engine.entered.wait, 10)
        await wait_until(lambda: len(said) > 2 and said[-1] - said[0] > 6 * STALL_S, timeout=30)
        assert not st.scheduler.fleet.workers["w-compiling"].stalled
        assert not st.gateway.front.fleet.workers["w-compiling"].stalled
        assert st.scheduler.recovery.redispatched == 0

        engine.gate.set()
        reply = await call
        await beats.unsubscribe()
        assert reply.code == 200, reply.body
        assert reply.body["choices"][0]["text"] == "aaaa"  # the mock's tag, 4 tokens
        assert st.scheduler.recovery.redispatched == 0
        # The step that waited also ran the prompt: learned, its compile would price
        # a one-token prompt at seconds, and admission would refuse what fits.
        cost = worker.runner.costs.cost()
        assert cost is None or cost.prefill_s(1, 1, 16) + cost.step_s(1) < STALL_S
