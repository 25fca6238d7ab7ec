"""`tool_choice: "auto"`: one grammar lets the model answer in plain text or call a
function, and the reply is read back as content and calls, whole and streamed
(docs/decisions/0057).

  - **The grammar** (`auto_grammar`, llguidance's lark form). A reply is either a
    call or an answer. Calls are written as the documented tool prompt asks, a
    JSON list `[{"name": <a tool>, "arguments": <its parameters>}, ...]` (or one
    such object, without the list), after optional whitespace; where the chat
    template teaches tags (services/gateway/tool_formats.py's `hermes`), also
    inside `<tool_call>` ... `</tool_call>` tags, anywhere in the text, as Qwen's
    and Hermes' templates teach. A template that teaches another form of its own
    gets `native_grammar`: that form's calls, or an answer as below. Once a call
    starts, the grammar forces its name to be one of the tools and its arguments
    to validate against that tool's parameters (compact JSON, as `required`).
    A plain answer is any text that does not begin with `[` or `{`; with
    `response_format` it is instead the JSON that format asks (and the calls
    outside the tags are a list only, so the two cannot be confused).
  - **Release**: in the untagged grammar, once an answer's first character is
    written nothing is left to enforce; the grammar marks that point with the
    capture `RELEASE`, and the engine drops the sequence's grammar there
    (engine/decoder/grammar.py), so the rest of a plain answer decodes exactly as
    without tools' grammar (a native form's too). The tagged grammar keeps
    watching for a tag.
  - **The reply** (`AutoCalls`): fed the text as it comes, it gives content as soon
    as it cannot be part of a call (a possible `<tool_call>` prefix is held back)
    and each call as OpenAI streams it: its id and name, then its arguments in
    pieces as they are generated. The whole reply is read by the same code, so the
    streamed and the whole agree.
"""

from __future__ import annotations

import json

