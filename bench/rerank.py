"""Reranker engine benchmark: pairs/s of the JAX engine's `score` against
sentence-transformers' `CrossEncoder.predict` on the same weights and pairs.

    .venv/bin/python -m bench.rerank [--seconds 6] [--batch 64] [--doc-words 12]

The cross-encoder is MiniLM-sized: the bundled all-MiniLM-L6-v2 transformer (6
layers, 384 wide) under a fresh one-label sequence-classification head (seeded), as
ms-marco-MiniLM-L6 is shaped, saved by `CrossEncoder.save` into a temporary
directory (nothing downloaded). `batch` pairs (a short query, a document of
`doc-words` words) are scored per call: by the engine in one call (default
buckets), by `predict` with `batch_size=batch`. Both run float32 on the CPU with
their default threads, alternating in short rounds; each reports its median round
(bench.engine_encoder's method, so load from other processes hits both alike). The
largest difference between the two sets of scores is reported too.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import harness
from bench.engine_encoder import _rounds
from shared import catalog


def build(out: Path) -> Path:
    """The MiniLM-shaped cross-encoder, saved to `out/ce`; its directory."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import BertForSequenceClassification, BertTokenizerFast
    from transformers.utils import logging as hf_logging

    minilm = catalog.bundled_dir(catalog.ENCODER)
    hf_logging.set_verbosity_error()  # the new head's "newly initialized" notice
    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(str(minilm), num_labels=1)
    model.save_pretrained(str(out / "hf"))
    BertTokenizerFast.from_pretrained(str(minilm)).save_pretrained(str(out / "hf"))
    CrossEncoder(str(out / "hf"), max_length=256, device="cpu").save(str(out / "ce"))
    return out / "ce"


def run(batch: int = 64, doc_words: int = 12, seconds: float = 6.0, rounds: int = 4,
        cache_dir: str | None = None) -> dict:
    """One side-by-side measurement; quiet (no output), returns the figures."""
    from sentence_transformers import CrossEncoder

    from engine import jaxrt
    from engine.encoder import EncoderEngine
    from engine.tokenizer import Tokenizer
    from bench.support.workload import sentences

    device = jaxrt.setup(cache_dir)
    with tempfile.TemporaryDirectory(prefix="bench-rerank-") as tmp:
        d = build(Path(tmp))
        queries, docs = sentences(batch, 6, seed=3), sentences(batch, doc_words, seed=4)
        pairs = list(zip(queries, docs))
        ids, types = Tokenizer.from_dir(d).encode_pairs(pairs)
        engine = EncoderEngine(d, name="minilm-reranker", max_batch=max(batch, 1))
        t0 = time.perf_counter()
        ours = engine.score(ids, types)[:, 0]  # compiles the bucket this batch needs
        compile_s = time.perf_counter() - t0
        ce = CrossEncoder(str(d), device="cpu")
        ref = np.asarray(ce.predict(pairs, batch_size=batch, show_progress_bar=False))
        fns = {"jax": lambda: engine.score(ids, types),
               "cross_encoder": lambda: ce.predict(pairs, batch_size=batch,
                                                   show_progress_bar=False)}
        t = _rounds(fns, seconds, rounds)
    return {
        "batch": batch, "pair_tokens_mean": float(np.mean([len(x) for x in ids])),
        "device": device, "compile_s": round(compile_s, 2),
        "jax_pairs_per_s": batch / t["jax"],
        "cross_encoder_pairs_per_s": batch / t["cross_encoder"],
        "ratio": t["cross_encoder"] / t["jax"],
        "max_abs_score_diff": float(np.abs(ours - ref).max()),
        **harness.run_info(),
    }


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--seconds", type=float, default=6.0, help="per side, all rounds")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--doc-words", type=int, default=12)
    ap.add_argument("--cache-dir", default=".data/jax-cache")
    args = ap.parse_args()
    res = run(args.batch, args.doc_words, args.seconds, cache_dir=args.cache_dir)
    harness.write_json("rerank.json", res)
    print(json.dumps(res, indent=2))
    cmd = f"python -m bench.rerank --seconds {args.seconds:g}"
    print(harness.figure_row(
        f"rerank, MiniLM-sized cross-encoder, batch {res['batch']}: JAX `score` vs "
        f"`CrossEncoder.predict`",
        f"{res['jax_pairs_per_s']:.0f} vs {res['cross_encoder_pairs_per_s']:.0f} pairs/s "
        f"(**{res['ratio']:.2f}x**; target 1.5x), scores within "
        f"{res['max_abs_score_diff']:.1e}", cmd,
        f"{res['date'].removesuffix(' UTC')}, load {res['load_average_1m']}"))


if __name__ == "__main__":
    main()
