"""Host cost of `tool_choice: "auto"`'s grammar (services/gateway/tool_auto.py,
docs/decisions/0057) on the bundled SmolLM2 tokenizer (49,152 tokens): the time to
build it for two tools (the gateway, once per tool set) and to compile it for the
tokenizer (the engine, once; each sequence gets a copy), and the CPU time of the
next-token mask per token while a reply is fed token by token: a plain answer (in
the untagged grammar only its first token is masked, then the engine drops the
grammar; the tagged one masks every token, watching for a tag), and a call.
Run: python -m bench.auto_tool_grammar (a few seconds).
"""

from __future__ import annotations

import time

WEATHER = {"type": "object", "properties": {
    "location": {"type": "string", "description": "City and country"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["location", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 32}},
        "required": ["zone"], "additionalProperties": False}
PLAIN = ("The capital of France is Paris. It sits on the Seine, in the north of the "
         "country, and has been its capital for most of the last thousand years; about "
         "two million people live in the city itself and twelve million around it.")
CALL = ('{"name":"get_weather","arguments":{"location":"Lisbon, Portugal",'
        '"unit":"celsius","days":3}}')
REPEAT = 20


def main() -> None:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from bench.grammar_mask import _smollm2_tokenizer
    from shared.messages import GRAMMAR_RELEASE as RELEASE
    from services.gateway.tool_auto import auto_grammar, call_schema

    tok = _smollm2_tokenizer()
    eos = tok.eos_token_ids[0]
    ll = llguidance.LLTokenizer(tok.backend.to_str(), eos_token=eos)
    calls = [call_schema("get_weather", WEATHER), call_schema("get_time", TIME)]
    print("grammar | reply | tokens | build ms | compile ms | copy ms | masked tokens | "
          "mask ms/token")
    for tagged in (False, True):
        t0 = time.perf_counter()
        grammar = auto_grammar(calls, 8, tagged)
        build_ms = (time.perf_counter() - t0) * 1e3
        replies = {"plain": PLAIN, "call": f"[{CALL}]" if not tagged else
                   f"Let me look. <tool_call>\n{CALL}\n</tool_call>"}
        for name, text in replies.items():
            ids = tok.encode(text, add_special_tokens=False) + [eos]
            mask = allocate_token_bitmask(1, ll.vocab_size)
            masked, cpu, copy_ms = 0, 0.0, 0.0
            t0 = time.perf_counter()
            pristine = llguidance.LLMatcher(ll, grammar)  # the engine compiles it once
            compile_ms = (time.perf_counter() - t0) * 1e3
            for _ in range(REPEAT):
                t0 = time.perf_counter()
                m = pristine.deep_copy()  # and copies it for each sequence
                copy_ms += (time.perf_counter() - t0) * 1e3 / REPEAT
                for t in ids:
                    t0 = time.process_time()
                    fill_next_token_bitmask(m, mask)
                    cpu += time.process_time() - t0
                    masked += 1
                    assert (mask[0, t // 32] >> (t % 32)) & 1, (name, tagged, t)
                    assert m.consume_token(t), m.get_error()
                    if not tagged and m.get_capture(RELEASE) is not None:
                        break  # the engine drops the grammar here
            print(f"{'tagged' if tagged else 'untagged'} | {name} | {len(ids)} | "
                  f"{build_ms:.1f} | {compile_ms:.2f} | {copy_ms:.3f} | {masked // REPEAT} | "
                  f"{cpu / masked * 1e3:.3f}")


if __name__ == "__main__":
    main()
