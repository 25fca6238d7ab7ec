"""Decode throughput with structured outputs, at the engine: 16 SmolLM2 streams
with no grammar, with a JSON schema on half of them and on all of them, each run in
turn on one engine (docs/decisions/0048). A step with a constrained row reads the
step before it, computes the masks and runs the masked program, so the figure is
what that costs beside the plain step; the mask's CPU time per token comes from the
engine's own count. Compiles (the plain and masked programs) happen in an untimed
first pass.

    .venv/bin/python -m bench.structured --streams 16 --steps 24 --rounds 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 30},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
    "required": ["title", "tags", "year"], "additionalProperties": False}


def _run(engine, streams: int, constrained: int, steps: int, grammar: str, tokens: list[int]):
    from shared.messages import Sampling

    for slot in range(streams):
        s = Sampling(temperature=1.0, grammar=grammar if slot < constrained else "")
        engine.begin(slot, tokens, s, slot)
        while engine.prefill_step(slot) is None:
            pass
    engine.step()  # the first step of this mix (a masked compile on the first pass)
    g = engine.grammar
    masks, mask_s = g.masks, g.mask_seconds
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - t0
    for slot in range(streams):
        engine.free(slot)
    per_mask = (g.mask_seconds - mask_s) / max(1, g.masks - masks) * 1e3
    return streams * steps / seconds, per_mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2,
                    help="alternated rounds; the summary is each mix's median (noisy machines)")
    args = ap.parse_args()

    from engine.decoder import DecoderEngine
    from services.gateway.structured import schema_grammar
    from shared import catalog

    path = catalog.bundled_dir(catalog.SMOLLM2)
    engine = DecoderEngine(path, catalog.SMOLLM2, slots=args.streams, max_context=128,
                           prefill_buckets=(64,), decode_windows=(128,))
    prompt = engine.tokenizer.encode("List some books as JSON with a title, tags and a year:")
    grammar = schema_grammar(SCHEMA)
    mixes = [0, args.streams // 2, args.streams]
    for c in mixes:  # compiles, untimed
        _run(engine, args.streams, c, 2, grammar, prompt)
    print(f"streams {args.streams}, steps {args.steps}, temperature 1")
    got: dict[int, list[float]] = {c: [] for c in mixes}
    for _ in range(args.rounds):  # alternated, so load moves every mix alike
        for c in mixes:
            tps, per_mask = _run(engine, args.streams, c, args.steps, grammar, prompt)
            got[c].append(tps)
            print(f"constrained {c:2d}/{args.streams}: {tps:7.1f} tokens/s"
                  + (f", mask {per_mask:.3f} ms per row" if c else ""))
    base = statistics.median(got[0])
    for c in mixes:
        med = statistics.median(got[c])
        print(f"median, constrained {c:2d}/{args.streams}: {med:7.1f} tokens/s"
              + (f" ({100 * (med / base - 1):+.0f} % against none)" if c else ""))


if __name__ == "__main__":
    main()
