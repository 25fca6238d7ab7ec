"""Tool-call formats (services/gateway/tool_formats.py), host only: the format a chat
template teaches, each format's replies read whole (calls, the text around them,
malformed calls as content) and streamed (cut anywhere, the same as whole), and
what each format's `auto` grammar lets through."""

from __future__ import annotations

import json

import msgspec
import pytest

from engine.chat import ChatTemplate
from services.gateway import tool_formats, tools
from shared.api import ChatCompletionRequest
from shared.api_replies import ChatDelta
from shared.errors import ServiceError
from tests.services.test_gateway_tools import _accepts, smollm2_ll  # noqa: F401 (a fixture)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}

# Short templates written as the models' own are, each teaching its format.
HERMES = (  # Qwen2.5's / Hermes 2 Pro's
    "{%- if tools %}<|im_start|>system\n# Tools\n\n<tools>\n{%- for tool in tools %}\n"
    "{{ tool | tojson }}\n{%- endfor %}\n</tools>\n\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n{%- endif %}\n{%- for m in messages %}<|im_start|>{{ m.role }}"
    "\n{{ m.content }}<|im_end|>\n{%- endfor %}<|im_start|>assistant\n")
LLAMA31 = (  # Llama 3.1's JSON tool calling
    "{{- bos_token }}{%- if tools is not none %}<|start_header_id|>user<|end_header_id|>\n\n"
    "{{- 'Given the following functions, please respond with a JSON for a function call "
    "with its proper arguments that best answers the given prompt.\\n\\n' }}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of "
    "argument name and its value}.' }}{%- for t in tools %}{{- t | tojson(indent=4) }}"
    "{%- endfor %}<|eot_id|>{%- endif %}{%- for m in messages %}"
    "{%- if m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n<|python_tag|>"
    "{%- endif %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}"
    "<|eot_id|>{%- endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n")
MISTRAL = (  # Mistral 7B Instruct v0.3's
    "{{- bos_token }}{%- for m in messages %}{%- if m.role == 'user' %}{%- if tools %}"
    "[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "[INST] {{ m.content }}[/INST]{%- elif m.tool_calls %}[TOOL_CALLS] "
    "{{ m.tool_calls | tojson }}{{ eos_token }}{%- else %}{{ m.content }}{%- endif %}"
    "{%- endfor %}")
PYTHONIC = (  # Llama 3.2's pythonic tool calling
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nYou are an expert in "
    "composing functions. If you decide to invoke any of the function(s), you MUST put it "
    "in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...),"
    " func_name2(params)]\nYou SHOULD NOT include any other text in the response.\n"
    "{{ tools | tojson }}<|eot_id|>{%- endif %}{%- for m in messages %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n")
PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
         "{% endfor %}<|im_start|>assistant\n")  # SmolLM2's: no tools


def _req(**body) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], **body}
    return msgspec.json.decode(json.dumps(body).encode(), type=ChatCompletionRequest)


def _plan(fmt: str, **body):
    return tools.plan(_req(tools=[WEATHER, TIME], **body), fmt)


