"""Tool calls: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` on chat.

  1. `plan(req, fmt)`: what the request asks. `tool_choice` "none" (or no
     tools): plain chat. "auto" (the default with tools): the model may answer or
     call, in the form its chat template teaches (`fmt`,
     services/gateway/tool_formats.py), under the grammar of
     services/gateway/tool_auto.py (a call, once begun, is forced as below; a
     plain answer is free, or follows `response_format`).
     "required": a grammar forces a JSON list of calls, each `{"name": <one of the
     tools>, "arguments": <valid against its parameters>}` (one call when
     `parallel_tool_calls` is false, else at most MAX_PARALLEL_CALLS). A named
     function: a grammar forces its arguments object. So arguments always parse
     against the function's schema (services/gateway/structured.py; a schema that
     cannot be enforced is a 400 naming the tool). `response_format` shapes only
     an auto plain answer (a forced reply is a call, no answer).
  2. `template_messages`: the conversation for the chat template. A template that
     renders tools itself (engine.chat.ChatTemplate.knows_tools) gets
     `tools`, assistant `tool_calls` and tool messages' `tool_call_id` as
     transformers passes them. Any other gets TOOL_PROMPT in its system message,
     earlier calls written as the JSON list the prompt asks for, and tool results
     as user turns in `<tool_response>` tags.
  3. `reply` (whole) and `ToolStream` (streamed): the text becomes `tool_calls`
     with `finish_reason: "tool_calls"`, read by the same scanners whole or in
     pieces: each call's id and name as soon as its opening is seen, then its
     arguments as they are generated, as OpenAI streams them (an auto call in a
     format with no closing marker: whole once the reply ends); an auto plain
     answer streams as content as it comes.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from services.gateway import tool_auto, tool_formats
from services.gateway.structured import (request_grammar, response_schema, schema_grammar,
                                         vllm_structures)
from services.gateway.tool_formats import call_id
from shared.api import (
    ChatCompletionRequest, FunctionCall, FunctionDelta, NamedToolChoice, ToolCall, ToolCallDelta)
from shared.api_replies import ChatDelta, ResponseMessage
from shared.errors import bad_request

# Calls one forced reply may hold: bounded, so a small model cannot loop on calls.
MAX_PARALLEL_CALLS = 8
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOL_PROMPT = (
    "You can call functions. They are, as JSON:\n{tools}\n"
    "To call functions, reply with only a JSON list of calls, each "
    '{{"name": <function name>, "arguments": <an object of its arguments>}}, and nothing '
    "else. Otherwise answer in plain text.")
NAMED_PROMPT = "Call the function {name} now: reply with only its arguments, one JSON object."


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "auto" | "required" | "named"
    tools: tuple  # shared.api.Tool
    name: str = ""  # the named function
    parallel: bool = True
    grammar: str = ""
    format: str = "json"  # auto: the form of the calls (services/gateway/tool_formats.py)
    answer: bool = False  # auto: a plain answer follows response_format's schema

    @property
    def tagged(self) -> bool:
        """Auto calls may come in <tool_call> tags."""
        return self.format == "hermes"

    def dicts(self) -> list[dict]:
        return [{"type": "function", "function": {
            k: v for k, v in (("name", t.function.name), ("description", t.function.description),
                              ("parameters", t.function.parameters)) if v is not None}}
            for t in self.tools]  # fmt: skip


def _parameters(tool) -> dict:
    p = tool.function.parameters
    return NO_ARGUMENTS if not p else p


def plan(req: ChatCompletionRequest, fmt: str = "json") -> ToolPlan | None:
    """The request's tool plan (None: plain chat), or a 400 saying what is wrong.
    `fmt`: the form auto calls take, the one the chat template teaches
    (services/gateway/tool_formats.py; `json` where it renders no tools)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'")
        return None
    if choice == "none":
        return None
    names = [t.function.name for t in req.tools]
    if len(set(names)) < len(names):
        raise bad_request("'tools' names a function twice")
    answer = response_schema(req.response_format)  # a 400 when it is malformed
    parallel = req.parallel_tool_calls is not False
    tools = tuple(req.tools)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise bad_request(f"'tool_choice' names function '{name}', which 'tools' "
                              f"does not define")
        i = names.index(name)
        grammar = schema_grammar(_parameters(tools[i]), f"tools[{i}].function.parameters")
        return ToolPlan("named", tools, name, parallel, grammar)
    calls = tool_auto.check_tools(tools)  # a refusal names the tool, not the list
    most = MAX_PARALLEL_CALLS if parallel else 1
    if choice == "required":
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "maxItems": most}
        return ToolPlan("required", tools, "", parallel, schema_grammar(schema, "'tools'"))
    if answer is not None:
        schema_grammar(answer)  # its own 400 first
        if fmt == "json" and answer.get("type") != "object":
            raise bad_request("'response_format' with 'tools' needs a schema whose root is "
                              "an object here: a reply that starts with '[' is a list of "
                              "calls to this model's tool prompt")
    grammar = _auto_grammar(json.dumps([calls, answer]), most, fmt)
    return ToolPlan("auto", tools, "", parallel, grammar, fmt, answer is not None)


