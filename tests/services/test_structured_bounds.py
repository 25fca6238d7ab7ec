"""Default bounds on structured outputs' values (services/gateway/structured_bounds.py):
the schema rewrite (defaults where the schema sets none, its own bounds kept, every
place a subschema sits, off when the request says so), the request's
`structured_bounds` from its body (JSON and msgpack, as both transports decode it) to
the grammar, and the grammar itself under llguidance with the bundled SmolLM2's
tokenizer: a 40-digit number is refused where a float is taken."""

from __future__ import annotations

import json

import msgspec
import pytest
from msgspec import UNSET

from services.gateway import codec
from services.gateway.structured import request_grammar
from services.gateway.structured_bounds import DEFAULT, OFF, Bounds, bounded, request_bounds
from shared.api import ChatCompletionRequest, CompletionRequest
from shared.api_structured import StructuredBounds
from shared.errors import ServiceError

TOP = 10**15
NUMBER = {"type": "number", "exclusiveMinimum": -TOP, "exclusiveMaximum": TOP,
          "multipleOf": 1e-6}
INTEGER = {"type": "integer", "minimum": -(TOP - 1), "maximum": TOP - 1}
POPULATION = {"type": "object", "properties": {"population_millions": {"type": "number"}},
              "required": ["population_millions"]}


def test_defaults_go_where_the_schema_sets_no_bound():
    schema = {"type": "object", "properties": {
        "n": {"type": "number"}, "i": {"type": "integer"}, "s": {"type": "string"},
        "a": {"type": "array", "items": {"type": "number"}}, "b": {"type": "boolean"},
        "o": {"type": "object", "properties": {"x": {"type": "string"}}},
        "free": {}}, "required": ["n"]}
    assert bounded(schema) == {"type": "object", "properties": {
        "n": NUMBER, "i": INTEGER, "s": {"type": "string", "maxLength": 512},
        "a": {"type": "array", "items": NUMBER, "maxItems": 64}, "b": {"type": "boolean"},
        "o": {"type": "object", "properties": {"x": {"type": "string", "maxLength": 512}},
              "additionalProperties": False},
        "free": {}}, "required": ["n"], "additionalProperties": False}
    assert schema["properties"]["n"] == {"type": "number"}  # a copy was rewritten
    # A type list gets each type's bounds (JSON Schema applies each to its own type).
    assert bounded({"type": ["number", "string", "null"]}) == {
        "type": ["number", "string", "null"], "exclusiveMinimum": -TOP,
        "exclusiveMaximum": TOP, "multipleOf": 1e-6, "maxLength": 512}
    # A bare object (json_object's) keeps any members: nothing of its own to bound.
    assert bounded({"type": "object"}) == {"type": "object"}


def test_the_schemas_own_bounds_are_never_tightened():
    kept = [
        {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.5},
        {"type": "integer", "exclusiveMinimum": 5, "maximum": 10**20},
        {"type": "string", "maxLength": 10**6},
        {"type": "string", "pattern": "^[a-z]+$"},  # the schema's own shape of it
        {"type": "string", "format": "email"},
        {"type": "string", "enum": ["a", "b"]},
        {"type": "number", "const": 3},
        {"type": "array", "maxItems": 1000},
        {"type": "array", "prefixItems": [{"const": 1}], "items": False},
        {"type": "object", "properties": {"a": {"const": 1}}, "additionalProperties": True},
        {"type": "object", "properties": {"a": {"const": 1}},
         "patternProperties": {"^x": {"const": 2}}},
    ]
    for schema in kept:
        assert bounded(schema) == schema, schema
    # One side given: the other gets its default; a default past the schema's own
    # bound on the other side (nothing would match) is not added.
    assert bounded({"type": "integer", "minimum": 0}) == {
        "type": "integer", "minimum": 0, "maximum": TOP - 1}
    assert bounded({"type": "number", "maximum": -5}) == {
        "type": "number", "maximum": -5, "exclusiveMinimum": -TOP, "multipleOf": 1e-6}
    assert bounded({"type": "integer", "minimum": 10**16}) == {
        "type": "integer", "minimum": 10**16}
    # Lower floors than the schema's own minimum are raised to it, never under it.
    assert bounded({"type": "string", "minLength": 600})["maxLength"] == 600
    assert bounded({"type": "array", "minItems": 100})["maxItems"] == 100
    # A range finer than the default step keeps its fractions.
    assert "multipleOf" not in bounded({"type": "number", "minimum": 1e-9, "maximum": 2e-9})


