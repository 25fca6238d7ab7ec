"""The Responses API's translation (services/gateway/responses.py), without a bus: input
items into chat messages, a request into chat's, chat chunks into the documented
event sequence, and the input items a response keeps and lists in pages
(services/gateway/response_items.py)."""

from __future__ import annotations

import msgspec
import pytest

from services.gateway.response_events import Events
from services.gateway.response_items import listed, page
from services.gateway.responses import (
    chat_request,
    input_messages,
    reply_message,
    skeleton,
)
from shared.api import ChatCompletionRequest, ToolCallDelta, Usage
from shared.api_replies import ChatChunkChoice, ChatCompletionChunk, ChatDelta
from shared.api_responses import ListedItem, ResponsesRequest
from shared.api import FunctionDelta
from shared.errors import ServiceError


def _req(**kw) -> ResponsesRequest:
    return msgspec.json.decode(msgspec.json.encode({"model": "m", "input": "hi", **kw}),
                               type=ResponsesRequest)


def test_a_tool_loop_becomes_chat_messages():
    req = _req(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{\"a\":1}"},
        {"type": "reasoning", "id": "rs_1"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ])
    msgs = input_messages(req.input, [])
    assert [m.role for m in msgs] == ["user", "assistant", "tool"]
    assert [c.id for c in msgs[1].tool_calls] == ["c1", "c2"]
    assert msgs[2].tool_call_id == "c1" and msgs[2].content == "sunny"
    assert msgs[0].content[0].text == "weather?"


@pytest.mark.parametrize("items,needle", [
    ([], "'input' is empty"),
    ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
    ([{"type": "function_call_output", "call_id": "zz", "output": "x"}], "no function_call"),
    ([{"role": "robot", "content": "x"}], "input[0].role"),
    ([{"type": "item_reference", "id": "x"}], "input[0].type"),
])
def test_bad_items_are_400s_naming_them(items, needle):
    with pytest.raises(ServiceError) as err:
        input_messages(_req(input=items).input, [])
    assert err.value.status == 400 and needle in err.value.message


def test_the_chat_request_decodes_as_chat_does():
    req = _req(tools=[{"type": "function", "name": "w", "parameters": {"type": "object"}}],
               tool_choice={"type": "function", "name": "w"}, max_output_tokens=7,
               text={"format": {"type": "json_schema", "name": "n", "schema": {}}},
               stream=True, temperature=0.5)
    chat = chat_request(req, input_messages(req.input, []))
    back = msgspec.json.decode(msgspec.json.encode(chat), type=ChatCompletionRequest)
    assert back.tools[0].function.name == "w" and back.tool_choice.function.name == "w"
    assert back.max_completion_tokens == 7 and back.temperature == 0.5
    assert back.response_format.json_schema.name == "n"
    assert back.stream_options.include_usage


def _chunk(content=None, calls=None, reason=None, usage=None):
    choices = [] if usage else [ChatChunkChoice(0, ChatDelta(content=content, tool_calls=calls),
                                                reason)]
    return ChatCompletionChunk("c", 0, "m", choices, usage=usage)


def test_events_for_text_then_a_call_in_order():
    ev = Events(skeleton(_req(), 0))
    out = ev.start() + ev.feed(_chunk("")) + ev.feed(_chunk("He")) + ev.feed(_chunk("llo"))
    out += ev.feed(_chunk(calls=[ToolCallDelta(0, "call_1", "function",
                                               FunctionDelta("w", ""))]))
    out += ev.feed(_chunk(calls=[ToolCallDelta(0, function=FunctionDelta(arguments="{}"))],
                          reason="tool_calls"))
    out += ev.feed(_chunk(usage=Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)))
    out += ev.finish()
    assert [e.type for e in out] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in out] == list(range(len(out)))
    assert [e.output_index for e in out[2:-1]] == [0] * 7 + [1] * 4
    final = out[-1].response
    assert final.status == "completed" and final.usage.total_tokens == 7
    assert final.output[0].content[0].text == "Hello"
    assert (final.output[1].call_id, final.output[1].arguments) == ("call_1", "{}")
    turn = reply_message(final)
    assert turn.content == "Hello" and turn.tool_calls[0].id == "call_1"
    wire = msgspec.json.decode(msgspec.json.encode(out[9]))
    assert wire["item"]["type"] == "function_call" and wire["item"]["status"] == "in_progress"


def test_an_empty_stream_is_an_empty_message_and_length_is_incomplete():
    ev = Events(skeleton(_req(), 0))
    out = ev.start() + ev.feed(_chunk(reason="length")) + ev.finish()
    assert [e.type for e in out][2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]
    assert out[-1].response.incomplete_details.reason == "max_output_tokens"
    assert [e.sequence_number for e in out] == list(range(len(out)))


def test_input_items_keep_their_ids_and_shapes():
    items = listed(_req(input=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "id": "msg_given", "content": [{"type": "output_text",
                                                              "text": "yes"}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]).input)
    wire = msgspec.json.decode(msgspec.json.encode(items))
    assert [i["type"] for i in wire] == ["message", "message", "function_call",
                                         "function_call_output"]
    assert wire[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert wire[1]["id"] == "msg_given" and wire[1]["content"] == [
        {"type": "output_text", "text": "yes", "annotations": [], "logprobs": []}]
    assert wire[2]["id"].startswith("fc_") and wire[3]["id"].startswith("fco_")
    assert (wire[3]["call_id"], wire[3]["output"], wire[3]["status"]) == ("c1", "sunny",
                                                                        "completed")
    assert "role" not in wire[2] and "output" not in wire[2]
    (one,) = listed("just text")
    assert (one.role, one.content[0].type, one.content[0].text) == ("user", "input_text",
                                                                    "just text")


def _ids(n: int):
    return [ListedItem(id=f"i{k}", type="message") for k in range(n)]


@pytest.mark.parametrize("query,want,more", [
    ({}, ["i4", "i3", "i2", "i1", "i0"], False),  # desc, the default: newest first
    ({"order": "asc", "limit": "2"}, ["i0", "i1"], True),
    ({"order": "asc", "limit": "2", "after": "i1"}, ["i2", "i3"], True),
    ({"order": "asc", "after": "i3"}, ["i4"], False),
    ({"limit": "2", "after": "i3"}, ["i2", "i1"], True),  # after, in desc order
    ({"order": "asc", "limit": "2", "before": "i4"}, ["i2", "i3"], True),  # nearest it
    ({"order": "asc", "after": "i0", "before": "i3"}, ["i1", "i2"], False),
    ({"order": "asc", "after": "i4"}, [], False),
])
def test_input_items_pages(query, want, more):
    got = page(_ids(5), query)
    assert [i.id for i in got.data] == want and got.has_more is more
    assert (got.first_id, got.last_id) == ((want[0], want[-1]) if want else (None, None))


@pytest.mark.parametrize("query,needle", [
    ({"limit": "0"}, "'limit'"), ({"limit": "101"}, "'limit'"), ({"limit": "x"}, "'limit'"),
    ({"order": "up"}, "'order'"), ({"after": "nope"}, "'after'"), ({"before": "nope"}, "'before'"),
])
def test_input_items_bad_queries_are_400s_naming_them(query, needle):
    with pytest.raises(ServiceError) as err:
        page(_ids(2), query)
    assert err.value.status == 400 and needle in err.value.message
