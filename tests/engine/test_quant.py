"""Quantized weights (engine/quant.py): the storage format, then accuracy against
independent references: MiniLM embeddings against sentence-transformers, the demo
model's perplexity on the fixed text set (bench/support/texts.py) against its float32 weights."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import quant
from engine.decoder import DecoderEngine
from engine.decoder.static import generate_static
from engine.encoder import EncoderEngine
from engine.tokenizer import Tokenizer
from shared.catalog import DEMO_LM, bundled_dir
from tests.engine.minilm_inputs import mixed_texts, model_dir
from bench.support.texts import PERPLEXITY_TEXTS, perplexity


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
    f32 = EncoderEngine(model_dir(), batch_buckets=(16,), seq_buckets=(16, 64, 256), max_batch=16)
    enc = EncoderEngine(model_dir(), batch_buckets=(16,), seq_buckets=(16, 64, 256), max_batch=16,
                        quant=mode)  # fmt: skip
    cos = _cosine(enc.embed(ids), reference)
    assert cos.min() >= min_cosine, f"worst cosine {cos.min():.5f}"
    assert enc.weight_bytes <= max_bytes * f32.weight_bytes


def test_demo_model_perplexity_within_bounds_of_float32():
    d = bundled_dir(DEMO_LM)
    ppl = {m: perplexity(DecoderEngine(d, DEMO_LM, slots=1, max_context=64, quant=m))
           for m in ("none", "int8", "int4", "fp8")}  # fmt: skip
    # The demo model is small (4M parameters, docstrings only): about 300 here, far
    # better than a uniform guess over its 4096 tokens, which is all this needs.
    assert 1.0 < ppl["none"] < 1000, ppl
    assert ppl["int8"] <= 1.02 * ppl["none"], ppl
    assert ppl["int4"] <= 1.08 * ppl["none"], ppl
    assert ppl["fp8"] <= 1.08 * ppl["none"], ppl


# ---------------------------------------------------------------- fp8 and int8 x int8


def test_fp8_weights_round_to_e4m3_with_a_scale_per_output_channel():
    import ml_dtypes

    w = np.random.default_rng(1).standard_normal((96, 40)).astype(np.float32)
    w[:, 3] *= 1e3  # one loud channel keeps its own scale
    qw = quant.quantize(w, "fp8", 0)
    assert qw.q.dtype == jnp.float8_e4m3fn and qw.scale.shape == (1, 40)
    back = np.asarray(quant.dequantize(qw, jnp.float32))
    scale = np.abs(w).max(0) / float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    # e4m3: 3 mantissa bits (half a step is 2^-4 of the value), subnormal steps of 2^-9.
    bound = np.maximum(np.abs(w) * 2.0**-4, scale * 2.0**-10) * 1.0001
    assert (np.abs(back - w) <= bound).all()
    assert np.abs(back[:, 3] - w[:, 3]).max() <= 2.0**-4 * np.abs(w[:, 3]).max()


@pytest.mark.parametrize("axis", [0, 1])
def test_int8_by_int8_matmul_tracks_the_float64_product(axis):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 192)).astype(np.float32)
    x[:, 7] *= 20  # an outlier input channel, as real activations have
    w = rng.standard_normal((192, 320) if axis == 0 else (320, 192)).astype(np.float32)
    qw = quant.quantize(w, "w8a8", axis)
    assert qw.compute == "int8" and qw.group == 192 and qw.q.dtype == np.int8
    want = x.astype(np.float64) @ (w if axis == 0 else w.T).astype(np.float64)
    mm = quant.matmul if axis == 0 else quant.unembed
    got = np.asarray(jax.jit(mm)(jnp.asarray(x), jax.tree.map(jnp.asarray, qw)))
    assert got.dtype == np.float32
    rel = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    assert rel.max() < 0.05, rel.max()  # the outlier sets each row's step: 3.5 % here
    # The int32 accumulation is exact: the only error is the two roundings to int8.
    xq, sx = quant.quantize_rows(jnp.asarray(x))
    wf = np.asarray(quant.dequantize(qw, jnp.float32), np.float64)
    exact = (np.asarray(xq, np.float64) * np.asarray(sx, np.float64)) @ (wf if axis == 0 else wf.T)
    np.testing.assert_allclose(got, exact, rtol=2e-5, atol=2e-4 * np.abs(exact).max())


def _smollm2_perplexity(**kw) -> float:
    from shared.catalog import SMOLLM2

    eng = DecoderEngine(bundled_dir(SMOLLM2), SMOLLM2, slots=1, max_context=64, forms_cache=None,
                        prefill_buckets=(16,), decode_windows=(64,), **kw)  # fmt: skip
    return perplexity(eng)


def test_smollm2_int8_activations_and_fp8_weights_against_float32_perplexity():
    """The issue's int8 target (2 %) holds for int8 x int8 matmuls too; fp8 (e4m3,
    a scale per output channel) is measured here at +5.2 %, bounded by int4's 8 %."""
    ref = _smollm2_perplexity()
    w8a8 = _smollm2_perplexity(quant="int8", quant_form="w8a8")
    fp8 = _smollm2_perplexity(quant="fp8")
    assert ref < w8a8 <= 1.02 * ref, (ref, w8a8)
    assert ref < fp8 <= 1.08 * ref, (ref, fp8)