def test_every_place_a_subschema_sits_is_reached():
    schema = {
        "$defs": {"Leaf": {"type": "string"},
                  "Node": {"type": "object", "properties": {
                      "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
                      "name": {"$ref": "#/$defs/Leaf"}}}},
        "definitions": {"old": {"type": "integer"}},
        "type": "object",
        "properties": {
            "root": {"$ref": "#/$defs/Node"},
            "pick": {"anyOf": [{"type": "number"}, {"type": "null"}]},
            "one": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
            "pair": {"type": "array", "prefixItems": [{"type": "number"}],
                     "items": {"type": "string"}},
            "map": {"type": "object", "additionalProperties": {"type": "number"}},
            "pat": {"type": "object", "patternProperties": {"^n": {"type": "integer"}}},
        },
        "required": ["root"],
    }
    out = bounded(schema)
    node = out["$defs"]["Node"]
    assert out["$defs"]["Leaf"] == {"type": "string", "maxLength": 512}
    assert node["properties"]["kids"]["maxItems"] == 64
    assert node["additionalProperties"] is False
    assert out["definitions"]["old"] == INTEGER
    props = out["properties"]
    assert props["pick"]["anyOf"] == [NUMBER, {"type": "null"}]
    assert props["one"]["oneOf"] == [INTEGER, {"type": "string", "maxLength": 512}]
    assert props["pair"]["prefixItems"] == [NUMBER]
    assert props["pair"]["items"] == {"type": "string", "maxLength": 512}
    assert props["map"] == {"type": "object", "additionalProperties": NUMBER}  # a map stays
    assert props["pat"]["patternProperties"]["^n"] == INTEGER
    assert out["additionalProperties"] is False


def test_objects_intersected_with_others_stay_open():
    """An `allOf` member cannot know the other members' properties: closing it would
    refuse them (and a required one would leave nothing to match). So too a `$ref`
    target or an `anyOf` member beside properties of the schema holding it."""
    schema = {
        "$defs": {"A": {"type": "object", "properties": {"a": {"type": "integer"}}},
                  "B": {"type": "object", "properties": {"b": {"type": "integer"}}},
                  "C": {"type": "object", "properties": {"c": {"type": "integer"}}},
                  "D": {"type": "object", "properties": {"d": {"type": "integer"}}}},
        "type": "object",
        "properties": {
            "both": {"allOf": [{"$ref": "#/$defs/A"},
                               {"type": "object", "properties": {"x": {"type": "string"}}}]},
            "more": {"$ref": "#/$defs/B", "properties": {"y": {"type": "integer"}}},
            "alone": {"$ref": "#/$defs/C"},
            "tagged": {"type": "object", "properties": {"kind": {"type": "string"}},
                       "anyOf": [{"$ref": "#/$defs/D"}]},
        },
    }
    out = bounded(schema)
    defs = out["$defs"]
    assert "additionalProperties" not in defs["A"] and "additionalProperties" not in defs["B"]
    assert "additionalProperties" not in defs["D"]
    assert defs["C"]["additionalProperties"] is False  # referenced alone: closed
    both = out["properties"]["both"]["allOf"][1]
    assert "additionalProperties" not in both and both["properties"]["x"]["maxLength"] == 512
    assert "additionalProperties" not in out["properties"]["tagged"]
    assert defs["A"]["properties"]["a"] == INTEGER  # still bounded inside


def test_the_setting_chooses_the_bounds():
    schema = {"type": "object", "properties": {"n": {"type": "number"},
                                               "s": {"type": "string"}}}
    assert request_bounds(UNSET) == request_bounds(True) == DEFAULT
    assert request_bounds(None) == request_bounds(False) == OFF
    assert bounded(schema, OFF) == schema
    mine = request_bounds(StructuredBounds(number_digits=3, fraction_digits=0,
                                           string_length=None, additional_properties=True))
    assert mine == Bounds(3, 0, None, 64, True, "compact")
    assert bounded(schema, mine) == {"type": "object", "properties": {
        "n": {"type": "number", "exclusiveMinimum": -1000, "exclusiveMaximum": 1000,
              "multipleOf": 1.0}, "s": {"type": "string"}}}


def _decoded(body: dict, typ=ChatCompletionRequest, msgpack: bool = False):
    body = {"model": "m", **({"messages": [{"role": "user", "content": "hi"}]}
                             if typ is ChatCompletionRequest else {"prompt": "hi"}), **body}
    raw = msgspec.msgpack.encode(body) if msgpack else json.dumps(body).encode()
    return codec.decode(raw, typ, msgpack)


