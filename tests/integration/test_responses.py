"""OpenAI's Responses API through the whole stack (a real nats-server, gateway,
scheduler, worker, the JAX engine serving SmolLM2-135M-Instruct from its GGUF file),
asked with the unchanged `openai` client: a response's text and usage are the chat
completion's of the same messages (greedy; the chat path is checked against
transformers in test_smollm2.py), whole and streamed (the documented events, in
order); a forced function call, answered through `previous_response_id` and a
`function_call_output`; `text.format` json_schema; retrieve and delete from the
JetStream KV bucket; a stored response's input items, listed in pages; the 400s and
404s of the error contract; and the same endpoint over NATS."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import pytest_asyncio

from shared import catalog, subjects
from tests.integration.test_generation import request, stream
from tests.support.stack import running_stack

MODEL = catalog.SMOLLM2
CONTEXT = 256  # the shapes of test_smollm2.py's engine: their programs compile once
PREFILL = 128
INSTRUCTIONS = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12}},
               "required": ["city"], "additionalProperties": False}, "strict": True}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(smollm2_dir, jax_cache_dir):
    from engine.decoder import DecoderEngine

    engine = DecoderEngine(smollm2_dir, MODEL, slots=2, max_context=CONTEXT,
                           prefill_buckets=(PREFILL,), decode_windows=(), compile_ahead="all",
                           quant="gguf", quant_form="kernel")  # fmt: skip
    engine.warmup(progress=False)  # inside a request, compiling could outlast its deadline
    return engine


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, engine, smollm2_dir):
    async with running_stack(nats_server.url, models={MODEL: str(smollm2_dir)},
                             max_context=CONTEXT, decode_slots=2) as st:
        await st.add_worker(engine, "dec-responses", kind="decoder")
        yield st


@pytest.fixture
def client(stack):
    return openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="none", max_retries=0,
                              default_headers={"Tensorbus-Timeout": "120"})


async def _chat(client, **kw):
    return await client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": INSTRUCTIONS},
                               {"role": "user", "content": QUESTION}], temperature=0, **kw)


async def test_text_and_usage_equal_the_chat_completions(client):
    chat = await _chat(client, max_tokens=16)
    resp = await client.responses.create(model=MODEL, input=QUESTION, instructions=INSTRUCTIONS,
                                         temperature=0, max_output_tokens=16)
    assert resp.output_text == chat.choices[0].message.content and resp.output_text
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.error is None
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                           else "completed")
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [p.type for p in item.content] == ["output_text"]
    u = resp.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert u.input_tokens_details.cached_tokens == 0
    assert u.output_tokens_details.reasoning_tokens == 0
    assert (resp.instructions, resp.temperature, resp.max_output_tokens, resp.store) == (
        INSTRUCTIONS, 0, 16, True)
    # cut by length: incomplete, and says why
    short = await client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                          max_output_tokens=2)
    assert short.status == "incomplete"
    assert short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 2


async def test_streamed_events_in_order_join_to_the_same_text(client, stack):
    chat = await _chat(client, max_tokens=24)
    stream = await client.responses.create(model=MODEL, input=QUESTION,
                                           instructions=INSTRUCTIONS, temperature=0,
                                           max_output_tokens=24, stream=True)
    events = [ev async for ev in stream]
    kinds = [ev.type for ev in events]
    deltas = [ev for ev in events if ev.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    final = "response.incomplete" if chat.choices[0].finish_reason == "length" else \
        "response.completed"
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", final]
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    text = "".join(d.delta for d in deltas)
    assert text == chat.choices[0].message.content
    item_id = events[2].item.id
    assert all(d.item_id == item_id and d.output_index == 0 and d.content_index == 0
               for d in deltas)
    assert events[-4].text == text and events[-2].item.content[0].text == text
    whole = events[-1].response
    assert whole.output_text == text and whole.output[0].id == item_id
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    # on the wire: SSE events named by their type, no [DONE]
    async with httpx.AsyncClient(timeout=120) as http:
        raw = await http.post(stack.http_url + "/v1/responses", json={
            "model": MODEL, "input": "Hi", "max_output_tokens": 2, "stream": True,
            "store": False})
    assert raw.text.startswith("event: response.created\ndata: {")
    assert "[DONE]" not in raw.text and "event: response." in raw.text.rsplit("\n\n", 2)[-2]


async def test_a_forced_function_call_then_its_output_through_previous_response_id(client):
    first = await client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
        max_output_tokens=32)
    assert first.status == "completed"
    (call,) = [i for i in first.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id
    assert call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), CITY)
    assert first.tools[0].name == "get_weather"
    assert first.tool_choice.name == "get_weather"
    second = await client.responses.create(
        model=MODEL, previous_response_id=first.id, temperature=0, max_output_tokens=48,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"temperature_c": 21, "sky": "sunny"})}])
    assert second.previous_response_id == first.id
    assert [i.type for i in second.output] == ["message"]
    assert second.status == "completed" and second.output_text
    # the follow-up's prompt holds the first turn: more input than the output alone
    assert second.usage.input_tokens > first.usage.input_tokens // 2


async def test_text_format_json_schema(client):
    resp = await client.responses.create(
        model=MODEL, input="Name a city in France as JSON.", temperature=0,
        max_output_tokens=48, text={"format": {"type": "json_schema", "name": "city",
                                               "schema": CITY, "strict": True}})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), CITY)
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "city"


async def test_retrieve_delete_and_unknown_ids(client):
    resp = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=4,
                                         metadata={"k": "v"})
    got = await client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text
    assert got.metadata == {"k": "v"}
    await client.responses.delete(resp.id)
    for rid in (resp.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(resp.id)
    unstored = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                             store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        await client.responses.create(model=MODEL, input="Hi", previous_response_id=resp.id)



async def test_input_items_list_what_a_stored_response_was_made_from(client, stack):
    """`GET /v1/responses/{id}/input_items` through the client: the items with their
    ids (a follow-up's: the earlier input and output first), newest first by default,
    in cursor pages; unknown or unstored ids are 404s, bad parameters 400s."""
    first = await client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                          instructions=INSTRUCTIONS, max_output_tokens=4)
    listed = await client.responses.input_items.list(first.id)
    (asked,) = listed.data
    assert (asked.type, asked.role) == ("message", "user") and asked.id.startswith("msg_")
    assert [(c.type, c.text) for c in asked.content] == [("input_text", QUESTION)]
    assert listed.first_id == listed.last_id == asked.id and listed.has_more is False
    given = [{"role": "user", "content": "Thanks."},
             {"type": "message", "id": "msg_given", "role": "user",
              "content": [{"type": "input_text", "text": "And of Spain?"}]}]
    second = await client.responses.create(model=MODEL, previous_response_id=first.id,
                                           input=given, temperature=0, max_output_tokens=4)
    oldest = await client.responses.input_items.list(second.id, order="asc")
    ids = [i.id for i in oldest.data]
    assert len(ids) == 4 and ids[0] == asked.id and ids[1] == first.output[0].id
    assert ids[3] == "msg_given" and ids[2].startswith("msg_")
    reply = oldest.data[1]
    assert (reply.role, reply.content[0].type) == ("assistant", "output_text")
    assert reply.content[0].text == first.output_text
    assert oldest.data[2].content[0].text == "Thanks."
    newest = await client.responses.input_items.list(second.id)  # desc, the default
    assert [i.id for i in newest.data] == ids[::-1]
    head = await client.responses.input_items.list(second.id, order="asc", limit=3)
    assert [i.id for i in head.data] == ids[:3] and head.has_more and head.last_id == ids[2]
    tail = await client.responses.input_items.list(second.id, order="asc", after=ids[2])
    assert [i.id for i in tail.data] == ids[3:] and not tail.has_more
    walked = [i.id async for i in client.responses.input_items.list(second.id, limit=1)]
    assert walked == ids[::-1]  # the client's own paging, by `after`
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=30) as http:
        url = f"/v1/responses/{second.id}/input_items"
        got = (await http.get(url, params={"order": "asc", "before": ids[3], "limit": 2})).json()
        assert [i["id"] for i in got["data"]] == ids[1:3] and got["object"] == "list"
        for params, needle in (({"limit": 0}, "'limit'"), ({"order": "up"}, "'order'"),
                               ({"after": "msg_nope"}, "'after'")):
            r = await http.get(url, params=params)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    unstored = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                             store=False)
    await client.responses.delete(first.id)
    for rid in (first.id, unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError):
            await client.responses.input_items.list(rid)

@pytest.mark.parametrize("body,needle", [
    ({"input": []}, "'input' is empty"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, r"input\[0\].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
     r"input\[0\].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     r"input\[0\].content\[0\].type"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, r"tools\[0\].type"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": CITY}}},
     "text.format.name"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "not_a_field": 1}, "not_a_field"),
])
async def test_bad_input_is_a_400_naming_the_field(client, body, needle):
    with pytest.raises(openai.BadRequestError, match=needle):
        await client.post("/responses", body={"model": MODEL, **body},
                          cast_to=httpx.Response)


async def test_documented_fields_are_accepted_and_named_back(stack):
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(stack.http_url + "/v1/responses", json={
            "model": MODEL, "input": "Hi", "max_output_tokens": 2, "truncation": "disabled",
            "reasoning": {"effort": "low"}, "include": [], "store": False})
    assert r.status_code == 200, r.text
    assert r.headers["tensorbus-ignored-fields"] == "include, reasoning, truncation"


async def test_over_nats_whole_and_streamed(stack):
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 8, "temperature": 0,
            "store": False}
    code, whole = await request(stack.client, subjects.RESPONSES, body, 120)
    assert code == 200, whole
    assert whole["object"] == "response" and whole["output"][0]["type"] == "message"
    msgs = await stream(stack.client, subjects.RESPONSES, {**body, "stream": True}, 120)
    assert msgs[-1] == b"[DONE]"
    events = [json.loads(m) for m in msgs[:-1]]
    assert events[0]["type"] == "response.created"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == \
        whole["output"][0]["content"][0]["text"]
