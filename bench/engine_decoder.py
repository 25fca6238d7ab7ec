"""Decoder engine throughput (the demo model, or `--model`), against sequential transformers.

- engine: a static batch of `slots` copies of one prompt, greedy, decoding in
  lock-step (`static.generate_static`); decode tokens/s counts the tokens the
  decode steps produce over the time they take (prefill excluded), and end-to-end
  tokens/s counts every generated token over the whole call.
- transformers: `generate(do_sample=False)` on the same weights, one request after
  another, same prompt and length, with `--torch-threads` (default 1: on a small
  shared CPU, torch's second thread made a 4M-parameter model's generate 8x slower,
  and the comparison should be against the reference at its best).
- `--engines jax,torch --streams 1,16`: the same static batch on each engine at each
  stream count (1 stream = one sequence decoding alone), side by side. The torch
  engine runs with torch's default thread count unless `--engine-threads` says;
  transformers then runs with `--torch-threads` (set after the engines ran).

Timings on a shared CPU are noisy; compare figures from one run.

    .venv/bin/python -m bench.engine_decoder [--max-new 64] [--hf-requests 3]
    .venv/bin/python -m bench.engine_decoder --engines jax,torch --streams 1,16 \
        --engine-threads 1 --out bench/out/engine_decoder.json
    .venv/bin/python -m bench.engine_decoder --model smollm2-135m-instruct --max-new 32 \
        --max-context 128 --prefill-buckets 16

A GGUF model (SmolLM2) is read by transformers from the same file
(`from_pretrained(dir, gguf_file=...)`, dequantized to float32).
"""

from __future__ import annotations

import json
import os
import statistics
import time

from bench import harness

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "This module provides functions for"


def _build(kind: str, model_dir, slots: int, max_context: int, prefill_buckets=None):
    if kind == "torch":
        from engine.torch_decoder import TorchDecoder

        return TorchDecoder(model_dir, "bench", slots=slots, max_context=max_context)
    from engine.decoder import DecoderEngine

    kw = {"prefill_buckets": tuple(prefill_buckets)} if prefill_buckets else {}
    return DecoderEngine(model_dir, "bench", slots=slots, max_context=max_context, **kw)


def _static_figures(engine, streams: int, max_new: int, prompt: list[int], min_s: float = 3.0):
    """One static batch of `streams` copies of the prompt: (figures, first stream's tokens).

    The decode-only figure is the median of repeated rounds of `max_new - 1` steps
    (at least three, and at least `min_s` seconds in all): one round of a small model
    is a fraction of a second, and on a shared machine a single one swung 2x."""
    from engine.decoder.static import GREEDY, generate_static, prefill_insert

    generate_static(engine, [prompt] * streams, 2)  # compile (JAX) or warm (torch)
    t0 = time.perf_counter()
    out = generate_static(engine, [prompt] * streams, max_new)
    total = time.perf_counter() - t0
    # Decode alone: the same steps, timed without the prefills.
    rounds: list[float] = []
    while len(rounds) < 3 or sum(rounds) < min_s:
        for s in range(streams):
            prefill_insert(engine, s, prompt, GREEDY, 0)
        t1 = time.perf_counter()
        for _ in range(max_new - 1):
            engine.step()
        rounds.append(time.perf_counter() - t1)
        for s in range(streams):
            engine.free(s)
    decode = statistics.median(rounds)
    return {
        "streams": streams,
        "step_ms": round(1000 * decode / (max_new - 1), 3),
        "decode_tokens_per_s": round(streams * (max_new - 1) / decode, 1),
        "decode_rounds": len(rounds),
        "decode_tokens_per_s_range": [round(streams * (max_new - 1) / r, 1)
                                      for r in (max(rounds), min(rounds))],
        "end_to_end_tokens_per_s": round(sum(map(len, out)) / total, 1),
    }, out[0]


