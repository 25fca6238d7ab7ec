"""Structured outputs at the edge: `response_format` (or vLLM's fields) -> the
grammar the engine enforces token by token (engine/decoder/grammar.py;
docs/decisions/0048).

  - `{"type": "text"}` or none: no grammar.
  - `{"type": "json_object"}`: any JSON object.
  - `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`: JSON
    that validates against `schema` (none given: any JSON object).
  - vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, or
    `structured_outputs` {json, regex, choice, grammar}: a schema as above, a
    regular expression the whole answer matches, one of the strings, or a Lark
    grammar. At most one way per request: two are a 400.

The grammar is llguidance's JSON form of the schema, compiled here once without a
tokenizer to validate it: a schema that uses a feature llguidance does not
implement (`if`/`then`, look-around in a `pattern`, ...) is a 400 that names it.
Before that, the schema's unbounded numbers, strings, arrays and objects get
default bounds (services/gateway/structured_bounds.py; the request's
`structured_bounds` sets them), so that a reply ends. Whitespace between JSON
tokens is fixed (none, or with `structured_bounds.whitespace: "flexible"` a bounded
run; whatever the schema's `x-guidance` asks), so a small model cannot spend its
tokens on blank lines.
"""

from __future__ import annotations

import functools
import json

import re
from typing import TYPE_CHECKING, Any

from services.gateway.structured_bounds import (DEFAULT, WHITESPACE, Bounds, add_bounds,
                                                request_bounds)
from shared.api import ResponseFormat
from shared.errors import bad_request

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # only its stub declares it

ANY_OBJECT = {"type": "object"}
# Applied after the schema's own `x-guidance` options: separators "," and ":" only.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ",",
                                     "key_separator": ":"}
FLEXIBLE_OPTIONS: JsonCompileOptions = {"whitespace_pattern": WHITESPACE, "item_separator": ",",
                                        "key_separator": ":"}


def grammar_for(fmt: ResponseFormat | None, bounds: Bounds | None = DEFAULT) -> str:
    """The grammar for a request's `response_format` ("" for none or text), its
    schema under `bounds`, or a 400 naming what is wrong with it."""
    schema = response_schema(fmt)
    return "" if schema is None else schema_grammar(schema, bounds=bounds)


def vllm_structures(req) -> dict[str, Any]:
    """vLLM's structured-output fields a request sets: field name -> value."""
    so = req.structured_outputs
    asked = {"guided_json": req.guided_json, "guided_regex": req.guided_regex,
             "guided_choice": req.guided_choice, "guided_grammar": req.guided_grammar,
             **({f"structured_outputs.{k}": getattr(so, k) for k in
                 ("json", "regex", "choice", "grammar")} if so is not None else {})}
    given = {k: v for k, v in asked.items() if v is not None}
    if so is not None and not any(k.startswith("structured_outputs.") for k in given):
        raise bad_request("'structured_outputs' needs one of json, regex, choice, grammar")
    return given


def request_grammar(req) -> str:
    """The grammar a completion or chat request asks for ("" for none): its
    `response_format` or one of vLLM's fields, or a 400 naming what is wrong."""
    given = vllm_structures(req)
    bounds = request_bounds(req.structured_bounds)
    fmt = grammar_for(req.response_format, bounds)
    if fmt:
        given = {"response_format": fmt, **given}
    if len(given) > 1:
        raise bad_request(f"{' and '.join(sorted(given))} ask for two structures: send one")
    if not given:
        return ""
    (field, value), = given.items()
    kind = field.rsplit(".", 1)[-1].removeprefix("guided_")
    if field == "response_format":
        return value
    if kind == "json":
        return schema_grammar(_schema(value, field), f"'{field}'", bounds)
    if kind == "choice":  # as vLLM does: an alternation of the strings, escaped
        return _checked(_regex_grammar("|".join(re.escape(c) for c in value)), field)
    if kind == "regex":
        return _checked(_regex_grammar(value), field)
    import llguidance

    return _checked(llguidance.LLMatcher.grammar_from_lark(value), field)


def _schema(value, field: str) -> dict:
    """A schema sent as an object or as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request(f"'{field}' is not a JSON schema (nor JSON text of one)") from None
    if value is True or value == {}:
        return ANY_OBJECT
    if not isinstance(value, dict):
        raise bad_request(f"'{field}' is not a JSON schema object")
    return value


def _regex_grammar(pattern: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_regex(f"({pattern})")


def _checked(grammar: str, field: str) -> str:
    import llguidance

    err = llguidance.LLMatcher.validate_grammar(grammar)
    if err:
        raise bad_request(f"'{field}' is not valid: {_short(err)}")
    return grammar


def response_schema(fmt: ResponseFormat | None) -> dict | None:
    """The JSON schema a request's `response_format` asks for (None for none or
    text), or a 400 naming what is wrong with it."""
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise bad_request("'response_format.json_schema' needs type 'json_schema'")
        return None
    if fmt.type == "json_object":
        return ANY_OBJECT
    if fmt.json_schema is None:
        raise bad_request("'response_format' of type 'json_schema' needs 'json_schema'")
    schema = fmt.json_schema.schema
    if schema is None or schema is True:
        return ANY_OBJECT
    if schema is False:
        raise bad_request("'response_format.json_schema.schema' is false: nothing "
                          "can match it")
    return schema


def schema_grammar(schema: dict, where: str = "'response_format' schema",
                   bounds: Bounds | None = None) -> str:
    """The grammar of JSON valid against `schema` (with `bounds` added where it has
    none; None: as it is, compact), or a 400 naming what `where` (the field that
    holds the schema) uses that cannot be enforced."""
    # Property order kept (no sort_keys): the model writes the properties in it.
    return _compiled(json.dumps(schema), where, bounds)


@functools.lru_cache(maxsize=256)
def _compiled(schema_text: str, where: str, bounds: Bounds | None) -> str:
    import llguidance

    schema = json.loads(schema_text)  # a copy of its own, rewritten in place
    if isinstance(schema, dict):
        schema.pop("x-guidance", None)
        if bounds is not None:
            add_bounds(schema, bounds)
    options = FLEXIBLE_OPTIONS if bounds is not None and bounds.whitespace == "flexible" \
        else JSON_OPTIONS
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as exc:
        raise bad_request(f"{where} is not valid: {exc}") from None
    err = llguidance.LLMatcher.validate_grammar(grammar)
    if err:
        raise bad_request(f"{where} uses what structured outputs do not support: "
                          f"{_short(err)}")
    return grammar


def _short(err: str) -> str:
    return " ".join(err.split())[:300]
