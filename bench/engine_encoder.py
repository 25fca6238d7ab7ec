"""Encoder engine benchmark: JAX against torch eager and ONNX Runtime on the same
weights and inputs.

    .venv/bin/python -m bench.engine_encoder [--seconds 4] [--kinds short,long]

What `run()` measures, in one process, side by side:
  1. the JAX engine (`EncoderEngine.embed`, default layout: packed rows for MiniLM)
     at `batch` inputs per call, and its batch-1 latency; beside it the same engine on
     the padded (batch x length) grid it used before packing (`jax_grid`);
  2. torch eager, two ways: transformers' `BertModel` plus mean pooling (the
     reference, as sentence-transformers runs it) and our `TorchEncoder`, both under
     `torch.inference_mode()` with torch's default thread count;
  2b. the onnx engine (`OnnxEncoder`), float32 and int8 (the int8 graph is built
     whatever its accuracy, which is reported beside it: `onnx_int8_min_cosine`, its
     check against float32, and `onnx_int8_cosine_here`, on these inputs);
  3. two jit-compiled float32 matmuls, 2048^3 and the encoder's 1024x384x1536 FFN
     shape, so the encoder's GFLOP/s can be read as a share of the CPU's GEMM rate.
Everything alternates in short rounds and each reports its median round, so that
load from other processes on a shared machine hits all of them alike. FLOPs are
counted on the padded shapes actually computed (the programs), not the real tokens.
Kinds: short (14-17 tokens), long (128), mixed (half short, half cut to 24-200
tokens: distinct lengths, as a retrieval corpus is).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable

import numpy as np

from bench import harness
from shared import catalog

MODEL = catalog.ENCODER


LONG_TOKENS = 128


def _inputs(tok, kind: str, n: int) -> list[list[int]]:
    """short: 14-17 tokens (the 16 bucket, one input in 32); long: exactly 128 tokens.

    The long texts run a little past 128 tokens (some words split), and a batch that
    spills into the 256 bucket measures padding policy, not engine speed; they are cut
    to 128 ids ([SEP] kept) so JAX and torch compute the same shapes."""
    from bench.support.workload import long_inputs, sentences, short_inputs

    if kind == "short":
        return tok.encode_batch(short_inputs(n))
    if kind == "long":
        ids = tok.encode_batch(long_inputs(n))
        return [x[: LONG_TOKENS - 1] + x[-1:] if len(x) > LONG_TOKENS else x for x in ids]
    if kind == "mixed":
        cut = np.random.default_rng(0).integers(24, 201, n - n // 2)
        texts = tok.encode_batch(sentences(n - n // 2, 200, seed=3))
        longs = [x[: c - 1] + x[-1:] for x, c in zip(texts, cut)]
        return tok.encode_batch(short_inputs(n // 2)) + longs
    raise ValueError(f"kind must be 'short', 'long' or 'mixed', not {kind!r}")


def encoder_flops(batch: int, seq: int, hidden: int, ffn: int, layers: int) -> float:
    """Multiply-adds x 2 of one forward pass on a [batch, seq] padded input."""
    tokens = batch * seq
    dense = 2 * tokens * (hidden * 3 * hidden + hidden * hidden + 2 * hidden * ffn)
    attention = 2 * 2 * batch * seq * seq * hidden  # scores and the weighted sum
    return float(layers * (dense + attention))


def _rounds(fns: dict[str, Callable[[], None]], seconds: float, rounds: int) -> dict:
    """Alternate the functions for `rounds` rounds of about seconds/rounds each;
    return each one's median seconds per call."""
    per: dict[str, list[float]] = {k: [] for k in fns}
    budget = seconds / rounds
    for _ in range(rounds):
        for name, fn in fns.items():
            n, t0 = 0, time.perf_counter()
            while True:
                fn()
                n += 1
                dt = time.perf_counter() - t0
                if dt >= budget:
                    break
            per[name].append(dt / n)
    return {k: statistics.median(v) for k, v in per.items()}


