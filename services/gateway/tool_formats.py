"""Tool-call formats: the form a model writes its `tool_choice: "auto"` calls in,
read from its chat template, and the reading of a reply in that form.

A model calls tools the way its chat template taught it (the template writes the
instructions and the earlier calls of a conversation), so the template names the
format (`detect`), as vLLM's `--tool-call-parser` names it by hand:

  - `json`: `[{"name": ..., "arguments": {...}}, ...]` (or one call object) opening
    the reply. The template renders no tools, so the model gets the documented
    tool prompt (services/gateway/tools.py), which asks for this.
  - `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere
    in the text. The template writes `<tool_call>` (Qwen's, Hermes'), or renders
    tools with none of the markers below.
  - `mistral`: `[TOOL_CALLS]`, then `[{"name": ..., "arguments": {...}}, ...]`.
    The template writes `[TOOL_CALLS]` (Mistral's).
  - `pythonic`: `[get_weather(city="Paris"), f(x=1)]` opening the reply. The
    template shows calls as `[name(arg=value, ...)]` (Llama 3.2's and 4's pythonic).
  - `llama3_json`: `<|python_tag|>` (optional), then `{"name": ..., "parameters":
    {...}}`, several separated by `;`. The template writes `<|python_tag|>` or asks
    for `"parameters"` (Llama 3.1's and 3.2's JSON).

Each format gives the `auto` grammar its calls (`auto_grammar`; the grammar is
services/gateway/tool_auto.py's, so a call, once begun, names a tool and, in the
JSON formats, carries arguments valid against its parameters) and a reader
(`reader`): fed the reply as it comes, it returns content and tool-call deltas,
and the whole reply is read by the same code, so streamed and whole agree. The
grammar writes a format's marker as text: a token the model's vocabulary holds as
special (Llama's `<|python_tag|>`, Mistral's `[TOOL_CALLS]` in v3 tokenizers) is
never allowed under a grammar, so a Llama JSON call opens with its `{` (read with
the tag or without it) and Mistral's marker is spelled out.

  - `json` and `hermes` are read by tool_auto.AutoCalls: each call's name as soon
    as its opening is seen, then its arguments in pieces as they are generated.
  - The others by `MarkedCalls`: text before a call's start (its marker, or the
    format's first character at the reply's start) streams as content; from the
    start on, the text is held until the reply ends, then parsed whole (JSON, or
    Python's `ast` for `pythonic`: literals only, never evaluated). Each call then
    comes as two deltas, its id and name, then its arguments whole. These formats
    have no closing marker, so a call is only known complete at the reply's end.
    Text the parse does not accept (a malformed call, cut short by `max_tokens`)
    is content, whole: a reply never fails for its calls' sake.
"""

from __future__ import annotations

import ast
import json
import keyword
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from services.gateway import tool_auto
from shared.api import FunctionDelta, ToolCallDelta
from shared.errors import bad_request

PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
# A pythonic template shows a call list as `[func_name1(params_name1=params_value1, ...`.
_PYTHONIC = re.compile(r"\[\s*[A-Za-z_]\w*\(\s*[A-Za-z_]\w*\s*=")
_JSON = json.JSONDecoder()


def detect(source: str) -> str:
    """The format a chat template (its Jinja source) teaches. A template that does
    not use `tools` (engine.chat.ChatTemplate.knows_tools) renders none, so the
    model gets the documented tool prompt: `json`. Markers are checked from the
    most specific: Mistral's and Hermes' are their own, a pythonic call list is
    shown as such, and `"parameters"` is the key only Llama's JSON form asks for."""
    if "tools" not in source:
        return "json"
    if MISTRAL_CALLS in source:
        return "mistral"
    if tool_auto.OPEN in source:
        return "hermes"
    if _PYTHONIC.search(source):
        return "pythonic"
    if PYTHON_TAG in source or '"parameters"' in source:
        return "llama3_json"
    return "hermes"  # a template that renders tools in a form not known here


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def reader(fmt: str, answer: bool, forced_factory):
    """A choice's reader: `feed(text)` -> (content, call deltas) for a piece of the
    reply, `end()` -> the same for what is held when the choice ends. `answer`:
    a plain answer follows response_format's JSON; `forced_factory`: the `required`
    scanner (services.gateway.tools._ForcedCalls) the JSON formats read calls with."""
    if fmt in ("json", "hermes"):
        return tool_auto.AutoCalls(fmt == "hermes", answer, forced_factory)
    return MarkedCalls(_NATIVE[fmt])


def auto_grammar(fmt: str, calls: list[dict], most: int, answer: dict | None) -> str:
    """The `auto` grammar for `fmt`. `calls`: each tool's call schema
    (tool_auto.call_schema); `most`: calls one reply may hold; `answer`: the
    response_format schema a plain answer follows. A tool the format cannot write
    is a 400 naming it."""
    if fmt in ("json", "hermes"):
        return tool_auto.auto_grammar(calls, most, fmt == "hermes", answer)
    native = _NATIVE[fmt]
    return tool_auto.native_grammar(native.rules(calls, most), native.opens, answer)


