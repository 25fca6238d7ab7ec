"""The decoder's step by batch bucket, window and attention kernel, against the floor.

What a decode step costs when it follows the live work: for each (streams,
context) the engine serves `streams` sequences whose contexts are about `context`
tokens long, and times `--steps` decode steps (the batch bucket and window the
engine picked are reported with the figure). Each attention kernel is measured in
turn (engine/decoder/attention.py: "xla" gathers each row's blocks, "pallas" reads
them in place; on a CPU only "xla" is measured unless asked, the kernel runs
interpreted there). Beside it, the floor of one stream: a bare jitted pass of one
token through the same weights (every matmul, norm and the head; no cache), which
is what a memory-bound batch-1 step cannot beat.

Weights: the bundled SmolLM2 (`--model smollm2-135m-instruct`, the default on a
CPU) or random weights in SmolLM2's shapes (`--random`, for machines the model file
cannot reach, such as the lent GPU machine; bench/engine_check.py writes them).
Compiles happen on first use of each shape and are not timed.

    .venv/bin/python -m bench.decode_steps --cases 1x128,16x128 --steps 32
    .venv/bin/python -m bench.decode_steps --variants none,gguf:dequant,gguf:kernel \
        --cases 1x64,4x64 --steps 12 --rounds 3

`--variants` (QUANT[:FORM][@KERNEL][/f32scales], comma-separated: none@xla,none@cpu
sets two attention kernels side by side; gguf:kernel,gguf:kernel/f32scales the
file's float16 scales against the same scales held as float32) builds one engine
per variant
and times them side by side: each case's steps alternate between the engines in
rounds, and the median over all rounds is reported (a loaded machine's swings fall
on every variant alike).
    python -m bench.decode_steps --random --dtype bfloat16 --kernels xla,pallas \
        --cases 1x128,16x128,64x128,1x4096,16x4096,64x4096 --out $OUT/decode.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np


def _model_dir(args, tmp: Path) -> Path:
    if args.random:
        from bench.engine_check import DRY, SMOLLM2, write_decoder

        dry = dict(DRY, num_attention_heads=4, num_key_value_heads=2)  # head_dim 16
        cfg = dict(SMOLLM2, **dry) if args.dry else SMOLLM2
        return write_decoder(tmp / "smollm2-shaped", cfg)
    from shared import catalog

    return Path(catalog.bundled_dir(catalog.SMOLLM2))


def _start(eng, streams: int, length: int) -> None:
    from shared.messages import Sampling

    greedy = Sampling(temperature=0.0)
    rng = np.random.default_rng(0)
    for slot in range(streams):
        prompt = rng.integers(10, eng.vocab_size - 10, length).tolist()
        eng.begin(slot, prompt, greedy, slot)
        while eng.prefill_step(slot) is None:
            pass


def bare_pass_ms(eng, repeats: int) -> float:
    """One token through every weight of the step's form (no attention cache): the
    memory-bound floor of a batch-1 step."""
    import jax
    import jax.numpy as jnp

    from engine.decoder.model import family

    fam, cfg = family(eng.cfg), eng.cfg
    params = eng.forms.params_for("step", eng.programs.batches[0])

    @jax.jit
    def one(params, token):
        pos = jnp.zeros((1,), jnp.int32)
        x = fam.embed(params, cfg, token, pos)
        inv = None
        if cfg.family == "llama":
            from engine.decoder.layers import inv_frequencies

            inv = jnp.asarray(inv_frequencies(cfg))
        for lp in params["layers"]:
            q, k, v = fam.attn_in(lp, cfg, x, pos, inv)
            x = fam.attn_out(lp, cfg, x, q.reshape(1, -1))  # attention of a lone token: v
        return fam.head(params, cfg, x)

    token = jnp.asarray([5], jnp.int32)
    jax.block_until_ready(one(params, token))
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(one(params, token))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    bare_pass_ms.cpu_ms = 1000 * statistics.median(cpu)
    return 1000 * statistics.median(times)


def measure(model_dir: Path, args, kernel: str) -> dict:
    from engine.decoder import DecoderEngine

    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    top = max(c for _, c in cases) + args.steps + 16
    slots = max(s for s, _ in cases)
    blocks = sum(-(-(c + args.steps + 2) // 16) for s, c in cases for _ in range(s)) + 2
    eng = DecoderEngine(model_dir, "bench", dtype=args.dtype, slots=slots, max_context=top,
                        kv_blocks=max(blocks, 64), attention=kernel, prefix_cache=False,
                        quant=args.quant, weight_budget=args.weight_budget_mb << 20,
                        forms_cache=None)  # fmt: skip
    if args.quant != "none":
        eng.select_forms()  # the fastest form per batch bucket, measured here
    out = {"kernel": kernel, "device": eng.device, "dtype": eng.dtype, "slots": slots,
           "quant": args.quant, "forms": dict(eng.forms.compute_forms),
           "batches": list(eng.programs.batches), "windows": list(eng.programs.windows), "cases": []}
    for streams, context in cases:
        _start(eng, streams, max(1, context - args.steps - 1))
        eng.programs.step_counts.clear()
        for _ in range(2):  # compiles this shape (not timed) and settles
            eng.step()
        eng.programs.cache.wait_background()  # CPU time below is the steps' own
        times, cpu = [], []
        for _ in range(args.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            eng.step()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        ms = 1000 * statistics.median(times)
        cpu_ms = 1000 * statistics.median(cpu)  # CPU time of the process: the step's own work
        batch = max(eng.programs.step_counts, key=eng.programs.step_counts.get)
        case = {"streams": streams, "context": context, "batch_bucket": batch,
                "window": eng.programs.window_for(), "step_ms_p50": round(ms, 3),
                "cpu_ms_per_step": round(cpu_ms, 2),
                "tokens_per_s": round(streams * 1000 / ms, 1)}
        out["cases"].append(case)
        print(json.dumps(case), flush=True)
        for slot in range(streams):
            eng.free(slot)
    out["bare_pass_ms"] = round(bare_pass_ms(eng, max(8, args.steps)), 3)
    out["bare_pass_cpu_ms"] = round(bare_pass_ms.cpu_ms, 2)
    print(json.dumps({"kernel": kernel, "bare_pass_ms": out["bare_pass_ms"],
                      "bare_pass_cpu_ms": out["bare_pass_cpu_ms"]}), flush=True)
    return out


def _timed_steps(eng, steps: int) -> tuple[list[float], list[float]]:
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        eng.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return times, cpu


WIDE = "/f32scales"  # a variant's suffix: a GGUF file's float16 scales held as float32


@contextlib.contextmanager
def _scales_widened(on: bool):
    """While an engine is built: kept GGUF blocks with their scales and minimums
    widened to float32 (what the kernel read before it read float16 ones)."""
    from engine import gguf_blocks as gguf

    if not on:
        yield
        return
    kept = gguf.kept_blocks

    def widened(data, qtype):
        w = kept(data, qtype)
        wide = lambda a: None if a is None else a.astype(np.float32)  # noqa: E731
        return w if w is None else dataclasses.replace(w, scale=wide(w.scale),
                                                       offset=wide(w.offset))

    gguf.kept_blocks = widened
    try:
        yield
    finally:
        gguf.kept_blocks = kept


def compare(model_dir: Path, args) -> dict:
    """The variants' engines side by side (see the module docstring)."""
    from engine.decoder import DecoderEngine

    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    slots = max(s for s, _ in cases)
    top = max(c for _, c in cases) + args.steps * args.rounds + 16
    engines = {}
    for v in args.variants.split(","):
        name = v
        v, wide = (v[: -len(WIDE)], True) if v.endswith(WIDE) else (v, False)
        v, _, kernel = v.partition("@")
        quant, _, form = v.partition(":")
        with _scales_widened(wide):
            engines[name] = DecoderEngine(
                model_dir, "bench", dtype=args.dtype, slots=slots,
                max_context=max(top, args.max_context), prefix_cache=False, quant=quant,
                quant_form=form or "auto", forms_cache=None, attention=kernel or "auto")
        v = name
        print(json.dumps({"variant": v, "forms": engines[v].forms.candidates}), flush=True)
    out = {"variants": list(engines), "cases": []}
    for streams, context in cases:
        got = {v: ([], []) for v in engines}
        for eng in engines.values():
            _start(eng, streams, max(1, context - 1))
            for _ in range(2):  # compiles this shape (not timed) and settles
                eng.step()
        for _ in range(args.rounds):
            for v, eng in engines.items():
                t, c = _timed_steps(eng, args.steps)
                got[v][0].extend(t), got[v][1].extend(c)
        for v, eng in engines.items():
            ms = 1000 * statistics.median(got[v][0])
            case = {"variant": v, "streams": streams, "context": context,
                    "step_ms_p50": round(ms, 2),
                    "cpu_ms_per_step": round(1000 * statistics.median(got[v][1]), 2),
                    "tokens_per_s": round(streams * 1000 / ms, 1)}  # fmt: skip
            out["cases"].append(case)
            print(json.dumps(case), flush=True)
            for slot in range(streams):
                eng.free(slot)
    return out