def _hf_reference(model_dir):
    """transformers' BertModel + mean pooling + L2 norm, as sentence-transformers."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import BertModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = BertModel.from_pretrained(str(model_dir)).eval()
    hf_logging.enable_progress_bar()

    def embed(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            t_ids, t_mask = torch.from_numpy(ids).long(), torch.from_numpy(mask).long()
            hidden = model(input_ids=t_ids, attention_mask=t_mask).last_hidden_state
            m = t_mask.unsqueeze(-1).float()  # [B, S, 1]
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)  # [B, D]
            return torch.nn.functional.normalize(pooled, dim=1).numpy()

    return embed


def _matmuls() -> dict[str, tuple[Callable[[], None], float]]:
    """Reference GEMMs, jit-compiled with default options: {name: (call, flops)}.

    "matmul": the 2048^3 float32 matmul the issue names; "gemm": the encoder's own
    FFN shape (64x16 tokens by 384 by 1536), a steadier ceiling on this CPU."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    out = {}
    for name, (m, k, n) in {"matmul": (2048, 2048, 2048), "gemm": (1024, 384, 1536)}.items():
        a = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))  # [m, k]
        b = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32))  # [k, n]
        mm = jax.jit(jnp.matmul)
        mm(a, b).block_until_ready()
        out[name] = (lambda mm=mm, a=a, b=b: mm(a, b).block_until_ready(), 2.0 * m * k * n)
    return out


def _latency_ms(fn: Callable[[], None], seconds: float) -> float:
    lat, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(lat) < 5:
        t = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t)
    return harness.pct_ms(lat, 50, digits=None)


def run(batch: int = 64, kind: str = "short", seconds: float = 4.0,
        cache_dir: str | None = None, rounds: int = 4) -> dict:  # fmt: skip
    """One side-by-side measurement; quiet (no output), returns the figures."""
    from engine import jaxrt
    from engine.encoder.config import BertConfig
    from engine.buckets import pad, plan
    from engine.encoder import EncoderEngine, packing
    from engine.onnx_encoder import OnnxEncoder
    from engine.tokenizer import Tokenizer
    from engine.torch_encoder import TorchEncoder

    device = jaxrt.setup(cache_dir)
    d = catalog.bundled_dir(MODEL)
    ids = _inputs(Tokenizer.from_dir(d), kind, batch)  # batch x ~S ids
    jax_enc = EncoderEngine(d, name=MODEL, max_batch=max(batch, 1))
    grid = EncoderEngine(d, name=MODEL, max_batch=max(batch, 1), layout="grid")
    t0 = time.perf_counter()
    jax_enc.embed(ids)  # compiles the programs this batch needs
    jax_enc.embed(ids[:1])
    compile_s = time.perf_counter() - t0
    torch_enc = TorchEncoder(d, name=MODEL)
    # Graphs kept beside the compilation cache as a worker keeps them (None: exported
    # to a temporary folder); the int8 one whatever its check says: this measures speed.
    onnx_dir = os.path.join(cache_dir, "onnx-encoders") if cache_dir else None
    onnx_f32 = OnnxEncoder(d, name=MODEL, cache_dir=onnx_dir)
    onnx_int8 = OnnxEncoder(d, name=MODEL, cache_dir=onnx_dir, quant="int8", min_int8_cosine=0.0)
    hf = _hf_reference(d)
    width = max(len(x) for x in ids)
    hf_ids, hf_mask = pad(ids, len(ids), width)  # torch pads to the longest input only
    refs = _matmuls()
    fns = {
        "jax": lambda: jax_enc.embed(ids),
        "jax_grid": lambda: grid.embed(ids),
        "torch_hf": lambda: hf(hf_ids, hf_mask),
        "torch_ours": lambda: torch_enc.embed(ids),
        "onnx": lambda: onnx_f32.embed(ids),
        "onnx_int8": lambda: onnx_int8.embed(ids),
        **{name: call for name, (call, _) in refs.items()},
    }
    for fn in fns.values():
        fn()
    t = _rounds(fns, seconds, rounds)
    cfg = BertConfig(d)
    ffn = int(json.loads((d / "config.json").read_text())["intermediate_size"])
    lengths = [len(x) for x in ids]
    groups = packing.plan(lengths, jax_enc.shapes)  # what the packed engine runs
    flops = sum(encoder_flops(g.shape.rows, g.shape.width, cfg.hidden, ffn, cfg.layers)
                for g in groups)  # fmt: skip
    grid_groups = plan(lengths, grid.batch_buckets, grid.seq_buckets, grid.max_batch,
                       grid.token_budget)  # fmt: skip
    gflops = flops / t["jax"] / 1e9
    want = torch_enc.embed(ids)
    got = onnx_int8.embed(ids)
    int8_here = float(((got * want).sum(1) / (np.linalg.norm(got, axis=1)
                                             * np.linalg.norm(want, axis=1))).min())  # fmt: skip
    lat_s = min(seconds, 2.0)
    matmul = refs["matmul"][1] / t["matmul"] / 1e9
    gemm = refs["gemm"][1] / t["gemm"] / 1e9
    return {
        "kind": kind, "batch": batch, "tokens_mean": float(np.mean([len(x) for x in ids])),
        "programs": [[len(g.index), g.shape.name] for g in groups],  # inputs, RxW per forward
        "grid_buckets": [[len(r), b, s] for r, b, s in grid_groups],  # [inputs, B, S]
        "device": device, "compile_s": round(compile_s, 2),
        "jax_sentences_per_s": batch / t["jax"],
        "jax_grid_sentences_per_s": batch / t["jax_grid"],
        "ratio_packed_vs_grid": t["jax_grid"] / t["jax"],
        "torch_eager_sentences_per_s": batch / t["torch_hf"],
        "torch_engine_sentences_per_s": batch / t["torch_ours"],
        "ratio_vs_torch_eager": t["torch_hf"] / t["jax"],
        "ratio_vs_torch_engine": t["torch_ours"] / t["jax"],
        "onnx_sentences_per_s": batch / t["onnx"],
        "onnx_int8_sentences_per_s": batch / t["onnx_int8"],
        "ratio_onnx_vs_jax": t["jax"] / t["onnx"],
        "onnx_threads": onnx_f32.threads,
        "onnx_int8_min_cosine": onnx_int8.int8_cosine,
        "onnx_int8_cosine_here": int8_here,
        "jax_batch1_p50_ms": _latency_ms(lambda: jax_enc.embed(ids[:1]), lat_s),
        "jax_grid_batch1_p50_ms": _latency_ms(lambda: grid.embed(ids[:1]), lat_s),
        "torch_eager_batch1_p50_ms": _latency_ms(
            lambda: hf(hf_ids[:1, : len(ids[0])], hf_mask[:1, : len(ids[0])]), lat_s
        ),
        "torch_engine_batch1_p50_ms": _latency_ms(lambda: torch_enc.embed(ids[:1]), lat_s),
        "onnx_batch1_p50_ms": _latency_ms(lambda: onnx_f32.embed(ids[:1]), lat_s),
        "onnx_int8_batch1_p50_ms": _latency_ms(lambda: onnx_int8.embed(ids[:1]), lat_s),
        "jax_gflops": gflops,
        "matmul_gflops": matmul,
        "share_of_matmul": gflops / matmul,
        "gemm_gflops": gemm,
        "share_of_gemm": gflops / gemm,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_avg_1m": os.getloadavg()[0],
    }


