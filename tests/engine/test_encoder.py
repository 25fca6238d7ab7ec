"""Both encoder engines against sentence-transformers on the same MiniLM weights.

The JAX engine in both layouts: packed rows (MiniLM's default: a ladder of 7 token
counts) and the padded grid (small bucket sets keep its compile time down). The
mixed batch holds short sentences and 129..256-token texts and is larger than
max_batch, so it exercises splitting, grouping and the longest program.
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
    # tests use too: same programs, compiled once.
    enc = EncoderEngine(model_dir(), dtype="float32", max_batch=MAX_BATCH)
    assert enc.packed and enc.warmup(progress=False) == len(enc.shapes)
    return enc


@pytest.fixture(scope="module")
def jax_grid() -> EncoderEngine:
    enc = EncoderEngine(model_dir(), dtype="float32", batch_buckets=BATCH_BUCKETS,
                        seq_buckets=SEQ_BUCKETS, max_batch=MAX_BATCH, layout="grid")  # fmt: skip
    assert enc.warmup(progress=False) == len(BATCH_BUCKETS) * len(SEQ_BUCKETS)
    return enc


@pytest.fixture(params=["packed", "grid"])
def layout(request) -> EncoderEngine:
    return request.getfixturevalue("jax_f32" if request.param == "packed" else "jax_grid")


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


def test_jax_float32_matches_sentence_transformers(layout, ids, reference):
    _check(layout.embed(ids), reference, 0.9999)


def test_jax_engine_describes_itself(jax_f32):
    assert (jax_f32.name, jax_f32.dim, jax_f32.max_tokens) == ("all-MiniLM-L6-v2", 384, 256)
    assert (jax_f32.dtype, jax_f32.device, jax_f32.max_batch) == ("float32", "cpu", 16)


def test_jax_result_does_not_depend_on_batch_company(layout, ids, reference):
    """One input alone, or padded (or packed into a row) among others of different
    length, embeds the same."""
    alone = np.concatenate([layout.embed([x]) for x in ids[:6]])
    _check(alone, reference[:6], 0.9999)
    np.testing.assert_allclose(alone, layout.embed(ids)[:6], atol=2e-6)


def test_packed_rows_hold_several_inputs_and_each_embeds_as_alone(jax_f32, ids, reference):
    """Short inputs share rows (here 3 to 10 per row); none leaks into another."""
    from engine.encoder import packing

    short = [x for x in ids if len(x) < 40][:12]
    groups = packing.plan([len(x) for x in short], jax_f32.shapes)
    assert len(groups) == 1 and len(set(groups[0].row)) < len(short)
    got = jax_f32.embed(short)
    np.testing.assert_allclose(got, np.concatenate([jax_f32.embed([x]) for x in short]),
                               atol=2e-6)  # fmt: skip
    _check(got, reference[[ids.index(x) for x in short]], 0.9999)


@pytest.mark.parametrize("which", ["packed", "grid"])
def test_compiled_programs_stay_at_their_count(which, ids, request):
    """A packed MiniLM serves everything from 8 programs (the target for an encoder);
    the grid from its buckets. No batch or length compiles another."""
    enc = request.getfixturevalue("jax_f32" if which == "packed" else "jax_grid")
    count = 8 if which == "packed" else len(BATCH_BUCKETS) * len(SEQ_BUCKETS)
    assert enc.compiled_count() == count and enc.traces == count
    rng = np.random.default_rng(0)
    for n in (1, 3, 5, 17, 33):
        batch = [ids[i] for i in rng.integers(0, len(ids), n)]
        assert enc.embed(batch).shape == (n, 384)
    for length in (2, 15, 16, 17, 63, 64, 65, 255, 256):
        enc.embed([[101] + [2000] * (length - 2) + [102]])
    assert enc.compiled_count() == count and enc.traces == count


def test_a_packed_encoder_at_the_worker_defaults_has_at_most_8_programs():
    enc = EncoderEngine(model_dir(), max_batch=64)  # the worker's default batch
    assert [s.name for s in enc.shapes] == ["1x16", "1x32", "1x64", "1x128", "1x256",
                                            "2x256", "4x256", "16x64"]  # fmt: skip


def test_rejects_inputs_no_bucket_holds(jax_f32):
    with pytest.raises(BucketError, match="257 tokens"):
        jax_f32.embed([[101, 102], [101] + [2000] * 255 + [102]])
    with pytest.raises(BucketError, match="empty"):
        jax_f32.embed([[101, 102], []])
    assert jax_f32.embed([]).shape == (0, 384)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_jax_half_precision_matches_sentence_transformers(dtype, ids, reference):
    # One batch bucket and the shortest useful seq set: half the compile time.
    enc = EncoderEngine(model_dir(), dtype=dtype, max_batch=16)
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


@pytest.mark.parametrize("which", ["packed", "grid"])
def test_compiling_first_is_ready_early_and_serves_any_batch_in_compiled_parts(
        which, ids, reference, monkeypatch):  # fmt: skip
    """compile_ahead="first": ready after a first set (packed: the smallest program,
    one row of the limit and the largest; grid: one input at every length plus the
    worker's timing shapes); while the rest compile in the background, a batch whose
    program is not compiled yet runs on compiled ones (a larger one, or several
    smaller ones), compiling nothing on the caller's thread, and embeds as sentence-
    transformers does."""
    import threading

    from engine import jaxrt

    hold = threading.Event()  # the background thread's first compile waits on it
    enc = EncoderEngine(model_dir(), dtype="float32", batch_buckets=BATCH_BUCKETS,
                        seq_buckets=SEQ_BUCKETS, max_batch=MAX_BATCH, compile_ahead="first",
                        layout=which)  # fmt: skip
    first = enc.first_shapes()
    if which == "grid":
        assert first[: len(SEQ_BUCKETS)] == [(1, s) for s in SEQ_BUCKETS]
    else:
        assert [s.name for s in first] == ["1x16", "1x256", "4x256", "16x64"]
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
