"""Embedding options beyond the basic request, end to end (real nats-server, the JAX
engine, the bundled MiniLM weights), judged against sentence-transformers:

- `dimensions` on a model that declares Matryoshka widths (`matryoshka_dimensions` in
  its config.json; here a copy of MiniLM that declares them) is truncated and
  renormalised, exactly as `SentenceTransformer.encode(truncate_dim=..)` with
  normalisation; a width it was not trained at, or any cut of a model that declares
  none, is a 400 that says why, and a good request right after is served.
- `truncate_prompt_tokens` cuts an over-long input as sentence-transformers cuts at its
  `max_seq_length`, instead of the default 400.
- A model's sentence-transformers prompts (config_sentence_transformers.json; the
  copy has `query: ` / `passage: ` and `query` as its default) are prepended as
  `SentenceTransformer.encode(prompt_name=..)` does, chosen by `prompt_name` or
  `input_type`.
"""

from __future__ import annotations

import json
import os
import shutil

import msgspec
import numpy as np
import pytest
import pytest_asyncio

from shared import catalog, subjects
from shared.errors import HEADER_CODE
from tests.conftest import TEST_BATCH_BUCKETS, TEST_SEQ_BUCKETS
from tests.support.stack import running_stack

MODEL = catalog.ENCODER
MRL = "minilm-matryoshka"
WIDTHS = [128, 256, 384]
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "Ünïcödé and 中文 text"]
LONG = " ".join(f"word{i} is followed by a comma, then more text" for i in range(30))


