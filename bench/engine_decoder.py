"""Decoder engine throughput on the demo model, against sequential transformers.

- engine: a static batch of `slots` copies of one prompt, greedy, decoding in
  lock-step (`DecoderEngine.generate_static`); decode tokens/s counts the tokens the
  decode steps produce over the time they take (prefill excluded), and end-to-end
  tokens/s counts every generated token over the whole call.
- transformers: `generate(do_sample=False)` on the same weights, one request after
  another, same prompt and length, with `--torch-threads` (default 1: on a small
  shared CPU, torch's second thread made a 4M-parameter model's generate 8x slower,
  and the comparison should be against the reference at its best).

Timings on a shared CPU are noisy; compare figures from one run.

    .venv/bin/python -m bench.engine_decoder [--max-new 64] [--hf-requests 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "This module provides functions for"


def _engine_figures(model_dir, slots: int, max_context: int, max_new: int, prompt: list[int]):
    import jax

    from engine.decoder import DecoderEngine
    from engine.decoder.engine import GREEDY

    engine = DecoderEngine(model_dir, "bench", slots=slots, max_context=max_context)
    engine.generate_static([prompt] * slots, 2)  # compile the bucket and the step
    t0 = time.perf_counter()
    out = engine.generate_static([prompt] * slots, max_new)
    total = time.perf_counter() - t0
    # Decode alone: the same steps, timed without the prefills.
    for s in range(slots):
        engine.prefill_insert(s, prompt, GREEDY, 0)
    t1 = time.perf_counter()
    for _ in range(max_new - 1):
        engine.step()
    decode = time.perf_counter() - t1
    for s in range(slots):
        engine.free(s)
    return {
        "device": engine.device,
        "dtype": engine.dtype,
        "slots": slots,
        "max_context": engine.max_context,
        "step_ms": round(1000 * decode / (max_new - 1), 3),
        "decode_tokens_per_s": round(slots * (max_new - 1) / decode, 1),
        "end_to_end_tokens_per_s": round(sum(map(len, out)) / total, 1),
        "jax_backend": jax.default_backend(),
    }, out[0]


def _hf_figures(model_dir, max_new: int, prompt: list[int], requests: int, threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.generation_config.eos_token_id = None  # same length as the engine's run
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm
        t0 = time.perf_counter()
        for _ in range(requests):
            out = model.generate(ids, max_new_tokens=max_new, do_sample=False)
        elapsed = time.perf_counter() - t0
    return {
        "requests": requests,
        "tokens_per_s": round(requests * max_new / elapsed, 1),
        "torch_threads": torch.get_num_threads(),
    }, out[0, len(prompt) :].tolist()


def run(max_new: int = 64, hf_requests: int = 3, slots: int = 16, max_context: int = 512,
        torch_threads: int = 1) -> dict:  # fmt: skip
    from engine.tokenizer import Tokenizer
    from shared.catalog import DEMO_LM, bundled_dir

    model_dir = bundled_dir(DEMO_LM)
    prompt = Tokenizer.from_dir(model_dir).encode(PROMPT)
    engine, ours = _engine_figures(model_dir, slots, max_context, max_new, prompt)
    hf, theirs = _hf_figures(model_dir, max_new, prompt, hf_requests, torch_threads)
    return {
        "model": DEMO_LM,
        "prompt_tokens": len(prompt),
        "max_new": max_new,
        "engine": engine,
        "transformers_sequential": hf,
        "speedup_decode": round(engine["decode_tokens_per_s"] / hf["tokens_per_s"], 2),
        "same_greedy_tokens": ours == theirs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="decoder engine vs transformers generate")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--hf-requests", type=int, default=3)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--torch-threads", type=int, default=1)
    args = ap.parse_args()
    out = run(args.max_new, args.hf_requests, args.slots, args.max_context, args.torch_threads)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
