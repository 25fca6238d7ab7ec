"""python -m services.worker: process wiring only (config, registry, engine, signals, drain)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.registry.source import ModelSource
from services.registry.store import open_or_none
from services.worker.engines import build_engine, engine_settings
from services.worker.service import Worker
from shared.bus import connection, stop_event
from shared.config import Config
from shared.logging import configure_logging, get_logger

log = get_logger("worker")


async def main() -> None:
    config = Config.from_env()
    configure_logging("worker", config.log_level, config.log_format)
    engine_settings(config, config.model)  # an unknown engine or dtype exits 78 here
    stop = stop_event()
    async with connection(config.nats_url, f"worker-{config.model}") as nc:
        # A fixed TENSORBUS_MODEL_DIR is served as version "local" and never swapped.
        registry = None if config.model_dir else await open_or_none(nc, "serving the local directory")
        source = ModelSource(registry, Path(config.data_dir) / "models")
        worker = Worker(nc, config, model=config.model, source=source,
                        engine_factory=lambda info, version: build_engine(config, info))
        task = asyncio.create_task(worker.run())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        worker.stop()
        await task


if __name__ == "__main__":
    import sys

    from services.probe import run_check

    run_check(sys.argv[1:], "tensorbus-worker", "")
    asyncio.run(main())
