"""Routing, admission, deadlines and failure isolation over a real nats-server.

The engine here is the hand-checkable mock (tests/support/mock_engine.py): these
tests are about the serving layer. Model correctness is tested with real weights in
test_embeddings.py.
"""

from __future__ import annotations

import asyncio

import msgspec

from shared import subjects
from shared.errors import HEADER_CODE
from bench.support.mock_encoder import MockEncoder
from tests.support.stack import running_stack, wait_until

MODEL = "all-MiniLM-L6-v2"


def body(**kw) -> bytes:
    kw.setdefault("model", MODEL)
    kw.setdefault("input", ["hello world"])
    return msgspec.json.encode(kw)


async def ask(nc, data: bytes, timeout: float = 10.0, headers=None):
    msg = await nc.request(subjects.EMBEDDINGS, data, timeout=timeout, headers=headers)
    code = int((msg.headers or {}).get(HEADER_CODE, 200))
    return code, msgspec.json.decode(msg.data)


async def test_request_reaches_a_worker_and_comes_back(nats_server):
    async with running_stack(nats_server.url) as st:
        await st.add_worker(MockEncoder(), "w1")
        code, resp = await ask(st.client, body(input=["a", "bb"]))
        assert code == 200
        assert resp["object"] == "list" and [d["index"] for d in resp["data"]] == [0, 1]
        assert all(len(d["embedding"]) == 8 for d in resp["data"])
        assert resp["usage"]["prompt_tokens"] > 0


async def test_two_workers_both_take_traffic(nats_server):
    a, b = MockEncoder(), MockEncoder()
    async with running_stack(nats_server.url) as st:
        await st.add_worker(a, "w-a")
        await st.add_worker(b, "w-b")
        results = await asyncio.gather(*(ask(st.client, body(input=[f"text {i}"])) for i in range(200)))
        assert all(code == 200 for code, _ in results)
        assert sum(a.batches) > 0 and sum(b.batches) > 0
        assert sum(a.batches) + sum(b.batches) == 200


async def test_unknown_model_is_404_at_once_and_a_known_one_is_held(nats_server):
    # No worker at all: a known model waits for one (test_cold_start.py), an
    # unknown one is refused without waiting.
    async with running_stack(nats_server.url) as st:
        code, resp = await ask(st.client, body(model="no-such-model"), timeout=2)
        assert code == 404 and resp["error"]["code"] == "model_not_found"
        code, resp = await ask(st.client, body(), timeout=5,
                               headers={"Tensorbus-Timeout": "0.3"})
        assert code == 504 and "cold start" in resp["error"]["message"]


async def test_overload_is_429_with_retry_after(nats_server):
    eng = MockEncoder()
    eng.gate.clear()  # the engine holds its first batch: nothing finishes
    async with running_stack(nats_server.url, max_queue_per_worker=4) as st:
        await st.add_worker(eng, "w1")
        tasks = [asyncio.create_task(ask(st.client, body())) for _ in range(4)]
        await wait_until(lambda: len(st.scheduler.outstanding) == 4)
        msg = await st.client.request(subjects.EMBEDDINGS, body(), timeout=2)
        assert msg.headers[HEADER_CODE] == "429"
        assert float(msg.headers["Retry-After"]) > 0
        eng.gate.set()
        assert [c for c, _ in await asyncio.gather(*tasks)] == [200] * 4


async def test_deadline_is_504_and_expired_work_is_never_computed(nats_server):
    eng = MockEncoder()
    eng.gate.clear()
    async with running_stack(nats_server.url) as st:
        await st.add_worker(eng, "w1")
        first = asyncio.create_task(ask(st.client, body(input=["first"])))
        await asyncio.to_thread(eng.entered.wait, 5)
        code, resp = await ask(st.client, body(input=["late"]), headers={"Tensorbus-Timeout": "0.2"})
        assert code == 504 and resp["error"]["code"] == "deadline_exceeded"
        eng.gate.set()
        assert (await first)[0] == 200
        # The expired request was dropped before compute: only the first batch ran.
        code, _ = await ask(st.client, body(input=["after"]))
        assert code == 200
        assert eng.batches == [1, 1]


