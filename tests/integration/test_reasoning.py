"""Reasoning replies through the whole stack: the real SmolLM2 (JAX engine, GGUF
file), a scheduler, a worker and two gateways on one bus. The stack's gateway serves
SmolLM2 as it is (its chat template has no think tags, so nothing is split); a
second one has TENSORBUS_REASONING_PARSER forcing the split on for it. A
`guided_regex` makes greedy SmolLM2 write a think block and an answer; the same
request to both gateways: the second's `reasoning_content` and `content` are the
first's text cut at the tags, whole and streamed (SSE), and the first's reply has no
`reasoning_content` at all."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import nats
import pytest
import pytest_asyncio

from services.fleet import Fleet
from services.gateway.frontend import Frontend
from services.gateway.models import ModelTable
from services.gateway.service import Gateway
from shared import catalog
from tests.support.stack import running_stack, table_resolver, wait_until
from tests.support.bus import connect as bus_connect

MODEL = catalog.SMOLLM2
CONTEXT = 256  # the shapes of test_smollm2.py's engine: their programs compile once
PREFILL = 128
REGEX = "<think>[a-z ]{1,20}</think>[A-Z][a-z]{1,10}"
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of "
                                     "France? Think first."}],
       "max_tokens": 48, "temperature": 0}


@pytest.fixture(scope="module")
def engine(smollm2_dir, jax_cache_dir):
    from engine.decoder import DecoderEngine

    engine = DecoderEngine(smollm2_dir, MODEL, slots=2, max_context=CONTEXT,
                           prefill_buckets=(PREFILL,), decode_windows=(), compile_ahead="all",
                           quant="gguf", quant_form="kernel")  # fmt: skip
    engine.warmup(progress=False)  # inside a request, compiling could outlast its deadline
    return engine


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gateways(nats_server, engine, smollm2_dir):
    """(plain, thinking): the HTTP URLs of the stack's gateway and of one that splits."""
    models = {MODEL: str(smollm2_dir)}
    async with running_stack(nats_server.url, models=models, max_context=CONTEXT,
                             decode_slots=2) as st:
        await st.add_worker(engine, "dec-reasoning", kind="decoder")
        config = st.config.with_(reasoning_parser=f"{MODEL}=think")
        nc = await bus_connect(nats_server.url, name="gateway-thinking")
        fleet = Fleet(expiry_s=config.worker_expiry_s)
        second = Gateway(nc, config, Frontend(nc, config, fleet,
                                              ModelTable(fleet, table_resolver(models))))
        ready = asyncio.Event()
        task = asyncio.create_task(second.run(ready))
        try:
            await asyncio.wait_for(ready.wait(), 10)
            await wait_until(lambda: second.front.fleet.ready(MODEL))
            yield st.http_url, f"http://127.0.0.1:{second.http_port}"
        finally:
            second.stop()
            await asyncio.gather(task, return_exceptions=True)
            await nc.close()


async def post(url: str, body: dict) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=120) as h:
        r = await h.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def deltas(url: str, body: dict) -> list[dict]:
    """Every streamed chunk's delta (SSE), up to `data: [DONE]`."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as h:
        async with h.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return out
                out += [c["delta"] for c in json.loads(line[len("data: "):])["choices"]]
    raise AssertionError("the stream ended without [DONE]")


async def test_the_split_is_the_plain_reply_cut_at_its_tags_whole_and_streamed(gateways):
    plain_url, thinking_url = gateways
    body = {**ASK, "guided_regex": REGEX}
    plain = (await post(plain_url, body))["choices"][0]
    assert plain["finish_reason"] == "stop"
    raw = plain["message"]["content"]
    assert re.fullmatch(REGEX, raw), raw
    assert "reasoning_content" not in plain["message"]  # off: the field is not there

    said = (await post(thinking_url, body))["choices"][0]
    assert said["finish_reason"] == "stop"
    thought, answer = said["message"]["reasoning_content"], said["message"]["content"]
    assert f"<think>{thought}</think>{answer}" == raw  # nothing lost, nothing added
    assert thought and answer and "<" not in thought + answer

    streamed = await deltas(thinking_url, body)
    assert streamed[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in streamed) == thought
    assert "".join(d.get("content", "") for d in streamed) == answer
    assert not any(set("<>/") & set(d.get("reasoning_content", "") + d.get("content", ""))
                   for d in streamed)  # no piece of a tag in any delta
    first = next(i for i, d in enumerate(streamed) if d.get("content"))
    assert not any(d.get("reasoning_content") for d in streamed[first:])  # reasoning first

    plain_deltas = await deltas(plain_url, body)
    assert not any("reasoning_content" in d for d in plain_deltas)
    assert "".join(d.get("content", "") for d in plain_deltas) == raw


async def test_a_reply_without_tags_is_content_whole_with_the_split_on(gateways):
    """SmolLM2 answering freely writes no think tags: with the split on, its reply is
    the same content and nothing else."""
    plain_url, thinking_url = gateways
    body = {**ASK, "max_tokens": 12}
    plain, said = [(await post(url, body))["choices"][0]["message"]
                   for url in (plain_url, thinking_url)]
    assert said == plain and "reasoning_content" not in said
    assert plain["content"].startswith("The capital of France is")
