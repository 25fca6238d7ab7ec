"""One iteration of the decode loop with a prompt waiting, mixed against apart, side
by side in one engine: `--streams` sequences decode, and each iteration a new
distinct prompt of `--prompt` tokens computes its first chunk (the tokens a mixed
pass leaves beside the decode rows). "mixed": the decode rows and the chunk in one
pass (engine/decoder/steps.py `mixed`); "apart": the chunk on its prefill program,
then the decode step. SmolLM2 as a worker serves it (its GGUF blocks on the CPU
kernel), every program compiled before anything is timed; the modes alternate
iteration by iteration.

Reported per mode: the median and p90 iteration (what each running stream waits
for its next token while prompts arrive) and prompt tokens computed per second.

    .venv/bin/python -m bench.mixed_steps --streams 16 --prompt 300 --iterations 16
"""

from __future__ import annotations

import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np


def _iteration(eng, mixed: bool, prompt: list[int], live: int) -> tuple[float, int]:
    """One iteration with a new prompt waiting beside the `live` streams: its first
    chunk (as many tokens as the mixed pass leaves it) and the streams' step ->
    (seconds, prompt tokens computed). The prompt's slot is freed after."""
    from shared.messages import Sampling

    slot = live
    eng.begin(slot, prompt, Sampling(temperature=0.0), 0)
    budget = eng.programs.mixed_shapes[0][0] - live
    t0 = time.perf_counter()
    eng.prefill_step(slot, budget, mix=mixed)
    step = eng.step_async()
    assert step.prompt_tokens if mixed else not step.prompt_tokens
    step.result()
    seconds = time.perf_counter() - t0
    done = len(prompt) - eng.prefilling(slot)
    eng.free(slot)
    return seconds, done


def main(argv=None) -> dict:
    from bench.harness import parser
    from engine import jaxrt
    from engine.decoder import DecoderEngine
    from shared import catalog

    ap = parser(__doc__)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--iterations", type=int, default=16, help="per mode, alternating")
    ap.add_argument("--quant", default="gguf", help="as a worker serves SmolLM2's file")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    jaxrt.setup(os.environ.get("JAX_CACHE_DIR") or None)
    model = catalog.bundled_dir(catalog.SMOLLM2)
    eng = DecoderEngine(model, "bench", slots=64, max_context=2048, forms_cache=None,
                        prefill_chunk=128, prefix_cache=False, quant=args.quant)  # fmt: skip
    for shape in eng.programs.compiles:
        eng.programs.get(*shape)
    eng.runner.claim_dummy()
    rng = np.random.default_rng(0)
    from shared.messages import Sampling

    for s in range(args.streams):  # the streams: short prompts, then they decode on
        eng.begin(s, rng.integers(10, 40000, 20).tolist(), Sampling(temperature=0.0), s)
        while eng.prefill_step(s) is None:
            pass
    got: dict[str, dict[str, list]] = {m: {"times": [], "tokens": []} for m in ("mixed", "apart")}
    for i in range(args.iterations + 2):  # alternating; the first two rounds not counted
        for mode in ("mixed", "apart") if i % 2 == 0 else ("apart", "mixed"):
            prompt = rng.integers(10, 40000, args.prompt).tolist()
            seconds, tokens = _iteration(eng, mode == "mixed", prompt, args.streams)
            if i >= 2:
                got[mode]["times"].append(seconds)
                got[mode]["tokens"].append(tokens)
    doc = {"date": time.strftime("%Y-%m-%d"), "streams": args.streams, "prompt": args.prompt,
           "quant": args.quant, "modes": {}}
    for mode, g in got.items():
        doc["modes"][mode] = {
            "iteration_ms_p50": round(1000 * statistics.median(g["times"]), 1),
            "iteration_ms_p90": round(1000 * float(np.percentile(g["times"], 90)), 1),
            "prompt_tokens_per_s": round(sum(g["tokens"]) / sum(g["times"]), 1),
        }
    print(json.dumps(doc), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    main()