@pytest.mark.parametrize("source,fmt", [
    (HERMES, "hermes"), (LLAMA31, "llama3_json"), (MISTRAL, "mistral"),
    (PYTHONIC, "pythonic"), (PLAIN, "json"),
    ("{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
])
def test_the_template_names_the_format(source, fmt):
    """Each template renders the tools it is given (or, PLAIN, knows none)."""
    assert tool_formats.detect(source) == fmt
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    assert template.knows_tools == (fmt != "json")
    text = template.render([{"role": "user", "content": "weather?"}], tools=[WEATHER])
    assert ("get_weather" in text) == (fmt != "json")


W_ROME = ("get_weather", '{"city":"Rome"}')
W_OSLO = ("get_weather", '{"city":"Oslo","unit":"celsius","days":-2}')
T_ANY = ("get_time", "{}")
HERMES_CALL = '{"name":"get_weather","arguments":{"city":"Rome"}}'
# (format, reply text, content, calls): as the auto grammar writes them, and others
CASES = [
    ("hermes", f"<tool_call>\n{HERMES_CALL}\n</tool_call>", None, [W_ROME]),
    ("hermes", f"Let me see. <tool_call>{HERMES_CALL}</tool_call><tool_call>"
               '{"name":"get_time","arguments":{}}</tool_call>', "Let me see. ", [W_ROME, T_ANY]),
    ("hermes", "Hmm <tool_call>{not a call}</tool_call>", None, None),
    ("llama3_json", '{"name":"get_weather","parameters":{"city":"Rome"}}', None, [W_ROME]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", '
                    '"unit": "celsius", "days": -2}}; {"name": "get_time", "parameters": {}}',
     None, [W_OSLO, T_ANY]),
    ("llama3_json", 'Calling. <|python_tag|>{"name": "get_weather", "arguments": '
                    '{"city": "Rome"}}\n', "Calling. \n", [W_ROME]),
    ("llama3_json", '  {"name":"get_weather","parameters":{"city":"Rome"}} Done.', " Done.",
     [W_ROME]),
    ("llama3_json", '{"name":"get_weather","parameters":{"city":"Ro', None, None),  # cut
    ("llama3_json", '{"answer": 42}', None, None),
    ("llama3_json", '{"name":"get_time","parameters":{}}; oops', None, None),
    ("llama3_json", "It is {sunny} today.", None, None),
    ("mistral", '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Rome"}}]', None,
     [W_ROME]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", '
                '"unit": "celsius", "days": -2}}, {"name": "get_time", "arguments": {}}]',
     "Sure. ", [W_OSLO, T_ANY]),
    ("mistral", '[TOOL_CALLS][{"name":"get_weather","arguments":"Rome"}]', None, None),
    ("mistral", "[TOOL_CALLS] no list", None, None),
    ("mistral", "[1, 2] and [TOOL_C", None, None),
    ("pythonic", '[get_weather(city="Rome")]', None, [W_ROME]),
    ("pythonic", "\n[get_weather(city='Oslo', unit='celsius', days=-2), get_time()]\n", None,
     [W_OSLO, T_ANY]),
    ("pythonic", '[get_weather(city="Rome", tags=("a", 1), x={"k": [None, True, 1.5]})]', None,
     [("get_weather", '{"city":"Rome","tags":["a",1],"x":{"k":[null,true,1.5]}}')]),
    ("pythonic", 'I will call [get_weather(city="Rome")]', None, None),  # not at the start
    ("pythonic", '[get_weather(city=__import__("os").getcwd())]', None, None),  # no eval
    ("pythonic", '[get_weather("Rome")]', None, None),
    ("pythonic", '[get_weather(city="Rome"), 3]', None, None),
    ("pythonic", "[get_weather(city={1, 2})]", None, None),
    ("pythonic", '[get_weather(city="Ro', None, None),
    ("pythonic", "[1] is a citation.", None, None),
]


def _whole(fmt: str, text: str):
    msg, reason = tools.message(_plan(fmt), text, "stop")
    calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls or [])
    return msg.content, calls or None, reason


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_whole_replies(fmt, text, content, calls):
    """Calls become tool_calls (arguments as compact JSON text) and the text outside
    them content; a reply whose calls do not parse is content, whole, as it came."""
    got = _whole(fmt, text)
    if calls is None:
        assert got == (text, None, "stop")
    else:
        assert got == (content, calls, "tool_calls")


def _streamed(tp, pieces: list[str], finish: str = "stop"):
    """(content or None, calls or None, finish_reason, deltas) of a reply fed in `pieces`."""
    stream = tools.ToolStream(tp, 1)
    content, deltas, reason = "", [], None
    for i, piece in enumerate(pieces):
        delta, reason = stream.feed(0, piece, finish if i == len(pieces) - 1 else None)
        if delta is not None:
            content += delta.content or ""
            deltas += delta.tool_calls or []
    names = {d.index: d.function.name for d in deltas if d.id}
    calls = [(names[i], "".join(d.function.arguments or "" for d in deltas if d.index == i))
             for i in sorted(names)]
    return content, calls or None, reason, deltas


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_streamed_replies_cut_anywhere_equal_the_whole(fmt, text, content, calls):
    tp = _plan(fmt)
    whole_content, whole_calls, whole_reason = _whole(fmt, text)
    for cut in range(len(text) + 1):
        got, got_calls, reason, deltas = _streamed(tp, [text[:cut], text[cut:]])
        assert (got or None, got_calls, reason) == (
            whole_content if whole_calls else text, whole_calls, whole_reason), cut
        for i in {d.index for d in deltas}:  # each call: its id and name first
            first = next(d for d in deltas if d.index == i)
            assert first.id.startswith("call_") and first.type == "function"
            assert first.function.name


def test_streamed_content_comes_before_the_call_and_the_call_at_the_end():
    """Text before a call streams as it comes (a possible marker's start held back);
    a call in a format with no closing marker comes once the reply ends: its name,
    then its arguments, whole."""
    tp = _plan("mistral")
    stream = tools.ToolStream(tp, 1)
    assert stream.feed(0, "Sure, checking [TOO", None)[0].content == "Sure, checking "
    assert stream.feed(0, 'L_CALLS][{"name":"get_time",', None) == (None, None)
    delta, reason = stream.feed(0, '"arguments":{}}]', "stop")
    assert reason == "tool_calls" and delta.content is None
    name, arguments = delta.tool_calls
    assert (name.index, name.function.name, name.function.arguments) == (0, "get_time", "")
    assert (arguments.index, arguments.id, arguments.function.arguments) == (0, None, "{}")
    stream = tools.ToolStream(_plan("llama3_json"), 1)  # an answer that is no call
    assert stream.feed(0, "It is ", None)[0].content == "It is "
    assert stream.feed(0, "sunny.", "stop") == (ChatDelta(content="sunny."), "stop")


