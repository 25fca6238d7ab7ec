"""Prompt-lookup speculation: the same tokens as without it, fewer steps.

Greedy tokens equal transformers' with drafts actually accepted (a repeating prompt
on a tiny model whose greedy output falls into loops); seeded sampling draws the
same tokens with speculation on and off; a sequence joining and leaving beside a
speculating one (the step turns normal while two are live) keeps both correct."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from engine.decoder import DecoderEngine
from engine.decoder.speculative import parse, propose
from engine.decoder.static import prefill_insert
from shared.messages import Sampling
from tests.support.tiny_models import build, hf_greedy

GREEDY = Sampling(temperature=0.0)
REPEATING = [5, 17, 300, 42, 9, 11] * 4
OTHER = list(range(40, 49))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama-spec")
    return out, build("llama", out, positions=128)


def _engine(path, k: int) -> DecoderEngine:
    return DecoderEngine(path, "tiny", slots=4, max_context=96, prefill_buckets=(16, 32),
                         decode_windows=(32, 64), speculative=k)  # fmt: skip


def _step(engine: DecoderEngine) -> dict[int, list[int]]:
    """One step -> each live slot's tokens (several when drafts were accepted)."""
    live = [int(s) for s in engine.table.active.nonzero()[0]]
    pending = engine.step_async()
    tokens = pending.result()
    return {s: [int(tokens[s])] + pending.more.get(s, []) for s in live}


def _generate(engine, slot, prompt, sampling, seed, n) -> list[int]:
    out = [prefill_insert(engine, slot, prompt, sampling, seed)]
    while len(out) < n:
        out += _step(engine)[slot]
    engine.free(slot)
    return out[:n]


def test_parse_and_propose():
    assert parse("") == parse("off") == 0 and parse("ngram:4") == 4 and parse("NGRAM:1") == 1
    for bad in ("ngram", "ngram:0", "ngram:x", "eagle:3", "ngram:17"):
        with pytest.raises(ValueError, match="ngram:K"):
            parse(bad)
    # The latest earlier occurrence of the longest matching tail wins.
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]
    assert propose([4, 2, 3, 5, 1, 2, 3], 3) == [5, 1, 2]  # "2 3" after 3 failed
    assert propose([6, 1, 7, 1], 4) == [7, 1]  # "1": what followed, up to the end
    assert propose([1, 2, 3], 4) == [] and propose([], 4) == []


def test_greedy_equals_transformers_with_drafts_accepted(llama):
    path, ref = llama
    engine = _engine(path, k=4)
    n = 48
    assert _generate(engine, 2, REPEATING, GREEDY, 0, n) == hf_greedy(ref, REPEATING, n)
    stats = engine.speculation.stats
    assert stats.accepted > 0 and stats.steps > 0
    # Fewer steps than tokens: the accepted drafts came for free.
    assert stats.steps + sum(engine.programs.step_counts.values()) < n - 1


def test_seeded_sampling_draws_the_same_tokens_on_and_off(llama, monkeypatch):
    """A sampled sequence's drafts are checked against the draws the sampler makes
    with the seed: the prompt lookup's own drafts (mostly rejected: sampled text
    rarely repeats, and the sequence backs off), then drafts that are right for their
    first tokens (the answer drawn with speculation off, a wrong token after): the
    same tokens every time, with drafts accepted and rejected part-way."""
    from engine.decoder import speculative

    path, _ = llama
    hot = Sampling(temperature=0.5, top_k=40, top_p=0.95)
    off = _generate(_engine(path, k=0), 0, REPEATING, hot, 1234, 40)
    engine = _engine(path, k=3)
    assert _generate(engine, 1, REPEATING, hot, 1234, 40) == off
    wrong = next(t for t in range(1, 1000) if t not in off)

    def known(tokens, k):  # what follows in `off`, its third token wrong
        at = len(tokens) - len(REPEATING)
        draft = off[at : at + k]
        return draft[:2] + [wrong] * (len(draft) - 2) if len(draft) > 2 else draft

    monkeypatch.setattr(speculative, "propose", known)
    engine = _engine(path, k=3)
    assert _generate(engine, 1, REPEATING, hot, 1234, 40) == off
    stats = engine.speculation.stats
    assert stats.accepted > 0 and stats.accepted < stats.drafted


