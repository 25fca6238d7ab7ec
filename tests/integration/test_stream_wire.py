"""Generated tokens on the wire: one message per gateway per decode step, chunks
coalesced for a reader that falls behind, late results dropped.

Real nats-server, a tiny real GPT-2 decoder on the JAX engine, transformers' greedy
`generate` on the same weights as the reference. A spy subscribed to the gateway's
group subject sees what the worker sends it."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest
import pytest_asyncio

from services.gateway.http import build_app
from shared import subjects
from shared.errors import HEADER_CODE
from shared.messages import (
    GenChunk,
    GenDone,
    GenerateWork,
    Results,
    Sampling,
    Timing,
    encode,
    result_decoder,
    results_decoder,
)
from tests.support.stack import request_that_expires, running_stack, wait_until
from tests.support.tiny_models import hf_greedy, serve_tiny

CONTEXT = 1024
PROMPTS = [[5, 17, 300, 42], list(range(40, 49)), list(range(100, 117)), list(range(7, 307, 10))]
NEW = 24
VERSION_HEADER = "Tensorbus-Model-Version"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp("wire-lm")
    model, engine = serve_tiny("gpt2", path, "tiny-wire", CONTEXT)
    # References before any service runs (a torch call in a test would stall the loop).
    greedy = {tuple(p): hf_greedy(model, p, NEW) for p in PROMPTS}
    refs = {p: engine.tokenizer.decode(_cut(ids, engine)) for p, ids in greedy.items()}
    refs["ignore_eos"] = {p: engine.tokenizer.decode(ids) for p, ids in greedy.items()}
    return refs, engine, str(path)


def _cut(ids: list[int], engine) -> list[int]:
    eos = set(engine.eos_token_ids)
    return next((ids[:i] for i, t in enumerate(ids) if t in eos), ids)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, tiny):
    _, engine, path = tiny
    async with running_stack(nats_server.url, models={engine.name: path}, max_context=CONTEXT,
                             decode_slots=4) as st:
        await st.add_worker(engine, "dec-wire", kind="decoder")
        yield st


class Spy:
    """Every Results message the gateway's inbox receives, decoded."""

    def __init__(self) -> None:
        self.messages: list[Results] = []

    async def on_msg(self, msg) -> None:
        self.messages.append(results_decoder.decode(msg.data))


@pytest_asyncio.fixture(loop_scope="session")
async def spy(stack):
    s = Spy()
    sub = await stack.client.subscribe(stack.gateway.front.inbox.group, cb=s.on_msg)
    await stack.client.flush()
    yield s
    await sub.unsubscribe()


async def stream(nc, payload: dict, headers: dict | None = None, timeout: float = 30.0):
    """(chunk bodies, their headers) up to [DONE], which is not included."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subjects.COMPLETIONS, msgspec.json.encode(payload), reply=inbox,
                     headers=headers)
    out = []
    while True:
        msg = await sub.next_msg(timeout=timeout)
        if msg.data == b"[DONE]":
            break
        out.append((msgspec.json.decode(msg.data), msg.headers or {}))
    await sub.unsubscribe()
    return out


async def whole(nc, payload: dict) -> dict:
    msg = await nc.request(subjects.COMPLETIONS, msgspec.json.encode(payload), timeout=30)
    assert (msg.headers or {}).get(HEADER_CODE) is None, msg.data
    return msgspec.json.decode(msg.data)


def body(engine, prompt, **kw) -> dict:
    return {"model": engine.name, "prompt": prompt, "max_tokens": NEW, "temperature": 0, **kw}


# --- (a) several streams through one gateway --------------------------------------


async def test_concurrent_streams_share_one_message_per_step_and_arrive_whole(stack, tiny, spy):
    refs, engine, _ = tiny
    wholes = await asyncio.gather(*(whole(stack.client, body(engine, p)) for p in PROMPTS))
    streams = await asyncio.gather(*(stream(stack.client, body(engine, p, stream=True))
                                     for p in PROMPTS))
    for p, w, s in zip(PROMPTS, wholes, streams):
        text = "".join(c["choices"][0]["text"] for c, _ in s)
        assert text == w["choices"][0]["text"] == refs[tuple(p)]
        assert s[-1][0]["choices"][0]["finish_reason"] == w["choices"][0]["finish_reason"]
        assert all(h.get(VERSION_HEADER) == "local" for _, h in s)  # every chunk names it
        assert all(c["object"] == "text_completion" for c, _ in s)
    # The worker sent each step's chunks of the four streams together: Results that
    # carry several requests' chunks, never one request's chunks twice.
    mixed = [m for m in spy.messages if len({i.request_id for i in m.items}) > 1]
    assert mixed
    for m in spy.messages:
        seen = [(i.request_id, i.index) for i in m.items if isinstance(i, GenChunk)]
        assert len(seen) == len(set(seen))
    assert stack.gateway.front.inbox.open_count == 0


# --- (b) a slow HTTP reader -------------------------------------------------------


class SlowReader:
    """The ASGI side of an HTTP client that stops reading after the first event: its
    `send` (what waits while a socket's buffers are full) blocks until released."""

    def __init__(self, path: str, payload: dict) -> None:
        self.body = json.dumps(payload).encode()
        self.writes: list[bytes] = []
        self.status = 0
        self.release = asyncio.Event()
        self.first = asyncio.Event()
        self._gone = asyncio.Event()
        self.scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": b"", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
            "headers": [(b"content-type", b"application/json")]}

    async def receive(self) -> dict:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._gone.wait()  # never disconnects
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message.get("body"):
            if self.writes:
                await self.release.wait()
            self.writes.append(message["body"])
            self.first.set()