async def test_silent_worker_stops_receiving_work(nats_server):
    a, b = MockEncoder(), MockEncoder()
    async with running_stack(nats_server.url) as st:
        await st.add_worker(a, "w-a")
        await st.add_worker(b, "w-b")
        st.kill_worker("w-a")
        await wait_until(lambda: "w-a" not in st.scheduler.fleet.workers, timeout=5)
        before = sum(a.batches)
        results = await asyncio.gather(*(ask(st.client, body(input=[f"x{i}"])) for i in range(50)))
        assert all(code == 200 for code, _ in results)
        assert sum(a.batches) == before


async def test_a_failing_request_does_not_fail_its_batch_mates(nats_server):
    eng = MockEncoder(fail_on=7777)
    eng.gate.clear()
    async with running_stack(nats_server.url) as st:
        await st.add_worker(eng, "w1")
        blocker = asyncio.create_task(ask(st.client, body(input=["blocker"])))
        await asyncio.to_thread(eng.entered.wait, 5)
        good = [asyncio.create_task(ask(st.client, body(input=[f"good {i}"]))) for i in range(5)]
        bad = asyncio.create_task(ask(st.client, body(input=[[7777]])))
        await wait_until(lambda: st.workers["w1"].runner.queue_depth == 6)
        eng.gate.set()
        assert (await blocker)[0] == 200
        assert [c for c, _ in await asyncio.gather(*good)] == [200] * 5
        code, resp = await bad
        assert code == 500 and "failed" in resp["error"]["message"]


async def test_event_loop_stays_responsive_while_a_batch_computes(nats_server):
    eng = MockEncoder()
    eng.gate.clear()
    async with running_stack(nats_server.url) as st:
        w = await st.add_worker(eng, "w1")
        pending = asyncio.create_task(ask(st.client, body()))
        await asyncio.to_thread(eng.entered.wait, 5)
        # While the engine thread is busy, the worker keeps heartbeating: a heartbeat
        # composed after the batch went in says so (one sent just before it may still
        # be on its way when the engine starts, so the first to arrive proves nothing),
        # and the next one comes while the batch still computes.
        view = lambda: st.scheduler.fleet.workers["w1"]  # noqa: E731
        await wait_until(lambda: view().hb.in_flight == 1, timeout=5)
        seen = view().seen
        await wait_until(lambda: view().seen > seen, timeout=5)
        assert view().hb.in_flight == 1
        # ... and the gateway still answers other requests.
        msg = await st.client.request(subjects.MODELS, b"", timeout=2)
        assert msgspec.json.decode(msg.data)["data"][0]["id"] == MODEL
        eng.gate.set()
        assert (await pending)[0] == 200
        assert w.state == "ready"


async def test_a_batch_waits_to_fill_no_longer_than_a_batch_takes(nats_server):
    """After a batch of 7, a lone request waits for company (up to max_wait_ms) only
    as long as a batch takes to compute: with an engine whose batch costs nothing it
    is computed at once, with one whose batch costs 0.3 s it waits about that long."""
    from shared.telemetry import RequestRecord, record_decoder

    waits: dict[str, float] = {}

    async def keep(msg) -> None:
        rec = record_decoder.decode(msg.data)
        if isinstance(rec, RequestRecord):
            waits[rec.request_id] = rec.batch_wait_s

    for per_batch_s in (0.0, 0.3):
        eng = MockEncoder(per_batch_s=per_batch_s)
        async with running_stack(nats_server.url, max_wait_ms=2000) as st:
            await st.client.subscribe(subjects.TELEMETRY_REQUESTS, cb=keep)
            w = await st.add_worker(eng, "w1")
            for _ in range(4):  # lone batches: the engine's batch time is known
                assert (await ask(st.client, body()))[0] == 200
            eng.gate.clear()  # one batch computing, seven waiting: the next batch is 7
            held = [asyncio.create_task(ask(st.client, body()))]
            await wait_until(lambda: w.runner.in_flight == 1)
            held += [asyncio.create_task(ask(st.client, body())) for _ in range(7)]
            await wait_until(lambda: w.runner.queue_depth == 7)
            eng.gate.set()
            assert [c for c, _ in await asyncio.gather(*held)] == [200] * 8
            assert eng.batches[-2:] == [1, 7]
            rid = f"lone-{per_batch_s}"
            code, _ = await ask(st.client, body(), headers={"X-Request-Id": rid})
            assert code == 200 and eng.batches[-1] == 1
            await wait_until(lambda: rid in waits)
        if per_batch_s == 0.0:
            assert waits[rid] < 0.5, waits[rid]  # not the 2 s it may wait at most
        else:
            assert 0.2 <= waits[rid] <= 1.0, waits[rid]