def test_drafts_that_keep_failing_back_off_and_change_no_token(llama, monkeypatch):
    """Every draft wrong (the lookup patched to guess a token greedy never picks here):
    after each empty verify the sequence waits twice as long before drafting again, so
    48 tokens take a handful of verify passes instead of one per step, and the tokens
    are still transformers' greedy ones."""
    from engine.decoder import speculative

    path, ref = llama
    want = hf_greedy(ref, OTHER, 48)
    wrong = next(t for t in range(1, 1000) if t not in want)
    monkeypatch.setattr(speculative, "propose", lambda tokens, k: [wrong] * k)
    engine = _engine(path, k=3)
    assert _generate(engine, 0, OTHER, GREEDY, 0, 48) == want
    stats = engine.speculation.stats
    assert stats.accepted == 0
    # Verifies at steps 0, 2, 5, 10, 19, 36: six, where no back-off would take 47.
    assert 3 <= stats.steps <= 7, stats


def test_a_sequence_joining_and_leaving_beside_a_speculating_one(llama):
    path, ref = llama
    engine = _engine(path, k=4)
    a = [prefill_insert(engine, 0, REPEATING, GREEDY, 0)]
    while len(a) < 10:
        a += _step(engine)[0]
    spec_before = engine.speculation.stats.steps
    assert spec_before > 0
    b = [prefill_insert(engine, 3, OTHER, GREEDY, 0)]  # joins: two live, normal steps
    for _ in range(6):
        got = _step(engine)
        a += got[0]
        b += got[3]
    assert engine.speculation.stats.steps == spec_before
    engine.free(3)  # leaves: the first speculates again
    while len(a) < 50:
        a += _step(engine)[0]
    assert engine.speculation.stats.steps > spec_before
    assert a[:50] == hf_greedy(ref, REPEATING, 50)
    assert b == hf_greedy(ref, OTHER, 7)


def test_a_constrained_sequence_is_never_drafted_for(llama):
    """A grammar's mask depends on the tokens drawn: a lone constrained stream on a
    speculating engine takes the masked step, so its JSON validates and nothing is
    drafted for it; the same stream on an engine without speculation agrees."""
    import json

    import jsonschema

    from services.gateway.structured import grammar_for
    from shared.api import JsonSchemaFormat, ResponseFormat

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    fmt = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="t", schema=schema))
    constrained = Sampling(temperature=0.0, grammar=grammar_for(fmt))
    path, _ = llama
    engine, plain = _engine(path, k=4), _engine(path, k=0)
    got = _generate(engine, 1, REPEATING, constrained, 0, 24)
    assert got == _generate(plain, 1, REPEATING, constrained, 0, 24)
    assert engine.speculation.stats.steps == 0
    eos = set(engine.eos_token_ids)
    text = engine.tokenizer.decode([t for t in got if t not in eos][: next(
        (i for i, t in enumerate(got) if t in eos), len(got))])
    if any(t in eos for t in got):  # it finished: the object is whole
        jsonschema.validate(json.loads(text), schema)


def test_an_auto_plain_answer_speculates_once_its_grammar_is_dropped(llama):
    """`tool_choice: "auto"`'s grammar is dropped once a plain answer begins
    (engine/decoder/grammar.py): from then on the sequence speculates like any
    other, and its tokens are still transformers' greedy ones."""
    from services.gateway.tool_auto import auto_grammar, call_schema

    path, ref = llama
    expected = hf_greedy(ref, REPEATING, 40)
    engine = _engine(path, k=4)
    first = engine.tokenizer.decode(expected[:1])
    assert first and first[0] not in " \t\n\r\x0b\x0c[{\ufffd"  # a plain answer's start
    grammar = auto_grammar([call_schema("f", {"type": "object"})], 8, tagged=False)
    got = _generate(engine, 1, REPEATING, Sampling(temperature=0.0, grammar=grammar), 0, 40)
    assert engine.grammar.released == 1 and engine.speculation.stats.accepted > 0
    assert got == expected
