"""python -m services.scheduler: process wiring only (config, registry, seeding, signals)."""

from __future__ import annotations

import asyncio

from services.registry.store import open_or_none
from services.scheduler.aliases import seed_registry
from services.scheduler.service import Scheduler
from shared.bus import connection, stop_event
from shared.config import Config
from shared.logging import configure_logging, get_logger
from shared.scaling import check_settings

log = get_logger("scheduler")


async def main() -> None:
    config = Config.from_env()
    check_settings(config)  # a fleet setting that cannot work exits 78
    configure_logging("scheduler", config.log_level, config.log_format)
    stop = stop_event()
    async with connection(config.nats_url, "scheduler") as nc:
        registry = await open_or_none(nc, "routing ignores versions")
        sched = Scheduler(nc, config, registry=registry)
        task = asyncio.create_task(sched.run())
        # First start: the bundled models reach the registry from here, in the
        # background (honcho stops the whole stack when a one-shot process exits).
        seeding = asyncio.create_task(seed_registry(registry)) if registry is not None else None
        await stop.wait()
        if seeding is not None and not seeding.done():
            seeding.cancel()
            await asyncio.gather(seeding, return_exceptions=True)
        sched.stop()
        await task


if __name__ == "__main__":
    import sys

    from services.probe import run_check

    run_check(sys.argv[1:], "tensorbus-scheduler", "")
    asyncio.run(main())
