"""Structured outputs through the whole stack (a real nats-server, gateway, scheduler,
worker and the JAX engine on tiny random weights): `response_format` json_object and
json_schema over HTTP (the unchanged `openai` client) and over NATS, whole and
streamed; every answer that ends with "stop" parses and validates against its schema
(`jsonschema`); a schema feature the grammar library does not implement is a 400
naming it; and an unconstrained request beside constrained ones still gets
transformers' greedy text."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
import pytest_asyncio

from shared import subjects
from tests.integration.test_generation import expected, request, stream
from tests.support.stack import running_stack
from tests.support.tiny_models import serve_tiny

CONTEXT = 128
PROMPT = [5, 17, 120, 42, 9, 81]
CHAT = [{"role": "user", "content": "the quick brown fox"}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
    "required": ["name", "age", "pets"], "additionalProperties": False}


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                   "strict": True}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp("structured")
    model, engine = serve_tiny("llama", path, "tiny-structured", CONTEXT, compile_ahead="all")
    return model, engine, str(path), expected(model, engine, PROMPT, 16)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, tiny):
    _, engine, path, _ = tiny
    async with running_stack(nats_server.url, models={engine.name: path}, max_context=CONTEXT,
                             decode_slots=4) as st:
        await st.add_worker(engine, "dec-structured", kind="decoder")
        yield st


@pytest.fixture
def client(stack):
    return openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="none", max_retries=0)


async def test_json_schema_over_http_whole_and_streamed(client, tiny):
    _, engine, _, _ = tiny
    body = dict(model=engine.name, messages=CHAT, max_tokens=96, temperature=1.0,
                response_format=_schema_format(PERSON))
    wholes = await asyncio.gather(*[client.chat.completions.create(**body, seed=s)
                                    for s in range(3)])
    streamed = await client.chat.completions.create(**body, seed=7, stream=True)
    texts, reasons = [], []
    async for ch in streamed:
        if ch.choices:
            texts.append(ch.choices[0].delta.content or "")
            reasons.append(ch.choices[0].finish_reason)
    answers = [(w.choices[0].message.content, w.choices[0].finish_reason) for w in wholes]
    answers.append(("".join(texts), reasons[-1]))
    for text, reason in answers:
        assert reason == "stop", text  # the schema is bounded: it always completes
        jsonschema.validate(json.loads(text), PERSON)


async def test_json_object_and_schema_over_nats(stack, tiny):
    _, engine, _, _ = tiny
    chat = {"model": engine.name, "messages": CHAT, "max_tokens": 96, "temperature": 1.0,
            "seed": 3, "response_format": {"type": "json_object"}}
    completion = {"model": engine.name, "prompt": PROMPT, "max_tokens": 96, "temperature": 0.8,
                  "seed": 4, "response_format": _schema_format(PERSON)}
    (c1, r1), (c2, r2) = await asyncio.gather(
        request(stack.client, subjects.CHAT_COMPLETIONS, chat),
        request(stack.client, subjects.COMPLETIONS, completion))
    assert c1 == 200 and c2 == 200, (r1, r2)
    obj = r1["choices"][0]
    if obj["finish_reason"] == "stop":
        assert isinstance(json.loads(obj["message"]["content"]), dict)
    assert r2["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(r2["choices"][0]["text"]), PERSON)
    msgs = await stream(stack.client, subjects.COMPLETIONS, {**completion, "stream": True})
    chunks = [json.loads(m) for m in msgs[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == r2["choices"][0]["text"]  # same seed, same tokens


@pytest.mark.parametrize("schema,needle", [
    ({"type": "string", "if": {"minLength": 2}, "then": {"maxLength": 4}}, "if"),
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
])
async def test_unsupported_schema_features_are_400s_naming_them(client, stack, tiny, schema,
                                                                needle):
    _, engine, _, _ = tiny
    with pytest.raises(openai.BadRequestError, match=needle):
        await client.chat.completions.create(model=engine.name, messages=CHAT, max_tokens=4,
                                             response_format=_schema_format(schema))
    code, body = await request(stack.client, subjects.COMPLETIONS, {
        "model": engine.name, "prompt": "x", "max_tokens": 4,
        "response_format": _schema_format(schema)})
    assert code == 400 and needle in body["error"]["message"]
    code, body = await request(stack.client, subjects.COMPLETIONS, {
        "model": engine.name, "prompt": "x", "max_tokens": 4, "extra": 1,
        "response_format": {"type": "json_object"}})
    assert code == 400


async def test_unconstrained_batch_mates_are_unaffected(client, tiny):
    _, engine, _, (greedy_text, greedy_reason) = tiny
    constrained = [client.completions.create(model=engine.name, prompt=PROMPT, max_tokens=64,
                                             temperature=1.0, seed=s,
                                             extra_body={"response_format":
                                                         _schema_format(PERSON)})
                   for s in range(3)]
    plain = client.completions.create(model=engine.name, prompt=PROMPT, max_tokens=16,
                                      temperature=0)
    *shaped, mate = await asyncio.gather(*constrained, plain)
    assert mate.choices[0].text == greedy_text
    assert mate.choices[0].finish_reason == greedy_reason
    for r in shaped:
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(r.choices[0].text), PERSON)


VLLM_CASES = [
    # (the request's fields, what the whole answer must be)
    ({"guided_choice": ["yes", "no", "not sure"]}, lambda t: t in ("yes", "no", "not sure")),
    ({"structured_outputs": {"choice": ["a.b*c", "(x)"]}}, lambda t: t in ("a.b*c", "(x)")),
    ({"guided_regex": "[a-z]{2,6}-[0-9]{2}"},
     lambda t: re.fullmatch("[a-z]{2,6}-[0-9]{2}", t) is not None),
    ({"structured_outputs": {"regex": "(cat|dog)s?"}},
     lambda t: re.fullmatch("(cat|dog)s?", t) is not None),
    ({"guided_grammar": 'start: ("red" | "green") " " ("cat" | "dog")'},
     lambda t: re.fullmatch("(red|green) (cat|dog)", t) is not None),
    ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"structured_outputs": {"json": json.dumps(PERSON)}},
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
]


@pytest.mark.parametrize("fields,holds", VLLM_CASES, ids=[
    "guided_choice", "so.choice", "guided_regex", "so.regex", "guided_grammar", "guided_json",
    "so.json"])
async def test_vllm_structured_output_fields_shape_the_whole_answer(client, stack, tiny, fields,
                                                                    holds):
    """vLLM's guided_* fields and its structured_outputs object, over HTTP (the openai
    client's extra_body) and NATS, sampled: every answer ends at its structure's end
    and is what it asked for."""
    _, engine, _, _ = tiny
    answers = await asyncio.gather(*[client.completions.create(
        model=engine.name, prompt=PROMPT, max_tokens=96, temperature=1.0, seed=s,
        extra_body=fields) for s in range(3)])  # fmt: skip
    texts = [(a.choices[0].text, a.choices[0].finish_reason) for a in answers]
    code, body = await request(stack.client, subjects.CHAT_COMPLETIONS, {
        "model": engine.name, "messages": CHAT, "max_tokens": 96, "temperature": 0.7,
        "seed": 5, **fields})
    assert code == 200, body
    texts.append((body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]))
    for text, reason in texts:
        assert reason == "stop" and holds(text), (text, reason)


@pytest.mark.parametrize("fields,needle", [
    ({"guided_regex": "[a-z", "guided_choice": ["a"]}, "guided_choice and guided_regex"),
    ({"guided_json": PERSON, "response_format": {"type": "json_object"}},
     "guided_json and response_format"),
    ({"guided_regex": "[a-z"}, "'guided_regex' is not valid"),
    ({"guided_grammar": "start: missing_rule"}, "'guided_grammar' is not valid"),
    ({"guided_json": "{not json"}, "'guided_json' is not a JSON schema"),
    ({"structured_outputs": {}}, "needs one of json, regex, choice, grammar"),
    ({"guided_choice": []}, "guided_choice"),
])
async def test_bad_or_doubled_structures_are_400s_naming_the_fields(stack, tiny, fields, needle):
    _, engine, _, _ = tiny
    code, body = await request(stack.client, subjects.COMPLETIONS, {
        "model": engine.name, "prompt": "x", "max_tokens": 4, **fields})
    assert code == 400 and needle in body["error"]["message"], body
