"""python -m services.scheduler: process wiring only (config, registry, seeding, signals)."""

from __future__ import annotations

import asyncio

from services.registry.store import Registry
from services.scheduler.aliases import seed_registry
from services.scheduler.service import Scheduler
from shared.bus import connection, stop_event
from shared.config import Config
from shared.logging import configure_logging, get_logger

log = get_logger("scheduler")


async def open_registry(nc) -> Registry | None:
    """The registry, or None (logged): routing then ignores versions it cannot see."""
    try:
        return await Registry.open(nc)
    except Exception as exc:  # noqa: BLE001 - scheduling works without it
        log.warning("registry_unavailable", error=str(exc))
        return None


async def main() -> None:
    config = Config.from_env()
    configure_logging("scheduler", config.log_level, config.log_format)
    stop = stop_event()
    async with connection(config.nats_url, "scheduler") as nc:
        registry = await open_registry(nc)
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
