"""Streaming detokenization: never a broken character, stop strings cut like OpenAI.

Two tokenizer styles: the demo model's byte-level BPE (GPT-2 style), and a
sentencepiece-style BPE built here with `▁` spaces and `<0xNN>` byte fallback (the
Llama layout). The reference is the tokenizer's own full decode of all the tokens.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, trainers

from engine.detok import REPLACEMENT, Detokenizer, StopMatcher
from shared.catalog import DEMO_LM, bundled_dir

TEXT = "naïve café, señor — 日本語のテキスト 🎉🎉 done. Ünïcödé ☃ ok"
TRAIN = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "café"]


def _sentencepiece_style() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(TRAIN * 10, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte fallback pieces, as Llama's tokenizer.json has them
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = json.loads(
        decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
             decoders.Strip(" ", 1, 0)]
        ).__getstate__()
    )  # fmt: skip
    return Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def tok(request) -> Tokenizer:
    if request.param == "byte-level":
        return Tokenizer.from_file(str(bundled_dir(DEMO_LM) / "tokenizer.json"))
    return _sentencepiece_style()


def _stream(tok, prompt_ids, ids, stop=(), include_stop=False):
    d = Detokenizer(tok, prompt_ids=prompt_ids, stop=stop, include_stop=include_stop)
    pieces = [d.feed(i) for i in ids]
    return pieces, d.flush(), d


def _reference(tok, prompt_ids, ids) -> str:
    return tok.decode(prompt_ids + ids)[len(tok.decode(prompt_ids)) :]


def test_multibyte_text_streams_whole_characters(tok):
    prompt = tok.encode("Say it:", add_special_tokens=False).ids
    ids = tok.encode(" " + TEXT, add_special_tokens=False).ids
    # The test means something only if some tokens are fragments of a character.
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    pieces, tail, _ = _stream(tok, prompt, ids)
    for piece in pieces:
        assert REPLACEMENT not in piece
        piece.encode("utf-8")  # well-formed
    assert "".join(pieces) + tail == _reference(tok, prompt, ids)
    assert tail == ""


def test_stop_string_cuts_before_itself(tok):
    ids = tok.encode("hello world STOP and more", add_special_tokens=False).ids
    pieces, tail, d = _stream(tok, [], ids, stop=["STOP"])
    assert "".join(pieces) + tail == "hello world "
    assert d.stopped and d.matched_stop == "STOP"
    assert d.feed(ids[0]) == ""


def test_possible_stop_prefix_is_held_then_released(tok):
    ids = tok.encode("hello wor", add_special_tokens=False).ids
    pieces, tail, d = _stream(tok, [], ids, stop=["world"])
    assert not d.stopped
    assert "".join(pieces) == "hello " and tail == "wor"


def test_earliest_of_several_stops_wins(tok):
    ids = tok.encode("one two three four", add_special_tokens=False).ids
    pieces, tail, d = _stream(tok, [], ids, stop=["four", " t"])
    assert "".join(pieces) + tail == "one"
    assert d.matched_stop == " t"


ALPHABET = st.sampled_from(list("ab xyz.,\n") + ["é", "ß", "—", "日", "本", "🎉", "☃", "ü"])


@settings(max_examples=60, deadline=None)
@given(text=st.text(ALPHABET, min_size=0, max_size=40), stops=st.lists(
    st.text(ALPHABET, min_size=1, max_size=4), max_size=3), include=st.booleans())  # fmt: skip
def test_streamed_text_equals_reference_cut_at_first_completed_stop(tok, text, stops, include):
    """Cut before the stop string, or (vLLM's include_stop_str_in_output) after it."""
    ids = tok.encode(text, add_special_tokens=False).ids
    pieces, tail, d = _stream(tok, [], ids, stop=stops, include_stop=include)
    full = tok.decode(ids)
    # Generation ends where the first stop string completes.
    hits = [(full.find(s) + len(s), full.find(s)) for s in stops if s in full]
    expected = full[: min(hits)[0 if include else 1]] if hits else full
    assert "".join(pieces) + tail == expected
    assert d.stopped == bool(hits)
    assert all(REPLACEMENT not in p or REPLACEMENT in full for p in pieces)


def test_stop_matcher_without_stops_passes_everything():
    m = StopMatcher()
    assert m.push("abc") == "abc" and m.flush() == ""


def test_special_tokens_are_in_the_text_only_when_asked(tok):
    """vLLM's skip_special_tokens: by default a generated special token has no text;
    with false, its text streams in place, as the tokenizer decodes it."""
    special = next(i for i in range(tok.get_vocab_size()) if tok.id_to_token(i) in
                   ("</s>", "<|endoftext|>", "<|im_end|>", "<s>"))  # fmt: skip
    ids = tok.encode("hello there", add_special_tokens=False).ids
    ids = ids[:1] + [special] + ids[1:]
    kept = Detokenizer(tok, skip_special_tokens=False)
    text = "".join(kept.feed(i) for i in ids) + kept.flush()
    assert text == tok.decode(ids, skip_special_tokens=False)
    assert tok.id_to_token(special) in text
    plain = Detokenizer(tok)
    assert "".join(plain.feed(i) for i in ids) + plain.flush() == tok.decode(ids)


def test_stop_matcher_ignores_matches_that_end_in_guarded_text():
    """min_tokens: text pushed unarmed cannot end a match; a later piece can complete
    one that began inside it (vLLM searches from the new text's start minus the stop
    string's length)."""
    m = StopMatcher(["ab"])
    assert m.push("xab", armed=False) == "xab"  # whole inside the held-off tokens
    assert m.push("a", armed=False) == ""  # could begin a later match: held
    assert m.push("b") == "" and m.matched == "ab"  # completed by an armed piece
    kept = StopMatcher(["ab"], include=True)
    assert kept.push("ab", armed=False) + kept.push("cab") == "abcab" and kept.matched == "ab"
    rolled = StopMatcher(["aa"])
    assert rolled.push("aa", armed=False) == "a"  # its last "a" may start a match
    assert rolled.push("a") == "" and rolled.matched == "aa"  # "aa" ends in the new "a"


def _vllm_reference(tok, ids, stops, include, min_tokens) -> tuple[str, bool]:
    """What vLLM's detokenizer answers (v1 engine/detokenizer.py `update` and
    `check_stop_strings`): once more than `min_tokens` tokens are out, a stop string
    counts only if it ends in text from after the first `min_tokens` tokens' (it may
    begin before); of several, the one that completes first (this server's choice)."""
    full = tok.decode(ids)
    # the text out after min_tokens tokens: that of the longest run of them ending
    # in a whole character (vLLM's incremental decode holds an incomplete one back)
    known = (tok.decode(ids[:k]) for k in range(min(min_tokens, len(ids)), -1, -1))
    guard = len(next(t for t in known if not t.endswith(REPLACEMENT)))
    hits = []
    for s in stops:
        at = full.find(s, max(0, guard - len(s) + 1))
        if at >= 0:
            hits.append((at + len(s), at))
    if not hits:
        return full, False
    end, at = min(hits)
    return full[: end if include else at], True


@settings(max_examples=60, deadline=None)
@given(text=st.text(ALPHABET, min_size=0, max_size=40), stops=st.lists(
    st.text(ALPHABET, min_size=1, max_size=4), max_size=3), include=st.booleans(),
    min_tokens=st.integers(0, 12))  # fmt: skip
def test_stop_strings_are_held_until_min_tokens_as_vllm_does(tok, text, stops, include,
                                                              min_tokens):
    ids = tok.encode(text, add_special_tokens=False).ids
    d = Detokenizer(tok, stop=stops, include_stop=include, min_tokens=min_tokens)
    got = "".join(d.feed(i) for i in ids) + d.flush()
    want, stopped = _vllm_reference(tok, ids, stops, include, min_tokens)
    assert (got, d.stopped) == (want, stopped)
