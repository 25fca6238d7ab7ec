"""python -m services.gateway: process wiring only."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.fleet import Fleet
from services.gateway.frontend import Frontend
from services.gateway.models import ModelTable, registry_resolver
from services.gateway.service import Gateway
from services.registry.store import Registry, open_or_none
from shared.bus import connection, stop_event
from shared.config import Config
from shared.logging import configure_logging, get_logger
from shared.scaling import check_settings

log = get_logger("gateway")


def frontend(nc, config: Config, registry: Registry | None) -> Frontend:
    """The gateway's core, resolving unbundled model names through the registry."""
    fleet = Fleet(expiry_s=config.worker_expiry_s)
    cache = Path(config.data_dir) / "gateway-models"
    return Frontend(nc, config, fleet, ModelTable(fleet, registry_resolver(registry, cache, fleet)))


async def main() -> None:
    config = Config.from_env()
    check_settings(config)  # a fleet setting that cannot work exits 78
    configure_logging("gateway", config.log_level, config.log_format)
    stop = stop_event()
    async with connection(config.nats_url, "gateway") as nc:
        gw = Gateway(nc, config, frontend(nc, config, await open_or_none(nc, "bundled catalogue only")))
        task = asyncio.create_task(gw.run())
        await stop.wait()
        gw.stop()
        await task


if __name__ == "__main__":
    asyncio.run(main())
