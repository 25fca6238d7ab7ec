"""python -m services.orchestrator: process wiring only (config, catalogue, signals).

The one way it exits on its own is a fleet setting that cannot work, such as a
malformed TENSORBUS_FLEET (exit 78, with the entry at fault): a crashed, killed or
misconfigured worker never stops it, so `honcho start` keeps running.
"""

from __future__ import annotations

import asyncio

from services.orchestrator.service import Orchestrator, registry_catalogue
from services.registry.store import open_or_none
from shared.bus import connection, stop_event
from shared.config import Config
from shared.logging import configure_logging, get_logger
from shared.scaling import check_settings

log = get_logger("orchestrator")


async def main() -> None:
    config = Config.from_env()
    check_settings(config)  # a fleet setting that cannot work exits 78
    configure_logging("orchestrator", config.log_level, config.log_format)
    stop = stop_event()
    async with connection(config.nats_url, "orchestrator") as nc:
        registry = await open_or_none(nc, "managing the bundled models only")
        orch = Orchestrator(nc, config, registry_catalogue(registry))
        task = asyncio.create_task(orch.run())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        orch.stop()
        await task


if __name__ == "__main__":
    import sys

    from services.probe import run_check

    run_check(sys.argv[1:], "tensorbus-orchestrator", "")
    asyncio.run(main())
