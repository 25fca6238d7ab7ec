"""A prompt's prefill by attention kernel, side by side: the time from `begin` to
its first token, for distinct prompts of several lengths (chunked where longer than
the largest bucket) and, with `--shared`, prompts that share a cached system prompt
of that many tokens (the chunk then attends to the cached blocks).

Each length's prompts alternate between the engines in rounds and the median is
reported; every prefill program of each engine is compiled before anything is
timed (an engine otherwise computes a short chunk on a larger compiled bucket).

    .venv/bin/python -m bench.prefill_steps --kernels xla,cpu --lengths 32,200,500,1500 \
        --shared 1000 --rounds 3
"""

from __future__ import annotations

import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np


def _prefill(eng, prompt: list[int]) -> float:
    from shared.messages import Sampling

    t0 = time.perf_counter()
    eng.begin(0, prompt, Sampling(temperature=0.0), 0)
    while eng.prefill_step(0) is None:
        pass
    seconds = time.perf_counter() - t0
    eng.free(0)
    return seconds


def main(argv=None) -> dict:
    from bench.harness import parser
    from engine import jaxrt
    from engine.decoder import DecoderEngine
    from shared import catalog

    ap = parser(__doc__)
    ap.add_argument("--kernels", default="xla,cpu")
    ap.add_argument("--lengths", default="32,200,500,1500")
    ap.add_argument("--shared", type=int, default=0, help="a cached system prompt's tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    jaxrt.setup(os.environ.get("JAX_CACHE_DIR") or None)
    model = catalog.bundled_dir(catalog.SMOLLM2)
    engines = {k: DecoderEngine(model, "bench", slots=4, max_context=args.max_context,
                                attention=k, forms_cache=None, prefix_cache=bool(args.shared))
               for k in args.kernels.split(",")}  # fmt: skip
    for eng in engines.values():
        for kind, size, other in eng.programs.compiles:
            if kind == "prefill":
                eng.programs.get(kind, size, other)
    rng = np.random.default_rng(0)
    system = rng.integers(10, 40000, args.shared).tolist()
    lengths = [int(n) for n in args.lengths.split(",")]
    doc = {"date": time.strftime("%Y-%m-%d"), "shared": args.shared, "cases": []}
    for n in lengths:
        prompts = [system + rng.integers(10, 40000, n).tolist() for _ in range(args.rounds + 1)]
        got = {k: [] for k in engines}
        for k, eng in engines.items():
            if args.shared:
                _prefill(eng, system + [1])  # the system prompt's blocks cached
            _prefill(eng, prompts[0])  # compiles what this length needs (not timed)
        for prompt in prompts[1:]:
            for k, eng in engines.items():
                got[k].append(_prefill(eng, prompt))
        for k in engines:
            case = {"kernel": k, "tokens": n, "shared": args.shared,
                    "prefill_ms_p50": round(1000 * statistics.median(got[k]), 1)}
            doc["cases"].append(case)
            print(json.dumps(case), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    return doc


if __name__ == "__main__":
    main()
