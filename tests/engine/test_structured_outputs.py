"""Structured outputs in the JAX engine (engine/decoder/grammar.py, the mask in steps.py):
on a tiny decoder with random weights, sampled hot, every constrained sequence's
text parses and validates against its schema (the independent check: `jsonschema`);
unconstrained batch-mates draw exactly transformers' greedy tokens beside them; and
a step with no constrained row runs the engine's own program with no early read of
the step before it (counted, not timed). On the real SmolLM2, the default bounds on a
schema's values are what lets a greedy reply end (services/gateway/structured_bounds.py)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jsonschema
import msgspec
import pytest

from engine.chat import ChatTemplate
from engine.decoder import DecoderEngine
from engine.decoder.static import prefill_insert
from services.gateway.structured import grammar_for, request_grammar
from shared import catalog
from shared.api import ChatCompletionRequest, JsonSchemaFormat, ResponseFormat
from shared.messages import Sampling
from tests.support.tiny_models import build, hf_greedy

PROMPT = [5, 17, 120, 42, 7]
NEW = 96

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                 "minItems": 1, "maxItems": 3}},
     "required": ["unit", "ok", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "choice": {"anyOf": [{"type": "null"}, {"const": "yes"},
                             {"type": "integer", "minimum": -5, "maximum": 5}]},
        "nested": {"type": "object", "properties": {"x": {"type": "boolean"}},
                   "required": ["x"], "additionalProperties": False}},
     "required": ["choice", "nested"], "additionalProperties": False},
]


def _schema_grammar(schema: dict) -> str:
    return grammar_for(ResponseFormat(type="json_schema",
                                      json_schema=JsonSchemaFormat(name="t", schema=schema)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("structured")
    ref = build("llama", out, positions=128)
    engine = DecoderEngine(out, "structured", slots=4, max_context=128, prefill_buckets=(16,),
                           decode_windows=(128,))  # fmt: skip
    engine.warmup(progress=False)
    return ref, engine


def _generate(engine, plan: dict[int, tuple[Sampling, int]], new: int = NEW,
              raw: bool = False) -> dict:
    """slot -> its tokens, up to and without EOS (None when it never reached it);
    `raw`: every token drawn, EOS included."""
    eos = set(engine.eos_token_ids)
    out = {slot: [prefill_insert(engine, slot, PROMPT, s, seed)]
           for slot, (s, seed) in plan.items()}
    for _ in range(new - 1):
        if all(t[-1] in eos for t in out.values()):
            break
        tokens = engine.step()
        for slot in plan:
            if not out[slot] or out[slot][-1] not in eos:
                out[slot].append(int(tokens[slot]))
    for slot in range(engine.slots):
        engine.free(slot)
    if raw:
        return out
    return {slot: (t[:-1] if t[-1] in eos else None) for slot, t in out.items()}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_constrained_output_validates(tiny, seed):
    _, engine = tiny
    plan = {i: (Sampling(temperature=1.0, grammar=_schema_grammar(s)), seed * 10 + i)
            for i, s in enumerate(SCHEMAS)}
    plan[3] = (Sampling(temperature=1.0, grammar=grammar_for(ResponseFormat(type="json_object"))),
               seed)
    done = _generate(engine, plan)
    for slot, tokens in done.items():
        schema = SCHEMAS[slot] if slot < len(SCHEMAS) else {"type": "object"}
        if tokens is None:
            assert slot == 3, "a bounded schema must end within the budget"
            continue
        value = json.loads(engine.tokenizer.decode(tokens))
        jsonschema.validate(value, schema)


def test_greedy_constrained_output_validates(tiny):
    _, engine = tiny
    done = _generate(engine, {1: (Sampling(temperature=0.0, grammar=_schema_grammar(SCHEMAS[0])),
                                  0)})  # fmt: skip
    jsonschema.validate(json.loads(engine.tokenizer.decode(done[1])), SCHEMAS[0])


def test_batch_mates_without_a_grammar_are_unaffected(tiny):
    ref, engine = tiny
    expected = hf_greedy(ref, PROMPT, 24)
    greedy = Sampling(temperature=0.0)
    before = engine.grammar.masked_steps
    mixed = _generate(engine, {0: (Sampling(temperature=1.0, grammar=_schema_grammar(SCHEMAS[1])),
                                   4), 2: (greedy, 0)}, new=24, raw=True)  # fmt: skip
    got = mixed[2]
    eos = set(engine.eos_token_ids)
    want = expected[: next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))]
    assert got == want and len(got) > 3  # up to its EOS, or all 24
    assert engine.grammar.masked_steps > before  # the mate rode in masked steps


def test_unconstrained_steps_run_the_plain_program(tiny, monkeypatch):
    _, engine = tiny
    grammar = engine.grammar
    syncs, masked, masks = grammar.syncs, grammar.masked_steps, grammar.masks
    plain = set(engine.programs.cache.keys())
    reads = []
    from engine.decoder import runner as slots

    original = slots.PendingStep.result

    def counted(self):
        reads.append(self)
        return original(self)

    monkeypatch.setattr(slots.PendingStep, "result", counted)
    prefill_insert(engine, 0, PROMPT, Sampling(temperature=1.0), 5)
    prefill_insert(engine, 1, PROMPT, Sampling(temperature=0.0), 6)
    steps = [engine.step_async() for _ in range(8)]
    assert reads == []  # nothing read a dispatched step: no host round trip
    for p in steps:
        p.result()
    assert len(reads) == len(steps)  # each read once, by its caller
    for slot in range(engine.slots):
        engine.free(slot)
    assert (grammar.syncs, grammar.masked_steps, grammar.masks) == (syncs, masked, masks)
    assert set(engine.programs.cache.keys()) == plain  # the same compiled steps as ever


# ------------------------------------------------------- generated schemas
def _schemas():
    from hypothesis import strategies as st

    names = st.sampled_from(["a", "b", "cd", "e"])
    leaf = st.one_of(
        st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
        st.tuples(st.integers(-50, 50), st.integers(0, 200)).map(
            lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.lists(st.sampled_from(["x", "yz", "no", "ok"]), min_size=1, max_size=3,
                 unique=True).map(lambda e: {"enum": e}),
    )

    def obj(props):
        return {"type": "object", "properties": props, "required": sorted(props),
                "additionalProperties": False}

    def nested(children):
        return st.one_of(
            st.tuples(children, st.integers(0, 2)).map(
                lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}),
            st.dictionaries(names, children, min_size=1, max_size=3).map(obj),
            st.lists(children, min_size=2, max_size=3).map(lambda xs: {"anyOf": xs}),
        )

    tree = st.recursive(leaf, nested, max_leaves=5)
    return st.dictionaries(names, tree, min_size=1, max_size=3).map(obj)


@pytest.fixture(scope="module")
def roomy(tmp_path_factory):
    out = tmp_path_factory.mktemp("structured-roomy")
    build("llama", out, positions=512)
    engine = DecoderEngine(out, "structured-roomy", slots=4, max_context=512,
                           prefill_buckets=(16,), decode_windows=(512,))  # fmt: skip
    engine.warmup(progress=False)
    return engine


def test_generated_schemas_validate_and_nearly_all_complete(roomy):
    """Over generated schemas (hypothesis), 4 sampled sequences each: every one that
    ends at EOS validates; with a generous budget at least 95 % end that way."""
    from hypothesis import HealthCheck, given, settings

    seen = {"stop": 0, "all": 0}

    @settings(max_examples=12, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(schema=_schemas())
    def check(schema):
        grammar = _schema_grammar(schema)
        plan = {i: (Sampling(temperature=1.0, grammar=grammar), 100 + i) for i in range(4)}
        for tokens in _generate(roomy, plan, new=400).values():
            seen["all"] += 1
            if tokens is not None:
                seen["stop"] += 1
                jsonschema.validate(json.loads(roomy.tokenizer.decode(tokens)), schema)

    check()
    assert seen["all"] == 48 and seen["stop"] >= 0.95 * seen["all"], seen


def test_a_rerun_feeds_its_tokens_to_the_grammar_again(tiny):
    """A preempted sequence re-runs from its prompt plus its tokens so far
    (`generated`): its matcher is fed them again, so it goes on as it would have."""
    _, engine = tiny
    s = Sampling(temperature=0.0, grammar=_schema_grammar(SCHEMAS[1]))
    full = _generate(engine, {0: (s, 0)}, raw=True)[0]
    assert full[-1] in engine.eos_token_ids and len(full) > 6
    k = len(full) // 2
    engine.begin(1, PROMPT + full[:k], s, 0, generated=k)
    first = None
    while first is None:
        first = engine.prefill_step(1)
    rest = [first]
    while rest[-1] not in engine.eos_token_ids:
        rest.append(int(engine.step()[1]))
    engine.free(1)
    assert full[:k] + rest == full


# ------------------------------------------------------ tool_choice "auto"
CALL_ARGS = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                    "maximum": 99}},
             "required": ["a"], "additionalProperties": False}


def _auto_grammar(most: int = 8) -> str:
    from services.gateway.tool_auto import auto_grammar, call_schema

    return auto_grammar([call_schema("f", CALL_ARGS)], most, tagged=False)


def test_a_plain_auto_answer_drops_its_grammar_after_it_begins(tiny):
    """`tool_choice: "auto"`'s grammar (services/gateway/tool_auto.py) lets a plain
    answer begin and then marks its RELEASE: the sequence's grammar is dropped, so
    it decodes exactly transformers' greedy tokens with no masked step after."""
    ref, engine = tiny
    expected = hf_greedy(ref, PROMPT, 24)
    first = engine.tokenizer.decode(expected[:1])
    assert first and first[0] not in " \t\n\r\x0b\x0c[{\ufffd"  # a plain answer's start
    grammar = engine.grammar
    released, masked = grammar.released, grammar.masked_steps
    got = _generate(engine, {0: (Sampling(temperature=0.0, grammar=_auto_grammar()), 0)},
                    new=24, raw=True)[0]
    eos = set(engine.eos_token_ids)
    assert got == expected[: next((i + 1 for i, t in enumerate(expected) if t in eos),
                                  len(expected))]
    assert grammar.released == released + 1 and grammar.masked_steps == masked


