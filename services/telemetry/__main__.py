"""`python -m services.telemetry`: process wiring only (services.lifecycle.serve).

Leaving the connection drains it: the last summary and unsubscribes are flushed."""

from __future__ import annotations

from services.lifecycle import serve
from services.registry.store import open_or_none
from shared.config import Config

from .service import SERVICE_NAME, TelemetryService


async def build(nc, config: Config):
    registry = await open_or_none(nc, why="no automatic canary rollback")
    return TelemetryService(nc, config, metrics_host=config.metrics_host,
                            model_registry=registry), []


if __name__ == "__main__":
    serve("telemetry", build, client_name=SERVICE_NAME)
