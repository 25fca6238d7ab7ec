"""Quantized weights (engine/quant.py): the storage format, then accuracy against
independent references: MiniLM embeddings against sentence-transformers, the demo
model's perplexity on the fixed text set (bench/texts.py) against its float32 weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.texts import PERPLEXITY_TEXTS
from engine import quant
from engine.decoder import DecoderEngine
from engine.decoder.model import token_nll
from engine.encoder import JaxEncoder
from engine.tokenizer import Tokenizer
from shared.catalog import DEMO_LM, bundled_dir
from tests.engine.minilm_inputs import mixed_texts, model_dir


@pytest.mark.parametrize("mode, axis, shape, group, worst", [
    ("int8", 0, (256, 24), 128, 1 / 254), ("int8", 1, (24, 96), 32, 1 / 254),
    ("int8", 0, (72, 5), 72, 1 / 254), ("int4", 0, (96, 24), 32, 1 / 15),
    ("int4", 1, (24, 688), 16, 1 / 15),
])  # fmt: skip
def test_round_trip_error_is_half_a_step_of_each_group(mode, axis, shape, group, worst):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    w[0] *= 50  # an outlier row must not spoil the other groups
    qw = quant.quantize(w, mode, axis)
    assert qw.group == group and qw.scale.shape[axis] == shape[axis] // group
    back = np.asarray(quant.dequantize(qw, jnp.float32))
    g = np.moveaxis(w, axis, -1).reshape(-1, group)  # every group's own amax
    err = np.abs(np.moveaxis(back - w, axis, -1).reshape(-1, group))
    assert (err <= np.abs(g).max(1, keepdims=True) * worst * 1.0001).all()


def test_int4_packs_two_values_per_byte():
    w = np.linspace(-7, 7, 32 * 2, dtype=np.float32).reshape(32, 2)  # [IN, OUT]
    qw = quant.quantize(w, "int4", 0)
    assert qw.q.dtype == np.uint8 and qw.q.shape == (16, 2)
    assert int(qw.q[0, 0] & 0xF) == 0 and int(qw.q[-1, 1] >> 4) == 15  # each group's min, max
    assert qw.q.nbytes * 2 == w.size


@pytest.fixture(scope="module")
def minilm_case():
    from sentence_transformers import SentenceTransformer

    texts = mixed_texts(40)
    ids = Tokenizer.from_dir(model_dir()).encode_batch(texts)
    reference = SentenceTransformer(str(model_dir()), device="cpu").encode(texts, batch_size=8)
    return ids, reference


def _cosine(a, b):
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# int8 meets the 0.999 target. int4 (groups of 32, symmetric) does not come close on
# MiniLM: worst 0.928, mean 0.958 when measured; the bound only guards against worse.
@pytest.mark.parametrize("mode, min_cosine, max_bytes", [
    ("int8", 0.999, 0.27), ("int4", 0.92, 0.2),
])  # fmt: skip
def test_quantized_minilm_tracks_sentence_transformers(minilm_case, mode, min_cosine, max_bytes):
    ids, reference = minilm_case
    f32 = JaxEncoder(model_dir(), batch_buckets=(16,), seq_buckets=(16, 64, 256), max_batch=16)
    enc = JaxEncoder(model_dir(), batch_buckets=(16,), seq_buckets=(16, 64, 256), max_batch=16,
                     quant=mode)  # fmt: skip
    cos = _cosine(enc.embed(ids), reference)
    assert cos.min() >= min_cosine, f"worst cosine {cos.min():.5f}"
    assert enc.weight_bytes <= max_bytes * f32.weight_bytes


def perplexity(engine: DecoderEngine, texts=PERPLEXITY_TEXTS, bucket: int = 64) -> float:
    """exp(mean token NLL) over the texts, each cut to `bucket` tokens."""
    nll = jax.jit(lambda p, t: token_nll(p, engine.cfg, t))
    total, count = 0.0, 0
    for text in texts:
        ids = engine.tokenizer.encode(text)[:bucket]
        padded = np.zeros(bucket, np.int32)
        padded[: len(ids)] = ids
        terms = np.asarray(nll(engine.params, padded))[: len(ids) - 1]
        total, count = total + float(terms.sum()), count + len(terms)
    return float(np.exp(total / count))


def test_demo_model_perplexity_within_bounds_of_float32():
    d = bundled_dir(DEMO_LM)
    ppl = {m: perplexity(DecoderEngine(d, DEMO_LM, slots=1, max_context=64, quant=m))
           for m in ("none", "int8", "int4")}  # fmt: skip
    # The demo model is small (4M parameters, docstrings only): about 300 here, far
    # better than a uniform guess over its 4096 tokens, which is all this needs.
    assert 1.0 < ppl["none"] < 1000, ppl
    assert ppl["int8"] <= 1.02 * ppl["none"], ppl
    assert ppl["int4"] <= 1.08 * ppl["none"], ppl
