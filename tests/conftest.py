"""Session-wide fixtures: one real nats-server per test session, on a free port."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import pytest_asyncio

from shared.natsd import NatsServer


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    with NatsServer(tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest_asyncio.fixture
async def nc(nats_server):
    import nats

    client = await nats.connect(nats_server.url)
    yield client
    await client.drain()
