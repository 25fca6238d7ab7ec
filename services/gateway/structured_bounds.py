"""Default bounds on a JSON-schema structured output's values, so that a constrained
reply ends.

A schema's grammar forces a reply to be JSON of its shape, not to finish: a bare
`{"type": "number"}` lets a model write digits until `max_tokens` (seen: a
`population_millions` float as `1212222222223332323333...` to the last token, and
openai's `parse()` raising `LengthFinishReasonError`); a bare string, array or free
whitespace does the same. So each schema is rewritten (a copy) before llguidance
compiles it, and every value the schema types without a bound gets one:

  - integer: at most `number_digits` (15) digits: `minimum` / `maximum`
    -(10^15 - 1) / 10^15 - 1;
  - number: at most 15 digits before the point (`exclusiveMinimum` /
    `exclusiveMaximum` -10^15 / 10^15) and `fraction_digits` (6) after it
    (`multipleOf` 1e-6: llguidance bounds a fraction that way, and writes no
    exponent under it);
  - string: `maxLength` `string_length` (512), not below its `minLength`; one with a
    `pattern` or a `format` keeps the shape the schema gave it;
  - array: `maxItems` `array_items` (64), not below its `minItems`;
  - object with `properties` (and no `additionalProperties`, `patternProperties`
    or combinator of its own): no properties but those (`additionalProperties:
    false`), unless `additional_properties` is true: a model otherwise adds keys
    after the last one, a key's name itself without end (vLLM's default grammar
    backend reads such a schema the same way);
  - whitespace: `compact` (none between JSON tokens), or `flexible`: up to 16
    characters of it where JSON allows it.

A side the schema bounds itself is left as it is: a bound the user gave is never
tightened, and a default that would leave nothing to match (a `minimum` past the
default's top) is not added. The rewrite reaches every place a subschema can sit
and narrows what it allows (`properties`, `items`, `anyOf`, `$defs`, ...; not
`not` or `if`, where a bound would widen the schema), so a `$ref` lands on a
rewritten target. An object intersected with others (an `allOf` member; an
`anyOf` / `oneOf` member or a `$ref` target beside properties of the schema that
holds it) stays open: it cannot know the others' properties. Values the schema
leaves untyped (`{}`, the members of a bare `{"type": "object"}` such as
`json_object`'s, a map's keys) are not bounded, nor are `enum` / `const` ones
(already finite). A request sets the bounds with `structured_bounds`
(shared/api_structured.py).
"""

from __future__ import annotations

import json
from typing import Any, Iterable, NamedTuple

from msgspec import UNSET

WHITESPACE = r"[\x20\x0A\x0D\x09]{1,16}"  # `flexible`: matched at most once per place