# ---------------------------------------------------------------- compute forms

_DEMO = dict(slots=2, max_context=64, prefill_buckets=(16, 32), decode_windows=(64,))
_PROMPTS = [list(range(30, 42)), list(range(50, 55))]


def _demo(**kw) -> DecoderEngine:
    return DecoderEngine(bundled_dir(DEMO_LM), DEMO_LM, **{**_DEMO, **kw})


def _teacher_forced_logits(engine: DecoderEngine) -> np.ndarray:
    from engine.decoder.model import prompt_logits

    f = jax.jit(lambda p, t: prompt_logits(p, engine.cfg, t))
    rows = []
    for text in PERPLEXITY_TEXTS:
        ids = engine.tokenizer.encode(text)[:64]
        padded = np.zeros(64, np.int32)
        padded[: len(ids)] = ids
        rows.append(np.asarray(f(engine.params, padded))[: len(ids)])
    return np.concatenate(rows)  # [tokens, V]


@pytest.fixture(scope="module")
def float32_demo():
    eng = _demo(forms_cache=None)
    return _teacher_forced_logits(eng), generate_static(eng, _PROMPTS, 12)


@pytest.mark.parametrize("quant_mode, form, min_cosine, min_top1", [
    ("int8", "float", 0.9999, 0.995), ("int8", "dequant", 0.9999, 0.995),
    ("int8", "w8a8", 0.999, 0.98), ("fp8", "dequant", 0.999, 0.98),
    ("fp8", "float", 0.999, 0.98),
])  # fmt: skip
def test_every_compute_form_agrees_with_float32(float32_demo, quant_mode, form, min_cosine,
                                                min_top1):  # fmt: skip
    want_logits, want_tokens = float32_demo
    eng = _demo(quant=quant_mode, quant_form=form, forms_cache=None)
    assert set(eng.forms.compute_forms.values()) == {form} and list(eng.forms.held) == [form]
    got = _teacher_forced_logits(eng)
    assert _cosine(got, want_logits).min() >= min_cosine
    assert (got.argmax(1) == want_logits.argmax(1)).mean() >= min_top1
    if quant_mode == "int8" and form != "w8a8":
        # The float form holds the int8 weights' own values: the same model as the
        # dequantizing matmul, whose greedy tokens equal float32's here.
        assert generate_static(eng, _PROMPTS, 12) == want_tokens


