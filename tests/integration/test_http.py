"""The HTTP API with the official `openai` client, unchanged, plus what HTTP adds:
SSE streaming, API keys, body limits, health, metrics, the OpenAPI document, and a
client that disconnects mid-stream freeing its slot."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest
import pytest_asyncio

from tests.support.stack import running_stack, wait_until
from tests.support.tiny_models import serve_tiny

KEY = "sk-test-key"
CONTEXT = 1024


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp("lm")
    _, engine = serve_tiny("gpt2", path, "tiny-lm", CONTEXT)
    return engine, str(path)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, minilm, tiny_lm, sentence_transformer):  # loaded before services run
    engine, path = tiny_lm
    async with running_stack(nats_server.url, models={"tiny-lm": path}, api_keys=KEY,
                             max_context=CONTEXT, decode_slots=4, max_payload=200_000) as st:
        await st.add_worker(minilm, "enc-http")
        await st.add_worker(engine, "dec-http", kind="decoder")
        yield st


@pytest.fixture
def client(stack):
    return openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0)


async def test_openai_client_embeddings(client, sentence_transformer):
    resp = await client.embeddings.create(model="all-MiniLM-L6-v2", input=["hello world", "tensor bus"])
    got = np.array([d.embedding for d in resp.data])
    ref = sentence_transformer.encode(["hello world", "tensor bus"], normalize_embeddings=True)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.9999 and resp.usage.prompt_tokens > 0


async def test_openai_client_completions_and_chat(client):
    c = await client.completions.create(model="tiny-lm", prompt="the quick", max_tokens=6, temperature=0)
    assert c.choices[0].finish_reason in ("stop", "length") and c.usage.completion_tokens <= 6
    stream = await client.completions.create(model="tiny-lm", prompt="the quick", max_tokens=6,
                                             temperature=0, stream=True)
    text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
    assert text == c.choices[0].text
    chat = await client.chat.completions.create(
        model="tiny-lm", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    stream = await client.chat.completions.create(
        model="tiny-lm", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    async for ch in stream:
        if ch.choices:
            pieces.append(ch.choices[0].delta.content or "")
        if ch.usage:
            usage = ch.usage
    assert "".join(pieces) == chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens


async def test_models_and_errors_through_the_client(client):
    models = await client.models.list()
    assert {"all-MiniLM-L6-v2", "tiny-lm"} <= {m.id for m in models.data}
    with pytest.raises(openai.NotFoundError):
        await client.embeddings.create(model="nope", input="x")
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model="tiny-lm", prompt=[1] * CONTEXT, max_tokens=1)
    assert "context" in str(e.value)


async def test_api_key_is_required(stack):
    bad = openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.embeddings.create(model="all-MiniLM-L6-v2", input="x")
    async with httpx.AsyncClient(base_url=stack.http_url) as h:
        r = await h.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


async def test_sse_wire_format_and_limits_and_probes(stack):
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=stack.http_url, headers=headers, timeout=30) as h:
        async with h.stream("POST", "/v1/completions", json={
                "model": "tiny-lm", "prompt": "the", "max_tokens": 4, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["tensorbus-model-version"] == "local"  # a fixed engine's version
            lines = [ln async for ln in r.aiter_lines() if ln]
        assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
        r = await h.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "x"})
        assert r.status_code == 200 and r.headers["tensorbus-model-version"] == "local"
        r = await h.post("/v1/completions", content=b"{" + b" " * 300_000 + b"}",
                         headers={"content-type": "application/json"})
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
        r = await h.post("/v1/embeddings", content=b"not json")
        assert r.status_code == 400
        assert (await h.get("/healthz")).status_code == 200
        assert (await h.get("/readyz")).json() == {"ready": True}
        metrics = (await h.get("/metrics")).text
        assert "tensorbus_gateway_http_requests_total" in metrics
        spec = (await h.get("/openapi.json")).json()
        assert {"/v1/embeddings", "/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])
        r = await h.get("/v1/nothing-here")
        assert r.status_code == 404 and "error" in r.json()


async def test_the_routes_other_servers_answer_on(stack):
    """vLLM's /health, /version, /tokenize and /detokenize, OpenAI's model retrieval,
    and `max_model_len` on the cards."""
    from shared import VERSION

    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=stack.http_url, headers=headers, timeout=30) as h:
        r = await h.get("/health")
        assert r.status_code == 200 and r.content == b""
        assert (await h.get("/version")).json() == {"version": VERSION}
        card = (await h.get("/v1/models/all-MiniLM-L6-v2")).json()
        assert card["id"] == "all-MiniLM-L6-v2" and card["object"] == "model"
        assert card["max_model_len"] == 256  # the encoder's longest input
        listed = (await h.get("/v1/models")).json()["data"]
        assert next(c for c in listed if c["id"] == "all-MiniLM-L6-v2") == card
        r = await h.get("/v1/models/no-such-model")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        body = {"model": "tiny-lm", "prompt": "the cat sat"}
        versioned, plain = await h.post("/v1/tokenize", json=body), await h.post("/tokenize", json=body)
        assert versioned.status_code == plain.status_code == 200
        assert plain.json() == versioned.json() and plain.json()["count"] > 0
        ids = plain.json()["tokens"]
        back = await h.post("/detokenize", json={"model": "tiny-lm", "tokens": ids})
        assert back.status_code == 200 and back.json()["prompt"].strip() == "the cat sat"
        card = (await h.get("/v1/models/tiny-lm")).json()  # read by the gateway now
        assert card["max_model_len"] == plain.json()["max_model_len"] > 0


async def test_a_requests_own_chat_template_is_refused_unless_trusted(stack):
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=stack.http_url, headers=headers, timeout=30) as h:
        r = await h.post("/v1/chat/completions", json={
            "model": "tiny-lm", "messages": [{"role": "user", "content": "x"}],
            "chat_template": "{{ messages[0].content }}", "max_tokens": 2})
    assert r.status_code == 400
    assert "TENSORBUS_TRUST_REQUEST_CHAT_TEMPLATE" in r.json()["error"]["message"]


async def test_client_disconnect_cancels_and_frees_the_slot(stack, tiny_lm):
    engine, _ = tiny_lm
    worker = stack.workers["dec-http"]
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=stack.http_url, headers=headers, timeout=30) as h:
        async with h.stream("POST", "/v1/completions", json={
                "model": "tiny-lm", "prompt": "the", "max_tokens": CONTEXT - 8, "temperature": 0,
                "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break  # one chunk arrived; now hang up
    await wait_until(lambda: worker.runner.in_flight == 0, timeout=10)
    assert engine.stats().active == 0
    # The slot was freed long before the request could have run to max_tokens.
    assert worker.runner.steps < CONTEXT


async def test_a_stream_starts_with_its_first_chunk_and_a_client_may_leave_before(nats_server):
    """No worker yet (a cold start): the streamed request is held and no response has
    started. A client that hangs up meanwhile is let go at once (499, inbox closed),
    not at its deadline."""
    from shared import subjects
    from shared.telemetry import RequestRecord, record_decoder

    model = "tensorbus-demo-lm"  # bundled: known with no worker, so its requests are held
    records: list[RequestRecord] = []

    async def on_record(msg) -> None:
        rec = record_decoder.decode(msg.data)
        if isinstance(rec, RequestRecord) and rec.model == model:
            records.append(rec)

    async with running_stack(nats_server.url, min_workers=0, idle_to_zero_s=30.0) as st:
        sub = await st.client.subscribe(subjects.TELEMETRY_REQUESTS, cb=on_record)
        await st.client.flush()
        async with httpx.AsyncClient(base_url=st.http_url, timeout=30) as h:
            call = asyncio.create_task(h.post("/v1/completions", json={
                "model": model, "prompt": "the", "max_tokens": 4, "stream": True}))
            # Submitted and waiting (held by whichever scheduler took it: this module's
            # other stack may be running on the same server).
            await wait_until(lambda: st.gateway.front.admission.waiting[model] == 1, timeout=10)
            assert not call.done()  # nothing sent yet: no status, no headers
            call.cancel()  # the client hangs up while its request waits for a worker
        await wait_until(lambda: records, timeout=5)
        await sub.unsubscribe()
        assert (records[0].status, records[0].error_code) == (499, "client_closed")
        assert st.gateway.front.inbox.open_count == 0 and st.gateway.front.admission.waiting[model] == 0
