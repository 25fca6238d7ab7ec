"""python -m services.gateway: process wiring only."""

from __future__ import annotations

import asyncio

from services.gateway.service import Gateway
from shared.bus import connection, stop_event
from shared.config import Config
from shared.logging import configure_logging


async def main() -> None:
    config = Config.from_env()
    configure_logging("gateway", config.log_level, config.log_format)
    stop = stop_event()
    async with connection(config.nats_url, "gateway") as nc:
        gw = Gateway(nc, config)
        task = asyncio.create_task(gw.run())
        await stop.wait()
        gw.stop()
        await task


if __name__ == "__main__":
    asyncio.run(main())
