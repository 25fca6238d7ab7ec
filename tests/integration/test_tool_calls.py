"""Tool calls through the whole stack (a real nats-server, gateway, scheduler, worker
and the JAX engine on tiny random weights; its template knows no tools, so the
documented tool prompt is used), with the unchanged `openai` client: a named
function and `required` are forced by the grammar, so even random weights give
arguments that validate against the function's schema (`jsonschema`), whole and
streamed; the tool loop's messages (assistant `tool_calls`, `tool` results) are
accepted; `tool_choice` mistakes are 400s; over NATS the same."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import pytest_asyncio

from shared import subjects
from tests.integration.test_generation import request
from tests.support.stack import running_stack
from tests.support.tiny_models import serve_tiny

CONTEXT = 1536
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp("tools")
    _, engine = serve_tiny("llama", path, "tiny-tools", CONTEXT, jax_cache_dir)
    _warm_masked(engine)
    return engine, str(path)


def _warm_masked(engine) -> None:
    """Compile the masked programs a tool request runs (a prompt as long as the tool
    prompt, decoded past the next windows) before the stack starts: compiled inside
    the first request, they would count as that prompt's cost for admission."""
    from engine.decoder.static import prefill_insert
    from services.gateway.structured import schema_grammar
    from shared.messages import Sampling

    grammar = schema_grammar({"type": "array", "items": {"type": "integer"}})
    prefill_insert(engine, 0, [5] * 730, Sampling(temperature=1.0, grammar=grammar), 0)
    for _ in range(CONTEXT - 731):
        engine.step()
    engine.free(0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, tiny):
    engine, path = tiny
    async with running_stack(nats_server.url, models={engine.name: path}, max_context=CONTEXT,
                             decode_slots=4) as st:
        await st.add_worker(engine, "dec-tools", kind="decoder")
        yield st


@pytest.fixture
def client(stack):
    return openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="none", max_retries=0,
                              default_headers={"Tensorbus-Timeout": "120"})


def _valid(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_named_function_whole_and_streamed(client, tiny):
    engine, _ = tiny
    body = dict(model=engine.name, messages=ASK, max_tokens=64, temperature=1.0, seed=2,
                tools=[WEATHER, TIME],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = await client.chat.completions.create(**body)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _valid(call)
    deltas, reasons = [], []
    async for ch in await client.chat.completions.create(**body, stream=True):
        if ch.choices:
            deltas += ch.choices[0].delta.tool_calls or []
            reasons.append(ch.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls"
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 for d in deltas) and len(deltas) > 2  # the arguments, piecewise
    args = "".join(d.function.arguments or "" for d in deltas)
    assert args == call.function.arguments  # the same seed draws the same tokens


async def test_required_calls_validate_and_the_tool_loop_goes_on(client, tiny):
    engine, _ = tiny
    for seed, parallel in ((1, False), (2, True), (3, True)):
        r = await client.chat.completions.create(
            model=engine.name, messages=ASK, max_tokens=640, temperature=1.0, seed=seed,
            tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            _valid(call)
    # The loop: the calls and their results go back; the model answers (in text, or
    # with more calls: random weights decide).
    messages = ASK + [{"role": "assistant", "content": None,
                       "tool_calls": [c.model_dump() for c in calls]}]
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "21 C, sunny"} for c in calls]
    final = await client.chat.completions.create(model=engine.name, messages=messages,
                                                  max_tokens=8, tools=[WEATHER, TIME])
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    plain = await client.chat.completions.create(model=engine.name, messages=messages,
                                                  max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None


async def test_required_streams_argument_deltas(client, tiny):
    engine, _ = tiny
    body = dict(model=engine.name, messages=ASK, max_tokens=640, temperature=1.0, seed=5,
                tools=[WEATHER, TIME], tool_choice="required")
    whole = await client.chat.completions.create(**body)
    deltas, reasons = [], []
    async for ch in await client.chat.completions.create(**body, stream=True):
        if ch.choices:
            deltas += ch.choices[0].delta.tool_calls or []
            reasons.append(ch.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls"
    names = {d.index: d.function.name for d in deltas if d.id}
    assert sorted(names) == list(range(len(names)))
    args = {i: "".join(d.function.arguments or "" for d in deltas if d.index == i) for i in names}
    for i, name in names.items():
        jsonschema.validate(json.loads(args[i]), SCHEMAS[name])
    # The same seed draws the same calls as the whole reply.
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
            ] == [(names[i], args[i]) for i in sorted(names)]


@pytest.mark.parametrize("body,needle", [
    ({"tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "nope"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "if": {"required": ["a"]}, "then": {}}}}], "tool_choice": "required"},
     "if"),
])
async def test_tool_mistakes_are_400s(client, stack, tiny, body, needle):
    engine, _ = tiny
    with pytest.raises(openai.BadRequestError, match=needle):
        await client.chat.completions.create(model=engine.name, messages=ASK, max_tokens=4,
                                             **body)
    code, resp = await request(stack.client, subjects.CHAT_COMPLETIONS, {
        "model": engine.name, "messages": ASK, "max_tokens": 4, **body})
    assert code == 400 and needle in resp["error"]["message"]


async def test_named_function_over_nats(stack, tiny):
    engine, _ = tiny
    code, resp = await request(stack.client, subjects.CHAT_COMPLETIONS, {
        "model": engine.name, "messages": ASK, "max_tokens": 64, "temperature": 0,
        "tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert code == 200, resp
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time" and call["type"] == "function"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_time"])
