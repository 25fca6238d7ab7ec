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
    assert auto.mode == "auto" and auto.grammar and not auto.tagged and not auto.answer
    tagged = tools.plan(_req(tools=[WEATHER], response_format={"type": "json_object"}), "hermes")
    assert tagged.tagged and tagged.answer and tagged.grammar != auto.grammar
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
    ({"tools": [WEATHER], "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "array"}}}}, "root is an object"),
    ({"tools": [WEATHER], "response_format": {"type": "json_schema"}}, "needs 'json_schema'"),
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
    """Auto replies as the auto grammar writes them: compact JSON calls, alone or as
    a list, or (a template that knows tools) in tags amid text."""
    auto = tools.plan(_req(tools=[WEATHER, TIME]))
    tagged = tools.plan(_req(tools=[WEATHER, TIME]), "hermes")
    call = '{"name":"get_weather","arguments":{"city":"Rome"}}'
    for tp, text, content in ((tagged, f"<tool_call>\n{call}\n</tool_call>", None),
                              (tagged, f"Let me see. <tool_call>{call}</tool_call>",
                               "Let me see. "),
                              (auto, f"[{call}]", None), (auto, f" {call}", None)):
        msg, reason = tools.message(tp, text, "stop")
        assert reason == "tool_calls" and msg.content == content
        (got,) = msg.tool_calls
        assert got.function.name == "get_weather" and got.id.startswith("call_")
        assert json.loads(got.function.arguments) == {"city": "Rome"}
    for text in ("It is sunny.", "  <b>sunny</b> <tool_call>", "[1, 2", ""):
        msg, reason = tools.message(auto, text, "stop")
        assert (msg.content, msg.tool_calls, reason) == (text, None, "stop")
    cut = f'[{call},{{"name":"get_time","arguments":{{"zo'
    msg, reason = tools.message(auto, cut, "length")  # cut short: the text, as it came
    assert (msg.content, msg.tool_calls, reason) == (cut, None, "length")
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


def _streamed(tp, text: str, step: int, finish: str = "stop"):
    """(content, {index: (name, arguments)}, deltas, finish_reason) of `text` fed in
    pieces of `step` characters."""
    stream = tools.ToolStream(tp, 1)
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    content, deltas, reason = "", [], None
    for i, piece in enumerate(pieces):
        delta, reason = stream.feed(0, piece, finish if i == len(pieces) - 1 else None)
        if delta is not None:
            content += delta.content or ""
            deltas += delta.tool_calls or []
    names = {d.index: d.function.name for d in deltas if d.id}
    calls = {i: (n, "".join(d.function.arguments or "" for d in deltas if d.index == i))
             for i, n in names.items()}
    return content, calls, deltas, reason


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_streamed_auto_calls_come_as_name_then_argument_deltas(step):
    """Whatever the pieces, the streamed reply reassembles to the whole reply's."""
    weather = '{"name":"get_weather","arguments":{"city":"R\\"o<tool_call>}"}}'
    time = '{"name":"get_time","arguments":{}}'
    for tp, text in (
            (tools.plan(_req(tools=[WEATHER, TIME])), f" [{weather},{time}]"),
            (tools.plan(_req(tools=[WEATHER, TIME]), "hermes"),
             f"Checking <tool_call>\n{weather}\n</tool_call>\n<tool_call>{time}</tool_call> ok"),
            (tools.plan(_req(tools=[WEATHER, TIME]), "hermes"), f"{weather}")):
        content, calls, deltas, reason = _streamed(tp, text, step)
        whole, _ = tools.message(tp, text, "stop")
        assert reason == "tool_calls"
        assert content == (whole.content or "")
        assert [calls[i] for i in sorted(calls)] == [
            (c.function.name, c.function.arguments) for c in whole.tool_calls]
        assert json.loads(calls[0][1]) == {"city": 'R"o<tool_call>}'}
        first = next(d for d in deltas if d.index == 0)
        assert first.id and first.function.name == "get_weather"  # the name first
        if step < 5:  # the arguments came in pieces, not whole at the end
            assert sum(1 for d in deltas if d.index == 0 and not d.id) > 1


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_auto_answers_are_content_as_they_come(step):
    auto = tools.plan(_req(tools=[WEATHER]))
    tagged = tools.plan(_req(tools=[WEATHER]), "hermes")
    answer = tools.plan(_req(tools=[WEATHER], response_format={"type": "json_object"}))
    for tp, text in ((auto, "Hello [there] {x}"), (tagged, "a <tool_ b <tool_cal"),
                     (answer, '{"city":"Rome"}'), (auto, "\n  hi")):
        content, calls, _, reason = _streamed(tp, text, step)
        assert (content, calls, reason) == (text, {}, "stop")
    stream = tools.ToolStream(tagged, 1)
    delta, _ = stream.feed(0, "Hi <tool", None)  # what may open a tag is held back
    assert delta.content == "Hi "
    assert stream.feed(0, "_c", None) == (None, None)
    assert stream.feed(0, "up", "stop")[0].content == "<tool_cup"


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


@pytest.fixture(scope="module")
def smollm2_ll():
    """llguidance's tokenizer of the bundled SmolLM2 (the grammar's real alphabet)."""
    import llguidance

    from engine.tokenizer import Tokenizer
    from shared import catalog

    tok = Tokenizer.from_dir(catalog.bundled_dir(catalog.SMOLLM2))
    return llguidance.LLTokenizer(tok.backend.to_str(), eos_token=tok.eos_token_ids[0])


def _accepts(ll, grammar: str, text: str) -> bool:
    import llguidance

    m = llguidance.LLMatcher(ll, grammar, log_level=0)
    ids = ll.tokenize_str(text)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def test_auto_grammars_force_calls_once_begun(smollm2_ll):
    """What each auto grammar lets through: answers, and calls only to known tools
    with arguments valid against their parameters (compact JSON, as forced)."""
    call = '{"name":"get_weather","arguments":{"city":"Rome"}}'
    bad = ['{"name":"get_weather","arguments":{"town":"Rome"}}',  # not its parameters
           '{"name":"nope","arguments":{}}', '{"name": "get_weather", "arguments": {}}']
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    cases = [  # (format, response_format, accepted, refused)
        ("json", None, ["It is sunny [mostly].", f"[{call}]", f"\n{call}", ""],
         [f"[{b}]" for b in bad] + ["[1]", "{}", "{x"]),
        ("hermes", None, [f"Looking. <tool_call>\n{call}\n</tool_call> Done.", f"[{call}]",
                      f"<tool_call>{call}</tool_call><tool_call>{call}</tool_call>", "Hi"],
         [f"<tool_call>{b}</tool_call>" for b in bad] + ["{x"]),
        ("json", fmt, ['{"n":3}', f"[{call}]"], ["It is sunny.", call, '{"n":"3"}']),
        ("hermes", fmt, ['{"n":3}', f"<tool_call>\n{call}\n</tool_call>"],
         ["It is sunny.", f"[{call}]", f"Hi <tool_call>{call}</tool_call>"]),
    ]
    for form, rf, good, refused in cases:
        body = {"tools": [WEATHER, TIME]} | ({"response_format": rf} if rf else {})
        grammar = tools.plan(_req(**body), form).grammar
        for text in good:
            assert _accepts(smollm2_ll, grammar, text), (form, rf, text)
        for text in refused:
            assert not _accepts(smollm2_ll, grammar, text), (form, rf, text)
