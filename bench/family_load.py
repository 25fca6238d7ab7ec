"""Load time and first request per model family, on the JAX engines.

    .venv/bin/python -m bench.family_load [--families bert,xlm-roberta,...]

Each family is a tiny model built from its real architecture's config with random
weights (bench/support/tiny_encoders.py's builders: 32 wide, 2-4 layers; the decoders
64 wide, 2-4 layers), saved as its library saves it, except SmolLM2-135M-Instruct,
which is the bundled Q8_0 GGUF file itself. For each, in this one process (jax and
the engines imported before any timing, as a worker has them), on a compilation
cache that starts empty:

  load     the engine's constructor: config, weights read, layout pass and placement
           on the device (no prepared-weights cache);
  first    its first request, which compiles the one shape it needs (an embedding of
           4 short texts, a rerank of 4 pairs, or a 12-token prompt and 8 greedy
           tokens for a decoder);
  warm     the same request again (compiled);
  cached   a second engine's load + first request on the same model: the compiled
           programs now come from the on-disk cache (what a restarted worker finds,
           less its process start and imports).

Tiny models make `load` mostly fixed cost (reading config files and safetensors,
building the tree) and `first` mostly compilation, which grows with layers and
shapes, not width; SmolLM2 shows a real 135M model's load (GGUF dequantisation).
One run per family: on a loaded machine, read differences under ~30 % as noise.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from bench import harness

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAMILIES = ("bert", "xlm-roberta", "mpnet", "modernbert", "bert-reranker",
            "modernbert-reranker", "qwen3", "gemma3", "smollm2-gguf")  # fmt: skip
TEXTS = ["A man is eating food.", "Nuclear fusion powers the sun.", "hi",
         "the quick brown fox jumps over the lazy dog"]  # fmt: skip
PAIRS = [("what powers the sun?", t) for t in TEXTS]


def _decoder(kind: str, out: Path) -> Path:
    """A tiny Qwen3 or Gemma 3 text model (the decoder family tests' shapes)."""
    import torch
    import transformers as T

    from bench.support.tiny_tokenizer import VOCAB, write_tokenizer

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0,
                  eos_token_id=0, pad_token_id=0, head_dim=16)  # fmt: skip
    if kind == "qwen3":
        cfg = T.Qwen3Config(num_hidden_layers=2, tie_word_embeddings=False, **common)
    else:
        cfg = T.Gemma3TextConfig(num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=24,
                                 layer_types=["sliding_attention", "full_attention"] * 2, **common)
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    return out


def build(family: str, tmp: Path) -> Path:
    """The model directory of `family`, built under `tmp` (not timed)."""
    from shared import catalog
    from bench.support import tiny_encoders

    out = tmp / family
    if family == "smollm2-gguf":
        return catalog.bundled_dir(catalog.SMOLLM2)
    if family in ("qwen3", "gemma3"):
        return _decoder(family, out)
    if family.endswith("-reranker"):
        tiny_encoders.build_cross_encoder(out, family.removesuffix("-reranker"), num_labels=1)
        return out / "ce"
    pooling = "cls" if family == "bert" else "mean"  # BGE's CLS; E5 / MPNet / ModernBERT mean
    tiny_encoders.build(out, family=family, pooling=pooling)
    return out / "st"


def measure(family: str, d: Path) -> dict:
    """One fresh engine on `d`: seconds to load, first and second request."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(d)
    if family in ("qwen3", "gemma3", "smollm2-gguf"):
        from engine.decoder import DecoderEngine
        from engine.decoder.static import generate_static

        prompt = tok.encode("The history of the Roman Empire, told in three short parts")[:12]
        t0 = time.perf_counter()
        engine = DecoderEngine(d, family, slots=4, max_context=256, prefill_buckets=(16, 64),
                               forms_cache=None, weights_cache=None)  # fmt: skip
        load = time.perf_counter() - t0

        def request():
            return generate_static(engine, [prompt], 8)
    else:
        from engine.encoder import EncoderEngine

        t0 = time.perf_counter()
        engine = EncoderEngine(d, name=family)
        load = time.perf_counter() - t0
        if family.endswith("-reranker"):
            ids, types = tok.encode_pairs(PAIRS)

            def request():
                return engine.score(ids, types)
        else:
            ids = tok.encode_batch(TEXTS)

            def request():
                return engine.embed(ids)
    t0 = time.perf_counter()
    request()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    request()
    warm = time.perf_counter() - t0
    return {"load_s": load, "first_s": first, "warm_s": warm}


def run(families: list[str]) -> dict:
    # Imported before any timing, as a worker has them.
    import engine.decoder.engine  # noqa: F401
    import engine.decoder.static  # noqa: F401
    import engine.encoder.engine  # noqa: F401
    import engine.encoder.modernbert  # noqa: F401
    from engine import jaxrt

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-family-load-") as tmp:
        device = jaxrt.setup(Path(tmp) / "jax-cache")  # empty: every first shape compiles
        for family in families:
            d = build(family, Path(tmp))
            cold, again = measure(family, d), measure(family, d)
            results[family] = {**{k: round(v, 4) for k, v in cold.items()},
                               "cached_s": round(again["load_s"] + again["first_s"], 4)}
    return {"families": results, "device": device, **harness.run_info()}


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = run(harness.csv_strs(args.families))
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    harness.write_json("family_load.json", res)
    print(json.dumps(res, indent=2))
    date = f"{res['date'].removesuffix(' UTC')}, load {res['load_average_1m']}"
    print(harness.FIGURE_HEADER)
    for family, r in res["families"].items():
        print(harness.figure_row(
            f"{family}: load / first request / warm request / load + first, cached",
            f"{1000 * r['load_s']:.0f} / {1000 * r['first_s']:.0f} / {1000 * r['warm_s']:.1f} / "
            f"{1000 * r['cached_s']:.0f} ms", "python -m bench.family_load", date))  # fmt: skip


if __name__ == "__main__":
    main()
