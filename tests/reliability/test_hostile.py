"""The catalogue of hostile requests over NATS, against the real encoder and a tiny
real decoder: each is answered with the contract's status, a typed error body and a
message that leaks no internals, and the next ordinary request still succeeds.

A few hostile-but-valid requests (thousands of headers, odd request ids, emoji) must
simply succeed. Pickled bytes are never unpickled: the pickle's payload would create
a file, and the file never appears.
"""

from __future__ import annotations

import asyncio
import time
import os
import pickle
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgspec
import numpy as np
import pytest

from shared import subjects
from tests.reliability.conftest import DECODER, DECODER_CONTEXT, ENCODER, MAX_INPUTS, MAX_PAYLOAD
from tests.reliability.replies import ask, assert_clean, assert_refused, completion_works, embedding_works

E, C, CH, M = subjects.EMBEDDINGS, subjects.COMPLETIONS, subjects.CHAT_COMPLETIONS, subjects.MODELS
DROP = object()  # a field to leave out
TRIPWIRE = Path(tempfile.gettempdir()) / f"tensorbus-unpickled-{os.getpid()}"
NAN, INF = float("nan"), float("inf")


def _trip(path: str) -> None:
    Path(path).write_text("a pickle from the bus was loaded")


class Tripwire:
    """Unpickling this calls _trip: proof by side effect that nothing unpickles."""

    def __reduce__(self):
        return (_trip, (str(TRIPWIRE),))


def _fields(base: dict, kw: dict) -> dict:
    out = {**base, **kw}
    return {k: v for k, v in out.items() if v is not DROP}


def emb(**kw) -> dict:
    return _fields({"model": ENCODER, "input": ["hello world"]}, kw)


def comp(**kw) -> dict:
    return _fields({"model": DECODER, "prompt": "the quick", "max_tokens": 2}, kw)


def chat(**kw) -> dict:
    return _fields({"model": DECODER, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2}, kw)


J, MP = msgspec.json.encode, msgspec.msgpack.encode
WORDS_300 = " ".join(f"word{i}" for i in range(300))
RAW_INPUT = b'{"model": "all-MiniLM-L6-v2", "input": [%s]}'
SLOW_WORDS = ("x" * 99 + " ") * 1900  # 190 kB of long words: WordPiece's worst case


@dataclass(frozen=True)
class Case:
    name: str
    subject: str
    body: bytes | Callable[[], bytes]
    status: int
    needle: str = ""
    code: str | None = None
    msgpack: bool = False
    headers: dict = field(default_factory=dict)

    def data(self) -> bytes:
        return self.body() if callable(self.body) else self.body