def main(argv=None) -> dict:
    from bench.harness import parser

    ap = parser(__doc__)
    ap.add_argument("--random", action="store_true", help="random weights in SmolLM2's shapes")
    ap.add_argument("--dry", action="store_true", help="tiny shapes (with --random): a smoke run")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kernels", default="xla", help="comma-separated: xla, pallas, cpu")
    ap.add_argument("--cases", default="1x128,16x128", help="STREAMSxCONTEXT, comma-separated")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--quant", default="none", help="stored weights (engine/quant.py)")
    ap.add_argument("--weight-budget-mb", type=int, default=0,
                    help="MB every held weight form may take (0: the float32 size)")
    ap.add_argument("--variants", default="", help="QUANT[:FORM],...: side by side")
    ap.add_argument("--rounds", type=int, default=3, help="with --variants")
    ap.add_argument("--max-context", type=int, default=0,
                    help="with --variants: the engines' longest context (0: what the cases need)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    from engine import jaxrt

    jaxrt.setup(os.environ.get("JAX_CACHE_DIR") or None)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(args, Path(tmp))
        doc = {"date": time.strftime("%Y-%m-%d"), "runs": []}
        if args.variants:
            doc["runs"].append(compare(model_dir, args))
        for kernel in [] if args.variants else args.kernels.split(","):
            try:
                doc["runs"].append(measure(model_dir, args, kernel))
            except Exception as exc:  # noqa: BLE001 - one kernel failing keeps the other's figures
                doc["runs"].append({"kernel": kernel, "error": f"{type(exc).__name__}: {exc}"})
                print(json.dumps(doc["runs"][-1]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2))
    return doc


if __name__ == "__main__":
    main()
