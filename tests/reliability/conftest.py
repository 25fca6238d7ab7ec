"""Fixtures for the reliability suite: the real bundled encoder (compiled once per
session, from tests/conftest.py) and a tiny real decoder."""

from __future__ import annotations

import pytest
import pytest_asyncio

DECODER = "tiny-gpt2"
DECODER_CONTEXT = 256


@pytest.fixture(scope="session")
def tiny_decoder(tmp_path_factory, jax_cache_dir):
    """(engine, model directory): a 2-layer GPT-2 with random weights, 4 KV slots."""
    from tests.support.tiny_models import serve_tiny

    path = tmp_path_factory.mktemp("tiny-gpt2")
    _, engine = serve_tiny("gpt2", path, DECODER, DECODER_CONTEXT)
    return engine, str(path)


ENCODER = "all-MiniLM-L6-v2"
MAX_INPUTS = 32
MAX_PAYLOAD = 200_000


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served(nats_server, minilm, tiny_decoder):
    """An in-process stack serving the real encoder and the tiny decoder, with small
    limits so that over-limit inputs stay cheap to send."""
    from tests.support.stack import running_stack

    engine, path = tiny_decoder
    async with running_stack(nats_server.url, models={DECODER: path}, max_inputs=MAX_INPUTS,
                             max_payload=MAX_PAYLOAD, max_context=DECODER_CONTEXT,
                             decode_slots=4, request_timeout_s=10) as st:
        await st.add_worker(minilm, "enc-hostile")
        await st.add_worker(engine, "dec-hostile", kind="decoder")
        yield st


@pytest_asyncio.fixture
async def cluster(tmp_path):
    """A formed three-server cluster with the TELEMETRY stream on all three members
    (the node-loss tests)."""
    from services.telemetry.stream import ensure_stream, stream_config
    from shared.bus import close
    from shared.natsd import NatsCluster
    from tests.support.cluster import js_ready, until

    with NatsCluster(tmp_path / "nats", 3).start(die_with_parent=True) as c:
        nc = await js_ready(c.url)
        try:
            await until(lambda: ensure_stream(nc.jetstream(), stream_config(), 3))
        finally:
            await close(nc)
        yield c