@pytest.mark.parametrize("seed", [1, 2])
def test_an_auto_call_once_begun_validates(tiny, seed):
    """Pushed to open a list (a bias on `[`), an auto reply must go on as calls whose
    arguments validate against the tool's parameters (`jsonschema`)."""
    _, engine = tiny
    (bracket,) = engine.tokenizer.encode("[")
    s = Sampling(temperature=1.0, grammar=_auto_grammar(2), logit_bias=[(bracket, 30.0)])
    before = engine.grammar.released
    tokens = _generate(engine, {0: (s, seed)}, new=120)[0]
    assert tokens is not None and engine.grammar.released == before
    calls = json.loads(engine.tokenizer.decode(tokens))
    assert isinstance(calls, list) and 1 <= len(calls) <= 2
    for call in calls:
        assert call["name"] == "f"
        jsonschema.validate(call["arguments"], CALL_ARGS)


def test_a_grammar_seen_again_is_copied_not_compiled(tiny):
    """Sequences that bring a grammar already compiled get a copy of its matcher."""
    _, engine = tiny
    grammar = _auto_grammar(3)
    before = engine.grammar.compiles
    plan = {i: (Sampling(temperature=1.0, grammar=grammar), i) for i in range(3)}
    _generate(engine, plan, new=4)
    _generate(engine, {3: (Sampling(temperature=1.0, grammar=grammar), 9)}, new=4)
    assert engine.grammar.compiles == before + 1