# (label, throughput key, batch-1 latency key) of each engine in `summary`.
_ROWS = [
    ("jax (packed)", "jax_sentences_per_s", "jax_batch1_p50_ms"),
    ("torch eager (transformers)", "torch_eager_sentences_per_s", "torch_eager_batch1_p50_ms"),
    ("torch engine", "torch_engine_sentences_per_s", "torch_engine_batch1_p50_ms"),
    ("onnx float32", "onnx_sentences_per_s", "onnx_batch1_p50_ms"),
    ("onnx int8", "onnx_int8_sentences_per_s", "onnx_int8_batch1_p50_ms"),
]


def summary(out: dict) -> str:
    """One row per engine and kind: sentences/s at the batch, batch-1 p50 latency."""
    lines = ["| kind | engine | sentences/s | batch-1 p50 ms |", "|---|---|---|---|"]
    for kind, r in out.items():
        for label, rate, lat in _ROWS:
            lines.append(f"| {kind} | {label} | {r[rate]:.0f} (batch {r['batch']}) | {r[lat]:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--seconds", type=float, default=4.0, help="per engine per kind")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--kinds", default="short,long")
    ap.add_argument("--cache-dir", default=".data/jax-cache")
    args = ap.parse_args()
    out = {k: run(args.batch, k, args.seconds, args.cache_dir) for k in harness.csv_strs(args.kinds)}
    print(json.dumps(out, indent=2))
    print(summary(out))


if __name__ == "__main__":
    main()
