"""`python -m services.telemetry`: process wiring only (config, logs, NATS, signals)."""

from __future__ import annotations

import asyncio

from services.registry.store import open_or_none
from shared.bus import connection, stop_event
from shared.config import Config
from shared.logging import configure_logging, get_logger

from .service import SERVICE_NAME, TelemetryService


async def main(config: Config) -> None:
    log = get_logger("telemetry")
    stop = stop_event()
    async with connection(config.nats_url, SERVICE_NAME) as nc:
        registry = await open_or_none(nc, why="no automatic canary rollback")
        service = TelemetryService(nc, config, metrics_host=config.metrics_host,
                                   model_registry=registry)
        runner = asyncio.create_task(service.run())
        waiter = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({runner, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        await service.stop()
        await runner  # re-raises if the service failed on its own
        log.info("telemetry_exit", signalled=waiter in done)
    # leaving `connection` drains: the last summary and unsubscribes are flushed


if __name__ == "__main__":
    cfg = Config.from_env()
    configure_logging("telemetry", cfg.log_level, cfg.log_format)
    asyncio.run(main(cfg))