class MarkedCalls:
    """One choice's reply in a format whose calls run to the reply's end (see the
    module docstring): content until a call starts, then held and parsed whole."""

    def __init__(self, fmt: "_Native") -> None:
        self.fmt = fmt
        self.state = "lead"  # lead (blanks so far) | text | call
        self.held = ""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.held += text
        if self.state == "call":
            return "", []
        if self.state == "lead":
            stripped = self.held.lstrip()
            if not stripped:
                return "", []
            if stripped[0] in self.fmt.leads:
                self.state = "call"
                return "", []
            self.state = "text"
        at = min((i for i in (self.held.find(m) for m in self.fmt.markers) if i >= 0),
                 default=-1)  # fmt: skip
        if at >= 0:
            content, self.held, self.state = self.held[:at], self.held[at:], "call"
            return content, []
        keep = _partial(self.held, self.fmt.markers)  # may be a marker's start: held
        content, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return content, []

    def end(self) -> tuple[str, list[ToolCallDelta]]:
        held, self.held = self.held, ""
        got = self.fmt.parse(held) if self.state == "call" else None
        if not got or not got[0]:
            return held, []
        calls, rest = got
        deltas = []
        for i, (name, arguments) in enumerate(calls):
            deltas += [ToolCallDelta(i, call_id(), "function", FunctionDelta(name, "")),
                       ToolCallDelta(i, function=FunctionDelta(arguments=arguments))]
        return rest, deltas


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """Characters at the end of `text` that may begin one of `markers`."""
    for n in range(min(max((len(m) for m in markers), default=1) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def _arguments(value) -> str:
    """A call's arguments as the reply carries them: compact JSON of an object."""
    if not isinstance(value, dict):
        raise ValueError("arguments are not an object")
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _json_call(obj, keys: tuple[str, ...]) -> tuple[str, str]:
    """(name, arguments) of a JSON call object whose arguments are under one of `keys`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a call")
    given = [k for k in keys if k in obj]
    if len(given) != 1 or set(obj) != {"name", given[0]}:
        raise ValueError("not a call")
    return obj["name"], _arguments(obj[given[0]])


@dataclass(frozen=True)
class _Native:
    """A format read by MarkedCalls. `markers`: text that starts calls anywhere;
    `leads`: characters that start them when they open the reply; `opens`: those
    a plain answer may not begin with under the `auto` grammar (its calls do).
    `read(text)` -> (calls as (name, arguments JSON), the text after them), raising
    on anything that is not well-formed calls; `grammar(calls, most)` -> Lark rules
    whose `calls` is one reply's calls in this format."""

    name: str
    read: Callable[[str], tuple[list[tuple[str, str]], str]]
    grammar: Callable[[list[dict], int], list[str]]
    markers: tuple[str, ...] = ()
    leads: str = ""
    opens: str = ""

    def parse(self, text: str) -> tuple[list[tuple[str, str]], str] | None:
        """The calls `text` (which begins where they start) holds; None when it holds
        no well-formed calls."""
        try:
            return self.read(text)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None

    def rules(self, calls: list[dict], most: int) -> list[str]:
        return self.grammar(calls, most)


def _renamed(call: dict, key: str) -> dict:
    """A call schema (tool_auto.call_schema) with its arguments under `key`."""
    props = call["properties"]
    return {**call, "properties": {"name": props["name"], key: props["arguments"]},
            "required": ["name", key]}


def _llama3_read(text: str):
    text = text.lstrip()
    at = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
    calls = []
    while True:
        obj, at = _JSON.raw_decode(text, _skip(text, at))
        calls.append(_json_call(obj, ("parameters", "arguments")))  # Llama writes either
        after = _skip(text, at)
        if not text.startswith(";", after):
            return calls, text[at:]
        at = after + 1


def _llama3_rules(calls: list[dict], most: int) -> list[str]:
    one = {"anyOf": [_renamed(c, "parameters") for c in calls]}
    return [f"call: {tool_auto.schema_lexeme(one)}",
            "calls: call" + _more('";" LEAD? call', most)]


def _mistral_read(text: str):
    listed, at = _JSON.raw_decode(text, _skip(text, len(MISTRAL_CALLS)))
    if not isinstance(listed, list):
        raise ValueError("not a list of calls")
    return [_json_call(c, ("arguments",)) for c in listed], text[at:]


def _mistral_rules(calls: list[dict], most: int) -> list[str]:
    listed = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "maxItems": most}
    return [f"calls: {json.dumps(MISTRAL_CALLS)} LEAD? listed",
            f"listed: {tool_auto.schema_lexeme(listed)}"]


def _pythonic_read(text: str):
    """`[f(a=1, b="x"), g()]`: read with `ast` (literal arguments only, as
    `ast.literal_eval` allows: strings, numbers, True / False / None, lists,
    tuples, dicts). Under the grammar a call names a tool and passes its parameters
    by keyword, each at most once, in the schema's order, the required ones always
    (so a call's keywords end where its parameters do, and a small model cannot
    repeat one until `max_tokens`); a value of a simple type (string, integer,
    number, boolean, null, an enum of these) has that type, and others are any
    such literal, not checked against the schema."""
    tree = ast.parse(text.strip(), mode="eval").body
    if not isinstance(tree, ast.List) or not tree.elts:
        raise ValueError("not a list of calls")
    calls = []
    for call in tree.elts:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) \
                or call.args or any(k.arg is None for k in call.keywords):  # fmt: skip
            raise ValueError("not a call with keyword arguments")
        args = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        calls.append((call.func.id, _arguments(_plain(args))))
    return calls, ""