def events(write: bytes) -> list[dict]:
    parts = [p for p in write.split(b"\n\n") if p]
    assert all(p.startswith(b"data: ") for p in parts)
    return [json.loads(p[6:]) for p in parts if p != b"data: [DONE]"]


@pytest.mark.parametrize("chat", [False, True])
async def test_a_slow_http_reader_gets_coalesced_openai_chunks(stack, tiny, spy, chat):
    refs, engine, _ = tiny
    worker = stack.workers["dec-wire"]
    prompt = PROMPTS[1]
    opts = {"include_usage": True, "continuous_usage_stats": True}
    if chat:
        payload = {"model": engine.name, "messages": [{"role": "user", "content": "the"}],
                   "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "n": 2,
                   "stream": True, "stream_options": opts}
        ref = await stack.client.request(subjects.CHAT_COMPLETIONS, msgspec.json.encode(
            {**payload, "stream": False, "stream_options": None}), timeout=30)
        expected = [c["message"]["content"] for c in msgspec.json.decode(ref.data)["choices"]]
    else:
        payload = body(engine, prompt, ignore_eos=True, stream=True, stream_options=opts)
        expected = [refs["ignore_eos"][tuple(prompt)]]
    app = build_app(stack.gateway.front, stack.gateway.routes, lambda: True)
    reader = SlowReader("/v1/chat/completions" if chat else "/v1/completions", payload)
    before = len(spy.messages)
    served = asyncio.create_task(app(reader.scope, reader.receive, reader.send))
    await asyncio.wait_for(reader.first.wait(), 30)
    # The reader is stuck; the worker finishes the request meanwhile, and its last
    # message reaches the request's queue in the gateway.
    await wait_until(lambda: any(isinstance(i, GenDone) for m in spy.messages[before:] for i in m.items))
    await stack.gateway.nc.flush()  # the gateway's connection has read it too ...
    await wait_until(lambda: stack.gateway.front.inbox.pending == 0)  # ... and queued it
    assert worker.runner.in_flight == 0
    reader.release.set()
    await asyncio.wait_for(served, 30)
    assert reader.status == 200

    chunks = [e for w in reader.writes for e in events(w)]
    assert reader.writes[-1].endswith(b"data: [DONE]\n\n")
    kind = "chat.completion.chunk" if chat else "text_completion"
    assert all(c["object"] == kind and set(c) == {"id", "object", "created", "model", "choices",
                                                  "usage"} for c in chunks)
    content = [c for c in chunks if c["choices"] and c["usage"] is not None]
    if chat:  # each choice's first chunk gives the role, as OpenAI's do
        roles = [c for c in chunks if c["choices"] and c["usage"] is None]
        assert [c["choices"][0]["delta"] for c in roles] == [{"role": "assistant", "content": ""}] * 2
    texts = []
    for i, exp in enumerate(expected):
        mine = [c for c in content if c["choices"][0]["index"] == i]
        assert all(len(c["choices"]) == 1 for c in mine)
        if chat:
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in mine)
        else:
            text = "".join(c["choices"][0]["text"] for c in mine)
        texts.append(text)
        assert mine[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in mine[:-1])
    assert texts == expected
    # Usage so far on every chunk, never down; the last content chunk counts all
    # tokens of every choice, as the final usage chunk does.
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert counts == sorted(counts) and counts[-1] == NEW * len(expected)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == NEW * len(expected)
    # Coalesced: fewer events than tokens, and the catch-up arrived as one write
    # holding a chunk per choice that covers many tokens, plus the usage chunk.
    assert len(content) < NEW * len(expected)
    last = events(reader.writes[-2])
    assert len(last) == len(expected) + 1 and last[-1]["choices"] == []
    assert max(b["usage"]["completion_tokens"] - a["usage"]["completion_tokens"]
               for a, b in zip(content, content[1:])) >= 2


