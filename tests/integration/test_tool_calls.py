"""Tool calls through the whole stack (a real nats-server, gateway, scheduler, worker
and the JAX engine on tiny random weights; its template knows no tools, so the
documented tool prompt is used), with the unchanged `openai` client: a named
function, `required`, and an `auto` reply once it opens a call are forced by the
grammar, so even random weights give arguments that validate against the
function's schema (`jsonschema`), whole and streamed; an `auto` plain answer is
transformers' greedy text for the same prompt; with `response_format` the answer
follows it; the tool loop's messages (assistant `tool_calls`, `tool` results) are
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
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}},
          "required": ["answer"], "additionalProperties": False}
PLAIN_NEW = 16
PLAIN_ASK = [{"role": "user", "content": "a stream of tokens"}]  # answered in plain text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp("tools")
    _, engine = serve_tiny("llama", path, "tiny-tools", CONTEXT)
    _warm_tool_shapes(engine)
    return engine, str(path)


def _warm_tool_shapes(engine) -> None:
    """Compile the programs a tool request runs (a prompt as long as the tool
    prompt, decoded past the next windows) before the stack starts: compiled inside
    the first requests, they would run on those requests' deadlines (a busy machine
    takes seconds a program). Fewer than `compile_ahead="all"` would compile at this
    context."""
    from engine.decoder.static import prefill_insert
    from services.gateway.structured import schema_grammar
    from shared.messages import Sampling

    grammar = schema_grammar({"type": "array", "items": {"type": "integer"}})
    prefill_insert(engine, 0, [5] * 730, Sampling(temperature=1.0, grammar=grammar), 0)
    for _ in range(CONTEXT - 731):
        engine.step()
    engine.free(0)


@pytest.fixture(scope="module")
def reference(tiny):
    """transformers' greedy reply (text, finish_reason) to PLAIN_ASK with the
    documented tool prompt, from the saved weights and transformers' own tokenizer;
    computed before the stack runs. Its first character is a plain answer's (the
    random weights' other prompts open with a byte that is no character)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.chat import ChatTemplate
    from services.gateway.tools import TOOL_PROMPT
    from tests.support.tiny_models import hf_greedy

    _, path = tiny
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    text = ChatTemplate.from_dir(path).render(
        [{"role": "system", "content": TOOL_PROMPT.format(tools=json.dumps([WEATHER, TIME]))}]
        + PLAIN_ASK)
    new = hf_greedy(model, tok(text)["input_ids"], PLAIN_NEW)
    eos = tok.eos_token_id
    kept = new[: new.index(eos)] if eos in new else new
    answer = tok.decode(kept)
    assert answer[:1] not in " \t\n\r\x0b\x0c[{\ufffd"  # a plain answer's start
    return answer, ("stop" if eos in new else "length")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, tiny, reference):
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


async def test_auto_plain_answer_is_the_unconstrained_greedy_text(client, tiny, reference):
    """Under `auto` a plain answer only has its first character checked (not a
    call's opening), then decodes free: transformers' greedy text, whole and
    streamed piece by piece."""
    engine, _ = tiny
    body = dict(model=engine.name, messages=PLAIN_ASK, max_tokens=PLAIN_NEW, temperature=0,
                tools=[WEATHER, TIME])
    whole = await client.chat.completions.create(**body)
    choice = whole.choices[0]
    assert (choice.message.content, choice.finish_reason) == reference
    assert choice.message.tool_calls is None
    pieces = []
    async for ch in await client.chat.completions.create(**body, stream=True):
        if ch.choices and ch.choices[0].delta.content:
            assert not ch.choices[0].delta.tool_calls
            pieces.append(ch.choices[0].delta.content)
    assert "".join(pieces) == reference[0] and len(pieces) > 1


def _bias(engine, text: str) -> dict[str, int]:
    (token,) = engine.tokenizer.encode(text)
    return {str(token): 30}


async def test_auto_calls_validate_and_stream_as_name_then_argument_deltas(client, tiny):
    """Pushed to open a call (a bias on `[`), an auto reply's calls validate; streamed
    with the same seed, each call's id and name come first, then its arguments in
    pieces, and they reassemble to the whole reply's calls."""
    engine, _ = tiny
    for seed, parallel in ((4, False), (6, True)):
        body = dict(model=engine.name, messages=ASK, max_tokens=640, temperature=1.0, seed=seed,
                    tools=[WEATHER, TIME], parallel_tool_calls=parallel,
                    logit_bias=_bias(engine, "["))
        whole = await client.chat.completions.create(**body)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            _valid(call)
        deltas, reasons = [], []
        async for ch in await client.chat.completions.create(**body, stream=True):
            if ch.choices:
                assert not ch.choices[0].delta.content
                deltas += ch.choices[0].delta.tool_calls or []
                reasons.append(ch.choices[0].finish_reason)
        assert reasons[-1] == "tool_calls"
        for i, call in enumerate(calls):
            mine = [d for d in deltas if d.index == i]
            assert mine[0].id and mine[0].function.name == call.function.name
            assert not any(d.id for d in mine[1:]) and len(mine) > 2
            assert "".join(d.function.arguments or "" for d in mine) == call.function.arguments
        assert {d.index for d in deltas} == set(range(len(calls)))
    # The loop goes on: the calls and their results go back, still under `auto`;
    # without the push, these weights' greedy reply is text.
    messages = ASK + [{"role": "assistant", "content": None,
                       "tool_calls": [c.model_dump() for c in calls]}]
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "21 C"} for c in calls]
    final = await client.chat.completions.create(model=engine.name, messages=messages,
                                                  max_tokens=8, temperature=0,
                                                  tools=[WEATHER, TIME])
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None


async def test_tools_with_response_format(client, tiny):
    """`auto` with `response_format`: a plain answer follows the format, a call its
    tool's schema (each branch pushed by a bias on its first character); a forced
    call ignores the format, as it is no answer."""
    engine, _ = tiny
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    base = dict(model=engine.name, messages=ASK, max_tokens=640, temperature=1.0,
                tools=[WEATHER, TIME], response_format=fmt)
    for seed in (1, 2):
        r = await client.chat.completions.create(**base, seed=seed, logit_bias=_bias(engine, "{"))
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None
        jsonschema.validate(json.loads(choice.message.content), ANSWER)
        r = await client.chat.completions.create(**base, seed=seed, logit_bias=_bias(engine, "["))
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            _valid(call)
    r = await client.chat.completions.create(**base, seed=3, tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    for call in r.choices[0].message.tool_calls:
        _valid(call)


@pytest.mark.parametrize("body,needle", [
    ({"tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "nope"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "if": {"required": ["a"]}, "then": {}}}}], "tool_choice": "required"},
     "if"),
    ({"tools": [WEATHER], "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "array"}}}}, "root is an object"),
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
