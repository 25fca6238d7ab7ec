"""Property-based fuzzing of the NATS API with hypothesis: random JSON and msgpack
structures, valid bodies with fields replaced, added or dropped, and valid bodies with
their bytes cut, spliced and flipped. Whatever arrives, the gateway answers: a success,
or a refusal per the error contract (never a 500, never silence), and it keeps serving.

Examples are drawn with a fixed seed (`derandomize`) so every run sends the same ones.
Hypothesis runs on a thread; the services run on the test's event loop meanwhile.
"""

from __future__ import annotations

import asyncio

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import subjects
from tests.reliability.conftest import DECODER, ENCODER
from tests.reliability.replies import Reply, ask, assert_refused, completion_works, embedding_works

E, C, CH = subjects.EMBEDDINGS, subjects.COMPLETIONS, subjects.CHAT_COMPLETIONS
BASES = {
    E: {"model": ENCODER, "input": ["hello world", "tensor bus"]},
    C: {"model": DECODER, "prompt": "the quick", "max_tokens": 3, "temperature": 0.5, "seed": 1},
    CH: {"model": DECODER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
}
FIELDS = ["model", "input", "prompt", "messages", "max_tokens", "max_completion_tokens",
          "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
          "encoding_format", "dimensions", "user", "ignore_eos", "echo", "presence_penalty"]
MODELS = st.sampled_from([ENCODER, DECODER, f"{DECODER}@local", f"{ENCODER}@9", "", "nope", "a@b@c"])
REFUSALS = {400, 404, 413, 503}

FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


def scalars(msgpack: bool):
    s = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1)
         | st.floats(allow_nan=msgpack, allow_infinity=msgpack) | st.text(max_size=30))
    if msgpack:
        s = s | st.binary(max_size=20)
    return s


def values(msgpack: bool):
    return st.recursive(scalars(msgpack), lambda inner: st.lists(inner, max_size=5)
                        | st.dictionaries(st.text(max_size=12), inner, max_size=5), max_leaves=16)


@st.composite
def mutated(draw, subject: str, msgpack: bool):
    """A valid body with a few fields replaced, added or dropped."""
    body = dict(BASES[subject])
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["replace", "add", "drop", "model"]))
        if op == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif op == "model":
            body["model"] = draw(MODELS)
        else:
            key = draw(st.sampled_from(sorted(body))) if op == "replace" and body else draw(
                st.sampled_from(FIELDS))
            body[key] = draw(values(msgpack))
    return body


@st.composite
def spliced(draw, subject: str, msgpack: bool) -> bytes:
    """The bytes of a valid body, cut, extended or with bytes flipped."""
    raw = bytearray((msgspec.msgpack.encode if msgpack else msgspec.json.encode)(BASES[subject]))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(raw)))
        op = draw(st.sampled_from(["cut", "insert", "flip"]))
        if op == "cut":
            del raw[i:i + draw(st.integers(1, 8))]
        elif op == "insert":
            raw[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif raw:
            raw[min(i, len(raw) - 1)] ^= draw(st.integers(1, 255))
    return bytes(raw)


def bodies(subject: str, msgpack: bool):
    enc = msgspec.msgpack.encode if msgpack else msgspec.json.encode
    return st.one_of(values(msgpack).map(enc), mutated(subject, msgpack).map(enc),
                     spliced(subject, msgpack))


def judge(reply: Reply) -> None:
    if reply.code == 200:
        assert isinstance(reply.body, dict) and ("data" in reply.body or "choices" in reply.body)
        return
    assert reply.code in REFUSALS, (reply.code, reply.raw[:300])
    assert_refused(reply, reply.code)


async def fuzz(served, msgpack: bool) -> None:
    loop = asyncio.get_running_loop()

    def send(subject: str, data: bytes) -> Reply:
        return asyncio.run_coroutine_threadsafe(
            ask(served.client, subject, data, msgpack=msgpack), loop).result(30)

    @FUZZ
    @given(st.sampled_from([E, C, CH]).flatmap(
        lambda s: st.tuples(st.just(s), bodies(s, msgpack))))
    def prop(case):
        subject, data = case
        judge(send(subject, data))

    await asyncio.to_thread(prop)
    await embedding_works(served.client, ENCODER)
    await completion_works(served.client, DECODER)
    assert all(not t.done() for t in served._tasks.values()), "a service stopped"


async def test_fuzzed_json_bodies_get_an_answer_per_the_contract(served):
    await fuzz(served, msgpack=False)


async def test_fuzzed_msgpack_bodies_get_an_answer_per_the_contract(served):
    await fuzz(served, msgpack=True)