from services.gateway.structured import JSON_OPTIONS, schema_grammar
from shared.api import ToolCallDelta
from shared.errors import bad_request
from shared.messages import GRAMMAR_RELEASE as RELEASE

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_schema(name: str, parameters: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def schema_lexeme(schema: dict) -> str:
    """`%json` of a schema, with the separators and whitespace structured outputs use."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def auto_grammar(calls: list[dict], max_calls: int, tagged: bool,
                 answer: dict | None = None) -> str:  # fmt: skip
    """The grammar of an auto reply (see the module docstring). `calls`: each tool's
    call schema; `answer`: the response_format schema a plain answer follows."""
    one = {"anyOf": calls}
    listed = {"type": "array", "items": one, "minItems": 1, "maxItems": max_calls}
    rules = [r"LEAD: /\s+/", r"NL: /\n/", f"call: {schema_lexeme(one)}"]
    if answer is not None:  # an answer in JSON; calls as a list or in tags
        rules += [f"answer: {schema_lexeme(answer)}",
                  f"start: answer | {f'tag{{1,{max_calls}}} LEAD?' if tagged else 'LEAD? calls'}",
                  f"calls: {schema_lexeme(listed)}"]
    elif tagged:  # text, with calls in tags anywhere; or calls alone
        rules += [f"start: LEAD? calls | tag{{0,{max_calls}}} TEXT",
                  f"calls: {schema_lexeme({'anyOf': [listed, one]})}",
                  f"tag_head[lazy]: TEXT \"{OPEN}\"",
                  r"TEXT: /\s*([^\s\[{](.|\n)*)?/"]
    else:  # text or calls, told apart by the first character; then text is free
        rules += ["start: LEAD? calls | LEAD? | first REST",
                  f"calls: {schema_lexeme({'anyOf': [listed, one]})}",
                  f"first[capture=\"{RELEASE}\"]: FIRST",
                  r"FIRST: /\s*[^\s\[{]/", r"REST: /(.|\n)*/"]
    if tagged:
        head = "tag_head" if answer is None else f"LEAD? \"{OPEN}\""
        rules.append(f"tag: {head} NL? call NL? \"{CLOSE}\"")
    return _checked(rules)


def native_grammar(call_rules: list[str], opens: str, answer: dict | None = None) -> str:
    """The grammar of an auto reply in a model's own call format
    (services/gateway/tool_formats.py): `call_rules` define `calls`, the reply's
    calls with their marker. Otherwise a plain answer, which may not begin with
    one of `opens` (the format's calls do) and is released at its first character
    as in the untagged grammar; or, with `answer`, response_format's JSON."""
    rules = [r"LEAD: /\s+/", *call_rules]
    if answer is not None:
        rules += [f"answer: {schema_lexeme(answer)}", "start: answer | LEAD? calls"]
    else:
        first = "".join("\\" + c for c in opens)
        rules += ["start: LEAD? calls | LEAD? | first REST",
                  f"first[capture=\"{RELEASE}\"]: FIRST",
                  f"FIRST: /\\s*[^\\s{first}]/", r"REST: /(.|\n)*/"]
    return _checked(rules)


def _checked(rules: list[str]) -> str:
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_lark("\n".join(rules) + "\n")
    err = llguidance.LLMatcher.validate_grammar(grammar)
    if err:
        raise bad_request(f"'tools' cannot be enforced with this request: "
                          f"{' '.join(err.split())[:300]}")
    return grammar


def check_tools(tools) -> list[dict]:
    """Each tool's call schema; a tool whose parameters cannot be enforced is a 400
    naming it."""
    out = []
    for i, t in enumerate(tools):
        params = t.function.parameters or {"type": "object", "properties": {},
                                           "additionalProperties": False}
        schema_grammar(params, f"tools[{i}].function.parameters")
        out.append(call_schema(t.function.name, params))
    return out


class AutoCalls:
    """One choice's auto reply, read as it comes: `feed` returns (content, call
    deltas) for a piece of text; `end` what is held back when the choice ends."""

    def __init__(self, tagged: bool, answer: bool, forced_factory) -> None:
        self.tagged, self.answer = tagged, answer  # answer: response_format's JSON
        self.state = "lead"  # lead | text | json | tag | plain (an answer: no tags)
        self.held = ""  # text not yet classified (lead, or a possible tag's start)
        self.forced = forced_factory()  # services.gateway.tools._ForcedCalls: the scanner
        self.opened = 0  # the scanner's calls when this tag began
        self.raw = ""  # json: the text given to the scanner (content if no call opens)
        self.tag_raw = ""  # tag: the text since its opening (content if no call opens)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        content, calls = "", []
        if self.state == "tag":
            self.tag_raw += text
        self.held += text
        while self.held:
            if self.state == "lead":
                stripped = self.held.lstrip()
                if not stripped:
                    break  # whitespace only so far
                if self.answer:  # calls in tags, or (untagged) a list; else the answer
                    self.state = ("text" if stripped[0] == "<" else "plain") if self.tagged \
                        else ("json" if stripped[0] == "[" else "plain")  # fmt: skip
                else:
                    self.state = "json" if stripped[0] in "[{" else "text"
                if self.state == "json":
                    self.held = stripped
            elif self.state == "plain":
                content, self.held = content + self.held, ""
            elif self.state == "json":
                self.raw += self.held
                calls += self.forced.feed(self.held)
                self.held = ""
            elif self.state == "text":
                at = self.held.find(OPEN) if self.tagged else -1
                if at < 0:
                    keep = _partial(self.held) if self.tagged else 0
                    content += self.held[:len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep:]
                    break
                content += self.held[:at]
                self.held, self.state, self.opened = self.held[at + len(OPEN):], "tag", \
                    self.forced.calls  # fmt: skip
                self.tag_raw = self.held
            else:  # tag: its call's JSON, then the closing tag
                forced = self.forced
                if forced.calls == self.opened or forced.depth >= 0:  # the call goes on
                    piece = self.held if forced.buf or forced.calls > self.opened \
                        else self.held.lstrip()  # fmt: skip
                    calls += forced.feed(piece)
                    self.held = ""
                    if forced.calls == self.opened or forced.depth >= 0:
                        break
                    self.held, forced.buf = forced.buf, ""  # its closing brace on
                at = self.held.find(CLOSE)
                if at < 0:
                    break
                self.held, self.state = self.held[at + len(CLOSE):], "text"
        return content, calls

    def end(self) -> tuple[str, list[ToolCallDelta]]:
        """Content still held when the choice ends (text that was not a call), and no
        more calls (the interface of services/gateway/tool_formats.py's readers)."""
        held, self.held = self.held, ""
        if self.state == "json" and not self.forced.calls:  # not in the grammar's form
            return self.raw, []
        if self.state == "tag" and self.forced.calls == self.opened:  # a tag with no call
            return OPEN + self.tag_raw, []
        return (held if self.state in ("text", "lead", "plain") else ""), []


def _partial(text: str) -> int:
    """Characters at the end of `text` that may begin the opening tag."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0

