"""Token-mask cost of the two grammar libraries considered for structured outputs
(docs/decisions/0048), on the bundled SmolLM2 tokenizer (49,152 tokens): for each
schema, the time to compile it and the CPU time per token of the next-token mask
while a valid instance is fed token by token; then which JSON Schema features each
compiles. Run: python -m bench.grammar_mask (about a minute).
"""

from __future__ import annotations

import json
import time

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False},
             {"name": "Ada Lovelace", "age": 36}),
    "nested": ({"type": "object", "properties": {
        "city": {"type": "string"},
        "days": {"type": "array", "items": {"type": "object", "properties": {
            "day": {"enum": ["mon", "tue", "wed"]}, "high": {"type": "number"},
            "rain": {"type": "boolean"}}, "required": ["day", "high", "rain"],
            "additionalProperties": False}}},
        "required": ["city", "days"], "additionalProperties": False},
        {"city": "Paris", "days": [{"day": "mon", "high": 21.5, "rain": False},
                                   {"day": "tue", "high": 18.0, "rain": True}]}),
    "tool": ({"type": "object", "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["location", "unit", "days"], "additionalProperties": False},
        {"location": "Lisbon, Portugal", "unit": "celsius", "days": 3}),
}

FEATURES = {
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "$ref/$defs": {"$defs": {"p": {"type": "integer"}}, "type": "object",
                   "properties": {"a": {"$ref": "#/$defs/p"}}, "required": ["a"]},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"},
    "pattern": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1,
                          "maxItems": 3},
    "format: date-time": {"type": "string", "format": "date-time"},
    "minimum/maximum": {"type": "integer", "minimum": 0, "maximum": 10},
    "const": {"const": "x"},
    "additionalProperties schema": {"type": "object",
                                    "additionalProperties": {"type": "integer"}},
    "any JSON (json_object)": {"type": "object"},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"required": ["a"]}]},
    "if/then": {"if": {"type": "string"}, "then": {"minLength": 1}},
}


def _smollm2_tokenizer():
    from engine.tokenizer import Tokenizer
    from shared import catalog

    return Tokenizer.from_dir(catalog.bundled_dir(catalog.SMOLLM2))


def _byte_vocab(tok):
    """token id -> bytes (GPT-2 byte-level BPE's printable alphabet undone)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    dec = {chr(c): b for b, c in zip(bs, cs)}
    out = {}
    for i in range(tok.vocab_size):
        s = tok.id_to_token(i)
        if s is None:
            continue
        try:
            out[i] = bytes(dec[c] for c in s)
        except KeyError:
            out[i] = s.encode()
    return out


def llguidance_run(tok, eos):
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    ll = llguidance.LLTokenizer(tok.backend.to_str(), eos_token=eos)
    rows = {}
    for name, (schema, instance) in SCHEMAS.items():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(ll, grammar)
        compile_ms = (time.perf_counter() - t0) * 1e3
        ids = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
        mask = allocate_token_bitmask(1, ll.vocab_size)
        t0 = time.process_time()
        for t in ids:
            fill_next_token_bitmask(m, mask)
            assert (mask[0, t // 32] >> (t % 32)) & 1, (name, t)
            assert m.consume_token(t), m.get_error()
        per = (time.process_time() - t0) / len(ids) * 1e3
        assert m.is_accepting()
        rows[name] = (compile_ms, per, len(ids))
    cov = {}
    for feat, schema in FEATURES.items():
        g = llguidance.LLMatcher.grammar_from_json_schema(schema)
        err = llguidance.LLMatcher.validate_grammar(g, ll)
        cov[feat] = "yes" if not err else "no"
    return rows, cov


def outlines_run(tok, eos):
    import numpy as np
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    vmap = {}
    for i, b in _byte_vocab(tok).items():
        if i != eos:
            vmap.setdefault(b, []).append(i)
    vocab = Vocabulary(eos, vmap)
    vocab_s = time.perf_counter() - t0
    rows = {}
    for name, (schema, instance) in SCHEMAS.items():
        t0 = time.perf_counter()
        index = Index(build_regex_from_schema(json.dumps(schema), whitespace_pattern=""), vocab)
        compile_ms = (time.perf_counter() - t0) * 1e3
        g = Guide(index)
        ids = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
        mask = np.zeros((tok.vocab_size + 31) // 32, np.int32)
        t0 = time.process_time()
        ok = True
        for t in ids:
            g.write_mask_into(mask.ctypes.data, mask.size, 4)
            if not (mask[t // 32] >> (t % 32)) & 1:
                ok = False
                break
            g.advance(t, return_tokens=False)
        per = (time.process_time() - t0) / len(ids) * 1e3
        rows[name] = (compile_ms, per, len(ids) if ok else -1)
    cov = {}
    for feat, schema in FEATURES.items():
        try:
            Index(build_regex_from_schema(json.dumps(schema), whitespace_pattern=""), vocab)
            cov[feat] = "yes"
        except BaseException as exc:  # noqa: BLE001 - a panic in the library is a "no"
            cov[feat] = f"no ({type(exc).__name__})"
    return rows, cov, vocab_s


def main() -> None:
    tok = _smollm2_tokenizer()
    eos = tok.eos_token_ids[0]
    print(f"vocab {tok.vocab_size}, eos {eos}")
    ll_rows, ll_cov = llguidance_run(tok, eos)
    oc_rows, oc_cov, vocab_s = outlines_run(tok, eos)
    print(f"outlines-core vocabulary build: {vocab_s:.2f} s")
    print("schema | tokens | llguidance compile ms | llguidance mask ms/token | "
          "outlines-core compile ms | outlines-core mask ms/token")
    for name in SCHEMAS:
        a, b = ll_rows[name], oc_rows[name]
        print(f"{name} | {a[2]} | {a[0]:.1f} | {a[1]:.3f} | {b[0]:.1f} | {b[1]:.3f}"
              + ("" if b[2] > 0 else " (instance refused)"))
    print("feature | llguidance | outlines-core")
    for feat in FEATURES:
        print(f"{feat} | {ll_cov[feat]} | {oc_cov[feat]}")


if __name__ == "__main__":
    main()
