"""python -m services.scheduler: process wiring only."""

from __future__ import annotations

import asyncio

from services.scheduler.service import Scheduler
from shared.bus import connection, stop_event
from shared.config import Config
from shared.logging import configure_logging


async def main() -> None:
    config = Config.from_env()
    configure_logging("scheduler", config.log_level, config.log_format)
    stop = stop_event()
    async with connection(config.nats_url, "scheduler") as nc:
        sched = Scheduler(nc, config)
        task = asyncio.create_task(sched.run())
        await stop.wait()
        sched.stop()
        await task


if __name__ == "__main__":
    asyncio.run(main())