@pytest.mark.parametrize("msgpack", [False, True])
@pytest.mark.parametrize("bad, field", [
    ({"number_digits": 0}, "number_digits"), ({"number_digits": 19}, "number_digits"),
    ({"fraction_digits": -1}, "fraction_digits"), ({"string_length": 0}, "string_length"),
    ({"array_items": "many"}, "array_items"), ({"whitespace": "pretty"}, "whitespace"),
    ({"additional_properties": 1}, "additional_properties"), ({"digits": 3}, "digits"),
])
def test_a_bad_setting_is_a_400_naming_the_field(bad, field, msgpack):
    with pytest.raises(ServiceError) as err:
        _decoded({"structured_bounds": bad}, msgpack=msgpack)
    assert err.value.status == 400
    assert "structured_bounds" in err.value.message and field in err.value.message
    with pytest.raises(ServiceError, match="structured_bounds"):
        _decoded({"structured_bounds": 3}, CompletionRequest, msgpack)


def _grammar_schema(grammar: str) -> dict:
    (part,) = json.loads(grammar)["grammars"]
    return part["json_schema"]


@pytest.mark.parametrize("msgpack", [False, True])
def test_the_setting_reaches_the_grammar_on_every_schema_field(msgpack):
    fields = [
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "p", "schema": POPULATION}}},
        {"guided_json": POPULATION},
        {"guided_json": json.dumps(POPULATION)},
        {"structured_outputs": {"json": POPULATION}},
    ]
    for typ in (ChatCompletionRequest, CompletionRequest):
        for body in fields:
            plain = _grammar_schema(request_grammar(_decoded(body, typ, msgpack)))
            assert plain["properties"]["population_millions"] == NUMBER
            assert plain["x-guidance"]["whitespace_flexible"] is False
            off = _grammar_schema(request_grammar(
                _decoded({**body, "structured_bounds": None}, typ, msgpack)))
            assert off["properties"]["population_millions"] == {"type": "number"}
            assert "additionalProperties" not in off
            assert _grammar_schema(request_grammar(
                _decoded({**body, "structured_bounds": False}, typ, msgpack))) == off
            mine = _grammar_schema(request_grammar(_decoded(
                {**body, "structured_bounds": {"number_digits": 4, "whitespace": "flexible"}},
                typ, msgpack)))
            assert mine["properties"]["population_millions"]["exclusiveMaximum"] == 10**4
            assert "whitespace_pattern" in mine["x-guidance"]


# ------------------------------------------------------------ under llguidance
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
    assert not m.is_error(), m.get_error()
    ids = ll.tokenize_str(text)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def _population_grammar(**body) -> str:
    return request_grammar(_decoded({"response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": POPULATION}}, **body}))


def test_the_grammar_refuses_a_runaway_number_and_takes_a_float(smollm2_ll):
    """The gateway's grammar (request_grammar, as the engine gets it) under the
    matcher the engine runs (llguidance): 40 digits are refused by default and taken
    with the defaults off; ordinary numbers pass either way."""
    grammar, off = _population_grammar(), _population_grammar(structured_bounds=None)
    runaway = '{"population_millions":' + "12" * 20 + "}"
    assert not _accepts(smollm2_ll, grammar, runaway)
    assert _accepts(smollm2_ll, off, runaway)
    for number in ["1417.492", "1417", "-0.5", "0.000001", "999999999999999.999999"]:
        text = '{"population_millions":' + number + "}"
        assert _accepts(smollm2_ll, grammar, text) and _accepts(smollm2_ll, off, text), number
    for number in ["1417.4921234", "1000000000000000", "1e3"]:  # 7 decimals, 16 digits
        assert not _accepts(smollm2_ll, grammar, '{"population_millions":' + number + "}")
    extra = '{"population_millions":1,"other":2}'
    assert not _accepts(smollm2_ll, grammar, extra) and _accepts(smollm2_ll, off, extra)


def test_whitespace_is_compact_or_bounded(smollm2_ll):
    spaced = '{ "population_millions": 1.5 }'
    assert not _accepts(smollm2_ll, _population_grammar(), spaced)
    flexible = _population_grammar(structured_bounds={"whitespace": "flexible"})
    assert _accepts(smollm2_ll, flexible, spaced)
    assert _accepts(smollm2_ll, flexible, '{\n  "population_millions": 1.5\n}')
    assert not _accepts(smollm2_ll, flexible, "{" + " " * 17 + '"population_millions":1}')