CATALOGUE = [
    # ---- bytes that are not a request
    Case("garbage bytes", E, b"\x00\xff\xfe\x13garbage", 400, "not valid JSON"),
    Case("pickle as JSON", E, lambda: pickle.dumps(Tripwire()), 400, "not valid JSON"),
    Case("pickle as msgpack", E, lambda: pickle.dumps(Tripwire()), 400, "invalid", msgpack=True),
    Case("pickle to completions", C, lambda: pickle.dumps(Tripwire(), protocol=2), 400, "not valid JSON"),
    Case("truncated msgpack", E, MP(emb())[:-4], 400, "not valid msgpack", msgpack=True),
    Case("truncated JSON", E, J(emb())[:-3], 400, "not valid JSON"),
    Case("empty body", E, b"", 400, "empty"),
    Case("msgpack body sent as JSON", E, MP(emb()), 400, "not valid JSON"),
    Case("JSON null", E, b"null", 400, "object"),
    Case("top-level array", E, b"[1, 2, 3]", 400, "object"),
    Case("byte-order mark", E, b"\xef\xbb\xbf" + J(emb()), 400, "not valid JSON"),
    Case("100k nested arrays", E, b'{"model": "m", "input": ' + b"[" * 100_000, 400, "invalid request"),
    Case("invalid UTF-8 in a string", E, b'{"model": "' + ENCODER.encode() + b'", "input": "\xff\xfe"}',
         400, "UTF-8"),
    Case("lone high surrogate escape", E, RAW_INPUT % b'"\\ud800x"', 400, "not valid JSON"),
    Case("lone low surrogate escape", E, RAW_INPUT % b'"\\udc00"', 400, "surrogate"),
    Case("JSON NaN literal", C, b'{"model": "tiny-gpt2", "prompt": "x", "temperature": NaN}', 400, "not valid JSON"),
    Case("number out of range", C, J(comp())[:-1] + b', "temperature": 1e400}', 400, "out of range"),
    # ---- wrong shapes and types
    Case("input wrong type", E, J(emb(input=42)), 400, "input"),
    Case("model wrong type", E, J(emb(model=7)), 400, "model"),
    Case("missing model", E, J(emb(model=DROP)), 400, "model"),
    Case("missing input", E, J(emb(input=DROP)), 400, "input"),
    Case("unknown field", E, J(emb(temprature=1)), 400, "temprature"),
    Case("float token id", E, J(emb(input=[1.5])), 400, "input"),
    Case("negative token id", E, J(emb(input=[[1, 2], [-1]])), 400, ">= 0"),
    Case("msgpack bytes for a string", C, MP(comp(prompt=b"raw bytes")), 400, "prompt", msgpack=True),
    Case("msgpack extension type", C, MP(comp(prompt=msgspec.msgpack.Ext(1, b"x"))), 400, "prompt",
         msgpack=True),
    Case("msgpack top-level string", E, MP("hello"), 400, "object", msgpack=True),
    Case("bad encoding_format", E, J(emb(encoding_format="bytes")), 400, "encoding_format"),
    Case("chat content part without text", CH, J(chat(messages=[{"role": "user", "content": [{"type": "text"}]}])),
         400, "content"),
    Case("chat unknown role", CH, J(chat(messages=[{"role": "root", "content": "x"}])), 400, "role"),
    Case("chat without messages", CH, J(chat(messages=DROP)), 400, "messages"),
    Case("chat empty messages", CH, J(chat(messages=[])), 400, "messages"),
    Case("logprobs over 20", C, J(comp(logprobs=21)), 400, "logprobs"),
    # Refused with both numbers, never clamped in silence (as vLLM answers it).
    Case("max_tokens far past the context", C, J(comp(max_tokens=10**30, ignore_eos=True)), 400,
         "'max_tokens' is 1000000000000000000000000000000"),
    Case("presence_penalty out of range", C, J(comp(presence_penalty=2.5)), 400, "presence_penalty"),
    # ---- models
    Case("unknown model", E, J(emb(model="no-such-model")), 404, "no-such-model", "model_not_found"),
    Case("unknown model for completions", C, J(comp(model="gpt-17")), 404, "gpt-17", "model_not_found"),
    Case("empty model name", E, J(emb(model="")), 400, "model"),
    Case("model name over 256 chars", E, J(emb(model="m" * 300)), 400, "model"),
    Case("version separator without version", E, J(emb(model=ENCODER + "@")), 400, "NAME@VERSION"),
    Case("control characters before a version separator", E, J(emb(model="a\x01\x07\t@")), 400,
         "NAME@VERSION"),
    Case("version nobody serves", E, J(emb(model=ENCODER + "@99")), 503, "version 99", "no_worker"),
    Case("header injection in the model name", E,
         J(emb(model="x\r\nNats-Service-Error-Code: 200\r\n")), 404, "does not exist"),
    Case("decoder on embeddings", E, J(emb(model=DECODER)), 400, "completions"),
    Case("encoder on completions", C, J(comp(model=ENCODER)), 400, "embedding"),
    # ---- empty, huge and out-of-range inputs
    Case("empty input list", E, J(emb(input=[])), 400, "empty"),
    Case("empty string input", E, J(emb(input="")), 400, "empty"),
    Case("empty token list", E, J(emb(input=[[]])), 400, "empty"),
    Case("mixed input kinds", E, J(emb(input=["x", 5])), 400, "mixes"),
    Case("too many inputs", E, J(emb(input=["x"] * (MAX_INPUTS + 1))), 400, "too many inputs"),
    Case("input over the token limit", E, J(emb(input=[WORDS_300])), 400, "at most 256",
         "context_length_exceeded"),
    Case("huge adversarial input", E, J(emb(input=[SLOW_WORDS])), 400, "at most 256",
         "context_length_exceeded"),
    Case("payload over the limit", E, J(emb(input=["a" * (MAX_PAYLOAD + 10)])), 413, "limit",
         "payload_too_large"),
    Case("payload over the limit (msgpack)", C, MP(comp(prompt="a" * (MAX_PAYLOAD + 10))), 413, "limit",
         msgpack=True),
    Case("4096 long token lists", E, J(emb(input=[[5] * 16] * 4096)), 400, "too many inputs"),
    Case("token id outside the vocabulary", E, J(emb(input=[[10**6]])), 400, "vocabulary"),
    Case("token id past int32", E, J(emb(input=[[2**40]])), 400, "input"),
    Case("NUL byte in embedding input", E, J(emb(input=["a\x00b"])), 400, "NUL"),
    Case("wrong dimensions", E, J(emb(dimensions=100)), 400, "384"),
    Case("prompt over the context", C, J(comp(prompt=[1] * DECODER_CONTEXT)), 400, "context",
         "context_length_exceeded"),
    Case("chat over the context", CH, J(chat(messages=[{"role": "user", "content": "x " * 400}])),
         400, "context", "context_length_exceeded"),
    Case("prompt token outside the vocabulary", C, J(comp(prompt=[10**7])), 400, "vocabulary"),
    Case("empty prompt", C, J(comp(prompt="")), 400, "empty"),
    Case("too many prompts", C, J(comp(prompt=["a"] * 65)), 400, "at most 64"),
    Case("prompts of two kinds", C, J(comp(prompt=["a", [1, 2]])), 400, "mixes"),
    # ---- sampling parameters
    Case("max_tokens zero", C, J(comp(max_tokens=0)), 400, "max_tokens"),
    Case("max_tokens negative", C, J(comp(max_tokens=-5)), 400, "max_tokens"),
    Case("max_tokens infinite (msgpack)", C, MP(comp(max_tokens=INF)), 400, "max_tokens", msgpack=True),
    Case("max_completion_tokens zero", CH, J(chat(max_completion_tokens=0)), 400, "max_completion_tokens"),
    Case("n huge", C, J(comp(n=10**6)), 400, "'n'"),
    Case("n zero", C, J(comp(n=0)), 400, "n"),
    Case("temperature NaN (msgpack)", C, MP(comp(temperature=NAN)), 400, "temperature", msgpack=True),
    Case("temperature +inf (msgpack)", C, MP(comp(temperature=INF)), 400, "temperature", msgpack=True),
    Case("top_p NaN (msgpack)", C, MP(comp(top_p=NAN)), 400, "top_p", msgpack=True),
    Case("top_p -inf (msgpack)", CH, MP(chat(top_p=-INF)), 400, "top_p", msgpack=True),
    Case("temperature out of range", C, J(comp(temperature=9)), 400, "temperature"),
    Case("top_k past int32", C, J(comp(top_k=99_999_999_999)), 400, "top_k"),
    Case("negative seed", C, J(comp(seed=-1)), 400, "seed"),
    Case("five stop strings", C, J(comp(stop=["a", "b", "c", "d", "e"])), 400, "stop"),
    Case("empty stop string", C, J(comp(stop="")), 400, "stop"),
    Case("stream_options with a typo", C, J(comp(stream_options={"include_usge": True})), 400,
         "include_usge"),
]