# Keywords whose value is one subschema, a map of them, or a list of them, where a
# bound on the subschema narrows the whole.
_ONE = ("additionalProperties", "items", "additionalItems", "then", "else",
        "unevaluatedProperties", "unevaluatedItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
# An object with one of these keeps whatever other properties they allow.
_OPEN = {"additionalProperties", "patternProperties", "unevaluatedProperties", "allOf",
         "anyOf", "oneOf", "$ref"}
# Keywords that, beside a combinator or a `$ref`, intersect an object with its members.
_OBJECT = {"properties", "patternProperties", "additionalProperties", "required",
           "minProperties", "maxProperties", "allOf"}


class Bounds(NamedTuple):
    """The bounds a schema's unbounded values get (None: that one off)."""

    number_digits: int | None = 15
    fraction_digits: int | None = 6
    string_length: int | None = 512
    array_items: int | None = 64
    additional_properties: bool = False
    whitespace: str = "compact"


DEFAULT = Bounds()
OFF = Bounds(None, None, None, None, True)


def request_bounds(setting) -> Bounds:
    """The bounds a request's `structured_bounds` asks for: unset or true, the
    defaults; null or false, none; an object, the defaults with its fields."""
    if setting is UNSET or setting is True:
        return DEFAULT
    if setting is None or setting is False:
        return OFF
    values: Iterable[Any] = (default if (v := getattr(setting, name)) is UNSET else v
                             for name, default in zip(Bounds._fields, DEFAULT))
    return Bounds(*values)


def bounded(schema: dict, bounds: Bounds = DEFAULT) -> dict:
    """A copy of `schema` with `bounds` added wherever it sets none of its own."""
    return add_bounds(json.loads(json.dumps(schema)), bounds)


def add_bounds(schema: dict, bounds: Bounds) -> dict:
    """`bounded`, in place (on a copy the caller owns). Iterative: a deep schema
    must not cost the stack."""
    if bounds[:5] == OFF[:5]:
        return schema
    merged = _merged_refs(schema)
    todo: list[tuple[object, str, bool]] = [(schema, "#", False)]  # node, pointer, shared
    while todo:
        node, at, shared = todo.pop()
        if not isinstance(node, dict):
            continue
        _bound(node, bounds, closable=not shared and at not in merged)
        for key in _ONE:
            if isinstance(node.get(key), dict):
                todo.append((node[key], f"{at}/{key}", False))
        for key in _MAP:
            if isinstance(node.get(key), dict):
                todo.extend((v, f"{at}/{key}/{_escape(k)}", False) for k, v in node[key].items())
        for key in _LIST:
            if isinstance(node.get(key), list):
                joined = _merges(node, key)
                todo.extend((v, f"{at}/{key}/{i}", joined) for i, v in enumerate(node[key]))
    return schema


def _merges(node: dict, key: str) -> bool:
    """Whether `node`'s `key` (a combinator, or `$ref`) is intersected with more."""
    return key == "allOf" or (key in ("anyOf", "oneOf", "$ref") and bool(node.keys() & _OBJECT))


def _merged_refs(schema: dict) -> set[str]:
    """The `$ref`s whose target is intersected with more: those targets stay open."""
    refs, todo = set(), [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str) and _merges(node, "$ref"):
                refs.add(node["$ref"])
            for key in ("allOf", "anyOf", "oneOf"):
                if isinstance(node.get(key), list) and _merges(node, key):
                    refs.update(m["$ref"] for m in node[key]
                                if isinstance(m, dict) and isinstance(m.get("$ref"), str))
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return refs


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _bound(node: dict, b: Bounds, closable: bool) -> None:
    types = node.get("type")
    types = {t for t in (types if isinstance(types, list) else [types]) if isinstance(t, str)}
    if not types or "enum" in node or "const" in node:
        return
    if ("object" in types and not b.additional_properties and closable
            and isinstance(node.get("properties"), dict) and node["properties"]
            and not node.keys() & _OPEN):
        node["additionalProperties"] = False
    if types & {"integer", "number"}:
        _bound_number(node, b, integer="number" not in types)
    if "string" in types and b.string_length is not None and not (
            node.keys() & {"maxLength", "pattern", "format"}):
        node["maxLength"] = max(b.string_length, _int(node.get("minLength")))
    if ("array" in types and b.array_items is not None and "maxItems" not in node
            and node.get("items") is not False):
        node["maxItems"] = max(b.array_items, _int(node.get("minItems")))


def _bound_number(node: dict, b: Bounds, integer: bool) -> None:
    low = _given(node, "minimum", "exclusiveMinimum")
    high = _given(node, "maximum", "exclusiveMaximum")
    if b.number_digits is not None:
        top = 10**b.number_digits
        lo_key, hi_key = ("minimum", "maximum") if integer else \
            ("exclusiveMinimum", "exclusiveMaximum")
        edge = top - 1 if integer else top
        if low is None and (high is None or high > -top):
            node[lo_key] = -edge
        if high is None and (low is None or low < top):
            node[hi_key] = edge
    if integer or b.fraction_digits is None or "multipleOf" in node:
        return
    step = 10.0**-b.fraction_digits
    if low is not None and high is not None and high - low < step:
        return  # the schema's own range is finer than the step: it would match nothing
    node["multipleOf"] = step


def _given(node: dict, *keys: str) -> float | None:
    """The schema's own bound among `keys` (a draft-4 boolean `exclusive*` is none)."""
    values = [node[k] for k in keys
              if isinstance(node.get(k), (int, float)) and not isinstance(node[k], bool)]
    return values[0] if values else None


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