def test_fastest_form_per_bucket_is_measured_once_then_read_from_the_cache(tmp_path,
                                                                           monkeypatch):
    from engine import forms

    path = tmp_path / "jax-cache" / forms.CACHE_NAME
    budget = 10**9  # room for the float copy: all three forms compete
    first = _demo(quant="int8", weight_budget=budget, forms_cache=path)
    assert first.forms.candidates == ("float", "dequant", "w8a8")
    first.warmup(progress=False)  # ready first: nothing measured yet, served in float
    assert (first.forms.measurements, first.forms.units) == (0, 12) and set(first.forms.compute_forms.values()) == {"float"}
    while first.stats().tune_due:  # as the worker's runner does between steps
        first.tune()
    buckets = ["step 1", "step 2", "prefill 16", "prefill 32"]  # batch buckets 1 and 2
    assert (first.forms.measurements, first.forms.units) == (12, 12) and first.forms.settled
    assert first.forms.measured and set(first.forms.compute_forms) == set(buckets)
    for bucket in buckets:
        ms = first.forms.form_ms[bucket]
        assert set(ms) == {"float", "dequant", "w8a8"} and min(ms.values()) > 0
        assert first.forms.compute_forms[bucket] == min(ms, key=ms.get)
    assert set(first.forms.held) == set(first.forms.compute_forms.values())  # the rest dropped
    doc = json.loads(path.read_text())
    (entry,) = doc.values()
    assert entry["choices"] == first.forms.compute_forms and entry["ms"] == first.forms.form_ms
    tokens = generate_static(first, _PROMPTS, 8)

    def no_timing(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(forms, "timed", no_timing)
    second = _demo(quant="int8", weight_budget=budget, forms_cache=path)
    second.warmup(progress=False)
    assert not second.forms.measured and second.forms.compute_forms == first.forms.compute_forms
    assert generate_static(second, _PROMPTS, 8) == tokens
    # Other shapes are another key: that engine would measure (and fail here).
    third = _demo(quant="int8", weight_budget=budget, forms_cache=path, slots=3)
    with pytest.raises(AssertionError, match="measured again"):
        third.select_forms()


def test_the_weight_budget_decides_whether_a_float_copy_may_compete():
    default = _demo(quant="int8", forms_cache=None)  # budget: the float32 size
    assert default.forms.candidates == ("dequant", "w8a8")
    tight = _demo(quant="int8", forms_cache=None, weight_budget=1)
    assert tight.forms.candidates == ("dequant",)
    assert _demo(quant="int4", forms_cache=None).forms.candidates == ("dequant",)
    assert _demo(quant="int4", forms_cache=None, weight_budget=10**9).forms.candidates == (
        "float", "dequant")
    with pytest.raises(ValueError, match="int8 weights only"):
        _demo(quant="int4", quant_form="w8a8")


# ---------------------------------------------------------------- GGUF blocks kept


def test_smollm2_gguf_blocks_are_served_as_stored():
    """quant 'gguf': the bundled file's Q4_1 layers become int4 groups of 32 and its
    Q8_0 embedding (the tied head) int8 groups of 32, holding the file's own numbers:
    the dequantized weights equal the float path's (the file dequantized by the gguf
    package) to float32 rounding, and so do the logits."""
    from engine.decoder.config import load_config
    from engine.decoder.model import gguf_blocks, load_params, prompt_logits
    from shared.catalog import SMOLLM2

    d = bundled_dir(SMOLLM2)
    cfg = load_config(d)
    assert gguf_blocks(d, cfg) == {"embed": ("int8", 32), "qkv_w": ("int4", 32),
                                   "o_w": ("int4", 32), "gate_up_w": ("int4", 32),
                                   "down_w": ("int4", 32)}  # fmt: skip
    kept = load_params(d, cfg, jnp.float32, "gguf")
    ref = load_params(d, cfg, jnp.float32, "none")
    assert quant.tree_bytes(kept) < 0.25 * quant.tree_bytes(ref)
    pairs = [(kept["embed"], ref["embed"])] + [
        (lk[n], lr[n]) for lk, lr in zip(kept["layers"], ref["layers"])
        for n in ("qkv_w", "o_w", "gate_up_w", "down_w")]  # fmt: skip
    for qw, w in pairs:
        back = np.asarray(quant.dequantize(qw, jnp.float32))
        np.testing.assert_allclose(back, np.asarray(w), rtol=0, atol=4e-6 * np.abs(w).max())
    tokens = np.asarray(Tokenizer.from_dir(d).encode(PERPLEXITY_TEXTS[0])[:32], np.int32)
    f = jax.jit(lambda p, t: prompt_logits(p, cfg, t))
    np.testing.assert_allclose(f(kept, tokens), f(ref, tokens), rtol=0, atol=2e-3)


def test_gguf_blocks_need_a_gguf_model():
    with pytest.raises(ValueError, match="has none"):
        DecoderEngine(bundled_dir(DEMO_LM), DEMO_LM, slots=1, max_context=32, quant="gguf")
