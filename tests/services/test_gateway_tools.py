"""Tool calls at the gateway (services/gateway/tools.py), host only: the plan a
request makes, the messages a chat template gets (one that renders tools itself and
one that does not), and the reply's parsing, whole and streamed."""

from __future__ import annotations

import json

import msgspec
import pytest

from engine.chat import ChatTemplate
from services.gateway import tools
from shared.api import ChatCompletionRequest
from shared.errors import ServiceError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CONVERSATION = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def _req(**body) -> ChatCompletionRequest:
    body = {"model": "m", "messages": CONVERSATION, **body}
    return msgspec.json.decode(json.dumps(body).encode(), type=ChatCompletionRequest)


def test_plans():
    assert tools.plan(_req()) is None
    assert tools.plan(_req(tools=[WEATHER], tool_choice="none")) is None
    auto = tools.plan(_req(tools=[WEATHER, TIME]))
    assert auto.mode == "auto" and not auto.grammar
    named = tools.plan(_req(tools=[WEATHER, TIME],
                            tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert named.mode == "named" and named.name == "get_time" and named.grammar
    required = tools.plan(_req(tools=[WEATHER, TIME], tool_choice="required",
                               parallel_tool_calls=False))
    assert required.mode == "required" and not required.parallel and required.grammar


@pytest.mark.parametrize("body,needle", [
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "nope"),
    ({"tools": [WEATHER, WEATHER]}, "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_400s(body, needle):
    with pytest.raises(ServiceError) as err:
        tools.plan(_req(**body))
    assert err.value.status == 400 and needle in err.value.message


def _plain(req, knows):
    tp = tools.plan(req)
    return tools.template_messages(req.messages, [m.content or "" for m in req.messages], tp,
                                   knows), tp


def test_a_template_that_knows_tools_gets_them_as_transformers_passes_them():
    source = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
              "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
              "{% for c in m.tool_calls or [] %}{{ c.function.name }}"
              "({{ c.function.arguments.city }}){% endfor %}"
              "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}")
    template = ChatTemplate(source)
    assert template.knows_tools
    plain, tp = _plain(_req(tools=[WEATHER]), True)
    text = template.render(plain, tools=tp.dicts())
    assert text == ("[get_weather]<user>weather in Paris?<assistant>get_weather(Paris)"
                    "<tool>sunny, 21 C#call_1")


def test_a_template_that_does_not_gets_the_tool_prompt():
    template = ChatTemplate()
    assert not template.knows_tools
    plain, _ = _plain(_req(tools=[WEATHER]), False)
    text = template.render(plain)
    assert text.startswith("system: You can call functions.") and '"get_weather"' in text
    assert '[{"name": "get_weather", "arguments": {"city": "Paris"}}]' in text
    assert "user: <tool_response>\nsunny, 21 C\n</tool_response>" in text


def test_whole_replies():
    auto = tools.plan(_req(tools=[WEATHER, TIME]))
    for text in ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
                 '[{"name": "get_weather", "arguments": {"city": "Rome"}}]',
                 ' {"name": "get_weather", "arguments": {"city": "Rome"}}'):
        msg, reason = tools.message(auto, text, "stop")
        assert reason == "tool_calls" and msg.content is None
        (call,) = msg.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"city": "Rome"}
    for text in ("It is sunny.", '{"name": "unknown", "arguments": {}}', "[1, 2"):
        msg, reason = tools.message(auto, text, "stop")
        assert (msg.content, msg.tool_calls, reason) == (text, None, "stop")
    named = tools.plan(_req(tools=[WEATHER], tool_choice={"type": "function",
                                                          "function": {"name": "get_weather"}}))
    msg, reason = tools.message(named, '{"city":"Oslo"}', "stop")
    assert reason == "tool_calls" and msg.tool_calls[0].function.arguments == '{"city":"Oslo"}'


def test_streamed_named_arguments_come_as_deltas():
    named = tools.plan(_req(tools=[WEATHER], tool_choice={"type": "function",
                                                          "function": {"name": "get_weather"}}))
    stream = tools.ToolStream(named, 1)
    pieces = [stream.feed(0, t, r) for t, r in (('{"ci', None), ('ty":"Os', None),
                                                 ('lo"}', "stop"))]
    first = pieces[0][0].tool_calls[0]
    assert first.id.startswith("call_") and first.function.name == "get_weather"
    args = "".join(d.tool_calls[0].function.arguments for d, _ in pieces)
    assert json.loads(args) == {"city": "Oslo"} and pieces[-1][1] == "tool_calls"
    assert all(d.tool_calls[0].index == 0 for d, _ in pieces)


def test_streamed_auto_holds_what_may_be_a_call_and_streams_content():
    auto = tools.plan(_req(tools=[WEATHER]))
    stream = tools.ToolStream(auto, 2)
    assert stream.feed(0, "<tool", None) == (None, None)
    assert stream.feed(0, '_call>{"name": "get_weather", ', None) == (None, None)
    delta, reason = stream.feed(0, '"arguments": {"city": "Rome"}}</tool_call>', "stop")
    assert reason == "tool_calls" and delta.tool_calls[0].function.name == "get_weather"
    delta, reason = stream.feed(1, "Hello", None)
    assert delta.content == "Hello" and reason is None
    assert stream.feed(1, " there", "stop")[0].content == " there"


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_required_calls_come_as_argument_deltas(step):
    required = tools.plan(_req(tools=[WEATHER, TIME], tool_choice="required"))
    text = ('[{"name":"get_weather","arguments":{"city":"R\\"o}{[","n":[1,{"a":2}]}},'
            '{"name":"get_time","arguments":{}}]')
    stream = tools.ToolStream(required, 1)
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    deltas, reasons = [], []
    for i, piece in enumerate(pieces):
        delta, reason = stream.feed(0, piece, "stop" if i == len(pieces) - 1 else None)
        deltas += delta.tool_calls if delta else []
        reasons.append(reason)
    assert reasons[-1] == "tool_calls"
    names = {d.index: d.function.name for d in deltas if d.id}
    args = {i: "".join(d.function.arguments for d in deltas if d.index == i) for i in names}
    assert names == {0: "get_weather", 1: "get_time"}
    assert [json.loads(args[i]) for i in (0, 1)] == [
        {"city": 'R"o}{[', "n": [1, {"a": 2}]}, {}]
    if step < 1000:  # the arguments came in pieces, not whole at the end
        assert sum(1 for d in deltas if d.index == 0 and not d.id) > 1
