"""Cancellation frees work everywhere, over a real nats-server and HTTP, with the mock
decoder: a non-streaming HTTP client that leaves, whether its request is held for a
cold start or queued at a worker, gets no token generated for it. The worker's own
count of generated tokens says so (`DecoderRunner.generated`)."""

from __future__ import annotations

import asyncio

import httpx
import msgspec

from shared import subjects
from shared.errors import HEADER_CODE
from shared.telemetry import RequestRecord, record_decoder
from tests.support.mock_engine import MockDecoder
from tests.support.stack import running_stack, wait_until

MODEL = "tensorbus-demo-lm"  # bundled: known with no worker, so its requests are held
MAX_TOKENS = 4
BODY = {"model": MODEL, "prompt": "the", "max_tokens": MAX_TOKENS, "temperature": 0}


async def records_of(nc, into: list) -> object:
    async def on_record(msg) -> None:
        rec = record_decoder.decode(msg.data)
        if isinstance(rec, RequestRecord) and rec.model == MODEL:
            into.append(rec)

    sub = await nc.subscribe(subjects.TELEMETRY_REQUESTS, cb=on_record)
    await nc.flush()
    return sub


async def leave(h: httpx.AsyncClient, call: asyncio.Task) -> None:
    """The client hangs up: its request task is cancelled and its connection closed."""
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    await h.aclose()


async def test_a_held_request_whose_client_leaves_is_never_generated(nats_server):
    async with running_stack(nats_server.url, min_workers=0, idle_to_zero_s=30.0) as st:
        records: list[RequestRecord] = []
        sub = await records_of(st.client, records)
        h = httpx.AsyncClient(base_url=st.http_url, timeout=30)
        call = asyncio.create_task(h.post("/v1/completions", json=BODY))
        await wait_until(lambda: st.scheduler.holds.count(MODEL) == 1, timeout=10)
        await leave(h, call)
        # Dropped at the gateway's Cancel, long before its 30 s deadline.
        await wait_until(lambda: st.scheduler.holds.count(MODEL) == 0, timeout=5)
        await wait_until(lambda: records, timeout=5)
        assert (records[0].status, records[0].error_code) == (499, "client_closed")

        worker = await st.add_worker(MockDecoder(name=MODEL), "late-dec", kind="decoder")
        async with httpx.AsyncClient(base_url=st.http_url, timeout=30) as h2:
            r = await h2.post("/v1/completions", json=BODY)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS
        # Had the held one been released to the worker, it would have gone first.
        assert worker.runner.generated == MAX_TOKENS
        await sub.unsubscribe()


async def test_a_queued_non_streaming_request_whose_client_leaves_is_never_generated(nats_server):
    engine = MockDecoder(name=MODEL, slots=1)
    async with running_stack(nats_server.url) as st:
        worker = await st.add_worker(engine, "one-slot", kind="decoder")
        runner = worker.runner
        engine.gate.clear()  # the first request holds the only slot, mid-step
        first = asyncio.create_task(st.client.request(
            subjects.COMPLETIONS, msgspec.json.encode(BODY), timeout=30))
        await wait_until(lambda: runner.in_flight == 1, timeout=10)

        h = httpx.AsyncClient(base_url=st.http_url, timeout=30)
        call = asyncio.create_task(h.post("/v1/completions", json=BODY))
        await wait_until(lambda: len(runner.sched.waiting) == 1, timeout=10)
        rid = runner.sched.waiting[0].work.request_id
        await leave(h, call)
        await wait_until(lambda: rid not in runner.requests or runner.requests[rid].cancelled,
                         timeout=5)

        engine.gate.set()
        msg = await first
        assert (msg.headers or {}).get(HEADER_CODE) is None
        assert msgspec.json.decode(msg.data)["usage"]["completion_tokens"] == MAX_TOKENS
        await wait_until(lambda: not runner.requests and runner.queue_depth == 0, timeout=5)
        assert runner.generated == MAX_TOKENS  # the first request's, none for the one that left