@pytest.fixture(scope="module")
def mrl_dir(tmp_path_factory):
    """The bundled MiniLM, its config declaring Matryoshka widths (weights shared)."""
    src, dst = catalog.bundled_dir(MODEL), tmp_path_factory.mktemp("mrl")
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors"))
    for f in src.glob("*.safetensors"):
        (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": WIDTHS}))
    (dst / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": "query"}))
    return dst


@pytest.fixture(scope="module")
def st_mrl(mrl_dir, sentence_transformer):
    """sentence-transformers on the copy: the reference for its prompts and widths."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(mrl_dir), device="cpu")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, minilm, mrl_dir, sentence_transformer, jax_cache_dir):
    from engine.encoder import EncoderEngine

    mrl = EncoderEngine(mrl_dir, name=MRL, batch_buckets=TEST_BATCH_BUCKETS,
                        seq_buckets=TEST_SEQ_BUCKETS, max_batch=16)
    mrl.warmup(progress=False)  # the same programs as MiniLM's: the compilation cache has them
    async with running_stack(nats_server.url, models={MRL: str(mrl_dir)}, max_inputs=32) as st:
        await st.add_worker(minilm, "enc-minilm")
        await st.add_worker(mrl, "enc-mrl")
        yield st


async def embed(nc, payload):
    msg = await nc.request(subjects.EMBEDDINGS, msgspec.json.encode(payload), timeout=30.0)
    return int((msg.headers or {}).get(HEADER_CODE, 200)), msgspec.json.decode(msg.data)


def vectors(resp) -> np.ndarray:
    return np.array([d["embedding"] for d in sorted(resp["data"], key=lambda d: d["index"])])


@pytest.mark.parametrize("width", [128, 256])
async def test_a_matryoshka_model_cuts_and_renormalises(stack, st_mrl, width):
    code, resp = await embed(stack.client, {"model": MRL, "input": TEXTS, "dimensions": width})
    assert code == 200, resp
    got = vectors(resp)
    assert got.shape == (len(TEXTS), width)
    ref = st_mrl.encode(TEXTS, truncate_dim=width, normalize_embeddings=True)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(got, ref, atol=2e-4)


async def test_the_full_width_needs_no_cut(stack, st_mrl):
    code, resp = await embed(stack.client, {"model": MRL, "input": TEXTS, "dimensions": 384})
    assert code == 200
    np.testing.assert_allclose(vectors(resp), st_mrl.encode(
        TEXTS, normalize_embeddings=True), atol=2e-4)


async def test_widths_the_model_was_not_trained_at_are_refused(stack):
    code, resp = await embed(stack.client, {"model": MRL, "input": TEXTS, "dimensions": 100})
    assert code == 400
    assert "100" in resp["error"]["message"] and "128, 256, 384" in resp["error"]["message"]
    # MiniLM itself declares no widths: only its own is accepted.
    code, resp = await embed(stack.client, {"model": MODEL, "input": TEXTS, "dimensions": 128})
    assert code == 400 and "384" in resp["error"]["message"]
    code, resp = await embed(stack.client, {"model": MODEL, "input": TEXTS, "dimensions": 384})
    assert code == 200 and vectors(resp).shape == (len(TEXTS), 384)


async def test_truncation_is_opt_in_and_cuts_as_sentence_transformers_does(
        stack, sentence_transformer):
    code, resp = await embed(stack.client, {"model": MODEL, "input": [LONG]})
    assert code == 400 and resp["error"]["code"] == "context_length_exceeded"

    limit = sentence_transformer.max_seq_length
    code, resp = await embed(stack.client, {"model": MODEL, "input": [LONG, "short"],
                                            "truncate_prompt_tokens": -1})
    assert code == 200 and resp["usage"]["prompt_tokens"] == limit + 3  # "short": 3 tokens
    ref = sentence_transformer.encode([LONG, "short"], normalize_embeddings=True)
    np.testing.assert_allclose(vectors(resp), ref, atol=2e-4)

    code, resp = await embed(stack.client, {"model": MODEL, "input": [LONG],
                                            "truncate_prompt_tokens": 12})
    assert code == 200 and resp["usage"]["prompt_tokens"] == 12
    try:
        sentence_transformer.max_seq_length = 12
        ref = sentence_transformer.encode([LONG], normalize_embeddings=True)
    finally:
        sentence_transformer.max_seq_length = limit
    np.testing.assert_allclose(vectors(resp), ref, atol=2e-4)


@pytest.mark.parametrize("keep", [1, 2, 100_000])
async def test_truncation_that_cannot_be_honoured_is_a_400(stack, keep):
    code, resp = await embed(stack.client, {"model": MODEL, "input": ["hello world"],
                                            "truncate_prompt_tokens": keep})
    assert code == 400 and "truncate_prompt_tokens" in resp["error"]["message"]


@pytest.mark.parametrize("body,prompt", [
    ({}, "query"),  # the model's default prompt
    ({"prompt_name": "passage"}, "passage"),
    ({"input_type": "document"}, "passage"),
    ({"input_type": "query"}, "query"),
])
async def test_prompts_are_prepended_as_sentence_transformers_does(stack, st_mrl, body, prompt):
    code, resp = await embed(stack.client, {"model": MRL, "input": TEXTS, **body})
    assert code == 200, resp
    ref = st_mrl.encode(TEXTS, prompt_name=prompt, normalize_embeddings=True)
    np.testing.assert_allclose(vectors(resp), ref, atol=2e-4)
    with_prompt = st_mrl.tokenizer([f"{prompt}: {t}" for t in TEXTS])["input_ids"]
    assert resp["usage"]["prompt_tokens"] == sum(len(x) for x in with_prompt)


async def test_unknown_prompts_are_refused_and_prompts_are_moot_without_them(
        stack, sentence_transformer):
    code, resp = await embed(stack.client, {"model": MRL, "input": TEXTS, "prompt_name": "nope"})
    assert code == 400 and "passage, query" in resp["error"]["message"]
    code, resp = await embed(stack.client, {"model": MRL, "input": TEXTS,
                                            "prompt_name": "query", "input_type": "query"})
    assert code == 400
    # MiniLM has no prompts: a role changes nothing.
    code, resp = await embed(stack.client, {"model": MODEL, "input": TEXTS, "input_type": "query"})
    assert code == 200
    np.testing.assert_allclose(vectors(resp), sentence_transformer.encode(
        TEXTS, normalize_embeddings=True), atol=2e-4)