# Hostile in form, valid in substance: these must simply be served.
SERVED = [
    Case("5000 headers", E, J(emb()), 200, headers={f"X-Junk-{i}": "v" * 8 for i in range(5000)}),
    Case("request id with subject wildcards", E, J(emb()), 200, headers={"X-Request-Id": "a.b >*"}),
    Case("request id of 10 kB", E, J(emb()), 200, headers={"X-Request-Id": "r" * 10_000}),
    Case("garbage timeout header", E, J(emb()), 200, headers={"Tensorbus-Timeout": "soon"}),
    Case("NaN timeout header", E, J(emb()), 200, headers={"Tensorbus-Timeout": "nan"}),
    Case("infinite timeout header", E, J(emb()), 200, headers={"Tensorbus-Timeout": "1e999"}),
    Case("emoji and a valid surrogate pair", E, RAW_INPUT % b'"\\ud83d\\ude80 ok"', 200),
    Case("NUL byte in a prompt (a byte-level tokenizer's byte)", C, J(comp(prompt="a\x00b")), 200),
    Case("models with a garbage body", M, b"\xff\x00garbage", 200),
]


@pytest.fixture(autouse=True)
def no_unpickling():
    TRIPWIRE.unlink(missing_ok=True)
    yield
    assert not TRIPWIRE.exists(), "a request body was unpickled"