def test_structured_outputs_compile_nothing_of_their_own(tmp_path):
    """A token mask is an argument of the engine's own programs: after a warm-up
    that compiled every program, constrained rows in a prefill and in steps of
    several batch shapes (beside unconstrained ones) compile nothing more, and the
    engine serves no more programs than its shapes (counted)."""
    build("llama", tmp_path, positions=128)
    engine = DecoderEngine(tmp_path, "structured", slots=4, max_context=128,
                           prefill_buckets=(16,), compile_ahead="all")
    engine.warmup(progress=False)
    served = engine.programs.compiles
    assert len(served) == 5  # mixed 16 x 4; prefill 16; steps at batch 1, 2, 4
    compiled = engine.programs.cache.compiled
    assert compiled == len(served)
    schema = Sampling(temperature=1.0, grammar=_schema_grammar(SCHEMAS[0]))
    plan = {0: (schema, 0), 1: (schema, 1), 2: (Sampling(temperature=1.0), 2)}
    masked = engine.grammar.masked_steps
    out = _generate(engine, plan, new=8)
    assert engine.grammar.masked_steps > masked and len(out) == 3
    assert engine.programs.cache.compiled == compiled
    done, total = engine.programs.progress()
    assert done == total == len(served)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_tagged_auto_call_once_its_tag_is_written_validates(tiny, seed):
    """The tagged auto grammar leaves text free until `<tool_call>` is written; a
    sequence that has written it (fed to the matcher as a preempted sequence's
    tokens are) must go on with one call that validates, then close the tag."""
    from services.gateway.tool_auto import auto_grammar, call_schema

    _, engine = tiny
    grammar = auto_grammar([call_schema("f", CALL_ARGS)], 8, tagged=True)
    said = engine.tokenizer.encode("Hi <tool_call>")
    s = Sampling(temperature=1.0, grammar=grammar)
    engine.begin(0, PROMPT + said, s, seed, generated=len(said))
    first = None
    while first is None:
        first = engine.prefill_step(0)
    out = [first]
    while len(out) < 60:
        out.append(int(engine.step()[0]))
    engine.free(0)
    head, closed, _ = engine.tokenizer.decode(out).partition("</tool_call>")
    assert closed, out
    call = json.loads(head.strip("\n"))
    assert call["name"] == "f"
    jsonschema.validate(call["arguments"], CALL_ARGS)