def _engine_figures(kind: str, model_dir, slots: int, max_context: int, max_new: int,
                    prompt: list[int], streams: tuple[int, ...], prefill_buckets=None):  # fmt: skip
    """{"device", "dtype", ..., "streams": {n: figures}} and the greedy tokens."""
    import jax
    import torch

    engine = _build(kind, model_dir, slots, max_context, prefill_buckets)
    by_streams, tokens = {}, None
    for n in streams:
        by_streams[str(n)], tokens = _static_figures(engine, n, max_new, prompt)
    info = {"device": engine.device, "dtype": engine.info.dtype, "slots": slots,
            "max_context": engine.max_context}
    if kind == "torch":
        info["torch_threads"] = torch.get_num_threads()
    else:
        info["jax_backend"] = jax.default_backend()
    return {**info, "streams": by_streams}, tokens


def _hf_figures(model_dir, max_new: int, prompt: list[int], requests: int, threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    from shared.gguf import find_file

    torch.set_num_threads(threads)
    gguf_file = find_file(model_dir)
    if gguf_file is not None:  # the same file, dequantized by transformers
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32).eval()
    else:
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
        torch_threads: int = 1, engines: tuple[str, ...] = ("jax",),
        streams: tuple[int, ...] | None = None, engine_threads: int = 0,
        model: str = "", prefill_buckets: tuple[int, ...] | None = None) -> dict:  # fmt: skip
    """`engine` (the JAX engine's static batch of `slots`) keeps the shape
    bench.generation reads; `engines` has every engine at every stream count."""
    import torch

    from engine.tokenizer import Tokenizer
    from shared.catalog import DEMO_LM, bundled_dir

    if engine_threads:
        torch.set_num_threads(engine_threads)
    model = model or DEMO_LM
    model_dir = bundled_dir(model)
    prompt = Tokenizer.from_dir(model_dir).encode(PROMPT)
    streams = tuple(streams or (slots,))
    figures, tokens = {}, {}
    for kind in engines:
        figures[kind], tokens[kind] = _engine_figures(kind, model_dir, slots, max_context,
                                                      max_new, prompt, streams,
                                                      prefill_buckets)  # fmt: skip
    hf, theirs = _hf_figures(model_dir, max_new, prompt, hf_requests, torch_threads)
    out = {"model": model, "prompt_tokens": len(prompt), "max_new": max_new}
    if "jax" in engines and str(slots) in figures["jax"]["streams"]:
        jax_fig = figures["jax"]
        engine = {k: v for k, v in jax_fig.items() if k != "streams"}
        out["engine"] = {**engine, **jax_fig["streams"][str(slots)]}
        out["speedup_decode"] = round(out["engine"]["decode_tokens_per_s"] / hf["tokens_per_s"], 2)
    out["engines"] = figures
    out["transformers_sequential"] = hf
    out["same_greedy_tokens"] = all(t == theirs for t in tokens.values())
    return out


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--hf-requests", type=int, default=3)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--model", default="", help="a bundled decoder (default: the demo LM)")
    ap.add_argument("--prefill-buckets", default="",
                    help="comma-separated prompt buckets of the JAX engine (default: the engine's)")
    ap.add_argument("--torch-threads", type=int, default=1, help="for transformers' generate")
    ap.add_argument("--engine-threads", type=int, default=0,
                    help="torch threads of the torch engine (0 = torch's default)")
    ap.add_argument("--engines", default="jax", help="comma-separated: jax,torch")
    ap.add_argument("--streams", default="", help="comma-separated stream counts (default: slots)")
    ap.add_argument("--out", default="",
                    help="also write the JSON here (e.g. bench/out/engine_decoder.json)")
    args = ap.parse_args()
    streams = tuple(harness.csv_ints(args.streams)) or None
    out = run(args.max_new, args.hf_requests, args.slots, args.max_context, args.torch_threads,
              tuple(harness.csv_strs(args.engines)), streams, args.engine_threads, args.model,
              tuple(harness.csv_ints(args.prefill_buckets)) or None)
    out["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = json.dumps(out, indent=2)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