# --- (c) late results -------------------------------------------------------------


async def test_late_results_of_finished_and_cancelled_requests_are_dropped(stack, tiny, spy):
    refs, engine, _ = tiny
    worker = stack.workers["dec-wire"]
    finished = await whole(stack.client, body(engine, PROMPTS[2]))
    done_id = next(i.request_id for m in spy.messages for i in m.items if isinstance(i, GenDone))
    long = asyncio.create_task(stream(stack.client, body(engine, PROMPTS[0], stream=True)))
    # A request that outlives its deadline is cancelled while the other one runs.
    cancelled = await request_that_expires(
        stack.client, subjects.COMPLETIONS,
        body(engine, PROMPTS[3], max_tokens=CONTEXT - 40, ignore_eos=True))
    assert cancelled.headers[HEADER_CODE] == "504"
    # Late answers for a finished request, forged as a worker would send them.
    late = Results([GenChunk(done_id, 0, "LATE", 1, None, 0, "local"),
                    GenDone(done_id, "dec-wire", engine.name, "local", 1, 1, Timing())])
    await stack.client.publish(stack.gateway.front.inbox.group, encode(late))
    chunks = await long
    assert "".join(c["choices"][0]["text"] for c, _ in chunks) == refs[tuple(PROMPTS[0])]
    assert finished["choices"][0]["text"] == refs[tuple(PROMPTS[2])]
    await wait_until(lambda: worker.runner.in_flight == 0 and not worker.runner.requests, timeout=10)
    assert stack.gateway.front.inbox.open_count == 0
    # The next request is served as usual.
    again = await whole(stack.client, body(engine, PROMPTS[2]))
    assert again["choices"][0]["text"] == refs[tuple(PROMPTS[2])]


# --- (d) a resumed stream ---------------------------------------------------------


async def _direct(nc, engine, prompt, skip: int) -> list[GenChunk]:
    """A greedy stream submitted to the scheduler as the gateway would resume it
    (`skip`: tokens already delivered), its answers on its own reply subject."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    work = GenerateWork(f"resume-{skip}-{len(prompt)}", engine.name, "", prompt, NEW,
                        Sampling(temperature=0.0), [], 1, True, time.time() + 30, inbox,
                        ignore_eos=True, skip=skip)
    await nc.publish(subjects.SCHED_SUBMIT, encode(work), reply=inbox)
    chunks = []
    while True:
        item = result_decoder.decode((await sub.next_msg(timeout=30)).data)
        if isinstance(item, GenDone):
            break
        if isinstance(item, GenChunk):
            chunks.append(item)
    await sub.unsubscribe()
    return chunks


async def test_a_resumed_stream_goes_on_where_the_delivered_tokens_stopped(stack, tiny):
    refs, engine, _ = tiny
    prompt = PROMPTS[1]
    whole_run = await _direct(stack.client, engine, prompt, 0)
    assert "".join(c.text for c in whole_run) == refs["ignore_eos"][tuple(prompt)]
    assert [c.seq for c in whole_run] == list(range(len(whole_run)))
    # Resumed after j chunks were delivered: the rest of the text, exactly, numbered from 0.
    for j in (1, len(whole_run) // 2):
        delivered = sum(c.tokens for c in whole_run[:j])
        rest = await _direct(stack.client, engine, prompt, delivered)
        assert "".join(c.text for c in rest) == "".join(c.text for c in whole_run[j:])
        assert sum(c.tokens for c in rest) == NEW - delivered
        assert [c.seq for c in rest] == list(range(len(rest)))
