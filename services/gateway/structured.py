"""Structured outputs at the edge: `response_format` -> the grammar the engine
enforces token by token (engine/decoder/grammar.py; docs/decisions/0048).

  - `{"type": "text"}` or none: no grammar.
  - `{"type": "json_object"}`: any JSON object.
  - `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`: JSON
    that validates against `schema` (none given: any JSON object).

The grammar is llguidance's JSON form of the schema, compiled here once without a
tokenizer to validate it: a schema that uses a feature llguidance does not
implement (`if`/`then`, look-around in a `pattern`, ...) is a 400 that names it.
Whitespace between JSON tokens is fixed (no free whitespace, whatever the schema's
`x-guidance` asks), so a small model cannot spend its tokens on blank lines.
"""

from __future__ import annotations

import functools
import json

from shared.api import ResponseFormat
from shared.errors import bad_request

ANY_OBJECT = {"type": "object"}
# Applied after the schema's own `x-guidance` options: separators "," and ":" only.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def grammar_for(fmt: ResponseFormat | None) -> str:
    """The grammar for a request's `response_format` ("" for none or text), or a
    400 naming what is wrong with it."""
    schema = response_schema(fmt)
    return "" if schema is None else schema_grammar(schema)


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


def schema_grammar(schema: dict, where: str = "'response_format' schema") -> str:
    """The grammar of JSON valid against `schema`, or a 400 naming what `where`
    (the field that holds the schema) uses that cannot be enforced."""
    # Property order kept (no sort_keys): the model writes the properties in it.
    return _compiled(json.dumps(schema), where)


@functools.lru_cache(maxsize=256)
def _compiled(schema_text: str, where: str) -> str:
    import llguidance

    schema = json.loads(schema_text)
    if isinstance(schema, dict):
        schema.pop("x-guidance", None)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as exc:
        raise bad_request(f"{where} is not valid: {exc}") from None
    err = llguidance.LLMatcher.validate_grammar(grammar)
    if err:
        raise bad_request(f"{where} uses what structured outputs do not support: "
                          f"{_short(err)}")
    return grammar


def _short(err: str) -> str:
    return " ".join(err.split())[:300]
