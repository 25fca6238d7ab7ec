"""Seconds from a built quantized decoder to ready with a cold compute-forms file:
measuring the forms before ready (what warm-up did until decision 0059: every
(bucket, form) compiled and timed first) against measuring them after ready (warm-up
compiles what a first request needs in the fallback form; the measuring waits).

One process per side, each a fresh engine with no choice file and no persistent
compilation cache, so both compile what they run:

    python -m bench.forms_ready --side after
    python -m bench.forms_ready --side before
"""

from __future__ import annotations

import time

from bench import harness


def main(argv=None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--side", choices=("before", "after"), required=True)
    ap.add_argument("--model", default="")
    ap.add_argument("--quant", default="int8")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--max-context", type=int, default=128)
    args = ap.parse_args(argv)

    from engine.decoder import DecoderEngine
    from shared.catalog import DEMO_LM, bundled_dir

    name = args.model or DEMO_LM
    eng = DecoderEngine(bundled_dir(name), name, slots=args.slots, max_context=args.max_context,
                        quant=args.quant, forms_cache=None, compile_ahead="first")  # fmt: skip
    t0 = time.perf_counter()
    if args.side == "before":
        eng.select_forms()
    eng.warmup(progress=False)
    ready_s = time.perf_counter() - t0
    measured, units = (eng.forms.measurements, eng.forms.units)
    eng.close()
    result = {"side": args.side, "model": name, "quant": args.quant, "slots": args.slots,
              "max_context": args.max_context, "candidates": list(eng.forms.candidates),
              "ready_s": round(ready_s, 2), "measured_at_ready": measured, "pairs": units,
              **harness.run_info(f"python -m bench.forms_ready --side {args.side}")}
    print(result)
    return result


if __name__ == "__main__":
    main()