@functools.lru_cache(maxsize=256)
def _auto_grammar(key: str, most: int, fmt: str) -> str:
    calls, answer = json.loads(key)
    return tool_formats.auto_grammar(fmt, calls, most, answer)


def _arguments_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_messages(messages: list, contents: list[str], tp: ToolPlan | None,
                      knows_tools: bool) -> list[dict]:  # fmt: skip
    """The messages as the chat template gets them (see the module docstring)."""
    out = []
    for m, text in zip(messages, contents):
        d = {"role": m.role, "content": text}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments_value(c.function.arguments)}
                     for c in m.tool_calls]  # fmt: skip
            if knows_tools:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": f}
                                   for c, f in zip(m.tool_calls, calls)]
            else:
                d["content"] = ((text + "\n") if text else "") + json.dumps(calls)
        if m.role == "tool":
            if knows_tools:
                if m.tool_call_id:
                    d["tool_call_id"] = m.tool_call_id
            else:
                d = {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
        out.append(d)
    if tp is not None and not knows_tools:
        prompt = TOOL_PROMPT.format(tools=json.dumps(tp.dicts()))
        if tp.mode == "named":
            prompt += "\n" + NAMED_PROMPT.format(name=tp.name)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def parse(tp: ToolPlan, text: str) -> tuple[str | None, list[tuple[str, str]] | None]:
    """(content, calls) of a choice's whole text, read as it would have been
    streamed; calls whose arguments are cut short (`length`) leave the text as
    content."""
    if tp.mode == "named":
        return None, [(tp.name, text)]
    if tp.mode == "required":
        content, deltas = "", _ForcedCalls().feed(text)
    else:
        auto = tool_formats.reader(tp.format, tp.answer, _ForcedCalls)
        content, deltas = auto.feed(text)
        rest, more = auto.end()
        content, deltas = content + rest, deltas + more
    # The readers' deltas each carry a function: a call's first (with its id) its name
    # and "", the rest pieces of its arguments.
    fns = [(d.index, d.id, d.function) for d in deltas if d.function is not None]
    names = {i: f.name or "" for i, first, f in fns if first}
    calls = [(names[i], "".join(f.arguments or "" for j, _, f in fns if j == i))
             for i in sorted(names)]
    try:
        if all(isinstance(json.loads(a), dict) for _, a in calls):
            return (content if content.strip() else None), (calls or None)
    except ValueError:
        pass
    return text, None


def message(tp: ToolPlan | None, text: str, finish: str | None):
    """(ResponseMessage, finish_reason) of a whole chat choice."""
    if tp is None:
        return ResponseMessage("assistant", text), finish
    content, calls, reason = reply(tp, text, finish)
    return ResponseMessage("assistant", content, calls), reason


def reply(tp: ToolPlan, text: str, finish: str | None):
    """(content, tool_calls or None, finish_reason) of a whole choice."""
    content, calls = parse(tp, text)
    if not calls:
        return text, None, finish
    tool_calls = [ToolCall(id=call_id(), function=FunctionCall(name=n, arguments=a))
                  for n, a in calls]
    return content, tool_calls, ("tool_calls" if finish == "stop" else finish)


_CALL_OPENS = re.compile(r'(?:\}?[\[,])?\{"name":"([^"\\]*)","arguments":')


class _ForcedCalls:
    """A `required` reply, as generated: the grammar writes the list compactly,
    `[{"name":"f","arguments":{...}},...]`, so each call's start and the end of its
    arguments are found by scanning (strings and nesting tracked); the arguments
    stream as they come."""

    def __init__(self) -> None:
        self.buf = ""
        self.calls = 0
        self.depth = -1  # inside a call's arguments: its nesting (-1: between calls)
        self.string = self.escape = False

    def feed(self, text: str) -> list[ToolCallDelta]:
        self.buf += text
        out: list[ToolCallDelta] = []
        while self.buf:
            if self.depth < 0:
                m = _CALL_OPENS.match(self.buf)
                if m is None:
                    break  # the next call's opening is not all here yet (or the end)
                out.append(ToolCallDelta(self.calls, call_id(), "function",
                                         FunctionDelta(m.group(1), "")))
                self.calls += 1
                self.buf, self.depth = self.buf[m.end():], 0
                continue
            n = self._scan()
            piece, self.buf = self.buf[:n], self.buf[n:]
            if piece:
                out.append(ToolCallDelta(self.calls - 1, function=FunctionDelta(arguments=piece)))
        return out

    def _scan(self) -> int:
        """How much of `buf` belongs to the current arguments (all of it, or up to
        where they close, which sets depth to -1)."""
        for i, ch in enumerate(self.buf):
            if self.string:
                self.escape, self.string = (False, True) if self.escape else (
                    ch == "\\", ch != '"')
                continue
            if ch == '"':
                self.string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.depth = -1
                    return i + 1
        return len(self.buf)


class ToolStream:
    """A streamed chat's choices turned into content and tool-call deltas."""

    def __init__(self, tp: ToolPlan, n: int) -> None:
        self.tp = tp
        self._id: list[str | None] = [None] * n
        self._forced = [_ForcedCalls() for _ in range(n)] if tp.mode == "required" else []
        auto = tp.mode == "auto"
        self._auto = [tool_formats.reader(tp.format, tp.answer, _ForcedCalls)
                      for _ in range(n if auto else 0)]  # fmt: skip
        self._called = [False] * n

    def feed(self, index: int, text: str, finish: str | None) -> tuple[ChatDelta | None, str | None]:
        """The delta for a piece of choice `index` (None: nothing to send yet), and
        its finish reason."""
        if self.tp.mode == "named":
            if self._id[index] is None:
                self._id[index] = call_id()
                call = ToolCallDelta(0, self._id[index], "function",
                                     FunctionDelta(self.tp.name, text))
            else:
                call = ToolCallDelta(0, function=FunctionDelta(arguments=text))
            reason = "tool_calls" if finish == "stop" else finish
            return (ChatDelta(tool_calls=[call]) if text or self._id[index] else None), reason
        content = ""
        if self._forced:
            calls = self._forced[index].feed(text)
        else:
            auto = self._auto[index]
            content, calls = auto.feed(text)
            if finish is not None:
                rest, more = auto.end()
                content, calls = content + rest, calls + more
        self._called[index] = self._called[index] or bool(calls) or self.tp.mode == "required"
        reason = "tool_calls" if finish == "stop" and self._called[index] else finish
        if not content and not calls:
            return None, reason
        return ChatDelta(content=content or None, tool_calls=calls or None), reason


def structure(req, fmt: str, chat: bool) -> tuple[ToolPlan | None, str]:
    """The request's tool plan (chat) and grammar, each compiled where it is first
    needed, or the 400 that says what is wrong with them."""
    tp = plan(req, fmt) if chat else None
    return tp, grammar(req, tp)


def grammar(req, tp) -> str:
    """The request's structure: its tool plan's grammar (which holds response_format's
    schema), else what its response_format or vLLM's fields ask for. Tools and one of
    vLLM's fields at once are a 400."""
    if tp is not None and tp.grammar:
        given = vllm_structures(req)
        if given:
            raise bad_request(f"'tools' and {' and '.join(given)} cannot both shape the "
                              "answer: send one")
        return tp.grammar
    return request_grammar(req)
