"""Helpers for tests on a routed nats-server cluster (shared.natsd.NatsCluster)."""

from __future__ import annotations

import asyncio
import time

import nats

from shared.bus import open_client
from shared.jetstream import cluster_size


async def quiet(*_a) -> None:
    return None


async def js_ready(url: str, timeout: float = 20.0) -> nats.aio.client.Client:
    """A connection as the services make it (shared.bus) once the cluster has formed:
    every member announced and JetStream answering (its meta leader elected)."""
    nc = await open_client(url, name="cluster-test", error_cb=quiet, reconnect_time_wait=0.1,
                           max_reconnect_attempts=-1)
    end = time.monotonic() + timeout
    while True:
        try:
            msg = await nc.request("$JS.API.INFO", b"", timeout=0.25)
            if b'"error"' not in msg.data and cluster_size(nc) == 3:
                return nc
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            pass
        assert time.monotonic() < end, f"the cluster never formed ({cluster_size(nc)} members)"
        await asyncio.sleep(0.05)


async def until(fn, timeout: float = 20.0):
    """fn()'s result once it stops raising (an election in progress), within `timeout`."""
    end = time.monotonic() + timeout
    while True:
        try:
            return await fn()
        except Exception:  # noqa: BLE001 - no leader yet: try again
            if time.monotonic() > end:
                raise
            await asyncio.sleep(0.1)
