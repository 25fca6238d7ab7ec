"""SmolLM2's prefill against the machine's matmul roofline, in one run.

A prompt's prefill is matmul-bound: 2 x parameters FLOPs per token (attention over a
few hundred tokens adds little). The roofline is what XLA's float32 matmul reaches
on this machine at SmolLM2's own shapes (the chunk's rows against the MLP's and the
attention's weights), measured in the same process, alternating with the prefills in
rounds so that a loaded machine's swings fall on both. Each weight form is an engine
of its own (`--variants`, QUANT:FORM as in bench.decode_steps): the float32 weights,
the GGUF blocks dequantized inside the step (XLA), and the blocks read by the CPU
kernel, four rows a pass (engine/kernels).

    .venv/bin/python -m bench.prefill_roofline --tokens 512 --rounds 3
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np


def _engine(model_dir: Path, variant: str, tokens: int):
    from engine.decoder import DecoderEngine
    from shared import catalog

    quant, _, form = variant.partition(":")
    return DecoderEngine(model_dir, catalog.SMOLLM2, slots=1, max_context=tokens + 16,
                         prefill_buckets=(tokens,), decode_windows=(), quant=quant,
                         quant_form=form or "auto", forms_cache=None)  # fmt: skip


def _prefill_s(eng, prompt: list[int]) -> float:
    from shared.messages import Sampling

    t0 = time.perf_counter()
    eng.begin(0, prompt, Sampling(temperature=0.0), 0)
    while eng.prefill_step(0, len(prompt)) is None:
        pass
    seconds = time.perf_counter() - t0
    eng.free(0)
    return seconds


def _shapes(cfg) -> list[tuple[int, int]]:
    """One layer's weight matrices: qkv, o, gate_up, down."""
    e, i, kv = cfg.hidden, cfg.intermediate, cfg.kv_heads * cfg.head_dim
    return [(e, e + 2 * kv), (e, e), (e, 2 * i), (i, e)]


def _matmuls(tokens: int, cfg):
    """One jitted call of one layer's four matmuls for `tokens` rows, and its FLOPs."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    shapes = _shapes(cfg)
    ws = [jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.02) for s in shapes]
    xs = [jnp.asarray(rng.standard_normal((tokens, s[0])).astype(np.float32)) for s in shapes]

    @jax.jit
    def run(xs, ws):
        return [x @ w for x, w in zip(xs, ws)]

    flops = sum(2 * tokens * a * b for a, b in shapes)
    return (lambda: jax.block_until_ready(run(xs, ws))), flops


def main(argv=None) -> dict:
    from bench.harness import csv_strs, parser, run_info, write_json
    from engine import jaxrt
    from engine.decoder.config import load_config
    from shared import catalog

    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", type=csv_strs, default=["none", "gguf:dequant", "gguf:kernel"])
    args = ap.parse_args(argv)
    jaxrt.setup(os.environ.get("JAX_CACHE_DIR") or None)
    model_dir = Path(catalog.bundled_dir(catalog.SMOLLM2))
    cfg = load_config(model_dir)
    engines = {v: _engine(model_dir, v, args.tokens) for v in args.variants}
    # The matmuls' weights a prompt token passes through (the head runs for the last
    # token only; the embedding is a lookup).
    params = cfg.layers * sum(a * b for a, b in _shapes(cfg))
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(100, cfg.vocab_size - 1, args.tokens)]
    matmul, mm_flops = _matmuls(args.tokens, cfg)
    matmul()
    for eng in engines.values():  # compiles: not timed
        _prefill_s(eng, prompt)
    times: dict[str, list[float]] = {v: [] for v in engines}
    roof: list[float] = []
    for _ in range(args.rounds):
        for _ in range(3):
            t0 = time.perf_counter()
            matmul()
            roof.append(mm_flops / (time.perf_counter() - t0) / 1e9)
        for v, eng in engines.items():
            times[v].append(_prefill_s(eng, prompt))
    roofline = statistics.median(roof)
    doc = {"run": run_info(), "tokens": args.tokens, "params": params,
           "roofline_gflops": round(roofline, 1), "variants": []}  # fmt: skip
    for v, ts in times.items():
        s = statistics.median(ts)
        gflops = 2 * params * args.tokens / s / 1e9
        row = {"variant": v, "forms": sorted(set(engines[v].forms.compute_forms.values())),
               "prefill_s": round(s, 3), "tokens_per_s": round(args.tokens / s, 1),
               "gflops": round(gflops, 1), "of_roofline": round(gflops / roofline, 3)}  # fmt: skip
        doc["variants"].append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"roofline_gflops": doc["roofline_gflops"]}), flush=True)
    write_json("prefill_roofline.json", doc)
    return doc


if __name__ == "__main__":
    main()
