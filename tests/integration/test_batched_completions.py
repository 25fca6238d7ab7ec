"""Completions with a list of prompts (OpenAI's and vLLM's batched completions), on a
real stack: one answer holding every prompt's choices in OpenAI's order (prompt index
x n + choice), usage summed, whole and streamed, over HTTP and NATS; a bad list is a
400 naming the problem before anything runs, and a list over the queue bound is the
429 one request gets. The reference is transformers' greedy continuation of each
prompt on the same tiny weights."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import openai
import pytest
import pytest_asyncio

from services.gateway.frontend import INLINE_TOKENIZE
from shared import subjects
from shared.api import MAX_PROMPTS
from tests.support.stack import running_stack
from tests.support.tiny_models import hf_greedy, serve_tiny

CONTEXT = 128
NEW = 8
N = 2
QUEUE = 16  # requests queued per ready worker (the count bound a list meets)
LONG = CONTEXT - NEW - 2  # tokens of each prompt of a list whose body is tokenized off the loop
TEXTS = ["the quick brown fox", "a", "jumps over the lazy dog, and then over the fence"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp("batched")
    model, engine = serve_tiny("gpt2", path, "tiny-batched", CONTEXT)
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    assert len({len(i) for i in ids}) == len(ids)  # of different lengths
    # References before any service runs (a torch call would stall the shared loop).
    texts = [engine.tokenizer.decode(hf_greedy(model, i, NEW)) for i in ids]
    long = [[(7 * k + 31 * i) % 300 + 1 for k in range(LONG)] for i in range(5)]
    return engine, str(path), ids, texts, long, [hf_greedy(model, i, NEW) for i in long]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, tiny):
    engine, path, *_ = tiny
    async with running_stack(nats_server.url, models={engine.name: path}, max_context=CONTEXT,
                             decode_slots=4, max_queue_per_worker=QUEUE) as st:
        await st.add_worker(engine, "dec-batched", kind="decoder")
        yield st


@pytest.fixture
def client(stack):
    return openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="none", max_retries=0)


def body(engine, prompt, **kw) -> dict:
    return {"model": engine.name, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
            "n": N, "ignore_eos": True, **kw}


def sdk(engine, prompt) -> dict:
    """`body` as the openai client takes it: vLLM's fields in `extra_body`."""
    kw = body(engine, prompt)
    extra = {"ignore_eos": kw.pop("ignore_eos")}
    return {**kw, "extra_body": extra}