# ------------------------------------------ default bounds, on the real SmolLM2
# What openai's `parse()` sends for a pydantic model with a str and a float field.
COUNTRY = {"type": "object", "properties": {"name": {"type": "string"},
                                            "population_millions": {"type": "number"}},
           "required": ["name", "population_millions"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the population of India in millions? "
                                   "Give every digit."}]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir, jax_cache_dir):
    """The bundled SmolLM2-135M-Instruct, one slot: a prefill and one step program."""
    engine = DecoderEngine(smollm2_dir, catalog.SMOLLM2, slots=1, max_context=256,
                           prefill_buckets=(128,), decode_windows=())  # fmt: skip
    engine.warmup(progress=False)
    return engine, ChatTemplate.from_dir(smollm2_dir).encode(engine.tokenizer, ASK)


def _reply(engine, prompt: list[int], body: dict, max_tokens: int = 120) -> tuple[str, str]:
    """(text, finish reason) of a greedy chat reply under the grammar the gateway
    builds for `body` (services/gateway/structured.py, request_grammar)."""
    req = msgspec.json.decode(json.dumps({"model": "m", "messages": ASK, **body}).encode(),
                              type=ChatCompletionRequest)
    eos = set(engine.eos_token_ids)
    out = [prefill_insert(engine, 0, prompt, Sampling(temperature=0.0,
                                                      grammar=request_grammar(req)), 0)]
    while out[-1] not in eos and len(out) < max_tokens:
        out.append(int(engine.step()[0]))
    engine.free(0)
    reason = "stop" if out[-1] in eos else "length"
    return engine.tokenizer.decode([t for t in out if t not in eos]), reason


def test_default_bounds_let_a_real_model_close_its_reply(smollm2):
    """Asked for every digit, SmolLM2 writes a float's digits without end (as a
    `population_millions` of `11232223222222322...` to `max_tokens`) when the
    schema's number is unbounded; under the default bounds (services/gateway/
    structured_bounds.py) the same greedy reply closes with "stop" and parses."""
    engine, prompt = smollm2
    fmt = {"response_format": {"type": "json_schema",
                               "json_schema": {"name": "country", "schema": COUNTRY}}}
    text, reason = _reply(engine, prompt, fmt)
    assert reason == "stop", text
    value = json.loads(text)
    jsonschema.validate(value, COUNTRY)
    whole = str(value["population_millions"]).lstrip("-").split(".")[0]
    assert len(whole) <= 15
    runaway, reason = _reply(engine, prompt, {**fmt, "structured_bounds": None})
    assert reason == "length", runaway  # the bound is what ends it
    assert runaway.startswith('{"name":"India","population_millions":1')
