"""What loading SmolLM2-135M-Instruct from its GGUF file costs, step by step, and its
greedy decode speed. One process per dtype (`--dtype`), so resident memory is the
model's own: the high-water mark (`ru_maxrss`) and what stays resident after loading.

    .venv/bin/python -m bench.gguf_load [--dtype float32] [--slots 1,16] [--steps 32]
"""

from __future__ import annotations

import json
import os
import resource
import time

from bench import harness

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--slots", default="1,16")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--max-context", type=int, default=256)
    args = p.parse_args()

    from shared import catalog, gguf

    d = catalog.bundled_dir(catalog.SMOLLM2)
    path = gguf.find_file(d)
    out: dict = {"file_mb": round(path.stat().st_size / 2**20, 1), "dtype": args.dtype}

    t0 = time.perf_counter()
    gguf.read_header(path)
    out["header_s"] = round(time.perf_counter() - t0, 3)
    from engine.tokenizer import Tokenizer

    t0 = time.perf_counter()
    tok = Tokenizer.from_dir(d)
    out["tokenizer_s"] = round(time.perf_counter() - t0, 3)
    import jax  # noqa: F401 - imported before the timings below, as a worker has it

    from engine.weights import load_weights

    before = _rss_mb()
    t0 = time.perf_counter()
    weights = load_weights(d)
    out["dequantize_s"] = round(time.perf_counter() - t0, 3)
    out["float32_weights_mb"] = round(sum(w.nbytes for w in weights.values()) / 2**20, 1)
    del weights
    out["rss_before_engine_mb"] = round(before, 1)

    from engine.decoder import DecoderEngine
    from engine.decoder.static import GREEDY, prefill_insert

    slot_counts = harness.csv_ints(args.slots)
    t0 = time.perf_counter()
    engine = DecoderEngine(d, catalog.SMOLLM2, dtype=args.dtype, slots=max(slot_counts),
                           max_context=args.max_context, prefill_buckets=(32,),
                           decode_windows=())  # fmt: skip
    out["engine_init_s"] = round(time.perf_counter() - t0, 3)
    out["rss_after_engine_mb"] = round(_rss_mb(), 1)
    out["peak_rss_mb"] = round(_peak_mb(), 1)
    t0 = time.perf_counter()
    engine.warmup(progress=False)
    out["warmup_s"] = round(time.perf_counter() - t0, 3)

    prompt = tok.encode("The history of the Roman Empire")
    for n in slot_counts:
        for s in range(n):
            prefill_insert(engine, s, prompt, GREEDY, 0)
        engine.step()  # the first step after inserts is not timed
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step = (time.perf_counter() - t0) / args.steps
        for s in range(n):
            engine.free(s)
        out[f"step_ms_{n}_slots"] = round(1000 * step, 2)
        out[f"tokens_per_s_{n}_slots"] = round(n / step, 1)
    out["device"] = engine.device
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
