"""Request metrics measure what a client sees: a real nats-server, a tiny real decoder,
the real telemetry service and its `/metrics`.

- TTFT counts from the gateway's receipt of the request, so the wait for a cold start
  is in it; the worker's own share is a metric of its own.
- Inter-token latency is one observation per generated token gap.
- `nats micro stats tensorbus-gateway` counts inference requests and their errors.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import msgspec
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from shared import subjects
from shared.errors import HEADER_CODE
from shared.telemetry import RequestRecord, record_decoder
from bench.support.mock_encoder import MockEncoder
from tests.support.stack import running_stack, wait_until
from tests.support.telemetry import running_telemetry
from tests.support.tiny_models import serve_tiny
from tests.support.bus import connect as bus_connect

CONTEXT = 128
MODEL = "tiny-metrics"


@pytest.fixture(scope="module")
def decoder(tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp("tiny-metrics")
    _, engine = serve_tiny("gpt2", path, MODEL, CONTEXT)
    return engine, str(path)


@pytest_asyncio.fixture
async def records(nats_server):
    """Every RequestRecord published from now on, as they arrive."""
    import nats

    nc = await bus_connect(nats_server.url)
    got: list[RequestRecord] = []

    async def on(msg):
        rec = record_decoder.decode(msg.data)
        if isinstance(rec, RequestRecord):
            got.append(rec)

    await nc.subscribe(subjects.TELEMETRY_REQUESTS, cb=on)
    yield got
    await nc.drain()


async def scrape(port: int) -> dict[tuple[str, tuple], float]:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def sample(samples, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


async def first_chunk_and_rest(nc, body: dict) -> tuple[float, list[bytes]]:
    """Send a streaming request; seconds to its first chunk, and every message."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    t0 = time.perf_counter()
    await nc.publish(subjects.COMPLETIONS, msgspec.json.encode({**body, "stream": True}),
                     reply=inbox)
    first, out = 0.0, []
    while True:
        msg = await sub.next_msg(timeout=60)
        if not first:
            first = time.perf_counter() - t0
        out.append(msg.data)
        if msg.data == b"[DONE]":
            break
    await sub.unsubscribe()
    return first, out


async def test_ttft_includes_a_cold_start_and_itl_counts_every_token(nats_server, decoder, records):
    engine, path = decoder
    async with running_stack(nats_server.url, models={MODEL: path}, max_context=CONTEXT,
                             decode_slots=4) as st, \
            running_telemetry(nats_server.url) as tel:
        # No worker yet: the request is held for a cold start, which its client waits out.
        body = {"model": MODEL, "prompt": [5, 17, 42], "max_tokens": 12, "ignore_eos": True,
                "temperature": 0}
        request = asyncio.create_task(first_chunk_and_rest(st.client, body))
        await wait_until(lambda: st.scheduler.holds.by_model.get(MODEL))
        await st.add_worker(engine, "dec-metrics", kind="decoder")
        client_ttft, msgs = await request
        assert msgs[-1] == b"[DONE]" and len(msgs) > 2

        await wait_until(lambda: any(r.model == MODEL for r in records), timeout=10)
        [rec] = [r for r in records if r.model == MODEL]
        assert rec.status == 200 and rec.completion_tokens == 12
        # The gateway's TTFT holds the cold start the client waited and the worker's own
        # share after it (disjoint parts of it), and no more than the client saw.
        assert rec.hold_s > 0 and rec.worker_ttft_s > 0
        assert rec.hold_s + rec.worker_ttft_s <= rec.ttft_s <= client_ttft
        # 12 tokens: 11 gaps, each one counted.
        assert sum(rec.itl_counts) == 11

        end = time.monotonic() + 10
        while True:  # poll /metrics until the record has been applied
            s = await scrape(tel.metrics_port)
            if sample(s, "tensorbus_inter_token_latency_seconds_count", model=MODEL):
                break
            assert time.monotonic() < end, "the request never reached /metrics"
            await asyncio.sleep(0.05)
        assert sample(s, "tensorbus_inter_token_latency_seconds_count", model=MODEL) == 11
        itl_sum = sample(s, "tensorbus_inter_token_latency_seconds_sum", model=MODEL)
        assert itl_sum == pytest.approx(rec.itl_s * 11)
        assert sample(s, "tensorbus_inter_token_latency_seconds_bucket", model=MODEL,
                      le="+Inf") == 11
        assert sample(s, "tensorbus_time_to_first_token_seconds_sum",
                      model=MODEL) == pytest.approx(rec.ttft_s)
        assert sample(s, "tensorbus_worker_time_to_first_token_seconds_sum",
                      model=MODEL) == pytest.approx(rec.worker_ttft_s)


async def test_nats_micro_stats_count_inference_requests(nats_server):
    async with running_stack(nats_server.url) as st:
        await st.add_worker(MockEncoder(), "enc-micro")
        nc = st.client
        for text in ("one", "two", "three"):
            msg = await nc.request(subjects.EMBEDDINGS, msgspec.json.encode(
                {"model": "all-MiniLM-L6-v2", "input": [text]}), timeout=10)
            assert (msg.headers or {}).get(HEADER_CODE) is None
        bad = await nc.request(subjects.EMBEDDINGS, b"{not json", timeout=10)
        assert bad.headers[HEADER_CODE] == "400"
        models = await nc.request(subjects.MODELS, b"", timeout=10)
        assert json.loads(models.data)["object"] == "list"

        async def stats() -> dict:
            reply = await nc.request("$SRV.STATS.tensorbus-gateway", b"", timeout=5)
            return {e["name"]: e for e in json.loads(reply.data)["endpoints"]}

        await wait_until(lambda: not st.gateway._tasks, timeout=10)
        eps = await stats()
        emb = eps["embeddings"]
        assert (emb["subject"], emb["queue_group"]) == (subjects.EMBEDDINGS, subjects.QUEUE_GATEWAY)
        assert (emb["num_requests"], emb["num_errors"]) == (4, 1)
        assert emb["average_processing_time"] > 0
        assert eps["models"]["num_requests"] == 1
        assert {e["subject"] for e in eps.values()} >= {
            subjects.COMPLETIONS, subjects.CHAT_COMPLETIONS, subjects.MODELS}
