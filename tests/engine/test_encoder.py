"""Both encoder engines against sentence-transformers on the same MiniLM weights.

Small bucket sets keep compile time down; the mixed batch holds short sentences and
129..256-token texts and is larger than max_batch, so it exercises splitting, the
length-sorted grouping and every sequence bucket.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.buckets import BucketError
from engine.encoder import EncoderEngine
from engine.interface import Encoder
from engine.tokenizer import Tokenizer
from engine.torch_encoder import TorchEncoder
from tests.engine.minilm_inputs import mixed_texts, model_dir, words

BATCH_BUCKETS = (1, 4, 16)
SEQ_BUCKETS = (16, 64, 256)
MAX_BATCH = 16


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return mixed_texts(40)


@pytest.fixture(scope="module")
def ids(texts) -> list[list[int]]:
    return Tokenizer.from_dir(model_dir()).encode_batch(texts)


@pytest.fixture(scope="module")
def reference(texts) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_dir()), device="cpu")
    return st.encode(texts, batch_size=8, convert_to_numpy=True)  # [N, D]


@pytest.fixture(scope="module")
def jax_f32() -> EncoderEngine:
    # The session's compilation cache (tests/conftest.py), which the integration
    # tests use too: same buckets, compiled once.
    enc = EncoderEngine(model_dir(), dtype="float32", batch_buckets=BATCH_BUCKETS,
                        seq_buckets=SEQ_BUCKETS, max_batch=MAX_BATCH)  # fmt: skip
    assert enc.warmup(progress=False) == len(BATCH_BUCKETS) * len(SEQ_BUCKETS)
    return enc


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _check(ours: np.ndarray, reference: np.ndarray, min_cosine: float) -> None:
    assert ours.dtype == np.float32 and ours.shape == reference.shape
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    cos = _cosine(ours, reference)
    assert cos.min() >= min_cosine, f"worst cosine {cos.min():.6f} at {cos.argmin()}"


def test_inputs_cover_long_buckets_and_exceed_max_batch(ids):
    lengths = [len(x) for x in ids]
    assert len(ids) > MAX_BATCH
    assert max(lengths) == 256 and sum(n > 128 for n in lengths) >= 8
    assert min(lengths) < 16


def test_jax_float32_matches_sentence_transformers(jax_f32, ids, reference):
    _check(jax_f32.embed(ids), reference, 0.9999)


def test_jax_engine_describes_itself(jax_f32):
    assert (jax_f32.name, jax_f32.dim, jax_f32.max_tokens) == ("all-MiniLM-L6-v2", 384, 256)
    assert (jax_f32.dtype, jax_f32.device, jax_f32.max_batch) == ("float32", "cpu", 16)


def test_jax_result_does_not_depend_on_batch_company(jax_f32, ids, reference):
    """One input alone, or padded among others of different length, embeds the same."""
    alone = np.concatenate([jax_f32.embed([x]) for x in ids[:6]])
    _check(alone, reference[:6], 0.9999)
    np.testing.assert_allclose(alone, jax_f32.embed(ids)[:6], atol=2e-6)


def test_compiled_shapes_stay_at_the_bucket_count(jax_f32, ids):
    count = len(BATCH_BUCKETS) * len(SEQ_BUCKETS)
    assert jax_f32.compiled_count() == count and jax_f32.traces == count
    rng = np.random.default_rng(0)
    for n in (1, 3, 5, 17, 33):
        batch = [ids[i] for i in rng.integers(0, len(ids), n)]
        assert jax_f32.embed(batch).shape == (n, 384)
    for length in (2, 15, 16, 17, 63, 64, 65, 255, 256):
        jax_f32.embed([[101] + [2000] * (length - 2) + [102]])
    assert jax_f32.compiled_count() == count and jax_f32.traces == count


def test_rejects_inputs_no_bucket_holds(jax_f32):
    with pytest.raises(BucketError, match="257 tokens"):
        jax_f32.embed([[101, 102], [101] + [2000] * 255 + [102]])
    with pytest.raises(BucketError, match="empty"):
        jax_f32.embed([[101, 102], []])
    assert jax_f32.embed([]).shape == (0, 384)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_jax_half_precision_matches_sentence_transformers(dtype, ids, reference):
    # One batch bucket and the shortest useful seq set: half the compile time.
    enc = EncoderEngine(model_dir(), dtype=dtype, batch_buckets=(16,), seq_buckets=(64,),
                        max_batch=16)  # fmt: skip
    assert enc.seq_buckets == (64, 256)  # the model's limit is always a bucket
    assert enc.params["layers"][0]["qkv_w"].dtype == np.dtype(dtype)
    _check(enc.embed(ids), reference, 0.999)


def test_torch_float32_matches_sentence_transformers(ids, reference):
    enc = TorchEncoder(model_dir(), batch_buckets=BATCH_BUCKETS, seq_buckets=SEQ_BUCKETS,
                       max_batch=MAX_BATCH)  # fmt: skip
    assert enc.warmup(progress=False) == 0  # eager: nothing to compile
    assert (enc.dim, enc.max_tokens, enc.dtype, enc.device) == (384, 256, "float32", "cpu")
    _check(enc.embed(ids), reference, 0.9999)
    with pytest.raises(BucketError):
        enc.embed([[101] * 257])


def test_engines_swap_without_the_caller_noticing(jax_f32, ids):
    torch_enc = TorchEncoder(model_dir(), batch_buckets=BATCH_BUCKETS, seq_buckets=SEQ_BUCKETS,
                             max_batch=MAX_BATCH)  # fmt: skip
    batch = ids[:5] + [Tokenizer.from_dir(model_dir()).encode(words(100))]
    a, b = jax_f32.embed(batch), torch_enc.embed(batch)
    assert a.shape == b.shape == (6, 384) and a.dtype == b.dtype == np.float32
    assert _cosine(a, b).min() >= 0.9999
    # The worker sees either only through the protocol: each has all of it.
    members = set(Encoder.__annotations__) | {
        k for k, v in vars(Encoder).items() if callable(v) and not k.startswith("_")}
    assert {"embed", "warmup", "dim", "max_batch"} <= members
    for enc in (jax_f32, torch_enc):
        assert not [m for m in members if not hasattr(enc, m)], type(enc).__name__


def test_compiling_first_is_ready_early_and_serves_any_batch_in_compiled_parts(ids, reference,
                                                                             monkeypatch):
    """compile_ahead="first": ready after one input at every length plus the worker's
    timing shapes; while the rest compile in the background, a batch whose bucket is
    not compiled yet runs in compiled parts (a larger bucket, or several smaller
    ones), compiling nothing on the caller's thread, and embeds as sentence-
    transformers does."""
    import threading

    from engine import jaxrt

    hold = threading.Event()  # the background thread's first compile waits on it
    enc = EncoderEngine(model_dir(), dtype="float32", batch_buckets=BATCH_BUCKETS,
                        seq_buckets=SEQ_BUCKETS, max_batch=MAX_BATCH, compile_ahead="first")
    first = enc.first_shapes()
    assert first[: len(SEQ_BUCKETS)] == [(1, s) for s in SEQ_BUCKETS]
    original = jaxrt.compile_lowered
    background = []

    def gated(lowered):
        if threading.current_thread() is enc.programs._thread:
            background.append(1)
            hold.wait(120)
        return original(lowered)

    monkeypatch.setattr(jaxrt, "compile_lowered", gated)
    try:
        assert enc.warmup(progress=False) == len(first) < len(enc.shapes)
        assert enc.programs.compiling and enc.compiled_count() == len(first)
        waited = enc.programs.waited_s
        got = enc.embed(ids)  # mixed lengths, more than MAX_BATCH inputs
        assert enc.programs.waited_s == waited  # nothing waited on a compile
        assert enc.compiled_count() == len(first)  # nor compiled one here
        _check(got, reference, 0.9999)
    finally:
        hold.set()
    assert enc.programs.wait_background(300) and enc.compiled_count() == len(enc.shapes)
    assert background  # the rest were compiled there
    _check(enc.embed(ids), reference, 0.9999)