def check_whole(reply: dict, ids: list[list[int]], texts: list[str]) -> None:
    choices = reply["choices"]
    assert [c["index"] for c in choices] == list(range(len(texts) * N))
    for c in choices:
        assert c["text"] == texts[c["index"] // N], c
        assert c["finish_reason"] == "length"
    assert reply["usage"] == {"prompt_tokens": sum(map(len, ids)),
                              "completion_tokens": len(texts) * N * NEW,
                              "total_tokens": sum(map(len, ids)) + len(texts) * N * NEW}


async def test_a_list_of_strings_and_of_token_id_lists_answer_each_prompt(stack, tiny, client):
    """Each choice is transformers' greedy continuation of its own prompt, at index
    prompt x n + choice; usage sums every prompt and every choice. Over HTTP (the
    unchanged openai client) and NATS, strings and token-id lists alike."""
    engine, _, ids, texts, *_ = tiny
    strings, tokens, over_bus = await asyncio.gather(
        client.completions.create(**sdk(engine, TEXTS)),
        client.completions.create(**sdk(engine, ids)),
        stack.client.request(subjects.COMPLETIONS, json.dumps(body(engine, ids)).encode(),
                             timeout=60))
    check_whole(strings.model_dump(exclude_unset=True), ids, texts)
    check_whole(tokens.model_dump(exclude_unset=True), ids, texts)
    check_whole(json.loads(over_bus.data), ids, texts)
    assert over_bus.headers["Tensorbus-Model-Version"]


async def test_streamed_lists_assemble_to_the_whole_answer(stack, tiny):
    """Chunks carry the request's indexes; each index's text joined is the whole
    answer's; one usage chunk sums them, then one [DONE] (HTTP and NATS)."""
    engine, _, ids, texts, *_ = tiny
    streamed = body(engine, TEXTS, stream=True, stream_options={"include_usage": True})
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json=streamed) as res:
            assert res.status_code == 200
            events = [line[6:] async for line in res.aiter_lines() if line.startswith("data: ")]
    inbox = stack.client.new_inbox()
    sub = await stack.client.subscribe(inbox)
    await stack.client.publish(subjects.COMPLETIONS, msgspec.json.encode(
        body(engine, ids, stream=True, stream_options={"include_usage": True})), reply=inbox)
    messages = []
    while not messages or messages[-1] != "[DONE]":
        messages.append((await sub.next_msg(timeout=60)).data.decode())
    await sub.unsubscribe()
    for got in (events, messages):
        assert got[-1] == "[DONE]" and got.count("[DONE]") == 1
        chunks = [json.loads(e) for e in got[:-1]]
        assert len({c["id"] for c in chunks}) == 1
        joined: dict[int, str] = {}
        for chunk in chunks[:-1]:
            for c in chunk["choices"]:
                joined[c["index"]] = joined.get(c["index"], "") + c["text"]
        assert joined == {i: texts[i // N] for i in range(len(texts) * N)}
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["prompt_tokens"] == sum(map(len, ids))
        assert chunks[-1]["usage"]["completion_tokens"] == len(texts) * N * NEW


async def test_a_large_list_body_is_admitted_and_answered_the_same(stack, tiny):
    """A body past the gateway's inline tokenizing size (its prompts tokenized off the
    event loop, admitted by a scheduler first) is answered as a small one."""
    engine, _, _, _, long, want = tiny
    payload = {**body(engine, long), "n": 1}
    assert len(json.dumps(payload)) > INLINE_TOKENIZE
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        res = await http.post("/v1/completions", json=payload)
    assert res.status_code == 200, res.text
    got = res.json()
    assert [c["index"] for c in got["choices"]] == list(range(len(long)))
    assert [c["text"] for c in got["choices"]] == [engine.tokenizer.decode(w) for w in want]
    assert got["usage"]["prompt_tokens"] == LONG * len(long)


BAD = [
    ([], "empty list"),
    (["a", 7], "mixes strings and token ids"),
    (["a", ""], "'prompt[1]' is empty"),
    (["x"] * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS}"),
    ([[5, 6], [7, 10**6]], "'prompt[1]': token id 1000000 is outside the vocabulary"),
    (["a", "word " * CONTEXT], "'prompt[1]': the prompt has"),
]


async def test_bad_lists_are_400s_naming_the_problem_and_run_nothing(stack, tiny):
    """Every case a 400 naming what is wrong, sent beside a good request, which is
    answered; only the good one reached a worker (every prompt is checked first)."""
    engine, _, ids, texts, *_ = tiny
    dispatched = stack.scheduler.dispatched
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        *bad, good = await asyncio.gather(
            *(http.post("/v1/completions", json=body(engine, p)) for p, _ in BAD),
            http.post("/v1/completions", json=body(engine, TEXTS[0], n=1)))
        for (prompt, needle), res in zip(BAD, bad):
            assert res.status_code == 400, (prompt, res.text)
            assert needle in res.json()["error"]["message"], res.text
        assert good.status_code == 200, good.text
        assert good.json()["choices"][0]["text"] == texts[0]
        assert stack.scheduler.dispatched == dispatched + 1
        # max_tokens over what one prompt's context leaves: that prompt named
        mid = "word " * 12
        left = CONTEXT - len(engine.tokenizer.encode(mid))
        over = await http.post("/v1/completions", json=body(engine, ["a", mid],
                                                            max_tokens=left + 1))
        assert over.status_code == 400 and "'prompt[1]': 'max_tokens'" in over.text


async def test_a_list_over_the_queue_bound_is_the_429_one_request_gets(stack, tiny):
    """A list counts as one request per prompt: more prompts than the model may queue
    is the 429 that a full queue gives one request, naming the list."""
    engine, *_ = tiny
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        res = await http.post("/v1/completions", json=body(engine, ["a"] * (QUEUE + 1)))
        assert res.status_code == 429 and "Retry-After" in res.headers
        err = res.json()["error"]
        assert err["code"] == "overloaded" and "is at capacity" in err["message"]
        assert f"this list of {QUEUE + 1} prompts counts as {QUEUE + 1}" in err["message"]
        half = QUEUE // 2  # room left for what earlier tests' reports may still count
        fits = await http.post("/v1/completions", json=body(engine, ["a"] * half, n=1))
        assert fits.status_code == 200 and len(fits.json()["choices"]) == half
