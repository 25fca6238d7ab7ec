"""A request sent while no scheduler is subscribed (one between servers, or being
restarted) reaches the next one: "no responders" meant nobody received it, so the
gateway submits it again when a scheduler reports, for streams as for embeddings.
Real nats-server, a tiny GPT-2 decoder and MiniLM, answers checked against
transformers and sentence-transformers."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from tests.support.stack import running_stack, wait_until
from tests.support.tiny_models import hf_greedy, serve_tiny

CONTEXT = 128
NEW = 12
PROMPT = [5, 17, 300, 42, 7]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp("gap-gpt2")
    model, engine = serve_tiny("gpt2", path, "tiny-gap", CONTEXT)
    return engine, str(path), engine.tokenizer.decode(hf_greedy(model, PROMPT, NEW))


async def _stream(http: httpx.AsyncClient, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text = ""
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += "".join(c["text"] for c in chunk["choices"])
    return text


async def test_requests_sent_between_schedulers_are_answered_by_the_next(
        nats_server, decoder, minilm, sentence_transformer):  # fmt: skip
    engine, path, ref = decoder
    # A scheduler heard within 3 expiries is waited for: 5 s ones keep the restart
    # below well inside that on a loaded machine.
    async with running_stack(nats_server.url, models={engine.name: path}, max_context=CONTEXT,
                             decode_slots=2, worker_expiry_s=5.0) as st:  # fmt: skip
        await st.add_worker(engine, "dec-gap", kind="decoder")
        await st.add_worker(minilm, "enc-gap")
        links = st.gateway.front.schedulers
        async with httpx.AsyncClient(base_url=st.http_url, timeout=60) as http:
            assert await _stream(http, engine.name) == ref  # served: its load is reported
            await wait_until(lambda: links.heard_at > 0)
            await st.stop_scheduler()  # gone, as a scheduler between servers is
            stream = asyncio.create_task(_stream(http, engine.name))
            embed = asyncio.create_task(http.post("/v1/embeddings", json={
                "model": "all-MiniLM-L6-v2", "input": ["the next scheduler answers"]}))
            await wait_until(lambda: links.waiting == 2)  # both found nobody, and wait
            await st.start_scheduler()
            assert await stream == ref
            r = await embed
        assert r.status_code == 200, r.text
        got = np.asarray(r.json()["data"][0]["embedding"])
        want = sentence_transformer.encode(["the next scheduler answers"])[0]
        assert float(got @ want / np.linalg.norm(got) / np.linalg.norm(want)) > 0.9999
        assert st.gateway.front.retried >= 2
