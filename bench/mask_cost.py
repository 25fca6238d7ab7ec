"""What the structured outputs' token mask costs a decode step with no grammar
(docs/decisions/0072): the engine's step (the all-set mask as an argument, applied)
against the same step without a mask, and one that skips the mask with a `lax.cond`
when every bit is set, alternating in rounds on one engine, SmolLM2, every row
decoding after a distinct 200-token prompt. An engine figure: compiles not timed.

    .venv/bin/python -m bench.mask_cost --batches 16,32,64 --rounds 12
"""

from __future__ import annotations

import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv=None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.harness import parser
    from engine import jaxrt
    from engine.decoder import DecoderEngine, steps
    from engine.decoder import sampling as smp
    from shared import catalog
    from shared.messages import Sampling

    ap = parser(__doc__)
    ap.add_argument("--batches", default="16,32,64")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args(argv)
    jaxrt.setup(os.environ.get("JAX_CACHE_DIR") or None)
    batches = [int(b) for b in args.batches.split(",")]
    eng = DecoderEngine(catalog.bundled_dir(catalog.SMOLLM2), "bench", slots=max(batches),
                        max_context=1024, forms_cache=None, prefix_cache=False)  # fmt: skip
    p, cfg = eng.programs, eng.cfg

    def step(mask_mode):
        def run(params, state, rows, tables, live, mask):
            original = steps.apply_mask  # patched while this variant traces
            if mask_mode == "none":
                steps.apply_mask = lambda logits, _: logits
            elif mask_mode == "cond":
                steps.apply_mask = lambda logits, m: jax.lax.cond(
                    jnp.all(m == -1), lambda: logits, lambda: smp.apply_mask(logits, m))
            try:
                return steps.generate(params, cfg, state, rows, tables, live, mask, p.attention,
                                      p.interpret)  # fmt: skip
            finally:
                steps.apply_mask = original
        return jax.jit(run, donate_argnums=1)

    variants = {m: step(m) for m in ("mask", "none", "cond")}
    rng = np.random.default_rng(0)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M"), "cases": []}
    for b in batches:
        for slot in range(b):
            eng.begin(slot, rng.integers(10, 40000, 200).tolist(), Sampling(temperature=0.0), slot)
            while eng.prefill_step(slot) is None:
                pass
        rows = np.arange(b, dtype=np.int32)
        tables, live = eng.table.tables[rows, : 1024 // 16], np.ones(b, bool)
        params, allowed = eng.forms.params_for("step", b), p.allowed(b)
        times = {m: [] for m in variants}
        for r in range(args.rounds + 1):  # the first round compiles: not timed
            for m, run in variants.items():
                t0 = time.perf_counter()
                eng.runner.state, out = run(params, eng.runner.state, rows, tables, live, allowed)
                jax.block_until_ready(out)
                if r:
                    times[m].append(time.perf_counter() - t0)
        case = {"batch": b, **{f"{m}_ms": round(1000 * statistics.median(t), 1)
                               for m, t in times.items()}}  # fmt: skip
        doc["cases"].append(case)
        print(json.dumps(case), flush=True)
        for slot in range(b):
            eng.free(slot)
    return doc


if __name__ == "__main__":
    main()