def _pythonic_rules(calls: list[dict], most: int) -> list[str]:
    out = [r"""STR: /"([^"\\\n]|\\.)*"|'([^'\\\n]|\\.)*'/""",
           r"INT: /-?(0|[1-9][0-9]*)/",
           r"NUM: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/", r"SEP: /, ?/",
           'value: STR | NUM | "True" | "False" | "None" | "[" (value ("," " "? value)*)? "]"'
           ' | "{" (value ":" " "? value ("," " "? value ":" " "? value)*)? "}"',
           'calls: "[" call' + _more('"," " "? call', most) + ' "]"',
           "call: " + " | ".join(f"fn{i}" for i in range(len(calls)))]
    for i, c in enumerate(calls):
        name = c["properties"]["name"]["const"]
        if not _identifier(name):
            raise bad_request(f"'tools[{i}].function.name' is '{name}': this model writes "
                              f"calls as Python (the pythonic tool format), so a tool's "
                              f"name must be a Python identifier")
        params = c["properties"]["arguments"]
        out += _keywords(f"fn{i}", name, params.get("properties") or {},
                         set(params.get("required") or ()))
    return out


def _keywords(rule: str, name: str, properties: dict, required: set) -> list[str]:
    """Lark rules whose `rule` is a pythonic call of `name` (see _pythonic_read): its
    keywords in order, each optional one may be left out. `f_j` is one or more of
    the keywords from the j-th on, with none before it; `g_j` the same after one
    (each of its keywords after a comma)."""
    names = [k for k in properties if _identifier(k)]  # others cannot be passed
    n = len(names)
    if not n:
        return [f"{rule}: {json.dumps(name + '()')}"]
    free = [all(k not in required for k in names[j:]) for j in range(n)] + [True]
    out = []

    def rest(j: int) -> str:  # what may follow the j-th keyword written
        return "" if j == n else f" {rule}_g{j}" + ("?" if free[j] else "")

    for j, k in enumerate(names):
        kw = f"{json.dumps(k + '=')} {_py_value(properties[k])}"
        skip = k not in required and j + 1 < n
        out += [f"{rule}_f{j}: {kw}{rest(j + 1)}" + (f" | {rule}_f{j + 1}" if skip else ""),
                f"{rule}_g{j}: SEP {kw}{rest(j + 1)}" + (f" | {rule}_g{j + 1}" if skip else "")]
    args = f"{rule}_f0" + ("?" if free[0] else "")
    return out + [f"{rule}: {json.dumps(name + '(')} {args} \")\""]


def _more(item: str, most: int) -> str:
    """Lark for up to `most - 1` more of `item`."""
    return f" ({item}){{0,{most - 1}}}" if most > 1 else ""


def _identifier(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


def _plain(value):
    """A literal as JSON has it (tuples as lists); anything JSON cannot hold is a
    ValueError (a set, bytes, a complex number, a key that is no string)."""
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("a key that is no string")
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise ValueError(f"{type(value).__name__} is no JSON value")


def _py_value(schema) -> str:
    """The lark expression of a pythonic argument's value under `schema`: its type
    where it is a simple one, else any literal."""
    if not isinstance(schema, dict):
        return "value"
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(
            v is None or isinstance(v, (str, bool, int, float)) for v in enum):  # fmt: skip
        forms = [f for v in enum for f in ({repr(v), json.dumps(v)} if isinstance(v, str)
                                          else {repr(v)})]  # fmt: skip
        return "(" + " | ".join(json.dumps(f) for f in sorted(forms)) + ")"
    simple: dict[str | None, str] = {"string": "STR", "integer": "INT", "number": "NUM",
                                     "boolean": '("True" | "False")', "null": '"None"'}
    kind = schema.get("type")
    return simple.get(kind, "value") if isinstance(kind, str) else "value"  # a list: any literal


_NATIVE: dict[str, _Native] = {f.name: f for f in (
    # PYTHON_TAG is a special token: under the grammar, never written
    _Native("llama3_json", _llama3_read, _llama3_rules, (PYTHON_TAG,), "{", "{"),
    _Native("mistral", _mistral_read, _mistral_rules, (MISTRAL_CALLS,), "", "["),
    _Native("pythonic", _pythonic_read, _pythonic_rules, (), "[", "["),
)}