def test_a_call_cut_short_keeps_length():
    text = '[get_weather(city="Ro'
    msg, reason = tools.message(_plan("pythonic"), text, "length")
    assert (msg.content, msg.tool_calls, reason) == (text, None, "length")
    assert _streamed(_plan("pythonic"), [text[:5], text[5:]], "length")[:3] == (
        text, None, "length")


def test_auto_grammars_write_the_format(smollm2_ll):  # noqa: F811
    """What each format's auto grammar lets through: calls in its form, naming a
    tool (the JSON forms: with arguments valid against its parameters; pythonic:
    its parameters in order, the required ones, each once, simple values of their
    type), or a plain answer that does not begin as its calls do."""
    cases = {  # format: (accepted, refused)
        "llama3_json": (
            ['{"name":"get_weather","parameters":{"city":"Rome"}}',
             '{"name":"get_weather","parameters":{"city":"Rome"}}; '
             '{"name":"get_time","parameters":{}}', "It is sunny.", "[1]", ""],
            ['{"name":"get_weather","arguments":{"city":"Rome"}}',
             '{"name":"get_weather","parameters":{"town":"Rome"}}',
             '{"name":"nope","parameters":{}}', "{x"]),
        "mistral": (
            ['[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Rome"}}]',
             '[TOOL_CALLS] [{"name":"get_time","arguments":{}}]', "It is sunny.", "{x"],
            ['[TOOL_CALLS][{"name":"nope","arguments":{}}]', "[1]",
             '[{"name":"get_time","arguments":{}}]']),
        "pythonic": (
            ['[get_weather(city="Rome")]', "[get_weather(city='Oslo', unit='celsius', "
             "days=-2), get_time()]", '[get_weather(city="Rome",days=3)]', "It is sunny.",
             "{x"],
            ["[get_weather(city=1)]", '[get_weather(town="Rome")]',
             '[get_weather(city="Rome", days=1.5)]', '[get_weather(city="Rome", unit="kelvin")]',
             '[get_weather(unit="celsius")]', '[get_weather(city="Rome", city="Oslo")]',
             '[get_weather(unit="celsius", city="Rome")]', "[nope()]", "[1]"]),
    }
    for fmt, (good, refused) in cases.items():
        grammar = _plan(fmt).grammar
        for text in good:
            assert _accepts(smollm2_ll, grammar, text), (fmt, text)
        for text in refused:
            assert not _accepts(smollm2_ll, grammar, text), (fmt, text)
    one = _plan("pythonic", parallel_tool_calls=False).grammar
    assert not _accepts(smollm2_ll, one, "[get_time(), get_time()]")
    answer = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array"}}}
    for fmt, call in (("mistral", '[TOOL_CALLS][{"name":"get_time","arguments":{}}]'),
                      ("pythonic", "[get_time()]")):
        grammar = _plan(fmt, response_format=answer).grammar  # any root: the forms differ
        assert _accepts(smollm2_ll, grammar, "[1,2]") and _accepts(smollm2_ll, grammar, call)
        assert not _accepts(smollm2_ll, grammar, "It is sunny.")
    # An object answer beside Llama's object calls: a reply that is a call is read as
    # one, any other as the answer.
    tp = _plan("llama3_json", response_format={"type": "json_object"})
    call = '{"name":"get_time","parameters":{}}'
    for text in ('{"n":3}', call):
        assert _accepts(smollm2_ll, tp.grammar, text)
    assert not _accepts(smollm2_ll, tp.grammar, "It is sunny.")
    assert tools.message(tp, '{"n":3}', "stop")[0].content == '{"n":3}'
    assert tools.message(tp, call, "stop")[0].tool_calls[0].function.name == "get_time"


def test_a_pythonic_tool_needs_a_python_name():
    bad = {"type": "function", "function": {"name": "get-weather"}}
    with pytest.raises(ServiceError) as err:
        tools.plan(_req(tools=[WEATHER, bad]), "pythonic")
    assert err.value.status == 400 and "tools[1].function.name" in err.value.message
    assert tools.plan(_req(tools=[WEATHER, bad]), "llama3_json").grammar


def test_a_pythonic_parameter_of_several_types_takes_any_literal(smollm2_ll):  # noqa: F811
    either = {"type": "function", "function": {"name": "set_limit", "parameters": {
        "type": "object", "properties": {"limit": {"type": ["integer", "null"]}}}}}
    grammar = tools.plan(_req(tools=[either]), "pythonic").grammar  # was a 500 (TypeError)
    for text in ("[set_limit(limit=3)]", "[set_limit(limit=None)]"):
        assert _accepts(smollm2_ll, grammar, text), text
