"""Fixtures shared by integration tests: the real bundled encoder, compiled once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared import catalog

ENCODER = catalog.ENCODER
# A small bucket set keeps warm-up short; inputs up to the model's 256-token limit fit.
TEST_BATCH_BUCKETS = (1, 4, 16)
TEST_SEQ_BUCKETS = (16, 64, 256)


@pytest.fixture(scope="session")
def jax_cache_dir() -> str:
    d = Path(os.environ.get("TENSORBUS_TEST_CACHE", ".data/test-jax-cache")).resolve()
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


@pytest.fixture(scope="session")
def minilm(jax_cache_dir):
    from engine import jaxrt
    from engine.encoder import JaxEncoder

    jaxrt.setup(jax_cache_dir)
    enc = JaxEncoder(catalog.bundled_dir(ENCODER), name=ENCODER,
                     batch_buckets=TEST_BATCH_BUCKETS, seq_buckets=TEST_SEQ_BUCKETS, max_batch=16)
    enc.warmup(progress=False)
    return enc


@pytest.fixture(scope="session")
def sentence_transformer():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(catalog.bundled_dir(ENCODER)), device="cpu")
