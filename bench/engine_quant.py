"""Quantized and split decoder engines side by side, on this machine's CPU.

Per weight form (float32, bfloat16, int8, int4) of one model:
  - weight bytes as stored (integers plus scales for int8/int4);
  - perplexity on the fixed text set (bench/texts.py, each text cut to 64 tokens);
  - decode tokens/s at 1 and at 16 streams (a static batch of one 12-token prompt,
    decode steps only, median of `--repeats` runs of `--steps` steps).
With `--tp 1,N` (and N forced CPU devices: XLA_FLAGS must be set before Python
starts), the float32 decode step time unsplit and split over N devices.

    .venv/bin/python -m bench.engine_quant --model smollm2-135m-instruct
    XLA_FLAGS=--xla_force_host_platform_device_count=2 .venv/bin/python -m \
        bench.engine_quant --model tensorbus-demo-lm --forms float32 --tp 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FORMS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"),
         "int8": ("float32", "int8"), "int4": ("float32", "int4")}  # fmt: skip


def perplexity(engine, texts, bucket: int = 64) -> float:
    import jax

    from engine.decoder.model import token_nll

    nll = jax.jit(lambda p, t: token_nll(p, engine.cfg, t))
    total, count = 0.0, 0
    for text in texts:
        ids = engine.tokenizer.encode(text)[:bucket]
        padded = np.zeros(bucket, np.int32)
        padded[: len(ids)] = ids
        terms = np.asarray(nll(engine.params, padded))[: len(ids) - 1]
        total, count = total + float(terms.sum()), count + len(terms)
    return float(np.exp(total / count))


def decode_rate(model_dir, name, dtype, quant, streams, steps, repeats, tp=1):
    """(seconds per step, tokens/s) of `streams` slots decoding in lock-step."""
    import jax

    from engine.decoder import DecoderEngine
    from engine.decoder.engine import GREEDY

    eng = DecoderEngine(model_dir, name, dtype=dtype, slots=streams, max_context=128,
                        prefill_buckets=(16,), decode_windows=(128,), quant=quant,
                        tensor_parallel=tp)  # fmt: skip
    prompt = list(range(30, 42))
    for s in range(streams):
        eng.prefill_insert(s, prompt, GREEDY, 0)

    def run():
        for _ in range(steps):
            eng.step_async()
        jax.block_until_ready(eng._state.tokens)

    run()  # compiles
    times = []
    for _ in range(repeats):
        for s in range(streams):  # restart the sequences: same positions every run
            eng.free(s)
            eng.prefill_insert(s, prompt, GREEDY, 0)
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    sec = float(np.median(times)) / steps
    return sec, streams / sec, eng


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--forms", default="float32,bfloat16,int8,int4")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp", default="", help="e.g. 1,2: float32 step time per degree")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    import jax

    from bench.texts import PERPLEXITY_TEXTS
    from engine import jaxrt
    from shared.catalog import bundled_dir

    jaxrt.setup(None)
    model_dir = bundled_dir(a.model)
    streams = [int(s) for s in a.streams.split(",") if s]
    rows, split = [], []
    for form in [f for f in a.forms.split(",") if f]:
        dtype, quant = FORMS[form]
        row = {"form": form}
        for n in streams:
            sec, rate, eng = decode_rate(model_dir, a.model, dtype, quant, n, a.steps, a.repeats)
            row[f"tokens_per_s_{n}"] = round(rate, 1)
            row[f"step_ms_{n}"] = round(1e3 * sec, 2)
        row["weight_bytes"] = eng.weight_bytes
        row["perplexity"] = round(perplexity(eng, PERPLEXITY_TEXTS), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del eng
    for tp in [int(t) for t in a.tp.split(",") if t]:
        for n in streams:
            sec, rate, _ = decode_rate(model_dir, a.model, "float32", "none", n, a.steps,
                                       a.repeats, tp)  # fmt: skip
            split.append({"tensor_parallel": tp, "streams": n, "step_ms": round(1e3 * sec, 2)})
            print(json.dumps(split[-1]), flush=True)
    result = {"model": a.model, "jax": jax.__version__, "devices": jax.device_count(),
              "cpus": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 1),
              "date": time.strftime("%Y-%m-%d"), "forms": rows, "split": split}  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
