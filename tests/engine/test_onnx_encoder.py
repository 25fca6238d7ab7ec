"""The onnx engine against sentence-transformers, on the same weights as the others.

MiniLM (the bundled model) and every tiny family the torch engine serves
(tests/engine/test_encoder_families.py) must give sentence-transformers' vectors
(cosine >= 0.9999) from a graph exported once into a cache folder and read back on
the next build; int8 is served only within its bound of float32, and what the engine
does not compute is refused by name before anything is exported.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.support import tiny_encoders
from bench.support.tiny_encoders import TEXTS
from engine import onnx_encoder
from engine.buckets import BucketError
from engine.encoder.spec import UnsupportedEncoder
from engine.interface import Encoder
from engine.onnx_encoder import FLOAT_FILE, INT8_FILE, OnnxEncoder
from engine.tokenizer import Tokenizer
from tests.engine.minilm_inputs import SENTENCES, model_dir, words
from tests.engine.test_encoder_families import CASES, KW, _check, _ids

BUCKETS = dict(batch_buckets=(1, 4, 16), seq_buckets=(16, 64, 256), max_batch=16)
# Short and long (up to MiniLM's 256-token limit), several scripts, symbols: 20 texts,
# more than max_batch, so a call is split into groups.
MINILM_TEXTS = SENTENCES + [
    "Москва — столица России, а Санкт-Петербург — её северная столица.",
    "emoji 🙂🚀 and symbols ∑ ∫ √ ≠ ≤",
    "def add(a, b):\n    return a + b",
    "SELECT name FROM users WHERE id = 42;",
    words(14), words(62, 3), words(126, 5), words(200, 7), words(231, 1), words(254, 9),
]  # fmt: skip


@pytest.fixture(scope="module")
def calls():
    """Counts of `export` and `quantize` calls by model directory: what a build did
    instead of reading a kept file."""
    counts: dict[tuple[str, str], int] = {}
    export, quantize = onnx_encoder.export, onnx_encoder.quantize

    def counted_export(model_dir, dtype, path):
        counts[("export", str(model_dir))] = counts.get(("export", str(model_dir)), 0) + 1
        export(model_dir, dtype, path)

    def counted_quantize(src, dst):
        counts[("quantize", str(src))] = counts.get(("quantize", str(src)), 0) + 1
        quantize(src, dst)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(onnx_encoder, "export", counted_export)
        mp.setattr(onnx_encoder, "quantize", counted_quantize)
        yield counts


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx-cache")


@pytest.fixture(scope="module")
def ids() -> list[list[int]]:
    out = Tokenizer.from_dir(model_dir()).encode_batch(MINILM_TEXTS)
    assert max(len(x) for x in out) == 256 and len(out) > BUCKETS["max_batch"]
    return out


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_dir()), device="cpu")
    return st.encode(MINILM_TEXTS, batch_size=8, convert_to_numpy=True)  # [N, 384]


@pytest.fixture(scope="module")
def minilm(calls, cache) -> OnnxEncoder:
    return OnnxEncoder(model_dir(), cache_dir=cache, **BUCKETS)


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_minilm_float_matches_sentence_transformers(minilm, ids, reference):
    for got in (minilm.embed(ids), np.concatenate([minilm.embed([x]) for x in ids])):
        assert got.dtype == np.float32 and got.shape == reference.shape
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        cos = _cosine(got, reference)
        assert cos.min() >= 0.9999, f"worst cosine {cos.min():.6f} at {cos.argmin()}"


def test_minilm_describes_itself_as_an_encoder(minilm):
    assert (minilm.name, minilm.dim, minilm.max_tokens) == ("all-MiniLM-L6-v2", 384, 256)
    assert (minilm.dtype, minilm.quant, minilm.device, minilm.max_batch) == (
        "float32", "none", "cpu", 16)
    assert minilm.warmup(progress=False) == 0 and minilm.program_counts() == (0, 0)
    assert minilm.close() and minilm.normalize and minilm.task == "embed"
    assert 1 <= minilm.threads <= onnx_encoder.usable_cores()
    members = set(Encoder.__annotations__) | {
        k for k, v in vars(Encoder).items() if callable(v) and not k.startswith("_")}
    assert not [m for m in members if not hasattr(minilm, m)]
    assert minilm.embed([]).shape == (0, 384)
    with pytest.raises(BucketError, match="257 tokens"):
        minilm.embed([[101, 102], [101] + [2000] * 255 + [102]])
    with pytest.raises(BucketError, match="empty"):
        minilm.embed([[101, 102], []])


def test_a_second_build_reads_the_kept_graph(minilm, calls, cache, ids):
    """What makes a restart fast: the same model, the same cache -> the same file,
    not exported again (nor rewritten)."""
    assert minilm.path.parent.parent == cache and minilm.path.name == FLOAT_FILE
    assert calls[("export", str(model_dir()))] == 1
    mtime = minilm.path.stat().st_mtime_ns
    again = OnnxEncoder(model_dir(), cache_dir=cache, **BUCKETS)
    assert again.path == minilm.path and again.path.stat().st_mtime_ns == mtime
    assert calls[("export", str(model_dir()))] == 1
    np.testing.assert_array_equal(again.embed(ids[:5]), minilm.embed(ids[:5]))


def test_minilm_int8_is_refused_below_its_bound_with_the_cosine(minilm, calls, cache):
    """Dynamic int8 MatMuls stray from MiniLM's float vectors by more than the bound
    (measured 0.979 on the check texts): refused with the cosine, never served."""
    with pytest.raises(UnsupportedEncoder, match=r"cosine 0\.9\d+ to float32's on the check "
                                                 r"texts, below 0\.999: serve it with "
                                                 r"TENSORBUS_QUANT=none"):  # fmt: skip
        OnnxEncoder(model_dir(), cache_dir=cache, quant="int8", **BUCKETS)
    assert (minilm.path.parent / INT8_FILE).exists()  # kept: the next start refuses at once
    assert calls[("export", str(model_dir()))] == 1  # quantized from the kept float graph


def test_int8_within_a_bound_is_served_and_kept_beside_the_float_graph(minilm, calls, cache,
                                                                       ids, reference):  # fmt: skip
    """The int8 path itself, with the bound lowered to what int8 MiniLM measures: the
    engine reports int8, reads the kept int8 file on the next build, and its vectors
    stay near sentence-transformers' (int8 is not float: they differ). Activations are
    quantized per call, so a text's int8 vector depends a little on its batch: the
    same batch is compared."""
    enc = OnnxEncoder(model_dir(), cache_dir=cache, quant="int8", min_int8_cosine=0.95, **BUCKETS)
    assert enc.quant == "int8" and enc.path == minilm.path.parent / INT8_FILE
    assert enc.int8_cosine is not None and 0.95 <= enc.int8_cosine < 0.999
    got = enc.embed(ids)
    cos = _cosine(got, reference)
    assert cos.min() >= 0.95 and np.median(cos) >= 0.98, cos
    assert not np.allclose(got, minilm.embed(ids), atol=1e-4)
    quantized = calls[("quantize", str(minilm.path))]
    again = OnnxEncoder(model_dir(), cache_dir=cache, quant="int8", min_int8_cosine=0.95, **BUCKETS)
    assert calls[("quantize", str(minilm.path))] == quantized == 1
    np.testing.assert_array_equal(again.embed(ids), got)  # the same file: the same vectors


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    st = tiny_encoders.build(out, **CASES[request.param])
    return request.param, out / "st", st


def test_each_family_matches_sentence_transformers(case, calls, cache):
    name, d, st = case
    enc = OnnxEncoder(d, name=name, cache_dir=cache, **KW)
    reference = st.encode(TEXTS, convert_to_numpy=True)  # [N, dim]
    assert enc.dim == reference.shape[1] and enc.max_tokens == tiny_encoders.MAX_SEQ
    _check(enc.embed(_ids(d, st, TEXTS)), reference)
    for prompt_name, prefix in enc.prompts.items():  # the gateway prepends the prefix
        reference = st.encode(TEXTS, prompt_name=prompt_name, convert_to_numpy=True)
        _check(enc.embed(_ids(d, st, [prefix + t for t in TEXTS])), reference)
    assert calls[("export", str(d))] == 1


def _unserved(d, what: str):
    """A tiny model the engine does not compute, built as the hub ships it."""
    if what == "reranker":
        tiny_encoders.build_cross_encoder(d, "bert", num_labels=1)
        return d / "ce"
    if what == "modernbert":
        tiny_encoders.build(d, family="modernbert")
    else:
        tiny_encoders.build_decoder_embedder(d)
    return d / "st"


@pytest.mark.parametrize("what, says", [
    ("reranker", "cross-encoders \\(rerankers\\) are scored by the JAX engine only"),
    ("modernbert", "ModernBERT is computed by the JAX engine only"),
    ("decoder-embedder", "decoder-based embedders are computed by the JAX engine only"),
])  # fmt: skip
def test_what_the_engine_does_not_compute_is_refused_before_export(tmp_path, calls, what, says):
    d = _unserved(tmp_path, what)
    with pytest.raises(UnsupportedEncoder, match=says):
        OnnxEncoder(d, cache_dir=tmp_path / "cache", **KW)
    assert ("export", str(d)) not in calls and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("kw, says", [
    (dict(dtype="bfloat16"), "computes float32"),
    (dict(quant="int4"), "float or int8 weights, not 'int4'"),
])  # fmt: skip
def test_settings_it_does_not_run_are_refused(kw, says, tmp_path):
    with pytest.raises(UnsupportedEncoder, match=says):
        OnnxEncoder(model_dir(), cache_dir=tmp_path, **kw)
    assert not list(tmp_path.iterdir())


def test_usable_cores_follows_affinity_and_the_workers_share(monkeypatch):
    import os

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("NPROC", raising=False)
    assert onnx_encoder.usable_cores() == cores
    monkeypatch.setenv("NPROC", "1")
    assert onnx_encoder.usable_cores() == 1
    monkeypatch.setenv("NPROC", str(cores + 8))
    assert onnx_encoder.usable_cores() == cores
