"""The real telemetry service in the test's event loop, on its own NATS connection,
with a fresh metrics registry and `/metrics` on a free port."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

import nats
from prometheus_client import CollectorRegistry

from services.registry.store import Registry
from services.telemetry.service import TelemetryService
from shared.config import Config
from tests.support.bus import connect as bus_connect


@asynccontextmanager
async def running_telemetry(nats_url: str, registry: bool = False,
                            **overrides) -> AsyncIterator[TelemetryService]:
    """`registry=True`: with the model registry, so guarded canaries roll back."""
    base = dict(nats_url=nats_url, metrics_port=0, summary_interval_s=0.5,
                worker_expiry_s=1.0, log_format="json", log_level="warning")
    config = Config.from_env({}, **{**base, **overrides})
    nc = await bus_connect(nats_url, name="telemetry")
    models = await Registry.open(nc) if registry else None
    svc = TelemetryService(nc, config, registry=CollectorRegistry(), model_registry=models)
    task = asyncio.create_task(svc.run())
    try:
        await asyncio.wait_for(svc.started.wait(), 15)
        yield svc
    finally:
        await svc.stop()
        await task
        await nc.drain()