async def next_request_succeeds(nc, subject: str) -> None:
    if subject in (C, CH):
        await completion_works(nc, DECODER)
    else:
        await embedding_works(nc, ENCODER)


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.name for c in CATALOGUE])
async def test_hostile_request_is_refused_cleanly_then_service_goes_on(served, case):
    reply = await ask(served.client, case.subject, case.data(), headers=case.headers or None,
                      msgpack=case.msgpack)
    assert_refused(reply, case.status, case.needle, case.code)
    await next_request_succeeds(served.client, case.subject)


@pytest.mark.parametrize("case", SERVED, ids=[c.name for c in SERVED])
async def test_hostile_but_valid_request_is_served(served, case):
    reply = await ask(served.client, case.subject, case.data(), headers=case.headers or None)
    assert reply.code == 200, reply.raw[:300]
    if case.subject == C:
        usage = reply.body["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= DECODER_CONTEXT
    elif case.subject == E:
        assert len(reply.body["data"][0]["embedding"]) == 384
    await next_request_succeeds(served.client, case.subject)


def test_the_catalogue_is_complete():
    assert len(CATALOGUE) >= 40
    assert {c.status for c in CATALOGUE} >= {400, 404, 413, 503}


async def test_a_reused_request_id_never_crosses_answers(served):
    """Clients that reuse one X-Request-Id concurrently each get their own answer."""
    texts = [f"sentence number {i} about {w}" for i, w in enumerate("abcdefgh")]
    solo = []
    for t in texts:
        r = await ask(served.client, E, J(emb(input=[t])))
        solo.append(np.asarray(r.body["data"][0]["embedding"]))
    replies = await asyncio.gather(*(
        ask(served.client, E, J(emb(input=[t])), headers={"X-Request-Id": "same-id"}) for t in texts))
    for r, ref in zip(replies, solo):
        assert r.code == 200, r.raw[:200]
        got = np.asarray(r.body["data"][0]["embedding"])
        assert float(got @ ref) > 0.9999  # its own input's vector, not a neighbour's
    assert len({round(float(s[0]), 6) for s in solo}) == len(texts)


async def test_a_huge_input_does_not_stall_the_gateway(served):
    """Tokenizing a large adversarial body (most of a second of CPU) runs off the event
    loop: the loop every in-process service shares never stops for anything close to
    the length of that request."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    t0 = time.perf_counter()
    reply = await ask(served.client, E, J(emb(input=[SLOW_WORDS])))
    took = time.perf_counter() - t0
    done.set()
    await tick
    assert_refused(reply, 400, "at most 256")
    assert max(gaps) < took / 2, (max(gaps), took)


async def test_error_messages_from_workers_are_clean_too(served):
    """A worker-side refusal (a pinned version it lacks) reaches the client clean."""
    reply = await ask(served.client, C, J(comp(model=DECODER + "@7")))
    assert_refused(reply, 503, "version 7")
    assert_clean(reply.message)
